#!/usr/bin/env python3
"""Structured mutation fuzzing of a Hugging Face model directory's load: config.json,
tokenizer.json, tokenizer_config.json, generation_config.json and the safetensors header.

Each JSON file (and the safetensors file's JSON header) is a tree; a case replaces one to three of
its nodes, or deletes them, with values chosen to break a loader (wrong types, 0, -1, 2**63, a
400-digit integer, NaN, a long string, a long list, nesting 100,000 deep), or cuts a file's text, or
gives the safetensors header a wrong length. The directory then goes through the whole load
(`load_engine`) and a use of what loaded, as tools/fuzz_gguf.py does for GGUF files.

A case passes when it loads or fails with a ValueError or OSError (a clear reason); anything else,
or a case over 5 s, is a finding.

    python3 tools/fuzz_hf.py --minutes 10 --out /tmp/fuzz-hf      # a longer run, in this process
    (tests/engine/test_fuzz_hf.py runs a bounded number of cases in the suite)
"""
import argparse
import json
import random
import shutil
import struct
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_gguf import HANG_S, load_and_use  # noqa: E402

JSON_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
WEIGHTS = "model.safetensors"
_DEEP = "\x00deep\x00"          # stands for 100,000 nested lists (json.dumps would recurse to build it)
HOSTILE = (None, True, False, -1, 0, 1, 3, 2 ** 31, 2 ** 63, -(2 ** 63), 10 ** 400, 1e308, -1e308,
           float("nan"), float("inf"), 0.5, "", "x" * 100_000, "\udcff", "<|im_end|>", [], [0] * 100_000,
           {}, {"": None}, [[[[]]]], _DEEP)
N_CHOICES = len(HOSTILE) + 3     # past HOSTILE: delete the node, cut the file's text, wrong header length


class Seed:
    """A model directory's JSON trees and the safetensors header, with every node's path."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.trees = {}
        for name in JSON_FILES:
            if (self.directory / name).is_file():
                self.trees[name] = json.loads((self.directory / name).read_text(encoding="utf-8"))
        raw = (self.directory / WEIGHTS).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        self.trees[WEIGHTS] = json.loads(raw[8:8 + n])
        self.tensor_data = raw[8 + n:]
        self.nodes = [(name, path) for name, tree in self.trees.items() for path in _paths(tree)]


def _paths(tree, prefix=(), depth=0):
    """Every node's path in a JSON tree (its root included), keys and indexes in order; long lists
    give their first, second and last elements only."""
    yield prefix
    if depth > 32:
        return
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, prefix + (key,), depth + 1)
    elif isinstance(tree, list):
        picks = range(len(tree)) if len(tree) <= 8 else (0, 1, len(tree) - 1)
        for i in picks:
            yield from _paths(tree[i], prefix + (i,), depth + 1)


def _replace(tree, path, value, delete=False):
    if not path:
        return value
    *head, last = path
    parent = tree
    for key in head:
        parent = parent[key]
    if delete:
        del parent[last]
    else:
        parent[last] = value
    return tree


def _dumps(tree):
    text = json.dumps(tree, ensure_ascii=False)
    return text.replace(json.dumps(_DEEP), "[" * 100_000 + "]" * 100_000)


def apply(seed, changes, workdir):
    """Writes one case into `workdir` (a fresh directory): the seed with `changes`, (node index,
    choice, cut) each, applied. Returns what changed."""
    workdir = Path(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(seed.directory, workdir)
    trees = json.loads(json.dumps({k: v for k, v in seed.trees.items()}))
    done, cuts, wrong_length = [], {}, None
    for node, choice, cut in changes:
        name, path = seed.nodes[node % len(seed.nodes)]
        choice %= N_CHOICES
        try:
            if choice < len(HOSTILE):
                trees[name] = _replace(trees[name], path, HOSTILE[choice])
                done.append(f"{name} {list(path)} = {repr(HOSTILE[choice])[:24]}")
            elif choice == len(HOSTILE) and path:
                trees[name] = _replace(trees[name], path, None, delete=True)
                done.append(f"{name} {list(path)} deleted")
            elif choice == len(HOSTILE) + 1:
                cuts[name] = cut
                done.append(f"{name} cut at {cut}")
            else:
                wrong_length = cut
                done.append(f"{WEIGHTS} header length {cut}")
        except (KeyError, IndexError, TypeError):       # an earlier change removed the path
            done.append(f"{name} {list(path)} gone")
    for name, tree in trees.items():
        text = _dumps(tree).encode("utf-8", "surrogatepass")
        if name in cuts:
            text = text[:cuts[name] % (len(text) + 1)]
        if name == WEIGHTS:
            n = len(text) if wrong_length is None else wrong_length
            (workdir / name).write_bytes(struct.pack("<Q", n) + text + seed.tensor_data)
        else:
            (workdir / name).write_bytes(text)
    return done


def random_changes(seed, rng):
    return [(rng.randrange(len(seed.nodes)), rng.randrange(N_CHOICES), rng.choice((0, 1, 7, 100, rng.getrandbits(64))))
            for _ in range(rng.choice((1, 1, 2, 3)))]


def run_case(seed, changes, workdir):
    """(what changed, outcome) of one case; raises what the load or use raises beyond ValueError /
    OSError (the finding)."""
    what = apply(seed, changes, workdir)
    return what, load_and_use(workdir)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="a Hugging Face model directory to mutate (with model.safetensors)")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--rng-seed", type=int, default=1)
    p.add_argument("--out", default="fuzz-hf-out")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seed, rng = Seed(args.directory), random.Random(args.rng_seed)
    totals = {"cases": 0, "loaded": 0, "refused": 0, "findings": 0, "hangs": 0, "max_seconds": 0.0}
    deadline = time.monotonic() + args.minutes * 60
    while time.monotonic() < deadline:
        changes = random_changes(seed, rng)
        started = time.monotonic()
        try:
            what, outcome = run_case(seed, changes, out / "case")
            finding = None
        except KeyboardInterrupt:
            break
        except BaseException as e:      # noqa: BLE001 - every other exception is a finding
            what, outcome = changes, "finding"
            finding = f"{type(e).__name__}: {str(e)[:300]}\n{traceback.format_exc()[-1500:]}"
        seconds = time.monotonic() - started
        totals["cases"] += 1
        totals["loaded" if outcome.startswith("loaded") else "refused"] += 1
        totals["max_seconds"] = max(totals["max_seconds"], round(seconds, 3))
        if finding or seconds > HANG_S:
            totals["findings" if finding else "hangs"] += 1
            with open(out / "findings.txt", "a") as log:
                log.write(json.dumps({"changes": changes, "what": str(what), "finding": finding,
                                      "seconds": seconds}) + "\n")
    print(json.dumps(totals, indent=1))
    return 0 if not (totals["findings"] or totals["hangs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

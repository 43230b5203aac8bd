#!/usr/bin/env python3
"""Structured mutation fuzzing of the GGUF loader and the tokenizer it builds.

A seed file's header is split into its fields (gguf-py's reader says where each lies): lengths and
counts, value and element types, scalars, strings and token bytes, tensor dimensions, types and
offsets. A case changes a few of them to values chosen to break a parser (0, one off, the file's
size, 2**32, 2**63, all ones, NaN, invalid UTF-8), and may truncate the file or append to it. Each
case runs the whole load (`load_engine`: header, tensor table, weights, tokenizer, chat template
probe), then encodes, renders a chat and generates two tokens with whatever loaded.

A case passes when it loads or fails with a ValueError or OSError (a clear reason); anything else
(another exception, a signal such as SIGBUS from a read past the file's end, a case over 5 s, memory
past the limit) is a finding, written with its bytes to the output directory.

    python3 tools/fuzz_gguf.py --minutes 30 --workers 2 --out /tmp/fuzz    # the long run
    (tests/engine/test_fuzz_gguf.py runs a bounded number of cases in the suite)

Its summary counts cases, loads, refusals, findings, hangs and signals, the slowest case, the peak
of Python's and numpy's allocations in any case (tracemalloc; also per byte of the case's file), the
children's largest resident size, and their CPU seconds.
"""
import argparse
import json
import os
import random
import resource
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SEED = REPO.parent / "shared" / "models" / "stories260K.gguf"
HANG_S = 5.0
MEMORY_LIMIT = 4 << 30              # address space of a long run's child (bytes)


class Layout:
    """The seed's bytes and every field of its header: (offset, numpy dtype, count, name)."""

    def __init__(self, path):
        from gguf import GGUFReader

        self.seed = Path(path).read_bytes()
        reader = GGUFReader(str(path))
        base = reader.data.__array_interface__["data"][0]
        self.fields = []
        for name, field in reader.fields.items():
            for i, part in enumerate(field.parts):
                self.fields.append((part.__array_interface__["data"][0] - base, part.dtype, part.size, f"{name}[{i}]"))
        for tensor in reader.tensors:
            for i, part in enumerate(tensor.field.parts):
                self.fields.append((part.__array_interface__["data"][0] - base, part.dtype, part.size,
                                    f"tensor {tensor.name}[{i}]"))
        self.data_offset = int(reader.data_offset)


def _int_values(old, bits, file_size):
    top = (1 << bits) - 1
    picks = [0, 1, old - 1, old + 1, old * 2, old + 32, file_size, file_size - 1, file_size + 1,
             1 << 31, 1 << 32, (1 << 32) - 1, 1 << (bits - 1), top, top - 1]
    return [v & top for v in picks if v >= 0]


_FLOATS = [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e38, -1e38, 1e-45, 65504.0, 2.0 ** 31]
_BYTES = (0x00, 0xFF, 0xC0, 0x80, 0xED, ord("{"), ord("%"), 0x7F)
N_CHOICES = 24          # a change's `choice`: one of the field kind's picks, or (past them) `raw` itself


def random_case(layout, rng):
    """(changes, tail) for `apply`, drawn from `rng`: one to three field changes, and sometimes a cut
    (anywhere, or inside the header) or appended bytes."""
    changes = [(rng.randrange(len(layout.fields)), rng.randrange(1 << 20), rng.randrange(N_CHOICES),
                rng.getrandbits(64)) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
    roll = rng.random()
    tail = (("cut", rng.randrange(len(layout.seed))) if roll < 0.08 else
            ("cut", rng.randrange(layout.data_offset)) if roll < 0.12 else
            ("append", rng.choice((1, 31, 4096))) if roll < 0.15 else None)
    return changes, tail


def apply(layout, changes, tail=None):
    """(bytes of one case, a description of what changed). `changes`: (field index, element index,
    choice, raw) each; `tail`: None, ("cut", offset) or ("append", n bytes)."""
    blob = bytearray(layout.seed)
    size = len(blob)
    done = []
    for field, element, choice, raw in changes:
        offset, dtype, count, name = layout.fields[field % len(layout.fields)]
        i = element % count
        at = offset + i * dtype.itemsize
        width = dtype.itemsize
        if dtype.kind in "ui":
            old = int.from_bytes(blob[at:at + width], "little")
            picks = list(_BYTES) if width == 1 else _int_values(old, width * 8, size)
            value = picks[choice] if choice < len(picks) else raw & ((1 << (width * 8)) - 1)
            blob[at:at + width] = value.to_bytes(width, "little")
            done.append(f"{name}+{i}: {old} -> {value}")
        elif dtype.kind == "f":
            fmt = {2: "<e", 4: "<f", 8: "<d"}[width]
            value = _FLOATS[choice % len(_FLOATS)]
            try:
                blob[at:at + width] = struct.pack(fmt, value)
            except OverflowError:
                blob[at:at + width] = struct.pack(fmt, float("inf"))
            done.append(f"{name}+{i}: -> {value}")
        else:
            blob[at] = raw & 0xFF
            done.append(f"{name}+{i}: byte")
    if tail is not None:
        kind, n = tail
        if kind == "cut":
            del blob[n % len(blob):]
        else:
            blob += bytes((n * 7 + k) & 0xFF for k in range(n))
        done.append(f"{kind} {n}")
    return bytes(blob), done


def mutate(layout, rng):
    """(bytes of one random case, a description of what changed)."""
    return apply(layout, *random_case(layout, rng))


def run_case(blob, workdir):
    """'loaded' | 'refused: <reason>'; raises anything the load or its use raises that is not a
    ValueError / OSError (the finding)."""
    from turbospark_wsgi.engine.gguf import GGUFFile

    path = Path(workdir) / "case.gguf"
    path.write_bytes(blob)

    def inside(engine):
        for info in GGUFFile(path).tensors.values():      # what loaded lies inside the file
            assert info.offset + info.nbytes <= len(blob), f"tensor {info.name} past the end"
    return load_and_use(path, inside)


def load_and_use(path, check=None):
    """Loads the model file or directory `path` and uses what loaded (encode, decode, a chat prompt,
    two greedy tokens): 'loaded' | 'refused: <reason>' | 'loaded; refused a use: <reason>'. Raises
    anything that is not a ValueError / OSError (the finding). `check(engine)` runs after the load."""
    from turbospark_wsgi.engine.engine import load_engine
    from turbospark_wsgi.engine.sampling import SamplingParams

    try:
        engine = load_engine(path, device="cpu", max_batch=1, max_paused=0, speculative="off")
    except (ValueError, OSError) as e:
        return f"refused: {str(e)[:160]}"
    if check is not None:
        check(engine)
    try:
        ids = engine.encode("Hello there, world! \u00e9\u4e2d", add_bos=True)
        engine.decode(ids)
        if engine.template.problem is None:
            try:
                ids = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
            except ValueError:
                pass
        ids = [t for t in ids if 0 <= t < engine.config.vocab_size][:32] or [0]
        for _ in engine.generate(ids, SamplingParams(max_new_tokens=2, temperature=0.0)):
            pass
    except ValueError as e:
        return f"loaded; refused a use: {str(e)[:120]}"
    except FloatingPointError as e:     # the scheduler's guard: weights that make no finite logits
        return f"loaded; {e}"
    return "loaded"


# ---- the long run: children under a memory limit, a watchdog per case ------------------------------

def _child(seed_path, rng_seed, cases, out_dir, report_fd):
    import tracemalloc
    import warnings

    warnings.simplefilter("ignore")         # NaN weights warn in numpy; the outcome is what counts
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    layout = Layout(seed_path)
    rng = random.Random(rng_seed)
    with tempfile.TemporaryDirectory() as work, os.fdopen(report_fd, "w", buffering=1) as report:
        for n in range(cases):
            blob, what = mutate(layout, rng)
            case = Path(out_dir) / f"current-{os.getpid()}.gguf"
            case.write_bytes(blob)                  # kept if this process dies on it
            started = time.monotonic()
            tracemalloc.start()
            try:
                outcome = run_case(blob, work)
                finding = None
            except BaseException as e:      # noqa: BLE001 - every other exception is a finding
                outcome, finding = "finding", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            seconds = time.monotonic() - started
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            report.write(json.dumps({"n": n, "outcome": outcome[:60], "seconds": round(seconds, 3), "peak": peak,
                                     "rss": rss, "bytes": len(blob), "what": what, "finding": finding}) + "\n")
            if finding or seconds > HANG_S:
                (Path(out_dir) / f"finding-{os.getpid()}-{n}.gguf").write_bytes(blob)
        case.unlink(missing_ok=True)
    os._exit(0)


def long_run(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.minutes * 60
    totals = {"cases": 0, "loaded": 0, "refused": 0, "findings": 0, "hangs": 0, "signals": 0,
              "max_seconds": 0.0, "max_peak": 0, "max_peak_per_byte": 0.0, "max_rss": 0, "cpu_seconds": 0.0}
    log = open(out / "findings.txt", "a")
    running = {}            # pid -> (read end, start time, last report time)
    batch = 0

    def start():
        nonlocal batch
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(args.seed[batch % len(args.seed)], args.rng_seed * 100003 + batch, args.batch, str(out), w)
        os.close(w)
        os.set_blocking(r, False)
        running[pid] = [r, b"", time.monotonic()]
        batch += 1

    while time.monotonic() < deadline or running:
        while time.monotonic() < deadline and len(running) < args.workers:
            start()
        time.sleep(0.05)
        for pid, state in list(running.items()):
            try:
                chunk = os.read(state[0], 1 << 16)
            except BlockingIOError:
                chunk = None
            if chunk:
                state[2] = time.monotonic()
                state[1] += chunk
                *lines, state[1] = state[1].split(b"\n")
                for line in lines:
                    rec = json.loads(line)
                    totals["cases"] += 1
                    totals["loaded" if rec["outcome"].startswith("loaded") else "refused"] += 1
                    totals["max_seconds"] = max(totals["max_seconds"], rec["seconds"])
                    totals["max_peak"] = max(totals["max_peak"], rec["peak"])
                    totals["max_peak_per_byte"] = max(totals["max_peak_per_byte"], rec["peak"] / max(rec["bytes"], 1))
                    totals["max_rss"] = max(totals["max_rss"], rec["rss"])
                    if rec["finding"] or rec["seconds"] > HANG_S:
                        totals["findings" if rec["finding"] else "hangs"] += 1
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
            if time.monotonic() - state[2] > HANG_S * 4:         # no case finished: a hang
                os.kill(pid, signal.SIGKILL)
                totals["hangs"] += 1
                log.write(json.dumps({"hang": pid}) + "\n")
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                use = resource.getrusage(resource.RUSAGE_CHILDREN)
                totals["cpu_seconds"] = use.ru_utime + use.ru_stime
                if os.WIFSIGNALED(status) and os.WTERMSIG(status) != signal.SIGKILL:
                    totals["signals"] += 1
                    current = out / f"current-{pid}.gguf"
                    if current.exists():
                        current.rename(out / f"signal-{os.WTERMSIG(status)}-{pid}.gguf")
                    log.write(json.dumps({"signal": os.WTERMSIG(status), "pid": pid}) + "\n")
                os.close(state[0])
                del running[pid]
    totals["seed_bytes"] = [len(Path(seed).read_bytes()) for seed in args.seed]
    print(json.dumps(totals, indent=1))
    return 0 if not (totals["findings"] or totals["hangs"] or totals["signals"]) else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", action="append", help="a GGUF file to mutate (repeatable; children take them in "
                                                   "turn; default: stories260K)")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=400, help="cases per child process")
    p.add_argument("--rng-seed", type=int, default=1)
    p.add_argument("--out", default="fuzz-gguf-out")
    args = p.parse_args(argv)
    args.seed = args.seed or [str(SEED)]
    os.environ.setdefault("TURBOSPARK_LOG_LEVEL", "error")
    return long_run(args)


if __name__ == "__main__":
    sys.exit(main())

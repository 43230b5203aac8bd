"""Dumps a GGUF file's metadata and tensor table.

    python tools/inspect_gguf.py MODEL.gguf [--full] [--no-tensors] [--config]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.engine.gguf import GGUFFile, ggml_type_name, model_config_from_gguf  # noqa: E402

PREVIEW = 8        # list items shown without --full
TEXT = 160         # characters of a string shown without --full


def describe(value, full):
    if isinstance(value, list):
        head = value if full else value[:PREVIEW]
        more = "" if full or len(value) <= PREVIEW else f", ... ({len(value)} items)"
        return "[" + ", ".join(repr(v) for v in head) + more + "]"
    if isinstance(value, str) and not full and len(value) > TEXT:
        return repr(value[:TEXT]) + f"... ({len(value)} chars)"
    return repr(value)


def dump_metadata(f, full):
    print(f"# metadata ({len(f.metadata)} keys)")
    for key, value in f.metadata.items():
        print(f"{key} = {describe(value, full)}")


def dump_tensors(f):
    total = sum(t.nbytes for t in f.tensors.values())
    print(f"\n# tensors ({len(f.tensors)}, {total / 2**20:.1f} MiB)")
    for t in f.tensors.values():
        shape = "x".join(str(d) for d in t.shape)
        print(f"{t.name:40s} {ggml_type_name(t.ggml_type):8s} {shape:>14s} {t.nbytes:>12d} @ {t.offset}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--full", action="store_true", help="print whole lists and strings")
    p.add_argument("--no-tensors", action="store_true")
    p.add_argument("--config", action="store_true", help="also print the ModelConfig built from the metadata")
    args = p.parse_args(argv)
    f = GGUFFile(args.path)
    dump_metadata(f, args.full)
    if args.config:
        print(f"\n# config\n{model_config_from_gguf(f.metadata)}")
    if not args.no_tensors:
        dump_tensors(f)


if __name__ == "__main__":
    main()

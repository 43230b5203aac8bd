"""Memory-bound decode's two figures: the machine's read bandwidth (tools/read_bandwidth.c) and the
weight bytes a decode token reads from a GGUF file.

    python tools/read_bandwidth.py [--mib 1024] [--passes 7] [--threads 1 N] [--model GGUF]

The C reader is compiled once (cc -O3 -fopenmp -march=native) into a cache directory, under a name
that holds a hash of its source and compiler; each thread streams its own contiguous 1/T of the
buffer, best of --passes. With --model it also prints the bytes a token reads and the decode rate
that bandwidth bounds it to (tok/s <= GB/s / GB a token).
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.engine.gguf import GGUFFile  # noqa: E402
from turbospark_wsgi.engine.kernels.native import compiler  # noqa: E402
from turbospark_wsgi.engine.weights import tensor_name  # noqa: E402

SOURCE = Path(__file__).resolve().with_name("read_bandwidth.c")
FLAGS = ("-O3", "-fopenmp", "-march=native")


class ReaderUnavailable(RuntimeError):
    """The reader cannot be built or run here: no C compiler, or it failed (the message says how)."""


def build(directory=None):
    """The reader's executable, compiled unless the cache directory has it already."""
    cc = compiler()
    if cc is None:
        raise ReaderUnavailable("no C compiler (cc, gcc or clang) on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + f"|{os.path.realpath(cc)}|{' '.join(FLAGS)}".encode()).hexdigest()[:16]
    directory = Path(directory or Path(tempfile.gettempdir()) / "turbospark-tools")
    exe = directory / f"read_bandwidth-{key}"
    if not exe.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
        if done.returncode:
            raise ReaderUnavailable(f"read_bandwidth.c did not compile: {done.stderr.strip()[-300:]}")
        os.replace(tmp, exe)
    return exe


def read_bandwidth(threads=(1,), mib=1024, passes=7, directory=None):
    """{threads: GB/s} of the best of `passes` reads of `mib` MiB by each thread count. Raises ReaderUnavailable."""
    cmd = [str(build(directory)), str(mib), str(passes), *map(str, threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise ReaderUnavailable(f"{' '.join(cmd)} ran past 600 s") from None
    if done.returncode:
        raise ReaderUnavailable(f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr.strip()[-300:]}")
    return {int(t): float(gb) for t, gb in re.findall(r"threads (\d+): ([\d.]+) GB/s", done.stdout)}


def bytes_per_token(path):
    """Weight bytes a decode token reads from the GGUF at `path`: every tensor once (a tied token
    embedding once, as the head), but of a separate token embedding only the token's row."""
    f = GGUFFile(path)
    total = sum(t.nbytes for t in f.tensors.values())
    embd = f.tensors.get(tensor_name("tok_embd", "gguf"))
    if embd is not None and tensor_name("head", "gguf") in f.tensors:
        total -= embd.nbytes - embd.nbytes // embd.shape[0]
    return total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    p.add_argument("--model", help="also the bytes a token reads from this GGUF, and the decode bound")
    args = p.parse_args(argv)
    try:
        rates = read_bandwidth(args.threads, args.mib, args.passes)
    except ReaderUnavailable as exc:
        sys.exit(str(exc))
    per_token = bytes_per_token(args.model) if args.model else None
    for threads, gb_s in rates.items():
        bound = f"; decode <= {gb_s * 1e9 / per_token:.1f} tok/s" if per_token else ""
        print(f"{gb_s:.2f} GB/s with {threads} thread{'s' * (threads > 1)}{bound}")
    if per_token:
        print(f"{args.model}: {per_token / 1e6:.1f} MB a token")


if __name__ == "__main__":
    main()

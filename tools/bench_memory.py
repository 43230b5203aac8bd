"""What a model costs in memory per worker: loads it in N processes one after another (as gunicorn's
workers do, each after the fork, each its own engine) and prints, for each, its load time, peak and
steady resident set (anonymous and file-backed), and how much the machine's used memory (`free`'s
"used": neither page cache nor buffers) grew, against the GGUF's size.

    python tools/bench_memory.py --model GGUF [--workers 2] [--cache DIR|off] [--context N]

--cache DIR  the weight cache (TURBOSPARK_WEIGHT_CACHE); default a fresh temporary directory, so the
             first process writes the packed weights and the next ones map them; `off`: every process
             builds and holds its own copy (the comparison)
--context N  KV positions per process (default 4096); the cache is allocated as the server's is

The issue's targets read off the output: steady RSS <= file + KV + 15%, peak <= steady + 10%, and each
worker after the first adds < 10% of the file to the machine's used memory.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from turbospark_wsgi.engine.loader import load_model
t = time.perf_counter()
lm = load_model(sys.argv[2], device="cpu", weight_cache=sys.argv[3], max_context=int(sys.argv[4]))
load_s = time.perf_counter() - t
def status():
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status")
            if l.startswith(("VmHWM", "VmRSS", "RssAnon", "RssFile"))}
loaded = status()
cache = lm.model.new_cache(int(sys.argv[4]))
lm.model.forward(list(range(1, 65)), cache, logits="last")
kv = cache.k.nbytes + cache.v.nbytes
status = {**status(), "load_peak": loaded["VmHWM"], "load_rss": loaded["VmRSS"]}
rollup = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/smaps_rollup")
          if l.split(":")[0] in ("Pss", "Private_Dirty", "Private_Clean", "Shared_Clean")}
print(json.dumps({"load_s": load_s, "weights": lm.weights, "kv_bytes": kv, **status, **rollup}), flush=True)
sys.stdin.readline()          # held until the parent has measured every worker
"""


def used_bytes():
    """The machine's used memory as `free` counts it: total - free - buffers - page cache."""
    info = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/meminfo")}
    return info["MemTotal"] - info["MemFree"] - info["Buffers"] - info["Cached"] - info.get("SReclaimable", 0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cache", default="")
    p.add_argument("--context", type=int, default=4096)
    return p.parse_args(argv)


def mb(n):
    return f"{n / 2 ** 20:,.0f} MB"


def main(argv=None):
    args = parse_args(argv)
    cache = "" if args.cache == "off" else args.cache or tempfile.mkdtemp(prefix="bench-memory-")
    size = os.path.getsize(args.model)
    print(f"model {os.path.basename(args.model)}: {mb(size)}; weight cache: {cache or 'off'}; "
          f"{args.workers} processes, {args.context} KV positions each")
    workers, rows = [], []
    try:
        for i in range(args.workers):
            before = used_bytes()
            child = subprocess.Popen([sys.executable, "-c", CHILD, ROOT, args.model, cache, str(args.context)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            workers.append(child)
            line = child.stdout.readline()
            if not line:
                raise SystemExit(f"process {i + 1} failed to load the model")
            time.sleep(1.0)
            r = json.loads(line)
            r["used_growth"] = used_bytes() - before
            rows.append(r)
            steady, peak = r["VmRSS"], r["load_peak"]
            print(f"process {i + 1}: load {r['load_s']:.1f} s | {r['weights']}\n"
                  f"  RSS {mb(steady)} after a 64-token prompt (anon {mb(r['RssAnon'])}, file {mb(r['RssFile'])}); "
                  f"peak while loading {mb(peak)} = loaded RSS x {peak / r['load_rss']:.2f}, after the prompt "
                  f"{mb(r['VmHWM'])}; KV {mb(r['kv_bytes'])}; "
                  f"RSS / (file + KV) = {steady / (size + r['kv_bytes']):.2f}\n"
                  f"  machine's used memory +{mb(r['used_growth'])} = {r['used_growth'] / size:.1%} of the file; "
                  f"private {mb(r['Private_Dirty'] + r['Private_Clean'])}, PSS {mb(r['Pss'])}", flush=True)
    finally:
        for child in workers:
            try:
                child.stdin.write("\n")
                child.stdin.flush()
            except OSError:
                pass
            child.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

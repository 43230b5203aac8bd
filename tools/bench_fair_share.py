"""A second client's time to first token while one client runs a burst of long streams.

    python tools/bench_fair_share.py --before /path/to/older/checkout --trials 5

Starts this checkout's server (and, with --before, another checkout's on its own port; both load
the same model), then interleaves per trial and per server: key B's request on a quiet server, and
key B's request once key A's burst (--streams streams of --tokens tokens, /v1/completions) has its
first tokens. A's streams are cut as soon as B has its first token, and the next run waits for an
empty queue. Prints B's TTFT medians (and every value) per server and condition, with the machine's
load average and the CPU seconds other processes used meanwhile (the machine may be shared).
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from bench_http_servers import REPO, CpuMeter, OurServer

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="another checkout of this project to compare (its server runs beside)")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--streams", type=int, default=16, help="key A's streams")
    p.add_argument("--tokens", type=int, default=200, help="max_tokens of each of A's streams")
    p.add_argument("--b-tokens", type=int, default=16, help="max_tokens of B's request")
    p.add_argument("--ban", default="0,2", help="token ids A's streams never sample (logit_bias -100), so "
                   "they run all --tokens: the default model's <|endoftext|> and <|im_end|>")
    p.add_argument("--model", default=os.environ.get("TURBOSPARK_MODEL", "smollm2-135m-instruct"))
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads")
    p.add_argument("--blas-threads", type=int, default=0)
    p.add_argument("--python", default=sys.executable)
    p.set_defaults(fresh_numba_cache=False)
    return p.parse_args(argv)


class Checkout(OurServer):
    """This project's server run from `repo` (its own code, on its own port)."""

    def __init__(self, args, repo, name):
        self.name, self.cwd = name, Path(repo).resolve()
        super().__init__(args)

    def command(self):
        return [self.args.python, "-m", "gunicorn", "-c", str(self.cwd / "gunicorn.conf.py"),
                "--no-control-socket", "turbospark_wsgi.wsgi:app"]

    def env(self):
        return dict(super().env(), PYTHONPATH=str(self.cwd))


class Stream(threading.Thread):
    """One streamed completion for `key`; `first` is the time of its first text, `cut()` drops it."""

    def __init__(self, port, key, max_tokens, ban=()):
        super().__init__(daemon=True)
        self.port, self.key, self.max_tokens, self.ban = port, key, max_tokens, ban
        self.first = self.started = None
        self.tokens, self.conn, self.error = 0, None, None
        self.got_first = threading.Event()

    def run(self):
        body = {"prompt": PROMPT, "max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        if self.ban:
            body["logit_bias"] = {str(t): -100 for t in self.ban}
        self.started = time.perf_counter()
        try:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            self.conn.request("POST", "/v1/completions", body=json.dumps(body),
                              headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"})
            resp = self.conn.getresponse()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}"
                return
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[5:])
                if any(c.get("text") for c in doc.get("choices") or ()):
                    self.tokens += 1
                    if self.first is None:
                        self.first = time.perf_counter() - self.started
                        self.got_first.set()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.error = self.error or type(exc).__name__
        finally:
            self.got_first.set()

    def cut(self):
        try:
            self.conn.sock.shutdown(2)
        except (OSError, AttributeError):
            pass


def queue_empty(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        queue = json.loads(conn.getresponse().read())["queue"]
        return queue["running"] == 0 and queue["waiting"] == 0
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return False
    finally:
        conn.close()


def settle(port, timeout=120):
    end = time.monotonic() + timeout
    while not queue_empty(port) and time.monotonic() < end:
        time.sleep(0.2)


def b_alone(server, args):
    b = Stream(server.port, "key-b", args.b_tokens)
    b.start()
    b.join()
    return b.first


def b_in_burst(server, args):
    ban = [int(t) for t in args.ban.split(",") if t.strip()]
    burst = [Stream(server.port, "key-a", args.tokens, ban) for _ in range(args.streams)]
    for s in burst:
        s.start()
    running = min(args.streams, args.max_batch)
    end = time.monotonic() + 120
    while sum(s.first is not None for s in burst) < running and time.monotonic() < end:
        time.sleep(0.05)
    b = Stream(server.port, "key-b", args.b_tokens)
    b.start()
    b.got_first.wait(600)
    made = [s.tokens for s in burst]
    for s in burst:
        s.cut()
    b.join(600)
    for s in burst:
        s.join(30)
    if b.error or any(s.error and s.tokens == 0 for s in burst[:running]):
        print(f"  errors: B {b.error}, A {[s.error for s in burst]}", flush=True)
    print(f"  A's streams' tokens when B had its first: {made}", flush=True)
    return b.first


def main(argv=None):
    args = parse_args(argv)
    servers = [Checkout(args, REPO, "after")]
    if args.before:
        servers.insert(0, Checkout(args, args.before, "before"))
    results = {(s.name, c): [] for s in servers for c in ("quiet", "burst")}
    for s in servers:
        s.__enter__()
    try:
        for s in servers:                                   # warm-up: kernels compiled, caches touched
            b_alone(s, args)
        meter, loads = CpuMeter([p for s in servers for p in s.pids()] + [os.getpid()]), []
        started = time.monotonic()
        for trial in range(args.trials):
            order = servers if trial % 2 == 0 else servers[::-1]
            for s in order:
                for condition, fn in (("quiet", b_alone), ("burst", b_in_burst)):
                    settle(s.port)
                    ttft = fn(s, args)
                    results[(s.name, condition)].append(ttft)
                    loads.append(os.getloadavg()[0])
                    print(f"trial {trial} {s.name:6} {condition:5} B's TTFT {ttft:.3f} s  load {loads[-1]:.1f}",
                          flush=True)
        elapsed = time.monotonic() - started
    finally:
        for s in servers:
            s.stop()
    print(f"\n{args.streams} streams x {args.tokens} tokens from key A; key B asks for {args.b_tokens}; "
          f"{args.trials} trials interleaved; model {args.model}, max_batch {args.max_batch}")
    print(f"load average (1 min) during the runs: median {statistics.median(loads):.1f}, "
          f"max {max(loads):.1f}; other processes used {meter.others() / elapsed:.2f} CPUs of {os.cpu_count()}")
    for (name, condition), values in results.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:6} {condition:5} B's TTFT median {statistics.median(values):7.3f} s   [{shown}]")


if __name__ == "__main__":
    main()

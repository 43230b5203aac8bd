"""Bounded load test: concurrent streaming and non-streaming completions, some clients leaving early.

    python tools/load_test.py --url http://127.0.0.1:8000 --requests 40 --concurrency 6

Stdlib only (http.client); talks to the server, not the package. Loopback targets only unless
--allow-remote. Stops after --requests requests or --duration seconds, whichever comes first.
"""
import argparse
import http.client
import ipaddress
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from urllib.parse import urlsplit


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--requests", type=int, default=40, help="total requests (bounded)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--duration", type=float, default=120.0, help="stop starting requests after this")
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--model", default=None, help="model id (default: the first from /v1/models)")
    p.add_argument("--api-key", default="x")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request socket timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-remote", action="store_true")
    return p.parse_args(argv)


class Client:
    def __init__(self, args):
        parts = urlsplit(args.url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.args = args

    def connect(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.args.timeout)

    def headers(self):
        return {"Content-Type": "application/json", "Authorization": f"Bearer {self.args.api_key}"}

    def first_model(self):
        conn = self.connect()
        try:
            conn.request("GET", "/v1/models", headers=self.headers())
            return json.loads(conn.getresponse().read())["data"][0]["id"]
        finally:
            conn.close()

    def one(self, model, stream, leave_early, rng):
        """-> (outcome, ttfb seconds or None, total seconds)."""
        body = json.dumps({"model": model, "prompt": self.args.prompt, "stream": stream,
                           "max_tokens": self.args.max_tokens, "temperature": 0})
        conn, start = self.connect(), time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body=body, headers=self.headers())
            if leave_early and not stream:
                time.sleep(rng.uniform(0.0, 0.5))          # leave while queued or generating
                _abort(conn)
                return "disconnected", None, time.perf_counter() - start
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                return ("rejected" if resp.status in (429, 503) else f"http_{resp.status}",
                        None, time.perf_counter() - start)
            return self._read(resp, conn, stream, leave_early, start)
        except (OSError, http.client.HTTPException) as exc:
            return f"error:{type(exc).__name__}", None, time.perf_counter() - start
        finally:
            conn.close()

    def _read(self, resp, conn, stream, leave_early, start):
        if not stream:
            json.loads(resp.read())
            return "completed", None, time.perf_counter() - start
        ttfb, events = None, 0
        for line in resp:
            if line.startswith(b"data: "):
                ttfb = ttfb or time.perf_counter() - start
                events += 1
                if line.strip() == b"data: [DONE]":
                    return "completed", ttfb, time.perf_counter() - start
                if leave_early and events >= 2:
                    _abort(conn)
                    return "disconnected", ttfb, time.perf_counter() - start
        return "error:truncated", ttfb, time.perf_counter() - start


def _abort(conn):
    if conn.sock is not None:
        conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def run(args):
    client = Client(args)
    model = args.model or client.first_model()
    rng = random.Random(args.seed)
    plan = [(rng.random() < args.stream_fraction, rng.random() < args.disconnect_fraction)
            for _ in range(args.requests)]
    results, lock = [], threading.Lock()
    deadline = time.monotonic() + args.duration

    def worker(index):
        local = random.Random(args.seed * 1000 + index)
        while time.monotonic() < deadline:
            with lock:
                if not plan:
                    return
                stream, leave = plan.pop()
            outcome = client.one(model, stream, leave, local)
            with lock:
                results.append((stream, *outcome))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - started


def report(results, elapsed):
    counts = Counter(outcome for _, outcome, _, _ in results)
    print(f"requests: {len(results)} in {elapsed:.1f} s")
    for key in ("completed", "rejected", "disconnected"):
        print(f"  {key}: {counts.pop(key, 0)}")
    print(f"  errors: {sum(counts.values())} {dict(counts) if counts else ''}")
    done = [r for r in results if r[1] == "completed"]
    _percentiles("latency (completed)", [total for _, _, _, total in done])
    _percentiles("time to first data event (streams)", [t for _, _, t, _ in done if t is not None])


def _percentiles(label, values):
    if not values:
        return
    values = sorted(values)
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    print(f"{label}: p50 {q[49]:.3f} s  p90 {q[89]:.3f} s  p99 {q[98]:.3f} s  max {values[-1]:.3f} s")


def _is_loopback(host):
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def main(argv=None):
    args = parse_args(argv)
    if not args.allow_remote and not _is_loopback(urlsplit(args.url).hostname or ""):
        print("refusing a non-loopback target without --allow-remote", file=sys.stderr)
        return 2
    results, elapsed = run(args)
    report(results, elapsed)
    return 0 if all(not r[1].startswith(("error", "http_")) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Bounded load test: concurrent streaming and non-streaming completions, some clients leaving early.

    python tools/load_test.py --url http://127.0.0.1:8000 --requests 400 --concurrency 200

Stdlib only (http.client); talks to the server, not the package. Loopback targets only unless
--allow-remote. Stops after --requests requests or --duration seconds, whichever comes first.
A leaving client closes its connection at a random point: while queued, during prefill, or
mid-decode. Every completed request is checked (a non-empty choice with a finish reason; a
stream ends with `data: [DONE]`); every rejection must be a 503 with Retry-After. Prints
completed, rejected, disconnected and error counts with latency percentiles (--json: one object).
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
    p.add_argument("--concurrency", type=int, default=6, help="client threads (up to 1000)")
    p.add_argument("--duration", type=float, default=120.0, help="stop starting requests after this")
    p.add_argument("--stream-fraction", type=float, default=0.5)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--model", default=None, help="model id (default: the first from /v1/models)")
    p.add_argument("--api-key", default="x")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request socket timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON summary instead of text")
    p.add_argument("--allow-remote", action="store_true")
    args = p.parse_args(argv)
    if not 1 <= args.concurrency <= 1000 or args.requests < 0:
        p.error("--concurrency must be 1..1000 and --requests >= 0")
    return args


class Client:
    def __init__(self, args):
        parts = urlsplit(args.url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.args = args
        self.samples = {}                       # error kind -> what the server said, the first time

    def sample(self, kind, detail):
        self.samples.setdefault(kind, detail[:400].decode("utf-8", "replace") if isinstance(detail, bytes)
                                else str(detail)[:400])
        return kind

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

    def one(self, model, stream, leave_at, rng):
        """-> (outcome, ttfb seconds or None, total seconds). `leave_at`: None or seconds / events."""
        body = json.dumps({"model": model, "prompt": self.args.prompt, "stream": stream,
                           "max_tokens": self.args.max_tokens, "temperature": 0})
        conn, start = self.connect(), time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body=body, headers=self.headers())
            if leave_at is not None and not stream:
                time.sleep(leave_at)                    # leave while queued, in prefill or decoding
                _abort(conn)
                return "disconnected", None, time.perf_counter() - start
            resp = conn.getresponse()
            if resp.status != 200:
                outcome = _refusal(resp)
                body = resp.read()
                if outcome != "rejected":
                    self.sample(outcome, body)
                return outcome, None, time.perf_counter() - start
            return self._read(resp, conn, stream, leave_at, start)
        except (OSError, http.client.HTTPException) as exc:
            return self.sample(f"error:{type(exc).__name__}", exc), None, time.perf_counter() - start
        finally:
            conn.close()

    def _read(self, resp, conn, stream, leave_at, start):
        if not stream:
            raw = resp.read()
            body = json.loads(raw)
            ok = body.get("choices") and body["choices"][0].get("finish_reason") in ("stop", "length")
            return ("completed" if ok else self.sample("error:bad_body", raw)), None, time.perf_counter() - start
        ttfb, events, finish, line = None, 0, None, b""
        for line in resp:
            if line.startswith(b"event: error"):
                return self.sample("error:stream_error_event", resp.readline()), ttfb, time.perf_counter() - start
            if not line.startswith(b"data: "):
                continue
            ttfb = ttfb or time.perf_counter() - start
            if line.strip() == b"data: [DONE]":
                outcome = "completed" if finish else self.sample("error:no_finish_reason", events)
                return outcome, ttfb, time.perf_counter() - start
            events += 1
            finish = finish or _finish_reason(line)
            if leave_at is not None and events >= leave_at:
                _abort(conn)
                return "disconnected", ttfb, time.perf_counter() - start
        return self.sample("error:truncated", line), ttfb, time.perf_counter() - start


def _refusal(resp):
    if resp.status in (429, 503):
        return "rejected" if resp.getheader("Retry-After") else "error:503_without_retry_after"
    return f"http_{resp.status}"


def _finish_reason(line):
    try:
        choices = json.loads(line[6:]).get("choices") or [{}]
    except ValueError:
        return None
    return choices[0].get("finish_reason")


def _abort(conn):
    if conn.sock is not None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    conn.close()


def make_plan(args):
    """[(stream, leave_at)]: leave_at None, seconds (non-streaming) or a data-event count (streams)."""
    rng = random.Random(args.seed)
    plan = []
    for _ in range(args.requests):
        stream = rng.random() < args.stream_fraction
        leave = rng.random() < args.disconnect_fraction
        leave_at = None if not leave else (rng.randint(1, max(args.max_tokens, 1)) if stream
                                           else rng.uniform(0.0, 0.5))
        plan.append((stream, leave_at))
    return plan


def run(args):
    client = Client(args)
    model = args.model or client.first_model()
    plan = make_plan(args)
    results, lock = [], threading.Lock()
    deadline = time.monotonic() + args.duration

    def worker(index):
        local = random.Random(args.seed * 1000 + index)
        while time.monotonic() < deadline:
            with lock:
                if not plan:
                    return
                stream, leave_at = plan.pop()
            outcome = client.one(model, stream, leave_at, local)
            with lock:
                results.append((stream, *outcome))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.duration + args.timeout + 5)
    return results, time.perf_counter() - started, client.samples


def summarize(results, elapsed, samples=None):
    counts = Counter(outcome for _, outcome, _, _ in results)
    summary = {"requests": len(results), "elapsed_s": round(elapsed, 3)}
    for key in ("completed", "rejected", "disconnected"):
        summary[key] = counts.pop(key, 0)
    summary["errors"] = sum(counts.values())
    summary["error_kinds"] = dict(counts)
    if counts and samples:
        summary["error_samples"] = {k: v for k, v in samples.items() if k in counts}
    done = [r for r in results if r[1] == "completed"]
    summary["latency_s"] = _percentiles([total for _, _, _, total in done])
    summary["first_event_s"] = _percentiles([t for _, _, t, _ in done if t is not None])
    summary["rejection_latency_s"] = _percentiles([total for _, o, _, total in results if o == "rejected"])
    return summary


def _percentiles(values):
    if not values:
        return None
    values = sorted(values)
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": round(q[49], 4), "p90": round(q[89], 4), "p99": round(q[98], 4), "max": round(values[-1], 4)}


def report(summary):
    print(f"requests: {summary['requests']} in {summary['elapsed_s']:.1f} s")
    for key in ("completed", "rejected", "disconnected"):
        print(f"  {key}: {summary[key]}")
    kinds = summary["error_kinds"]
    print(f"  errors: {summary['errors']} {kinds if kinds else ''}")
    for label, key in (("latency (completed)", "latency_s"), ("time to first data event (streams)", "first_event_s"),
                       ("rejection latency (503)", "rejection_latency_s")):
        q = summary[key]
        if q:
            print(f"{label}: p50 {q['p50']:.3f} s  p90 {q['p90']:.3f} s  p99 {q['p99']:.3f} s  max {q['max']:.3f} s")


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
    summary = summarize(*run(args))
    print(json.dumps(summary)) if args.json else report(summary)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

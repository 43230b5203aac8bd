"""How fast a full server says so: the time to a 503 for a burst of requests it cannot queue.

    python tools/bench_reject.py                       # starts gunicorn (default model, MAX_WAITING=8)
    python tools/bench_reject.py --model path/to/stories260K.gguf --burst 150
    python tools/bench_reject.py --url http://127.0.0.1:8000 --route completions

Fills the running batch and the queue with long streaming requests (refilled as they end), waits
until /health shows the queue full, then opens --burst connections at once, each sending one short
request, from a single selector loop so the client itself costs little CPU. Per request: the time
from its connect to the end of the response. Prints median/p95/p99/max, the statuses, whether every
503 carried Retry-After and the route's error envelope, and the load average before and after
(--json: one object). Stdlib only; talks to the server, not the package.
"""
import argparse
import contextlib
import http.client
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_http_report import percentile  # noqa: E402

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="an already running server (default: start gunicorn)")
    p.add_argument("--model", default=None, help="model id or .gguf path for the started server")
    p.add_argument("--max-waiting", type=int, default=8, help="TURBOSPARK_MAX_WAITING of the started server")
    p.add_argument("--max-batch", type=int, default=8, help="TURBOSPARK_MAX_BATCH (running slots) of the server")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the started server")
    p.add_argument("--route", choices=sorted(ROUTES), default="chat")
    p.add_argument("--filler-route", choices=sorted(ROUTES), default=None,
                   help="the filling streams' route (default: --route)")
    p.add_argument("--burst", type=int, default=184, help="short requests fired at once")
    p.add_argument("--rounds", type=int, default=1, help="bursts, one after another (results pooled)")
    p.add_argument("--prompt-chars", type=int, default=0, help="length of each burst request's prompt (0: \"Hi\")")
    p.add_argument("--filler-tokens", type=int, default=4000, help="max_tokens of each filling stream")
    p.add_argument("--timeout", type=float, default=30.0, help="per burst request")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def request_body(route, model, max_tokens, stream, text="Hi"):
    body = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if route == "completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return body


def raw_request(port, path, body):
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer x\r\nx-api-key: x\r\nanthropic-version: 2023-06-01\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


# ---- the fillers: long streams that keep every slot and every queue place taken ------------------

class Fillers:
    """`count` threads, each streaming one long request after another until stop()."""

    def __init__(self, port, path, body, count):
        self.port, self.path, self.body = port, path, json.dumps(body)
        self._stop = threading.Event()
        self._conns = set()
        self._lock = threading.Lock()
        self.events = 0                 # SSE data events received (about one per token)
        self.streaming = {}             # thread -> data events of the response it is reading now
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(count)]

    def start(self):
        for t in self.threads:
            t.start()
            time.sleep(0.02)            # in order: the first ones run, the rest queue
        return self

    def decoding(self, count, timeout=120.0):
        """Waits until `count` streams have each had 3 data events (their role, then tokens): the
        compute thread is then decoding, which hands the GIL back and forth far more than a prefill."""
        deadline = time.monotonic() + timeout
        while sum(n >= 3 for n in list(self.streaming.values())) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {count} streams are decoding: {sorted(self.streaming.values())}")
            time.sleep(0.05)

    def stop(self):
        self._stop.set()
        with self._lock:
            for conn in list(self._conns):
                _shut(conn.sock)
        for t in self.threads:
            t.join(10)

    def _loop(self):
        while not self._stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            with self._lock:
                self._conns.add(conn)
            try:
                conn.request("POST", self.path, body=self.body,
                             headers={"Content-Type": "application/json", "Authorization": "Bearer x",
                                      "x-api-key": "x", "anthropic-version": "2023-06-01"})
                resp = conn.getresponse()
                me = threading.get_ident()
                self.streaming[me] = 0
                while not self._stop.is_set():
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    seen = chunk.count(b"\ndata:") + chunk.startswith(b"data:")
                    with self._lock:
                        self.events += seen
                        self.streaming[me] += seen
                if resp.status != 200:
                    time.sleep(0.5)     # refused (a place not yet free): try again later
            except (OSError, http.client.HTTPException):
                time.sleep(0.5)
            finally:
                with self._lock:
                    self._conns.discard(conn)
                conn.close()


def _shut(sock):
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def health(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    except (OSError, http.client.HTTPException, ValueError):
        return None, {}
    finally:
        conn.close()


def wait_full(port, timeout=120.0):
    """Waits until /health shows every queue place taken; returns its queue object."""
    deadline = time.monotonic() + timeout
    queue = {}
    while time.monotonic() < deadline:
        queue = health(port)[1].get("queue", {})
        if queue and queue.get("waiting", 0) >= queue.get("max_waiting", 1):
            return queue
        time.sleep(0.1)
    raise RuntimeError(f"the queue never filled: {queue}")


# ---- the burst: one selector loop, every connection opened at once ------------------------------

class _Shot:
    __slots__ = ("sock", "out", "buf", "start", "end", "error")

    def __init__(self, sock, out):
        self.sock, self.out, self.buf = sock, out, bytearray()
        self.start = time.perf_counter()
        self.end = self.error = None


def burst(port, payload, count, timeout=30.0):
    """Sends `payload` on `count` fresh connections at once; a list of results, one per request:
    {"seconds", "status", "headers" (lower-case names), "body" (bytes), "error" (None or text),
    "start" (time.perf_counter() at its connect)}."""
    sel = selectors.DefaultSelector()
    shots = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        shot = _Shot(sock, memoryview(payload))
        sock.connect_ex(("127.0.0.1", port))
        sel.register(sock, selectors.EVENT_WRITE, shot)
        shots.append(shot)
    deadline = time.perf_counter() + timeout
    live = count
    while live and time.perf_counter() < deadline:
        for key, mask in sel.select(0.05):
            shot = key.data
            if _step(shot, mask):
                shot.end = time.perf_counter()
                sel.unregister(shot.sock)
                shot.sock.close()
                live -= 1
            elif not shot.out and mask & selectors.EVENT_WRITE:
                sel.modify(shot.sock, selectors.EVENT_READ, shot)
    for shot in shots:
        if shot.end is None:
            shot.error = shot.error or "timeout"
            sel.unregister(shot.sock)
            shot.sock.close()
    sel.close()
    return [_result(shot) for shot in shots]


def _step(shot, mask):
    """Writes or reads what the socket allows; True once the response is whole (or failed)."""
    try:
        if mask & selectors.EVENT_WRITE and shot.out:
            sent = shot.sock.send(shot.out)
            shot.out = shot.out[sent:]
            return False
        if mask & selectors.EVENT_READ:
            chunk = shot.sock.recv(65536)
            if not chunk:
                return True
            shot.buf += chunk
            return _complete(shot.buf)
    except OSError as e:
        shot.error = f"{type(e).__name__}: {e}"
        return True
    return False


def _complete(buf):
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return False
    for line in bytes(buf[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(buf) >= end + 4 + int(value.strip())
    return False            # no length: read until the server closes


def _result(shot):
    status, headers, body = None, {}, b""
    end = shot.buf.find(b"\r\n\r\n")
    if end >= 0:
        lines = bytes(shot.buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        body = bytes(shot.buf[end + 4:])
    seconds = None if shot.end is None else shot.end - shot.start
    error = shot.error or (None if status else "no response")
    return {"seconds": seconds, "status": status, "headers": headers, "body": body, "error": error,
            "start": shot.start}


def well_formed_503(result, route):
    """True when a 503 has Retry-After and the route's error envelope."""
    if result["status"] != 503 or not result["headers"].get("retry-after"):
        return False
    try:
        doc = json.loads(result["body"])
    except ValueError:
        return False
    if route == "messages":
        return doc.get("type") == "error" and isinstance(doc.get("error"), dict)
    return isinstance(doc.get("error"), dict) and {"message", "type", "param", "code"} <= set(doc["error"])


def summarize(results, route):
    rejected = [r for r in results if r["status"] == 503]
    times = [r["seconds"] * 1000 for r in rejected if r["seconds"] is not None]
    return {"requests": len(results), "statuses": dict(Counter(str(r["status"] or r["error"]) for r in results)),
            "rejected": len(rejected), "well_formed_503": sum(well_formed_503(r, route) for r in rejected),
            "median_ms": percentile(times, 50), "p95_ms": percentile(times, 95),
            "p99_ms": percentile(times, 99), "max_ms": max(times) if times else None}


# ---- the server ----------------------------------------------------------------------------------

def start_server(args):
    """gunicorn with the repository's gunicorn.conf.py on a free port; (process, port, log path)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TURBOSPARK_HOST="127.0.0.1", TURBOSPARK_PORT=str(port),
               TURBOSPARK_MAX_WAITING=str(args.max_waiting), PYTHONUNBUFFERED="1")
    if args.model:
        env["TURBOSPARK_MODEL"] = args.model
    env["TURBOSPARK_MAX_BATCH"] = str(args.max_batch)
    env.update(item.split("=", 1) for item in args.env)
    log = Path(tempfile.mkdtemp(prefix="bench-reject-")) / "gunicorn.log"
    cmd = [sys.executable, "-m", "gunicorn", "-c", str(REPO / "gunicorn.conf.py"), "--no-control-socket"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while health(port)[0] != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server did not start; see {log}")
        time.sleep(0.2)
    return proc, port, log


def stop_server(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def first_model(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer x"})
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    finally:
        conn.close()


def prompt_text(chars):
    """About `chars` characters of plain words (a burst request's prompt)."""
    words = "the quick brown fox jumps over a lazy dog while it rains on the hill "
    return (words * (chars // len(words) + 1))[:chars].strip() or "Hi"


def measure(port, route, burst_size, slots=8, rounds=1, filler_tokens=4000, timeout=30.0, prompt_chars=0,
            filler_route=None):
    """Fills the `slots` running places and the queue with `filler_route` streams (default: `route`),
    fires `rounds` bursts at `route`; (summary, pooled results, the queue as /health saw it full)."""
    path = ROUTES[route]
    model = first_model(port)
    places = slots + health(port)[1].get("queue", {}).get("max_waiting", 8)
    grow_descriptor_table(burst_size + places + 64)
    filler_route = filler_route or route
    fillers = Fillers(port, ROUTES[filler_route],
                      request_body(filler_route, model, filler_tokens, True, "Once upon a time"), places).start()
    try:
        queue = wait_full(port)
        fillers.decoding(slots)
        payload = raw_request(port, path, request_body(route, model, 16, False, prompt_text(prompt_chars)))
        results, slowest = [], []
        events, started, gave_way = fillers.events, time.monotonic(), front_door_wait(port)
        for _ in range(rounds):
            wait_full(port)
            shots = burst(port, payload, burst_size, timeout)
            results += shots
            slowest.append(max((r["seconds"] or timeout) * 1000 for r in shots))
        streamed = (fillers.events - events) / (time.monotonic() - started)
        gave_way = front_door_wait(port) - gave_way
    finally:
        fillers.stop()
    summary = summarize(results, route)
    summary["slowest_per_burst_ms"] = [round(ms, 1) for ms in slowest]
    summary["filler_events_per_s"] = round(streamed, 1)
    summary["compute_gave_way_ms_per_burst"] = round(gave_way * 1000 / max(rounds, 1), 1)
    return summary, results, queue


def front_door_wait(port):
    """turbospark_front_door_wait_seconds_total from /metrics (0 when absent)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers={"Authorization": "Bearer x"})
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return 0.0
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith("turbospark_front_door_wait_seconds_total "):
            return float(line.split()[1])
    return 0.0


def grow_descriptor_table(count):
    """Makes this process's descriptor table hold `count` descriptors before the fillers' threads
    run: growing it later, in a process with threads, waits ~15 ms for each doubling, which the first
    burst's connects would otherwise count against the server."""
    import fcntl
    import resource
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit != resource.RLIM_INFINITY:
        count = min(count, limit - 1)
    with contextlib.suppress(OSError):
        os.close(fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, count))


def main(argv=None):
    args = parse_args(argv)
    proc = log = None
    if args.url:
        parts = urlsplit(args.url)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("loopback servers only")
        port = parts.port or 80
    else:
        proc, port, log = start_server(args)
    try:
        load_before = os.getloadavg()
        summary, _, queue = measure(port, args.route, args.burst, args.max_batch, args.rounds,
                                    args.filler_tokens, args.timeout, args.prompt_chars, args.filler_route)
        summary.update(route=args.route, queue=queue, cpus=os.cpu_count(),
                       load_before=[round(x, 2) for x in load_before],
                       load_after=[round(x, 2) for x in os.getloadavg()])
    finally:
        if proc is not None:
            stop_server(proc)
    if args.json:
        print(json.dumps(summary))
        return
    fmt = lambda v: "-" if v is None else f"{v:.1f}"   # noqa: E731
    print(f"route {args.route}, burst {args.burst} x {args.rounds}, queue at start {queue}")
    print(f"statuses {summary['statuses']}; 503 with Retry-After and envelope: "
          f"{summary['well_formed_503']}/{summary['rejected']}")
    print(f"time to 503 (ms): median {fmt(summary['median_ms'])}  p95 {fmt(summary['p95_ms'])}  "
          f"p99 {fmt(summary['p99_ms'])}  max {fmt(summary['max_ms'])}")
    print(f"slowest answer of each burst (ms): {summary['slowest_per_burst_ms']}; the running streams "
          f"meanwhile: {summary['filler_events_per_s']} events/s; the compute thread gave way "
          f"{summary['compute_gave_way_ms_per_burst']} ms a burst")
    print(f"load average before {summary['load_before']}, after {summary['load_after']} ({summary['cpus']} CPUs)")
    if log is not None:
        print(f"server log: {log}")


if __name__ == "__main__":
    main()

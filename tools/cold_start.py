"""A first start as a new user makes it: `turbospark serve` (the README's command) with the model present
and an empty kernel cache, timed from launch to /health 200; then every route's first request against
the median of three warm ones of the same shape (distinct prompts, so no prefix-cache hit helps the
warm ones); then a restart on the now warm cache. Repeated --rounds times, each with a new empty cache.
It also counts the kernels numba compiled into the cache (none where the C kernels run).

    .venv/bin/python tools/cold_start.py --rounds 3
    NUMBA_CPU_NAME=znver3 .venv/bin/python tools/cold_start.py     # the AVX2 build on any x86 machine

Prints one line per measurement and a summary of medians (the cold-start paragraph of docs/performance.md).
"""
import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_http_servers import free_port, get_status  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def routes(model):
    """(name, method, path, body of request n): every generation route, embeddings, and the model list."""
    def completion(n):
        return {"model": model, "prompt": f"Item {n}: the capital of France is", "max_tokens": 16, "temperature": 0}

    def chat(n, stream=False):
        return {"model": model, "messages": [{"role": "user", "content": f"Question {n}: name three colors."}],
                "max_tokens": 16, "temperature": 0, "stream": stream}
    return [
        ("completions", "POST", "/v1/completions", completion),
        ("chat", "POST", "/v1/chat/completions", chat),
        ("chat, streamed", "POST", "/v1/chat/completions", lambda n: chat(n, True)),
        ("messages (Anthropic)", "POST", "/v1/messages",
         lambda n: {"model": model, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Note {n}: say hello."}]}),
        ("responses", "POST", "/v1/responses",
         lambda n: {"model": model, "input": f"Line {n}: count to five.", "max_output_tokens": 16, "temperature": 0}),
        ("embeddings", "POST", "/v1/embeddings", lambda n: {"model": model, "input": f"Sentence number {n} to embed."}),
        ("models", "GET", "/v1/models", None),
    ]


def timed(port, method, path, body):
    """Seconds until the whole answer (a stream to its end) is read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t = time.monotonic()
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{method} {path} answered {resp.status}: {text[:300]!r}")
    return time.monotonic() - t


def launch(args, cache, port):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    log = open(Path(cache) / "serve.log", "wb")
    cmd = [args.turbospark, "serve", "--port", str(port), "--model", args.model]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    started = time.monotonic()
    while time.monotonic() - started < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {(Path(cache) / 'serve.log').read_text()[-2000:]}")
        if get_status(port, "/health") == 200:
            return proc, time.monotonic() - started
        time.sleep(0.05)
    raise RuntimeError("serve not ready after 600 s")


def stop(proc):
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def numba_compiled(cache):
    return sum(1 for _, _, files in os.walk(cache) for f in files if f.endswith(".nbi"))


def one_round(args, r):
    cache = tempfile.mkdtemp(prefix="cold-start-")
    port = free_port()
    proc, ready = launch(args, cache, port)
    out = {"ready_s": ready, "routes": {}}
    try:
        for i, (name, method, path, body) in enumerate(routes(args.model_id)):
            n = 1000 * (r + 1) + 10 * i
            first = timed(port, method, path, body and body(n))
            warm = statistics.median(timed(port, method, path, body and body(n + k)) for k in (1, 2, 3))
            out["routes"][name] = {"first_s": first, "warm_s": warm, "ratio": first / warm if warm else None}
    finally:
        stop(proc)
    out["numba_kernels_compiled"] = numba_compiled(cache)
    proc, out["restart_ready_s"] = launch(args, cache, free_port())
    stop(proc)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the name `turbospark serve --model` takes")
    ap.add_argument("--model-id", default="smollm2-135m-instruct", help="the id requests name")
    ap.add_argument("--turbospark", default=str(Path(sys.executable).with_name("turbospark")))
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()
    rounds = []
    for r in range(args.rounds):
        res = one_round(args, r)
        rounds.append(res)
        worst = max(v["ratio"] for v in res["routes"].values())
        print(f"round {r + 1}: /health 200 after {res['ready_s']:.2f} s (empty cache), restart {res['restart_ready_s']:.2f} s;"
              f" worst first/warm {worst:.2f}x; numba kernels compiled: {res['numba_kernels_compiled']}", flush=True)
        for name, v in res["routes"].items():
            print(f"    {name:22s} first {v['first_s'] * 1000:7.1f} ms  warm {v['warm_s'] * 1000:7.1f} ms  {v['ratio']:.2f}x")
    med = statistics.median
    print(f"\nmedians of {len(rounds)} rounds: ready (empty cache) {med(r['ready_s'] for r in rounds):.2f} s, "
          f"restart (warm cache) {med(r['restart_ready_s'] for r in rounds):.2f} s")
    for name in rounds[0]["routes"]:
        print(f"    {name:22s} first/warm {med(r['routes'][name]['ratio'] for r in rounds):.2f}x  "
              f"(first {med(r['routes'][name]['first_s'] for r in rounds) * 1000:.0f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()

"""Side-by-side HTTP benchmark: this server against llama-cpp-python's server on the same GGUF.

    python tools/bench.py --vs-llama-cpp [--model GGUF] [--repeats 3] [--llama-python PY] [--json]

The servers run one at a time on loopback (never both loaded while measuring), with the same
thread count, and get the same prompts: prefill tok/s (512-token prompt, max_tokens=1, TTFT),
single-stream decode tok/s (128 tokens), aggregate tok/s with p50/p95 latency for 1/4/8/16
streaming clients (64 tokens each), TTFT of a second chat turn against the first (~600 tokens),
and the latency of 1-token requests. Prompts differ per request (a random number up front), so no
prefix cache helps except across the two chat turns. Prints medians (min-max) of the repeats,
ratios ours/llama.cpp, peak RSS and load average; --json prints one object instead. When
llama_cpp.server is not importable by --llama-python, only this server is measured.
"""
import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_http_load as load  # noqa: E402
from bench_http_report import OURS, THEIRS, build_report, format_info, format_table, to_json  # noqa: E402
from bench_http_servers import LlamaCppServer, OurServer  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

DEFAULT_MODEL = str(default_model_path())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llama-python", default="/opt/llamacpp-venv/bin/python")
    p.add_argument("--python", default=sys.executable, help="python that runs this server's gunicorn")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads of each server")
    p.add_argument("--blas-threads", type=int, default=0,
                   help="OpenBLAS threads of this server (default: --threads)")
    p.add_argument("--max-batch", type=int, default=8, help="TURBOSPARK_MAX_BATCH")
    p.add_argument("--clients", default="1,4,8,16", help="concurrency levels")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--budget", type=float, default=600.0,
                   help="seconds for the whole run; later repeats are skipped past a server's share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("ours", "llama"), help="measure one server")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if args.repeats < 1 or not args.clients or min(args.clients) < 1:
        p.error("--repeats and --clients must be positive")
    return args


def log(message):
    print(message, file=sys.stderr, flush=True)


def llama_available(python):
    try:
        return subprocess.run([python, "-c", "import llama_cpp.server.app, uvicorn"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def servers_to_run(args):
    servers = [] if args.only == "llama" else [OurServer(args)]
    if args.only != "ours":
        if llama_available(args.llama_python):
            servers.append(LlamaCppServer(args))
        else:
            log(f"llama_cpp.server is not importable by {args.llama_python}: measuring this server only")
    return servers

FILLER = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps and "
          "listening to the waves below. Ships passed in the distance, their lights blinking like slow "
          "stars, while gulls argued over scraps on the rocks. In the morning he wrote the weather in a "
          "worn notebook: wind from the west, clouds over the hills, a calm and silver sea.").split()
CHAT_SYSTEM = "You are assistant number {}. Answer in plain words."
CHAT_USER = "Read this passage, then answer my questions about it.\n\n"
CHAT_FOLLOW_UP = "Now give the passage a short title."
OVERHEAD_REQUESTS = 10


@dataclass
class Plan:
    """Every prompt of the run, per repeat, so both servers get the same ones."""
    prefill: list      # [repeat] -> ~512-token prompt
    decode: list       # [repeat] -> prompt
    chats: list        # [repeat] -> (system, first user message, follow-up)
    overhead: list     # [repeat] -> short prompts
    clients: dict      # level -> [repeat] -> [client] -> prompts
    warmup: dict


def filler(n):
    return " ".join(FILLER[i % len(FILLER)] for i in range(n))


def fit_words(count, make_text, target):
    """The most filler words n with count(make_text(n)) <= target (binary search; count is monotone)."""
    lo, hi = 0, 1
    while count(make_text(hi)) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(make_text(mid)) <= target else (lo, mid)
    return lo


def counting_prompt(n):
    # NOTE(long-output): greedy decoding continues a count for as long as it is allowed, so the
    # servers' output lengths match without an ignore_eos extension (llama-cpp-python has none).
    return f"Counting up from {n}: {n}, {n + 1}, {n + 2}, {n + 3},"


def make_plan(server, args):
    """Prompts with a distinct 6-digit number up front; long ones sized with the server's tokenizer."""
    numbers = iter(random.Random(args.seed).sample(range(100000, 1000000), 50000))
    n_words = fit_words(server.count_tokens, lambda n: f"{100000}. {filler(n)}", 512)
    # NOTE(exact): whole words may overshoot by a token; short dots fill up to exactly 512
    body = filler(n_words)
    body += " ." * fit_words(server.count_tokens, lambda k: f"{100000}. {body}" + " ." * k, 512)
    n_chat = fit_words(server.count_tokens, lambda n: CHAT_SYSTEM + CHAT_USER + filler(n), 590)

    def long():
        return f"{next(numbers)}. {body}"

    def chat():
        return CHAT_SYSTEM.format(next(numbers)), CHAT_USER + filler(n_chat), CHAT_FOLLOW_UP

    def count(k):
        return [counting_prompt(next(numbers)) for _ in range(k)]

    repeats = range(args.repeats)
    return Plan(prefill=[long() for _ in repeats], decode=[count(1)[0] for _ in repeats],
                chats=[chat() for _ in repeats],
                overhead=[[f"Hello {next(numbers)}" for _ in range(OVERHEAD_REQUESTS)] for _ in repeats],
                clients={c: [[count(args.requests_per_client) for _ in range(c)] for _ in repeats]
                         for c in args.clients},
                warmup={"long": long(), "chat": chat(), "clients": [count(1) for _ in range(args.max_batch)]})


def warm_up(server, plan):
    # NOTE(warm-up): first requests load kernels (numba's cache, BLAS) and page in weights; a
    # batch of concurrent requests also reaches the batched decode path before anything is timed.
    load.prefill(server, plan.warmup["long"])
    load.chat_turns(server, *plan.warmup["chat"], max_tokens=8)
    load.concurrent(server, plan.warmup["clients"], 8)


def one_repeat(server, plan, r, args, metrics, over_budget):
    single_stream(server, plan, r, metrics)
    for level in args.clients:
        if over_budget():
            log(f"{server.name}: over budget, {level}+ clients skipped")
            return
        with timed(server, f"{level} clients"):
            result = load.concurrent(server, plan.clients[level][r], 64)
        for key in CONCURRENT_METRICS:
            metrics[f"c{level}_{key}"].append(result[key])
        if result["errors"]:
            metrics[f"c{level}_errors"].append(result["errors"])


def single_stream(server, plan, r, metrics):
    with timed(server, "prefill"):
        tok_s, n = load.prefill(server, plan.prefill[r])
    metrics["prefill_tok_s"].append(tok_s)
    metrics["prefill_prompt_tokens"].append(n)
    with timed(server, "decode"):
        tok_s, n = load.decode(server, plan.decode[r], 128)
    metrics["decode_tok_s"].append(tok_s)
    metrics["decode_completion_tokens"].append(n)
    with timed(server, "chat turns"):
        t1, t2 = load.chat_turns(server, *plan.chats[r])
    metrics["chat_ttft1_s"].append(t1)
    metrics["chat_ttft2_s"].append(t2)
    metrics["chat_ttft2_over_1"].append(t2 / t1)
    with timed(server, "overhead"):
        metrics["overhead_s"].append(load.overhead(server, plan.overhead[r]))


@contextlib.contextmanager
def timed(server, what):
    started = time.monotonic()
    yield
    log(f"  {server.name}: {what} {time.monotonic() - started:.1f} s")


METRICS = ("prefill_tok_s", "decode_tok_s", "chat_ttft1_s", "chat_ttft2_s", "chat_ttft2_over_1", "overhead_s",
           "prefill_prompt_tokens", "decode_completion_tokens")
CONCURRENT_METRICS = ("aggregate_tok_s", "p50_s", "p95_s", "tokens")
HARD_LIMIT = 1.5
MIN_SHARE = 120.0


def measure(server, plan, args, budget):
    """Starts the server, warms it up, runs the repeats within its budget, always stops it.

    -> (result, plan); the first server measured builds the plan with its tokenizer. A failure is
    kept in the result's info, so the other server is still measured."""
    metrics = _defaulting({name: [] for name in METRICS})
    metrics.update({f"c{c}_{k}": [] for c in args.clients for k in CONCURRENT_METRICS})
    info = {"load_start": os.getloadavg()[0], "started": time.monotonic()}
    # NOTE(watchdog): the budget is checked between workloads; past 1.5x of it the server is stopped,
    # so its requests fail at once and the run stays bounded on a machine slower than expected.
    watchdog = threading.Timer(HARD_LIMIT * budget, _stop_late, (server, info))
    watchdog.daemon = True
    watchdog.start()
    try:
        with server:
            info["startup_s"] = server.startup_s
            plan = plan or make_plan(server, args)
            run_repeats(server, plan, args, metrics, info, time.monotonic() + budget)
            info["peak_rss_mib"] = server.peak_rss_mib()
    except Exception as exc:        # noqa: BLE001 -- reported, and the run goes on
        info["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{server.name}: failed: {info['error']}\n{server.tail()}")
    finally:
        watchdog.cancel()
    info["load_end"] = os.getloadavg()[0]
    info["wall_s"] = round(time.monotonic() - info.pop("started"), 1)
    return {"metrics": dict(metrics), "info": info}, plan


def _stop_late(server, info):
    info["stopped_after_s"] = round(time.monotonic() - info["started"], 1)
    log(f"{server.name}: still running at {HARD_LIMIT}x its budget: stopping it")
    info["peak_rss_mib"] = server.peak_rss_mib()
    server.stop()


def run_repeats(server, plan, args, metrics, info, deadline):
    with timed(server, "warm-up"):
        warm_up(server, plan)
    for r in range(args.repeats):
        if r and time.monotonic() > deadline:
            info["skipped_repeats"] = args.repeats - r
            log(f"{server.name}: over budget, {args.repeats - r} repeats skipped")
            return
        log(f"{server.name}: repeat {r + 1}/{args.repeats}")
        info.setdefault("load_per_repeat", []).append(round(os.getloadavg()[0], 2))
        one_repeat(server, plan, r, args, metrics, lambda: time.monotonic() > deadline)


class _defaulting(dict):
    def __missing__(self, key):
        self[key] = []
        return self[key]


def run(args):
    started = time.monotonic()
    servers = servers_to_run(args)
    plan, results = None, {}
    for i, server in enumerate(servers):
        share = max(MIN_SHARE, (args.budget - (time.monotonic() - started)) / (len(servers) - i))
        log(f"{server.name}: starting (budget {share:.0f} s)")
        results[server.name], plan = measure(server, plan, args, share)
    meta = {"model": args.model, "repeats": args.repeats, "threads": args.threads,
            "max_batch": args.max_batch,
            "clients": args.clients, "requests_per_client": args.requests_per_client,
            "cpu_count": os.cpu_count(), "wall_s": round(time.monotonic() - started, 1)}
    return build_report(meta, results)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)        # unwinds through the servers' context managers


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isfile(args.model):
        sys.exit(f"model not found: {args.model}")
    signal.signal(signal.SIGTERM, _terminate)
    report = run(args)
    if args.json:
        print(to_json(report))
        return report
    print(f"model {args.model}; {args.threads} threads each; repeats {args.repeats}; "
          f"wall {report['meta']['wall_s']} s")
    print(format_info(report))
    print(format_table(report))
    if THEIRS not in report["servers"] or OURS not in report["servers"]:
        print("(one server only: no ratios)")
    return report


if __name__ == "__main__":
    main()

"""Side-by-side HTTP benchmark: this server against llama.cpp's servers on the same GGUF.

    python tools/bench.py --vs-llama-cpp [--model GGUF] [--repeats 3] [--clients 1,8,16,32]
        [--llama-server PATH] [--llama-python PY] [--fresh-numba-cache] [--temperature T]
        [--ignore-eos] [--speculative off|auto|on] [--read-mib 1024] [--json]

The servers are up at once on loopback with the same thread count: this server, llama.cpp's C++
`llama-server` (-np = --max-batch, the anchor of the ratios) and llama-cpp-python's server when
--llama-python imports it (a missing one is skipped with a message). Each is started alone first
and timed cold: launch to /health 200, the first request after it, launch to the first answer,
and a first burst of --max-batch clients. Then every round runs each workload on every server,
the order of the servers rotating per round, so the machine's drift is shared: prefill tok/s
(~512-token prompt, max_tokens 1), single-stream decode tok/s (128 streamed tokens, between the
first and last chunk), aggregate tok/s with p50/p95 latency for --clients streaming clients (64
tokens each), TTFT of a second chat turn against the first (~600 tokens), and the TTFT of a
~12-token prompt one client at a time. Beside the HTTP aggregate at --engine-clients, the same
load driven in-process on this server's engine alone (tools/bench_engine_batch.py) gives the
engine-only figure and what the serving path keeps of it. Prompts differ per request (a number
up front), so no prefix cache helps except across the two chat turns. Prints medians (min-max)
over rounds, ratios ours/peer, peak RSS and the load average per round; --json prints one object.

Each llama.cpp server maps a copy of the GGUF of its own (in a temp directory, removed after):
processes that map one file share its page cache, which cost a decode ~10%. Before the servers
start, tools/read_bandwidth.c measures the machine's read bandwidth (--read-mib MiB, 1 and --threads
threads); single-stream decode is then also shown as the weight bytes it reads a second (tok/s x
the GGUF's bytes a token, tools/read_bandwidth.py) and their share of that bandwidth at --threads.

Random-weight models (tools/make_bench_model.py) want --ignore-eos, which every request and the
engine-only run carry (llama-server takes the field too; llama-cpp-python ignores it), and
--speculative off, which sets this server's TURBOSPARK_SPECULATIVE (llama.cpp's servers speculate
only when asked, and are not asked here): both then run plain decode steps.

Every request is greedy unless --temperature is given. With a temperature, llama.cpp's servers
sample with their own defaults on top of it (top_k 40, top_p 0.95, min_p 0.05, as llama-server's
/props reports), where this server's top_k, top_p and min_p stay off (the OpenAI defaults): the
side by side then compares a top-40 sampler with a whole-vocabulary one.
"""
import argparse
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_http_load as load  # noqa: E402
from bench_http_report import ANCHOR, OURS, build_report, decode_bandwidth, format_info, format_table, to_json  # noqa: E402
from bench_http_servers import (LLAMA_PREFIX, CpuMeter, EngineWorker, LlamaCppPythonServer, LlamaServer,  # noqa: E402
                                OurServer)
from turbospark_wsgi.pull import default_model_path  # noqa: E402

DEFAULT_MODEL = str(default_model_path())
SERVER_NAMES = (OURS, ANCHOR, LlamaCppPythonServer.name)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--repeats", type=int, default=3, help="rounds")
    p.add_argument("--llama-server", default=str(LLAMA_PREFIX / "bin" / "llama-server"),
                   help="llama.cpp's C++ server (default: tools/build_llama_server.sh's)")
    p.add_argument("--llama-ctx", type=int, default=16384, help="llama-server -c (shared by its -np slots)")
    p.add_argument("--llama-python", default=str(LLAMA_PREFIX / "venv" / "bin" / "python"),
                   help="python with llama_cpp.server (tools/build_llama_server.sh --with-python)")
    p.add_argument("--python", default=sys.executable, help="python that runs this server's gunicorn")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads of each server")
    p.add_argument("--blas-threads", type=int, default=0,
                   help="OpenBLAS threads of this server (default: --threads)")
    p.add_argument("--max-batch", type=int, default=8, help="TURBOSPARK_MAX_BATCH and llama-server -np")
    p.add_argument("--clients", default="1,8,16", help="concurrency levels, e.g. 1,8,16,32")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--engine-clients", type=int, default=8,
                   help="streams of the engine-only run (0: none); compared with the HTTP level of that count")
    p.add_argument("--fresh-numba-cache", action="store_true",
                   help="start this server with an empty kernel cache (NUMBA_CACHE_DIR: where the C kernels are built and numba's are cached; a fresh install's cold start)")
    p.add_argument("--budget", type=float, default=1800.0,
                   help="seconds for the whole run; rounds after the first are skipped past it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="of every request (0: greedy); llama.cpp's servers add their top_k 40, top_p 0.95 "
                        "and min_p 0.05 to it, this server nothing")
    p.add_argument("--deep-context", type=int, default=0,
                   help="also decode 64 tokens after a prompt of about this many tokens (0: not)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request decodes its max_tokens (random-weight models; both servers take it)")
    p.add_argument("--speculative", choices=("auto", "on", "off"),
                   help="this server's TURBOSPARK_SPECULATIVE (default: its own); llama.cpp's never speculate here")
    p.add_argument("--read-mib", type=int, default=1024,
                   help="MiB of the read-bandwidth measurement (tools/read_bandwidth.c; 0: none)")
    p.add_argument("--servers", default=",".join(SERVER_NAMES), help="which to measure, comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    args.clients = parse_levels(args.clients)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if args.repeats < 1 or not args.clients or min(args.clients) < 1 or args.engine_clients < 0:
        p.error("--repeats and --clients must be positive")
    unknown = set(args.servers) - set(SERVER_NAMES)
    if unknown or not args.servers:
        p.error(f"--servers takes {', '.join(SERVER_NAMES)}; got {', '.join(sorted(unknown)) or 'none'}")
    return args


def parse_levels(text):
    """'1,8,16' -> [1, 8, 16]: ascending, without duplicates."""
    return sorted({int(c) for c in text.split(",") if c.strip()})


def log(message):
    print(message, file=sys.stderr, flush=True)


def llama_python_available(python):
    try:
        return subprocess.run([python, "-c", "import llama_cpp.server.app, uvicorn"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def servers_to_run(args):
    """The servers asked for that this machine has, in SERVER_NAMES order; the others are named."""
    servers = []
    if OURS in args.servers:
        servers.append(OurServer(args))
    if ANCHOR in args.servers:
        if os.access(args.llama_server, os.X_OK):
            servers.append(LlamaServer(args))
        else:
            log(f"{args.llama_server} is not an executable: llama-server skipped "
                "(tools/build_llama_server.sh builds it)")
    if LlamaCppPythonServer.name in args.servers:
        if llama_python_available(args.llama_python):
            servers.append(LlamaCppPythonServer(args))
        else:
            log(f"llama_cpp.server is not importable by {args.llama_python}: llama-cpp-python skipped")
    return servers


FILLER = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps and "
          "listening to the waves below. Ships passed in the distance, their lights blinking like slow "
          "stars, while gulls argued over scraps on the rocks. In the morning he wrote the weather in a "
          "worn notebook: wind from the west, clouds over the hills, a calm and silver sea.").split()
CHAT_SYSTEM = "You are assistant number {}. Answer in plain words."
CHAT_USER = "Read this passage, then answer my questions about it.\n\n"
CHAT_FOLLOW_UP = "Now give the passage a short title."
SHORT_REQUESTS = 10
CONCURRENT_TOKENS = 64


@dataclass
class Plan:
    """Every prompt of the run, per round, so all servers get the same ones."""
    prefill: list      # [round] -> ~512-token prompt
    decode: list       # [round] -> prompt
    deep: list         # [round] -> ~--deep-context-token prompt ending in a count (empty when off)
    chats: list        # [round] -> (system, first user message, follow-up)
    short: list        # [round] -> ~12-token prompts
    clients: dict      # level -> [round] -> [client] -> prompts
    engine: list       # [round] -> [client] -> prompts (engine-only)
    warmup: dict
    sampling: dict     # the sampling fields of every request


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


def short_prompt(n):
    return f"Say hello to visitor number {n}."            # ~12 tokens: digits are tokens of their own


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

    def streams(n):
        return [count(args.requests_per_client) for _ in range(n)]

    rounds = range(args.repeats)
    deep_words = fit_words(server.count_tokens, lambda n: f"{100000}. {filler(n)} " + counting_prompt(100000),
                           args.deep_context) if args.deep_context else 0

    def deep():
        n = next(numbers)
        return f"{n}. {filler(deep_words)} " + counting_prompt(n)

    return Plan(prefill=[long() for _ in rounds], decode=[count(1)[0] for _ in rounds],
                deep=[deep() for _ in rounds] if args.deep_context else [],
                chats=[chat() for _ in rounds],
                short=[[short_prompt(next(numbers)) for _ in range(SHORT_REQUESTS)] for _ in rounds],
                clients={c: [streams(c) for _ in rounds] for c in args.clients},
                engine=[streams(args.engine_clients) for _ in rounds],
                warmup={"long": long(), "chat": chat(), "clients": [count(1) for _ in range(args.max_batch)]},
                sampling=sampling_of(args))


def own_copy(path, stack):
    """A copy of the file at `path` in a temporary directory that `stack` removes."""
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-model-"))
    copy = os.path.join(directory, os.path.basename(path))
    shutil.copyfile(path, copy)
    return copy


def memory_figures(args):
    """{"bytes_per_token", "read_gb_s": {threads: GB/s}} of the model and this machine; {} without
    --read-mib, and without read_gb_s where the reader cannot be built or run."""
    if not args.read_mib:
        return {}
    from read_bandwidth import ReaderUnavailable, bytes_per_token, read_bandwidth
    out = {"bytes_per_token": bytes_per_token(args.model)}
    try:
        out["read_gb_s"] = read_bandwidth(sorted({1, args.threads}), args.read_mib)
    except ReaderUnavailable as exc:
        log(f"read bandwidth not measured: {exc}")
    return out


def sampling_of(args):
    return {"temperature": args.temperature, **({"ignore_eos": True} if args.ignore_eos else {})}


def rotation(items, r):
    """items in the order of round r: each round starts one further along."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


# ---- cold start -------------------------------------------------------------------------------

COLD_NUMBER = 123456


def cold_start(server, args, metrics):
    """Right after the server first answers /health (nothing has run yet): the first request, then
    a first burst of max_batch clients, where kernels of new batch sizes first run."""
    metrics["ready_s"].append(server.startup_s)
    _, first = load.short(server, short_prompt(COLD_NUMBER), sampling=sampling_of(args))
    metrics["first_request_s"].append(first)
    metrics["first_answer_s"].append(time.monotonic() - server.launched)
    burst = [[counting_prompt(COLD_NUMBER + 10 * i)] for i in range(args.max_batch)]
    burst_tok_s = load.concurrent(server, burst, CONCURRENT_TOKENS, sampling_of(args))["aggregate_tok_s"]
    metrics["first_burst_tok_s"].append(burst_tok_s)
    log(f"  {server.name}: ready {server.startup_s:.1f} s, first request {first:.2f} s")


def warm_up(server, plan):
    # NOTE(warm-up): first requests load kernels (numba's cache, BLAS) and page in weights; a
    # batch of concurrent requests also reaches the batched decode path before anything is timed.
    load.prefill(server, plan.warmup["long"], plan.sampling)
    load.chat_turns(server, *plan.warmup["chat"], max_tokens=8, sampling=plan.sampling)
    load.concurrent(server, plan.warmup["clients"], 8, plan.sampling)


# ---- the workloads of a round -----------------------------------------------------------------

def prefill(server, plan, r, metrics):
    tok_s, n = load.prefill(server, plan.prefill[r], plan.sampling)
    metrics["prefill_tok_s"].append(tok_s)
    metrics["prefill_prompt_tokens"].append(n)


def decode(server, plan, r, metrics):
    tok_s, n = load.decode(server, plan.decode[r], 128, plan.sampling)
    metrics["decode_tok_s"].append(tok_s)
    metrics["decode_completion_tokens"].append(n)


def chat(server, plan, r, metrics):
    t1, t2 = load.chat_turns(server, *plan.chats[r], sampling=plan.sampling)
    metrics["chat_ttft1_s"].append(t1)
    metrics["chat_ttft2_s"].append(t2)
    metrics["chat_ttft2_over_1"].append(t2 / t1)


def short(server, plan, r, metrics):
    ttft, total = load.short_series(server, plan.short[r], sampling=plan.sampling)
    metrics["short_ttft_s"].append(ttft)
    metrics["short_latency_s"].append(total)


def clients(level):
    def workload(server, plan, r, metrics):
        result = load.concurrent(server, plan.clients[level][r], CONCURRENT_TOKENS, plan.sampling)
        for key in CONCURRENT_METRICS:
            metrics[f"c{level}_{key}"].append(result[key])
        if result["errors"]:
            metrics[f"c{level}_errors"].append(result["errors"])
    workload.__name__, workload.level = f"{level} clients", level
    return workload


def deep_decode(server, plan, r, metrics):
    tok_s, n = load.decode(server, plan.deep[r], DEEP_TOKENS, plan.sampling)
    metrics["deep_decode_tok_s"].append(tok_s)


def workloads(args):
    return [prefill, decode, *([deep_decode] if args.deep_context else []), chat, short,
            *(clients(level) for level in args.clients)]


def engine_only(worker, plan, r, metrics, level):
    """The engine-only aggregate of this round, and the HTTP aggregate at the same count over it."""
    result = worker.run(plan.engine[r], CONCURRENT_TOKENS, plan.sampling)
    metrics[f"engine_c{level}_aggregate_tok_s"].append(result["aggregate_tok_s"])
    http = metrics.get(f"c{level}_aggregate_tok_s") or []
    if len(http) > r and http[r] and result["aggregate_tok_s"]:
        metrics[f"c{level}_http_over_engine"].append(http[r] / result["aggregate_tok_s"])


DEEP_TOKENS = 64
METRICS = ("prefill_tok_s", "decode_tok_s", "decode_weight_gb_s", "decode_read_share", "deep_decode_tok_s",
           "chat_ttft1_s", "chat_ttft2_s", "chat_ttft2_over_1", "short_ttft_s", "short_latency_s")
COLD_METRICS = ("ready_s", "first_request_s", "first_answer_s", "first_over_warm", "first_burst_tok_s")
COUNT_METRICS = ("prefill_prompt_tokens", "decode_completion_tokens")
CONCURRENT_METRICS = ("aggregate_tok_s", "p50_s", "p95_s", "tokens")
HARD_LIMIT = 1.5


def new_metrics(args, ours):
    """Empty per-round lists in the order the table shows them."""
    names = [m for m in METRICS if args.deep_context or m != "deep_decode_tok_s"]
    for level in args.clients:
        names += [f"c{level}_{k}" for k in CONCURRENT_METRICS]
        if ours and level == args.engine_clients:
            names += [f"engine_c{level}_aggregate_tok_s", f"c{level}_http_over_engine"]
    names += [*COLD_METRICS, *COUNT_METRICS, "others_cpu_cores"]
    return _defaulting({name: [] for name in names})


def first_over_warm(metrics):
    """The cold first request over the median warm request of the same shape."""
    warm = metrics["short_latency_s"]
    if metrics["first_request_s"] and warm:
        metrics["first_over_warm"].append(metrics["first_request_s"][0] / statistics.median(warm))


# ---- the run ----------------------------------------------------------------------------------

class Run:
    """The servers of one run, their metrics and info; `fail` takes a server out of the rounds."""

    def __init__(self, args, servers):
        self.args, self.servers = args, servers
        self.metrics = {s.name: new_metrics(args, s.name == OURS) for s in servers}
        self.info = {s.name: {} for s in servers}
        self.alive = list(servers)
        self.processes = list(servers)      # what the watchdog stops: the servers and the engine worker
        self.meta = {"load_start": os.getloadavg()[0], "load_per_round": []}
        self.others = {s.name: [0.0, 0.0] for s in servers}    # CPU s of other processes, wall s

    def own_pids(self):
        return [os.getpid(), *(pid for process in self.processes for pid in process.pids())]

    def contention(self, server):
        """Cores that other processes used on average during the server's workloads since the last call."""
        others, wall = self.others[server.name]
        self.others[server.name] = [0.0, 0.0]
        return others / wall if wall > 0 else None

    def fail(self, server, exc):
        self.info[server.name]["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{server.name}: failed: {self.info[server.name]['error']}\n{server.tail()}")
        if server in self.alive:
            self.alive.remove(server)

    def attempt(self, server, what, work, *a):
        """Runs one piece of work on a server still alive; a failure is that server's alone."""
        if server not in self.alive:
            return
        started, meter = time.monotonic(), CpuMeter(self.own_pids())
        try:
            work(server, *a)
        except Exception as exc:        # noqa: BLE001 -- reported, and the others go on
            self.fail(server, exc)
            return
        wall, cores = self.account(server.name, started, meter)
        log(f"  {server.name}: {what} {wall:.1f} s (others used {cores:.2f} cores)")

    def account(self, name, started, meter):
        """Adds a stretch of work to the contention of `name`'s round -> (wall s, cores others used)."""
        wall, others = time.monotonic() - started, meter.others()
        self.others[name][0] += others
        self.others[name][1] += wall
        return wall, others / wall if wall > 0 else 0.0


def start(run, stack, server):
    """Starts one server alone and times its cold start; a failure leaves the others running."""
    log(f"{server.name}: starting")
    try:
        stack.enter_context(server)
    except Exception as exc:        # noqa: BLE001 -- reported, and the others go on
        run.fail(server, exc)
        return
    run.info[server.name]["startup_s"] = round(server.startup_s, 2)
    run.attempt(server, "cold start", cold_start, run.args, run.metrics[server.name])


def start_engine(run, stack):
    """The engine-only worker, warmed up, when this server is measured and --engine-clients asks."""
    if not run.args.engine_clients or OURS not in run.metrics:
        return None
    worker = EngineWorker(run.args)
    run.processes.append(worker)
    try:
        stack.enter_context(worker)
        worker.run([[counting_prompt(COLD_NUMBER + 1000 + i)] for i in range(run.args.engine_clients)], 8)
    except Exception as exc:        # noqa: BLE001 -- the HTTP side is still measured
        run.info[OURS]["engine_error"] = f"{type(exc).__name__}: {exc}"
        log(f"engine-only: failed: {run.info[OURS]['engine_error']}")
        return None
    return worker


def rounds(run, plan, worker, deadline):
    ours = run.metrics.get(OURS)
    for r in range(run.args.repeats):
        if r and time.monotonic() > deadline:
            run.meta["skipped_rounds"] = run.args.repeats - r
            log(f"over budget: {run.args.repeats - r} rounds skipped")
            return
        order = rotation(run.servers, r)
        log(f"round {r + 1}/{run.args.repeats}: {', '.join(s.name for s in order)}")
        run.meta["load_per_round"].append(round(os.getloadavg()[0], 2))
        for server in order:
            run.contention(server)          # from here on: this round's
        for workload in workloads(run.args):
            for server in order:
                run.attempt(server, workload.__name__, workload, plan, r, run.metrics[server.name])
            if worker and getattr(workload, "level", None) == run.args.engine_clients:
                run_engine_only(run, worker, plan, r, ours)     # next to the HTTP figure it is compared with
        if worker and run.args.engine_clients not in run.args.clients:
            run_engine_only(run, worker, plan, r, ours)
        for server in run.alive:
            run.metrics[server.name]["others_cpu_cores"].append(run.contention(server))


def run_engine_only(run, worker, plan, r, metrics):
    started, meter = time.monotonic(), CpuMeter(run.own_pids())
    try:
        engine_only(worker, plan, r, metrics, run.args.engine_clients)
    except Exception as exc:        # noqa: BLE001 -- the HTTP side is still measured
        run.info[OURS]["engine_error"] = f"{type(exc).__name__}: {exc}"
        log(f"engine-only: failed: {run.info[OURS]['engine_error']}")
        return
    # NOTE(contention): counted with this server's workloads of the round: it is this server's figure
    wall, cores = run.account(OURS, started, meter)
    log(f"  engine-only: {run.args.engine_clients} streams {wall:.1f} s (others used {cores:.2f} cores)")


def measure(args, servers):
    """Starts every server (each alone, timed cold), builds the plan, warms them up, runs the
    rounds within the budget and always stops them all. -> Run."""
    run = Run(args, servers)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        for server in servers:
            if server.name != OURS:
                # PERF(page-cache): two processes mapping one file share its pages: ~10% off a decode
                server.model = own_copy(args.model, stack)
        # NOTE(watchdog): the budget is checked between rounds; past 1.5x of it every server is
        # stopped, so their requests fail at once and the run stays bounded on a slow machine.
        watchdog = threading.Timer(HARD_LIMIT * args.budget, _stop_late, (run,))
        watchdog.daemon = True
        watchdog.start()
        stack.callback(watchdog.cancel)
        for server in servers:
            start(run, stack, server)
        worker = start_engine(run, stack)
        if run.alive:
            plan = make_plan(run.alive[0], args)
            for server in list(run.alive):
                run.attempt(server, "warm-up", warm_up, plan)
            rounds(run, plan, worker, started + args.budget)
        for server in servers:
            first_over_warm(run.metrics[server.name])
            run.info[server.name]["peak_rss_mib"] = server.peak_rss_mib()
        if worker:
            run.info[OURS]["engine_peak_rss_mib"] = round(worker.peak_rss_mib() or 0)
    run.meta["load_end"] = os.getloadavg()[0]
    return run


def _stop_late(run):
    log(f"still running at {HARD_LIMIT}x the budget: stopping every server")
    run.meta["stopped_late"] = True
    for process in run.processes:
        process.stop()


class _defaulting(dict):
    def __missing__(self, key):
        self[key] = []
        return self[key]


def report_of(args, run, wall_s, memory):
    meta = {"model": args.model, "repeats": args.repeats, "threads": args.threads, "max_batch": args.max_batch,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos, "speculative": args.speculative,
            **memory,
            "clients": args.clients, "requests_per_client": args.requests_per_client,
            "engine_clients": args.engine_clients, "fresh_numba_cache": args.fresh_numba_cache,
            "cpu_count": os.cpu_count(), "cpu": cpu_name(), "wall_s": round(wall_s, 1), **run.meta}
    if memory.get("read_gb_s"):
        for metrics in run.metrics.values():
            metrics.update(decode_bandwidth(metrics["decode_tok_s"], memory["bytes_per_token"],
                                            memory["read_gb_s"][args.threads]))
    # NOTE(order): a metric any server has, for every server that has it listed (empty where it
    # failed), so the table keeps the workloads' order whichever server failed
    measured = {k for m in run.metrics.values() for k, v in m.items() if v}
    results = {s.name: {"metrics": {k: v for k, v in run.metrics[s.name].items() if k in measured},
                        "info": run.info[s.name]} for s in run.servers}
    return build_report(meta, results)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _terminate(signum, frame):
    raise SystemExit(128 + signum)        # unwinds through the servers' context managers


def main(argv=None):
    args = parse_args(argv)
    if not os.path.isfile(args.model):
        sys.exit(f"model not found: {args.model}")
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    servers = servers_to_run(args)
    if not servers:
        sys.exit("no server to measure")
    memory = memory_figures(args)
    report = report_of(args, measure(args, servers), time.monotonic() - started, memory)
    if args.json:
        print(to_json(report))
        return report
    print(f"model {args.model}; {report['meta']['cpu']}; {args.threads} threads each; max batch / -np "
          f"{args.max_batch}; {args.repeats} rounds, rotating order; wall {report['meta']['wall_s']} s; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(format_info(report))
    print(format_table(report))
    if not report["peer_ratios"]:
        print("(one server only: no ratios)")
    return report


if __name__ == "__main__":
    main()

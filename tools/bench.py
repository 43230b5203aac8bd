"""Engine throughput: prefill tok/s on a 512-token prompt and single-stream decode tok/s.

    python tools/bench.py [--model PATH] [--repeats 3] [--device auto|cpu|cuda] [--threads N] [--temperature T]
        [--prompt-tokens 512] [--decode-steps 128] [--decode-depth 16]
    python tools/bench.py --speculative [--model PATH] [--repeats 3] [--max-tokens 400] [--llama-server PATH]
    python tools/bench.py --vs-llama-cpp [--model GGUF] [--repeats 3] [--clients 1,8,16,32]
        [--llama-server PATH] [--llama-python PY] [--fresh-numba-cache] [--temperature T]
        [--ignore-eos] [--speculative off|auto|on] [--read-mib 1024] [--json]

Decode runs after an untimed --decode-depth-token prompt (16; 4000 is llama-bench's `-d 4000`), and is greedy unless --temperature is given; then each token is drawn by the server's sampler
at that temperature (its other fields off, the OpenAI defaults).

--speculative times one stream's decode (first token to last, through the engine's scheduler) on
two chat workloads, a ~300-token function rewritten with one change and a free-form story, with
speculative decoding off, auto (the default) and on, in rotating order, and checks that all three
give the same tokens. With --llama-server, llama.cpp's server on the same file runs the same requests
one at a time, plain and with its n-gram speculation (`--spec-type ngram-simple`), and its own
decode rate (`timings.predicted_per_second`) is shown beside.

--vs-llama-cpp runs the HTTP benchmark of tools/bench_http.py instead: this server against
llama.cpp's C++ `llama-server` and llama-cpp-python's server, all up at once and measured in
rotating order, same GGUF and threads, beside this engine's own in-process figure
(tools/bench_engine_batch.py), and single-stream decode as weight GB/s and its share of the
machine's measured read bandwidth; see its --help for the other flags. On random-weight models
(tools/make_bench_model.py) run it with --ignore-eos --speculative off. With --temperature there,
llama.cpp's servers sample with their own top_k 40 (and top_p 0.95, min_p 0.05) on top of it.

On a CPU shared with other busy processes, OpenBLAS's worker threads can stall each other; compare
with --threads 1 (or OPENBLAS_NUM_THREADS=1) and watch the printed load average.
"""
import argparse
import contextlib
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.config import Config  # noqa: E402
from turbospark_wsgi.engine import Finish, Token, load_engine  # noqa: E402
from turbospark_wsgi.engine.loader import load_model  # noqa: E402
from turbospark_wsgi.engine.sampling import Sampler, SamplingParams  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

DEFAULT_MODEL = str(default_model_path())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", help="auto, cpu or cuda (default TURBOSPARK_DEVICE or auto)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="BLAS threads (0: library default)")
    p.add_argument("--temperature", type=float, default=0.0, help="of the decode (0: greedy)")
    p.add_argument("--decode-depth", type=int, default=16,
                   help="tokens of context before the timed decode (llama-bench's -d: 4000 beside -d 4000)")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding off / auto / on on an editing and a story workload")
    p.add_argument("--max-tokens", type=int, default=400, help="of each --speculative run")
    p.add_argument("--llama-server", help="--speculative: llama.cpp's llama-server binary to run beside")
    p.add_argument("--vs-llama-cpp", action="store_true",
                   help="HTTP benchmark against llama.cpp's servers (tools/bench_http.py)")
    return p.parse_args(argv)


def blas_threads(n):
    """Limits BLAS threads to n for the block (needs threadpoolctl); n = 0 changes nothing."""
    if not n:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n, user_api="blas")


def bench_prefill(model, n_tokens, rng):
    """tok/s of one prompt of n_tokens random ids into a fresh cache (last logits only)."""
    ids = rng.integers(0, model.cfg.vocab_size, n_tokens)
    cache = model.new_cache(n_tokens)
    t0 = time.perf_counter()
    model.forward(ids, cache, logits="last")
    return n_tokens / (time.perf_counter() - t0)


def bench_decode(model, steps, rng, temperature=0.0, depth=16):
    """tok/s of `steps` decode steps after an untimed `depth`-token prefill, through `decode_batch`
    with one sequence and the server's sampler: the path the server's scheduler runs for a lone stream."""
    cache = model.new_cache(depth + steps)
    logits = model.forward(rng.integers(0, model.cfg.vocab_size, depth), cache)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=0))
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model.decode_batch([sampler(logits)[0]], [cache])[0]
    return steps / (time.perf_counter() - t0)


def summary(values):
    return f"{statistics.median(values):7.1f} tok/s (min {min(values):.1f}, max {max(values):.1f})"


def run_engine_bench(args):
    t0 = time.perf_counter()
    # the server's options (TURBOSPARK_WEIGHTS, ...), the device from --device when given
    loaded = load_model(args.model, Config.from_env().engine_options(), device=args.device)
    print(f"model {args.model}\nbackend {loaded.backend} ({loaded.backend_reason}); "
          f"load {time.perf_counter() - t0:.2f} s")
    rng = np.random.default_rng(0)
    bench_decode(loaded.model, 4, rng)                     # warm-up: page in weights, rope tables
    prefill, decode = [], []
    for _ in range(args.repeats):
        prefill.append(bench_prefill(loaded.model, args.prompt_tokens, rng))
        decode.append(bench_decode(loaded.model, args.decode_steps, rng, args.temperature, args.decode_depth))
    print(f"prefill {args.prompt_tokens} tokens: {summary(prefill)}")
    print(f"decode {args.decode_steps} steps:     {summary(decode)}"
          + (f" at temperature {args.temperature:g}" if args.temperature else "")
          + (f" after {args.decode_depth} tokens of context" if args.decode_depth != 16 else ""))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"load average {os.getloadavg()[0]:.2f}")
    return {"prefill": prefill, "decode": decode}


EDIT_SOURCE = '''def summarize_orders(orders, currency="EUR", min_total=0.0):
    """Totals per customer of the orders in one currency, largest first."""
    totals = {}
    counts = {}
    for order in orders:
        if order.get("currency", "EUR") != currency:
            continue
        customer = order["customer"].strip().lower()
        amount = 0.0
        for item in order.get("items", []):
            price = float(item["price"])
            quantity = int(item.get("quantity", 1))
            if quantity <= 0:
                raise ValueError(f"bad quantity in order {order['id']}")
            amount += price * quantity
        discount = order.get("discount", 0.0)
        if discount:
            amount = amount * (1.0 - discount)
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    rows = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        rows.append({"customer": customer, "total": round(total, 2), "orders": counts[customer]})
    rows.sort(key=lambda row: row["total"], reverse=True)
    return rows
'''
STORY = "Write a long story about a dragon who learns to cook soup for the village."
WORKLOADS = {   # name: (request, temperature)
    "editing": ("Here is a Python function:\n\n```python\n" + EDIT_SOURCE + "```\n\nRewrite the whole function "
                "with one change: rename the variable `totals` to `sums`. Reply with the code only.", 0.0),
    "story": (STORY, 0.0),
    "story, sampled (temperature 0.8, seed 1)": (STORY, 0.8),
}


def run_speculative_bench(args):
    """Single-stream decode tok/s of each workload with speculation off, auto and on (rotating)."""
    from turbospark_wsgi.engine import SamplingParams as Params
    options = Config.from_env().engine_options()
    engines = {mode: load_engine(args.model, options, device=args.device, speculative=mode)
               for mode in ("off", "auto", "on")}
    print(f"model {args.model}; backend {engines['off'].backend}; load average {os.getloadavg()[0]:.2f}")
    cost = step_costs(engines["off"])
    print("decode step with R rows of one sequence, fastest of 9 (ms): "
          + ", ".join(f"R={r} {1e3 * t:.1f}" for r, t in cost.items()))
    steps = {}
    for mode, engine in engines.items():
        model, steps[mode] = engine.model, []

        def counted(tokens, caches, _run=model.decode_batch, _rows=steps[mode]):
            _rows.append(len(tokens))
            return _run(tokens, caches)
        model.decode_batch = counted
    results = {}
    for name, (text, temperature) in WORKLOADS.items():
        ids = engines["off"].apply_chat_template([{"role": "user", "content": text}])
        params = Params(temperature=temperature, seed=1, max_new_tokens=args.max_tokens)
        for engine in engines.values():
            engine.scheduler.slots.clear()
            list(engine.generate(ids, Params(temperature=0, max_new_tokens=2)))     # warm: prompt cached
        rates, cpu, tokens, ends = {m: [] for m in engines}, {m: [] for m in engines}, {}, {}
        for r in range(args.repeats):
            for mode in list(engines)[r % 3:] + list(engines)[:r % 3]:
                first, out = None, []
                del steps[mode][:]
                for event in engines[mode].generate(ids, params):
                    if isinstance(event, Token):
                        first = first or (time.perf_counter(), time.process_time())
                        out.append(event.id)
                    elif isinstance(event, Finish):
                        ends[mode] = event
                rates[mode].append((len(out) - 1) / (time.perf_counter() - first[0]))
                cpu[mode].append((len(out) - 1) / (time.process_time() - first[1]))
                tokens.setdefault(mode, out)
                assert out == tokens[mode], "a run gave other tokens than the one before"
        same = tokens["off"] == tokens["auto"] == tokens["on"]
        print(f"{name}: prompt {len(ids)} tokens, {len(tokens['off'])} generated; same tokens in all modes: {same}")
        # NOTE(load): on shared cores wall time swings with the neighbours; tokens per CPU-second of
        # this process (its kernel threads' spinning included) is the steadier second figure
        base, base_cpu = statistics.median(rates["off"]), statistics.median(cpu["off"])
        plain = sum(cost[1] for _ in steps["off"])
        for mode in engines:
            end = ends[mode]
            kept = f"{end.accepted_tokens}/{end.proposed_tokens} proposed tokens kept" if end.proposed_tokens else ""
            print(f"  {mode:>4}: {summary(rates[mode])} {statistics.median(rates[mode]) / base:4.2f}x; "
                  f"{statistics.median(cpu[mode]):6.1f} tok/CPU-s {statistics.median(cpu[mode]) / base_cpu:4.2f}x  {kept}")
            # the same run priced at the fastest step times: steady where the wall clock is not
            priced = sum(cost.get(r, cost[max(cost)] * r / max(cost)) for r in steps[mode])
            print(f"        {len(steps[mode])} steps, {sum(steps[mode])} rows: {plain / priced:4.2f}x at the fastest step times")
        results[name] = rates
        if args.llama_server:
            llama_server_rates(args, [{"role": "user", "content": text}], temperature)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return results


def step_costs(engine, rows=10, repeats=9):
    """Seconds of a decode step with R = 1..rows rows of one sequence (fastest of `repeats`)."""
    model = engine.model
    cache = model.new_cache(1024)
    model.forward(list(range(100, 400)), cache, "none")
    best = {r: float("inf") for r in range(1, rows + 1)}
    for _ in range(repeats):
        for r in best:
            cache.length = 300
            t0 = time.perf_counter()
            model.decode_batch(list(range(500, 500 + r)), [cache] * r)
            best[r] = min(best[r], time.perf_counter() - t0)
    return best


def llama_server_rates(args, messages, temperature):
    """llama-server's own decode tok/s for one chat request, plain and with n-gram speculation."""
    from types import SimpleNamespace
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_http_load import post_json
    from bench_http_servers import LlamaServer

    class Speculating(LlamaServer):
        def command(self):
            return super().command() + ["--spec-type", "ngram-simple"]

    ns = SimpleNamespace(model=args.model, threads=os.cpu_count(), llama_ctx=4096, max_batch=1, deep_context=0,
                         llama_server=args.llama_server)
    body = {"messages": messages, "temperature": temperature, "seed": 1, "max_tokens": args.max_tokens}
    for label, kind in (("llama-server", LlamaServer), ("llama-server ngram-simple", Speculating)):
        with kind(ns) as server:
            post_json(server.port, "/v1/chat/completions", dict(body, max_tokens=2), timeout=300)
            runs = [post_json(server.port, "/v1/chat/completions", body, timeout=600) for _ in range(args.repeats)]
        rates = [r["timings"]["predicted_per_second"] for r in runs]
        t = runs[-1]["timings"]
        drafted = f"  {t.get('draft_n_accepted')}/{t.get('draft_n')} drafted tokens kept" if t.get("draft_n") else ""
        print(f"  {label}: {summary(rates)}, {runs[-1]['usage']['completion_tokens']} generated{drafted}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--vs-llama-cpp" in argv:
        # NOTE(dispatch): before parsing, so bench_http's own flags reach its parser
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_http
        return bench_http.main([a for a in argv if a != "--vs-llama-cpp"])
    args = parse_args(argv)
    with blas_threads(args.threads):
        (run_speculative_bench if args.speculative else run_engine_bench)(args)


if __name__ == "__main__":
    main()

"""Engine-only aggregate tok/s: N streams driven in-process, no threads and no HTTP.

    python tools/bench_engine_batch.py [--model GGUF] [--clients 8] [--tokens 64] [--repeats 3] [--json]
    python tools/bench_engine_batch.py --worker     # for tools/bench_http.py: one JSON job a line on stdin

One thread iterates N `Engine.generate` runs round-robin (one `next()` each in turn; runs alive at
the same time share the engine's decode steps); when a run finishes, that client's next prompt
starts. Aggregate = completion tokens of all runs / wall time. Set up as the server sets up its
engine (TURBOSPARK_* from the environment, --max-batch for TURBOSPARK_MAX_BATCH), so the figure
beside the HTTP one at the same client count shows what the serving path keeps of the engine's
throughput.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.pull import default_model_path  # noqa: E402

DEFAULT_MODEL = str(default_model_path())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-batch", type=int, default=8, help="TURBOSPARK_MAX_BATCH")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="max_tokens of each run")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--worker", action="store_true",
                   help='read {"clients": [[prompt, ...], ...], "max_tokens": N, "temperature": T, '
                        '"ignore_eos": B} lines, answer one JSON line each')
    return p.parse_args(argv)


def drive(engine, client_prompts, max_tokens, make_params):
    """Runs each client's prompts one after another, all clients at once, round-robin in this thread.

    -> {"aggregate_tok_s", "tokens", "runs", "wall_s"}; `make_params(max_tokens)` builds the
    SamplingParams (passed in so this loop runs against a fake engine in tests)."""
    queues = [[engine.encode(p, add_bos=True) for p in prompts] for prompts in client_prompts]
    started = time.perf_counter()
    runs = [_start(engine, q, max_tokens, make_params) for q in queues]
    tokens = finished = 0
    while any(r is not None for r in runs):
        for i, run in enumerate(runs):
            if run is None:
                continue
            done = _advance(run)
            if done is not None:
                tokens += done
                finished += 1
                runs[i] = _start(engine, queues[i], max_tokens, make_params)
    wall = time.perf_counter() - started
    return {"aggregate_tok_s": tokens / wall if wall > 0 else None, "tokens": tokens, "runs": finished,
            "wall_s": wall}


def _start(engine, queue, max_tokens, make_params):
    """The next run of a client's queue, None when the queue is empty."""
    if not queue:
        return None
    return {"events": engine.generate(queue.pop(0), make_params(max_tokens)), "tokens": 0}


def _advance(run):
    """One `next()` on a run: -> its completion tokens once it has finished, else None."""
    from turbospark_wsgi.engine import Finish, Token
    try:
        event = next(run["events"])
    except StopIteration:
        return run["tokens"]
    if isinstance(event, Token):
        run["tokens"] += 1
    elif isinstance(event, Finish):
        run["events"].close()
        return event.completion_tokens or run["tokens"]
    return None


def greedy(max_tokens):
    return at_temperature(0.0)(max_tokens)


def at_temperature(temperature, ignore_eos=False):
    """make_params for `drive`: SamplingParams at that temperature (through EOS with ignore_eos),
    every other field at its default."""
    from turbospark_wsgi.engine import SamplingParams
    return lambda max_tokens: SamplingParams(max_new_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos)


def load(model, max_batch):
    """The engine as the server loads it (its options from TURBOSPARK_*), on the CPU."""
    from turbospark_wsgi.config import Config
    from turbospark_wsgi.engine import load_engine
    return load_engine(model, Config.from_env().engine_options(), device="cpu", max_batch=max_batch)


def counting_prompts(clients, per_client, first=500000):
    """Distinct prompts that greedy decoding continues past any max_tokens (see bench_http)."""
    n = iter(range(first, first + clients * per_client))
    return [[f"Counting up from {k}: {k}, {k + 1}, {k + 2}, {k + 3}," for k in (next(n) for _ in range(per_client))]
            for _ in range(clients)]


def worker(engine):
    """Answers one JSON job a line until stdin closes; a job's failure is answered, not raised."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            job = json.loads(line)
            params = at_temperature(job.get("temperature", 0.0), job.get("ignore_eos", False))
            result = drive(engine, job["clients"], job["max_tokens"], params)
        except Exception as exc:      # noqa: BLE001 -- reported to the caller, which goes on
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)


def main(argv=None):
    args = parse_args(argv)
    engine = load(args.model, args.max_batch)
    if args.worker:
        return worker(engine)
    # NOTE(warm-up): a first batch compiles/pages in the kernels of every batch size it reaches
    drive(engine, counting_prompts(args.clients, 1, first=900000), 8, greedy)
    results = [drive(engine, counting_prompts(args.clients, args.requests_per_client, 100000 * (r + 1)),
                     args.tokens, greedy) for r in range(args.repeats)]
    rates = [r["aggregate_tok_s"] for r in results]
    summary = {"clients": args.clients, "tokens": args.tokens, "aggregate_tok_s": rates,
               "median_tok_s": statistics.median(rates), "load_average": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"engine-only, {args.clients} streams x {args.tokens} tokens: median {summary['median_tok_s']:.1f} "
              f"tok/s (runs {', '.join(f'{r:.1f}' for r in summary['aggregate_tok_s'])}); "
              f"load average {summary['load_average']:.2f}")
    return summary


if __name__ == "__main__":
    main()

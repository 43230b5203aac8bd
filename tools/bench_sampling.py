"""Cost of sampling a token: the former whole-vocabulary sort against engine.sampling, per row and over HTTP.

    python tools/bench_sampling.py [--model GGUF] [--rows 32] [--repeats 5] [--http-rounds 3]
        [--clients 8] [--tokens 64] [--threads N] [--max-batch 8]

In-process: --rows rows of the model's logits (a short chat, sampled at temperature 1 with a fixed
seed) each go through one `Sampler` call per preset (the OpenAI defaults, top_p 0.95, top_k 40,
min_p 0.05, temperature 0.7 with top_p 0.9, temperature 1.5 with top_p 0.95): once with the choice
as it was (a stable argsort of the whole vocabulary, `full_sort_candidates` below, kept as the
reference) and once with engine.sampling's; interleaved, --repeats times. Prints the median per-row
time of each, the ratio and the size of the kept set; then the logprobs path (log_softmax and the
top 5) per row, which never sorted the vocabulary.

Over HTTP (--http-rounds 0 skips it): this server under gunicorn, set up as tools/bench_http.py
does, with --clients streaming clients of --tokens tokens each at temperature 1 (nothing else set:
what the OpenAI SDK sends by default) and at temperature 0, the order alternating per round.
End-of-text tokens are banned through logit_bias in both, so every answer is --tokens long. Prints
the aggregate tok/s of each (median over rounds) and temperature 1 over temperature 0.
"""
import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.engine import load_engine  # noqa: E402
from turbospark_wsgi.engine.sampling import Sampler, SamplingParams, candidates, log_softmax, top_n  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

DEFAULT_MODEL = str(default_model_path())
PRESETS = {"OpenAI defaults (temperature 1)": dict(temperature=1.0),
           "top_p 0.95": dict(temperature=1.0, top_p=0.95),
           "top_k 40": dict(temperature=1.0, top_k=40),
           "min_p 0.05": dict(temperature=1.0, min_p=0.05),
           "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
           "temperature 1.5, top_p 0.95": dict(temperature=1.5, top_p=0.95)}
PROMPT = "Write a short story about a lighthouse keeper and a storm."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--rows", type=int, default=32, help="logits rows of the in-process part")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--http-rounds", type=int, default=3, help="rounds of the HTTP part (0: none)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads of the server")
    p.add_argument("--max-batch", type=int, default=8, help="TURBOSPARK_MAX_BATCH")
    p.add_argument("--python", default=sys.executable, help="python that runs the server's gunicorn")
    return p.parse_args(argv)


def full_sort_candidates(x, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """engine.sampling.candidates before it stopped sorting the whole vocabulary."""
    z = x.astype(np.float64) / temperature
    if 0 < top_k < z.shape[0]:
        ids = np.argpartition(-z, top_k - 1)[:top_k]
    else:
        ids = np.arange(z.shape[0])
    ids = ids[np.argsort(-z[ids], kind="stable")]          # best first
    probs = np.exp(z[ids] - z[ids[0]])                     # [K], probs[0] == 1
    if not probs[-1] > 0:                                  # masked (-inf) or underflowed tokens never win
        keep = probs > 0
        ids, probs = ids[keep], probs[keep]
    if min_p > 0:
        keep = probs >= min_p                              # relative to the best token
        ids, probs = ids[keep], probs[keep]
    if top_p < 1.0:
        cum = np.cumsum(probs) / probs.sum()
        cut = int(np.searchsorted(cum, top_p)) + 1         # smallest prefix with mass >= top_p
        ids, probs = ids[:cut], probs[:cut]
    return ids, probs


class FullSortSampler(Sampler):
    """The Sampler with its former choice: the same call around it, only the candidates differ."""

    def _choose(self, x):
        p = self.params
        ids, probs = full_sort_candidates(x, p.temperature, p.top_k, p.top_p, p.min_p)
        cum = np.cumsum(probs)
        return int(ids[np.searchsorted(cum, self.rng.random() * cum[-1], side="right").clip(max=len(ids) - 1)])


def logits_rows(engine, n):
    """n rows of the model's next-token logits [n, V] along a chat answer sampled at temperature 1."""
    ids = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    cache = engine.model.new_cache(len(ids) + n)
    logits = engine.model.forward(np.asarray(ids), cache)
    sampler, rows = Sampler(SamplingParams(temperature=1.0, seed=0)), []
    for _ in range(n):
        rows.append(np.array(logits, dtype=np.float32).reshape(-1))
        logits = engine.model.decode_batch([sampler(rows[-1])[0]], [cache])[0]
    return np.stack(rows)


def per_row_ms(make_sampler, rows):
    sampler = make_sampler()
    started = time.perf_counter()
    for row in rows:
        sampler(row)
    return (time.perf_counter() - started) * 1e3 / len(rows)


def in_process(engine, args):
    rows = logits_rows(engine, args.rows)
    print(f"{args.rows} logits rows of V = {rows.shape[1]}; median over {args.repeats} repeats, ms per row")
    print(f"{'preset':32s} {'full sort':>10s} {'sampler':>10s} {'ratio':>7s}   kept tokens (median, max)")
    for name, preset in PRESETS.items():
        params = SamplingParams(seed=0, **preset)
        old, new = [], []
        for _ in range(args.repeats):
            old.append(per_row_ms(lambda: FullSortSampler(params), rows))
            new.append(per_row_ms(lambda: Sampler(params), rows))
        kept = [len(candidates(r, **preset)[0]) for r in rows]
        o, n = statistics.median(old), statistics.median(new)
        print(f"{name:32s} {o:10.3f} {n:10.3f} {o / n:6.1f}x   {statistics.median(kept):.0f}, {max(kept)}")
    logprobs = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for row in rows:
            top_n(log_softmax(row), 5)
        logprobs.append((time.perf_counter() - started) * 1e3 / len(rows))
    print(f"{'logprobs (log_softmax, top 5)':32s} {statistics.median(logprobs):10.3f} ms per row "
          "(an argpartition; no sort of the vocabulary)")


def over_http(engine, args):
    import bench_http_load as load
    from bench_engine_batch import counting_prompts
    from bench_http_servers import OurServer

    ban = {str(t): -100 for t in sorted(engine.tokenizer.stop_ids)}      # every answer runs --tokens long
    sampled, greedy = {"temperature": 1.0, "logit_bias": ban}, {"temperature": 0.0, "logit_bias": ban}
    server_args = SimpleNamespace(python=args.python, model=args.model, threads=args.threads,
                                  blas_threads=0, max_batch=args.max_batch, fresh_numba_cache=False)
    rates = {"temperature 0": [], "temperature 1": []}
    with OurServer(server_args) as server:
        load.concurrent(server, counting_prompts(args.clients, 1, first=900000), 8, sampled)      # warm-up
        for r in range(args.http_rounds):
            order = [("temperature 0", greedy), ("temperature 1", sampled)]
            for i, (name, sampling) in enumerate(order if r % 2 == 0 else order[::-1]):
                prompts = counting_prompts(args.clients, 1, first=100000 * (2 * r + i + 1))
                result = load.concurrent(server, prompts, args.tokens, sampling)
                if result["errors"]:
                    sys.exit(f"{result['errors']} requests failed at {name}")
                rates[name].append(result["aggregate_tok_s"])
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items())
                  + f"; load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    t0, t1 = statistics.median(rates["temperature 0"]), statistics.median(rates["temperature 1"])
    print(f"HTTP, {args.clients} streaming clients x {args.tokens} tokens, aggregate (median of "
          f"{args.http_rounds} rounds): temperature 0 {t0:.1f} tok/s, temperature 1 {t1:.1f} tok/s; "
          f"temperature 1 / 0 = {t1 / t0:.2f}")


def main(argv=None):
    args = parse_args(argv)
    engine = load_engine(args.model, device="cpu")
    print(f"model {args.model}; load average {os.getloadavg()[0]:.2f}")
    in_process(engine, args)
    if args.http_rounds:
        over_http(engine, args)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

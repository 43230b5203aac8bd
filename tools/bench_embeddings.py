"""Sentence embeddings: this engine's encoder next to sentence-transformers, same machine, same
threads, same run.

    python tools/bench_embeddings.py [--model DIR] [--threads N] [--repeats 5]

Sentences/s (median of `--repeats` timed runs after one warm-up) at batch 1 and 32 for ~16- and
~128-token inputs, tokenization included on both sides, and the ratio ours / theirs. The two sides
take turns run by run (A/B interleaved), so a change in the machine's load hits both alike; the
load average is printed with each row. Needs the test extra (sentence-transformers, torch) and
`turbospark pull all-minilm-l6-v2`.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.pull import default_models_dir  # noqa: E402

SHORT = "The quick brown fox jumps over the lazy dog near the river bank"
LONG = " ".join(["retrieval augmented generation with vector databases and embeddings"] * 12)


def sentences_per_s(fns, batch, repeats):
    """Sentences/s of each of `fns` (median of `repeats`), the functions taking turns run by run."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            t = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t)
    return [batch / statistics.median(t) for t in times]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_models_dir() / "all-minilm-l6-v2"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    import torch
    from sentence_transformers import SentenceTransformer
    from threadpoolctl import threadpool_limits

    from turbospark_wsgi.engine import EngineOptions
    from turbospark_wsgi.engine.encoder import load_encoder
    torch.set_num_threads(args.threads)
    ours = load_encoder(args.model, EngineOptions(encoder_threads=args.threads))     # same threads on both sides
    theirs = SentenceTransformer(args.model, device="cpu")
    print(f"{args.model}: {args.threads} threads, median of {args.repeats}")
    print(f"{'tokens':>6} {'batch':>5} {'ours s/s':>10} {'s-t s/s':>10} {'ratio':>6} {'load':>5}")
    with threadpool_limits(args.threads):
        for text in (SHORT, LONG):
            n = len(ours.encode(text))
            for batch in (1, 32):
                texts = [text] * batch
                a, b = sentences_per_s([lambda: ours.embed(ours.encode_batch(texts)),
                                        lambda: theirs.encode(texts, batch_size=32)], batch, args.repeats)
                print(f"{n:>6} {batch:>5} {a:>10.1f} {b:>10.1f} {a / b:>5.2f}x {os.getloadavg()[0]:>5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

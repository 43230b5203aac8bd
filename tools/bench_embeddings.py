"""Sentence embeddings: this engine's encoder next to sentence-transformers, same machine, same
threads, same run.

    python tools/bench_embeddings.py [--model DIR] [--threads N] [--repeats 7]

Sentences/s (median of `--repeats` timed runs after one warm-up) at batch 1 and 32 for ~16- and
~128-token inputs, tokenization included on both sides, and the ratio ours / theirs. Needs the
test extra (sentence-transformers, torch) and `turbospark pull all-minilm-l6-v2`.
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


def sentences_per_s(fn, batch, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_models_dir() / "all-minilm-l6-v2"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    import torch
    from sentence_transformers import SentenceTransformer
    from threadpoolctl import threadpool_limits

    from turbospark_wsgi.engine.encoder import load_encoder
    torch.set_num_threads(args.threads)
    ours, theirs = load_encoder(args.model), SentenceTransformer(args.model, device="cpu")
    print(f"{args.model}: {args.threads} threads, median of {args.repeats}")
    print(f"{'tokens':>6} {'batch':>5} {'ours s/s':>10} {'s-t s/s':>10} {'ratio':>6}")
    with threadpool_limits(args.threads):
        for text in (SHORT, LONG):
            n = len(ours.encode(text))
            for batch in (1, 32):
                texts = [text] * batch
                a = sentences_per_s(lambda: ours.embed(ours.encode_batch(texts)), batch, args.repeats)
                b = sentences_per_s(lambda: theirs.encode(texts, batch_size=32), batch, args.repeats)
                print(f"{n:>6} {batch:>5} {a:>10.1f} {b:>10.1f} {a / b:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

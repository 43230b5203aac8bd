"""In-process decode step time: each layer as one kernel (kernels/layer.py) against the step-by-step path.

    python tools/bench_decode.py [--model GGUF] [--batches 1,8,16] [--steps 20] [--rounds 5] [--depth 32]

B caches are filled with a `--depth`-token prompt each, then `Transformer.decode_batch` runs
`--steps` steps; a round does this for every B on both paths in turn (the order alternating from
round to round, so load drift hits both alike). Printed per B: median step time and tok/s of each
path over the rounds' medians, and their ratio, with the load average. The two paths round
differently (see kernels/layer.py), so each fills its own caches.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.engine import load_engine  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

PATHS = {"step-by-step": False, "fused": True}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--depth", type=int, default=32, help="prompt tokens in each cache before the steps")
    return p.parse_args(argv)


def step_ms(model, batch, steps, depth, fused):
    """Median ms of `steps` decode steps of `batch` sequences on one path."""
    model.plan = dataclasses.replace(model.plan, fused=fused)           # EngineOptions.fused_layers
    caches = [model.new_cache(depth + steps + 2) for _ in range(batch)]
    for b, cache in enumerate(caches):
        model.forward([(7 * b + 3 * i) % 1000 + 100 for i in range(depth)], cache, logits="none")
    tokens = [200 + b for b in range(batch)]
    model.decode_batch(tokens, caches)                                  # pages in this batch size's buffers
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.decode_batch(tokens, caches)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None):
    args = parse_args(argv)
    model = load_engine(args.model, device="cpu").model
    if not model.fused:
        sys.exit("this model's layers cannot run fused (see kernels_layer.layer_args)")
    batches = [int(b) for b in args.batches.split(",")]
    ms = {(name, b): [] for name in PATHS for b in batches}
    loads = []
    for r in range(args.rounds):
        order = list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]
        for b in batches:
            for name in order:
                ms[(name, b)].append(step_ms(model, b, args.steps, args.depth, PATHS[name]))
        loads.append(os.getloadavg()[0])
    print(f"decode step, {args.rounds} interleaved rounds x {args.steps} steps, depth {args.depth}; "
          f"load average {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'B':>3} | {'step-by-step ms':>15} {'tok/s':>7} | {'fused ms':>8} {'tok/s':>7} | fused speed-up")
    for b in batches:
        old, new = (statistics.median(ms[(name, b)]) for name in PATHS)
        print(f"{b:>3} | {old:>15.2f} {1e3 * b / old:>7.1f} | {new:>8.2f} {1e3 * b / new:>7.1f} | {old / new:.2f}x")
    return ms


if __name__ == "__main__":
    main()

"""In-process decode step time: each layer as one kernel (kernels/layer.py) against the step-by-step path.

    python tools/bench_decode.py [--model GGUF] [--batches 1,8,16] [--steps 20] [--rounds 5] [--depth 32]
        [--paths step-by-step,fused,fused-f32kv]

B caches are filled with a `--depth`-token prompt each, then `Transformer.decode_batch` runs
`--steps` steps; a round does this for every B on every path in turn (the order alternating from
round to round, so load drift hits them alike). Printed per B: median step time and tok/s of each
path over the rounds' medians, and each one's speed-up over the first. The paths round
differently (see kernels/layer.py), so each fills its own caches. `fused` is the default path (half
float KV caches), `fused-f32kv` the same with float32 KV caches (kernels/attention.py, NOTE(kv-half)).
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

PATHS = {"step-by-step": (False, "f32"), "fused": (True, "f16"), "fused-f32kv": (True, "f32"),
         "fused-q8kv": (True, "q8_0")}   # fused, KernelPlan.kv


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--depth", type=int, default=32, help="prompt tokens in each cache before the steps")
    p.add_argument("--paths", default="step-by-step,fused", help=f"comma list of {', '.join(PATHS)}")
    return p.parse_args(argv)


def step_ms(model, batch, steps, depth, path):
    """Median ms of `steps` decode steps of `batch` sequences on one path (PATHS)."""
    fused, kv = PATHS[path]
    model.plan = dataclasses.replace(model.plan, fused=fused, kv=kv)   # EngineOptions.fused_layers, kv_cache
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
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        sys.exit(f"--paths takes {', '.join(PATHS)}, not {','.join(unknown) or 'nothing'}")
    ms = {(name, b): [] for name in paths for b in batches}
    loads = []
    for r in range(args.rounds):
        order = paths if r % 2 == 0 else paths[::-1]
        for b in batches:
            for name in order:
                ms[(name, b)].append(step_ms(model, b, args.steps, args.depth, name))
        loads.append(os.getloadavg()[0])
    print(f"decode step, {args.rounds} interleaved rounds x {args.steps} steps, depth {args.depth}; "
          f"load average {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'B':>3} | " + " | ".join(f"{name + ' ms':>16} {'tok/s':>7}" for name in paths)
          + "".join(f" | {name} vs {paths[0]}" for name in paths[1:]))
    for b in batches:
        med = [statistics.median(ms[(name, b)]) for name in paths]
        print(f"{b:>3} | " + " | ".join(f"{m:>16.2f} {1e3 * b / m:>7.1f}" for m in med)
              + "".join(f" | {med[0] / m:.2f}x" for m in med[1:]))
    return ms


if __name__ == "__main__":
    main()

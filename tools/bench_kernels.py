"""Quantized matmul kernels vs float32 numpy on the SmolLM2-135M shapes, and on the real model.

    python tools/bench_kernels.py shapes [--types Q4_1,Q8_0] [--batches 1,4,8] [--repeats 20]
    python tools/bench_kernels.py model [--model PATH] [--steps 64] [--only fp32|quant]

`shapes`: per type, shape and batch the median time of `qmatmul` (auto path: fused kernel up to
GEMV_MAX_B rows, dequantized slabs + BLAS above) and of `x @ Wt` with a pre-transposed float32 Wt,
GB/s of the bytes each holds, the ratio, and a per-token estimate for the whole model (30 layers
of qkv/o/gate|up/down in the layer type + the 49152x576 head in Q8_0). Shapes are (out, in); the
K-quants need in % 256 == 0, so they are measured with in = 576 rounded up to 768.
`model`: the real model through engine/model.py with float32 weights and with the quantized drop-ins
(kernels_cpu.QLinear / QEmbedding): prefill tok/s, decode tok/s, max |logit difference| along the
greedy path, peak RSS (run with --only for each path's own RSS).
"""
import argparse
import os
import resource
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_T0 = time.perf_counter()
from turbospark_wsgi.engine import quant  # noqa: E402
from turbospark_wsgi.engine.kernels import cpu as kernels_cpu  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402

IMPORT_S = time.perf_counter() - _T0

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576)}
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")
N_LAYER = 30
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
DEFAULT_MODEL = str(default_model_path())


def random_raw(qtype, shape, rng):
    """GGUF bytes of a random [n, k] weight: quantized with gguf where it can, else random K-quant
    blocks with small finite float16 scales."""
    from gguf import GGMLQuantizationType, quants
    gtype = GGMLQuantizationType[qtype]
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        return quants.quantize(w, gtype)
    n, k = shape
    raw = rng.integers(0, 256, (n, k // 256, {"Q4_K": 144, "Q6_K": 210}[qtype]), dtype=np.uint8)
    scales = (rng.random((n, k // 256, 2)) * 2e-3).astype(np.float16).view(np.uint8)
    at = {"Q4_K": slice(0, 4), "Q6_K": slice(208, 210)}[qtype]
    raw[..., at] = scales.reshape(n, k // 256, 4)[..., :at.stop - at.start]
    return raw.reshape(n, -1)


def median_us(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bench_shapes(args):
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"threads: numba {kernels_cpu.numba.get_num_threads()}, GEMV_MAX_B {kernels_cpu.GEMV_MAX_B}")
    print(f"{'type':5} {'shape':8} {'n x k':12} {'B':>2} {'gemv us':>8} {'blas us':>8} {'quant GB/s':>10} "
          f"{'fp32 us':>8} {'GB/s':>6} {'fp32/quant':>10}")
    table = {}
    for qtype in args.types.split(","):
        for name, (n, k) in SHAPES.items():
            k = k if qtype not in ("Q4_K", "Q6_K") else -(-k // 256) * 256
            w = quant.pack(quant.decode(random_raw(qtype, (n, k), rng), TYPE_IDS[qtype], (n, k)))
            wt = np.ascontiguousarray(quant.dequantize(w).T)                  # [k, n] as the engine holds it
            for b in batches:
                x = rng.standard_normal((b, k)).astype(np.float32)
                tg = median_us(lambda: kernels_cpu.qmatmul(x, w, path="gemv"), args.repeats)
                tb = median_us(lambda: kernels_cpu.qmatmul(x, w, path="blas"), args.repeats)
                tf = median_us(lambda: x @ wt, args.repeats)
                tq = tg if b <= kernels_cpu.GEMV_MAX_B else tb                # what "auto" picks
                table[qtype, name, b] = (tq, tf)
                print(f"{qtype:5} {name:8} {f'{n}x{k}':12} {b:>2} {tg:8.0f} {tb:8.0f} {w.nbytes / tq / 1e3:10.1f} "
                      f"{tf:8.0f} {wt.nbytes / tf / 1e3:6.1f} {tf / tq:10.2f}", flush=True)
    print_estimates(table, args.types.split(","), batches)


def print_estimates(table, types, batches):
    """Per-token matmul time of the whole model from the shape medians (weights warm in cache:
    a lower bound for the float32 path, whose 538 MB cannot stay cached)."""
    head_type = "Q8_0" if "Q8_0" in types else types[0]
    print(f"\nper-token estimate: {N_LAYER} x (qkv + o + gate_up + down) in the layer type + head in {head_type}")
    for qtype in types:
        for b in batches:
            if any((qtype, s, b) not in table for s in LAYER_SHAPES) or (head_type, "head", b) not in table:
                continue
            q = N_LAYER * sum(table[qtype, s, b][0] for s in LAYER_SHAPES) + table[head_type, "head", b][0]
            f = N_LAYER * sum(table[qtype, s, b][1] for s in LAYER_SHAPES) + table[head_type, "head", b][1]
            print(f"  layers {qtype} B={b}: quant {q / 1e3:6.2f} ms ({b * 1e6 / q:6.1f} tok/s matmul-only), "
                  f"fp32 {f / 1e3:6.2f} ms ({b * 1e6 / f:6.1f} tok/s), fp32/quant {f / q:.2f}")


# ---------------------------------------------------------------------------- real model

def quantized_weights(cfg, source):
    """The engine's Weights with every matrix kept quantized: the recipe weights.py can follow."""
    from turbospark_wsgi.engine import weights as W

    def blocks(ours, layer=None):
        name = W.tensor_name(ours, "gguf", layer)
        info = source.tensors[name]
        return quant.decode(source.raw(name), info.ggml_type, info.shape)

    layers = []
    for i in range(cfg.n_layer):
        wq = blocks("wq", i).map_rows(lambda a: W.unpermute_rotary_rows(a, cfg.n_head))
        wk = blocks("wk", i).map_rows(lambda a: W.unpermute_rotary_rows(a, cfg.n_kv_head))
        wq = wq.scaled(1.0 / np.sqrt(cfg.head_dim))                           # as weights.py folds it
        layers.append(W.LayerWeights(
            attn_norm=W.fetch(source, "attn_norm", "gguf", i),
            wqkv=kernels_cpu.QLinear(quant.pack([wq, wk, blocks("wv", i)])),
            wo=kernels_cpu.QLinear(quant.pack(blocks("wo", i))),
            ffn_norm=W.fetch(source, "ffn_norm", "gguf", i),
            w_gate_up=kernels_cpu.QLinear(quant.pack([blocks("w_gate", i), blocks("w_up", i)])),
            w_down=kernels_cpu.QLinear(quant.pack(blocks("w_down", i)))))
    head = quant.pack(blocks("tok_embd" if cfg.tied_embeddings else "head"))
    embd = head if cfg.tied_embeddings else quant.pack(blocks("tok_embd"))
    rope = W.tensor_name("rope_freqs", "gguf")
    return W.Weights(layers=layers, norm=W.fetch(source, "norm", "gguf"), head=kernels_cpu.QLinear(head),
                     tok_embd=kernels_cpu.QEmbedding(embd),
                     rope_freqs=source.tensor(rope) if rope in source.names else None)


def bench_model(args):
    from turbospark_wsgi.engine.gguf import GGUFFile
    from turbospark_wsgi.engine.loader import _open_gguf, load_model
    from turbospark_wsgi.engine.model import Transformer
    prompt = list(range(100, 137))                                            # 37 tokens, fixed
    runs = {}
    if args.only in (None, "fp32"):
        t0 = time.perf_counter()
        runs["fp32"] = (load_model(args.model, device="cpu", weights="fp32").model, time.perf_counter() - t0)
    if args.only in (None, "quant"):
        t0 = time.perf_counter()
        _, cfg, source = _open_gguf(args.model)
        q = Transformer(cfg, quantized_weights(cfg, source), np)
        source._map = None                                                     # drop the file map
        kernels_cpu.warmup()
        runs["quant"] = (q, time.perf_counter() - t0)
        nbytes = sum(getattr(v, "nbytes", 0) for lw in q.w.layers for v in
                     (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)) + q.w.head.nbytes
        print(f"quantized matrices hold {nbytes / 1e6:.1f} MB")
    logits = {}
    for name, (model, _) in runs.items():
        ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, args.prefill)
        times = []
        for _ in range(args.prefill_repeats):
            t0 = time.perf_counter()
            model.forward(ids, model.new_cache(args.prefill))
            times.append(time.perf_counter() - t0)
        print(f"{name}: prefill {args.prefill} tokens median {statistics.median(times):.2f} s "
              f"= {args.prefill / statistics.median(times):.0f} tok/s")
    for name, (model, load_s) in runs.items():
        cache = model.new_cache(len(prompt) + args.steps + 1)
        out = [model.forward(prompt, cache)]
        tok, times = int(np.argmax(out[0])), []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out.append(model.forward([tok], cache))
            times.append(time.perf_counter() - t0)
            tok = int(np.argmax(out[-1]))
        logits[name] = np.stack(out)
        med = statistics.median(times)
        print(f"{name}: load {load_s:.1f} s, decode median {med * 1e3:.2f} ms/token = {1 / med:.1f} tok/s "
              f"(mean {args.steps / sum(times):.1f} tok/s over {args.steps} steps)")
    if len(logits) == 2:
        same = np.argmax(logits["fp32"], -1) == np.argmax(logits["quant"], -1)
        print(f"max |logit(quant) - logit(fp32)| = {np.abs(logits['quant'] - logits['fp32']).max():.2e}, "
              f"greedy tokens equal: {int(same.sum())}/{len(same)}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("shapes")
    s.add_argument("--types", default="Q4_0,Q4_1,Q4_K,Q6_K,Q8_0")
    s.add_argument("--batches", default="1,4,8")
    s.add_argument("--repeats", type=int, default=20)
    m = sub.add_parser("model")
    m.add_argument("--model", default=DEFAULT_MODEL)
    m.add_argument("--steps", type=int, default=64)
    m.add_argument("--only", choices=("fp32", "quant"))
    m.add_argument("--prefill", type=int, default=512)
    m.add_argument("--prefill-repeats", type=int, default=2)
    args = p.parse_args(argv)
    print(f"kernel warmup (compile or cache load): {kernels_cpu.warmup():.2f} s "
          f"(+ import {IMPORT_S:.2f} s)")
    bench_shapes(args) if args.cmd == "shapes" else bench_model(args)


if __name__ == "__main__":
    main()

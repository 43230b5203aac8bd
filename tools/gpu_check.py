"""One-call device check: parity of the device forward pass with numpy, then speed, in one run.

    python tools/gpu_check.py OUT_DIR [--device cuda|cpu] [--model GGUF ...] [--budget-s 450]

Prints every result and writes OUT_DIR/gpu_check.json (rewritten after each step, so a run cut
short keeps what it measured) and OUT_DIR/gpu_check.log. Steps:

1. packages: falcon, gunicorn, gguf, llguidance (and gguf's own dependencies) are installed from
   tools/wheels/ (filled by tools/fetch_gpu_wheels.sh) when the machine lacks them.
2. device: name and memory; the kernels compiled (CuPy RawModule, or the host build for --device cpu).
3. parity, on each model: the small mixed-type llama this script writes (Q4_0, Q4_1, Q8_0, Q4_K and
   Q6_K matrices) and any --model GGUF. The device forward pass (engine/gpu) against the numpy
   float32 path on the same file: max |dlogit| over a 256-token prompt, greedy agreement over 64
   tokens, and batched decode == each sequence alone.
4. speed, on a random-weight ~1B llama it writes (Q4_0 layers, Q8_0 embedding and head): prefill
   tok/s at 512 and 4096 tokens, single-stream decode, batched aggregate at B = 1, 8, 32, 128; the
   bytes a decode step reads per token against the measured device copy bandwidth; the block
   products alone at batch 1, and with other qmatmul launch shapes (threads per row, rows per block).

`--device cpu` is the dry run: the same code to the end on small sizes, the kernels built for the
host (tests/test_gpu_check.py runs it). Steps past --budget-s are skipped and say so.
"""
import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WHEELS = ROOT / "tools" / "wheels"
SITE = Path(tempfile.gettempdir()) / "turbospark-gpu-check-site"
# module -> distribution: the four the project needs beside what the device has, and gguf's own
PACKAGES = {"falcon": "falcon", "gunicorn": "gunicorn", "gguf": "gguf", "llguidance": "llguidance",
            "yaml": "pyyaml", "tqdm": "tqdm", "requests": "requests", "certifi": "certifi", "idna": "idna",
            "urllib3": "urllib3", "charset_normalizer": "charset-normalizer"}

# model sizes per device: the parity llama (every kernel type), the speed llama (~1B on a GPU)
SIZES = {
    "cuda": {"parity": dict(dim=512, n_layer=4, n_head=8, n_kv_head=4, ffn=1536, vocab=4096),
             "speed": dict(dim=2048, n_layer=16, n_head=32, n_kv_head=8, ffn=8192, vocab=32000),
             "prompt": 256, "greedy": 64, "batched": (4, 16), "prefill": (512, 4096), "decode_steps": 64,
             "batches": (1, 8, 32, 128), "batch_steps": 16, "batch_depth": 64, "copy_mib": 1024,
             "variants": [{"MM_LANES": lanes, "MM_BATCH": batch} for lanes in (8, 16, 32) for batch in (4, 8)]},
    "cpu": {"parity": dict(dim=256, n_layer=2, n_head=4, n_kv_head=2, ffn=512, vocab=512),
            "speed": dict(dim=256, n_layer=2, n_head=4, n_kv_head=2, ffn=512, vocab=1024),
            "prompt": 24, "greedy": 8, "batched": (3, 4), "prefill": (16, 64), "decode_steps": 4,
            "batches": (1, 2, 4), "batch_steps": 2, "batch_depth": 8, "copy_mib": 64,
            "variants": [{"MM_LANES": 8, "MM_BATCH": 8}]},
}


class Report:
    """Results as JSON and lines of log, both written to `out` as they come."""

    def __init__(self, out, budget_s):
        self.out, self.start, self.budget_s = Path(out), time.monotonic(), budget_s
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}
        self._log = open(self.out / "gpu_check.log", "w", encoding="utf-8")

    def log(self, text):
        line = f"[{time.monotonic() - self.start:7.1f}s] {text}"
        print(line, flush=True)
        self._log.write(line + "\n")
        self._log.flush()

    def put(self, step, value):
        self.data["steps"][step] = value
        self.data["elapsed_s"] = round(time.monotonic() - self.start, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2, default=_plain))
        self.log(f"{step}: {json.dumps(value, default=_plain)}")

    def run(self, step, fn, *args):
        """fn(*args) as step `step`: its result recorded, an error recorded with its traceback,
        skipped when the time budget is spent."""
        if time.monotonic() - self.start > self.budget_s:
            self.put(step, {"skipped": f"time budget of {self.budget_s} s spent"})
            return None
        try:
            value = fn(*args)
        except Exception as exc:
            self.log(traceback.format_exc())
            self.put(step, {"error": f"{type(exc).__name__}: {exc}"})
            return None
        self.put(step, value)
        return value


def _plain(v):
    return v.item() if isinstance(v, np.generic) else str(v)


# ---------------------------------------------------------------------------- 1. packages

def ensure_packages():
    """Installs from tools/wheels what the machine lacks into a folder of its own put first on
    sys.path (no index: the device reaches nothing; no write to the machine's own environment,
    which may be externally managed)."""
    missing = [pip for mod, pip in PACKAGES.items() if importlib.util.find_spec(mod) is None]
    done = {"missing": missing, "wheels": len(list(WHEELS.glob("*.whl"))) if WHEELS.is_dir() else 0}
    if missing:
        SITE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(WHEELS),
               "--target", str(SITE), *missing]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        done["pip"] = {"rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:]}
        sys.path.insert(0, str(SITE))
        importlib.invalidate_caches()
        done["still_missing"] = [pip for mod, pip in PACKAGES.items() if importlib.util.find_spec(mod) is None]
    return done


# ---------------------------------------------------------------------------- 2. device

def open_device(device):
    """(kernels, make_kernels, facts): the device's kernels (launch.Kernels), a function building
    them with other launch shapes, and what the device is."""
    from turbospark_wsgi.engine.gpu.launch import device_kernels, host_kernels
    if device == "cpu":
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return host_kernels(), host_kernels, {"name": f"host CPU ({platform.machine()}, {os.cpu_count()} cores; dry run)",
                                "memory_gib": round(pages * size / 2**30, 1), "kernels": "host build"}
    from turbospark_wsgi.engine.backend import select_backend
    backend = select_backend("cuda")
    if backend.kernels is None:
        raise RuntimeError(backend.reason)
    cp = backend.xp
    props = cp.cuda.runtime.getDeviceProperties(0)
    free, total = cp.cuda.Device(0).mem_info
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return backend.kernels, lambda shapes: device_kernels(cp, shapes), {"name": name, "memory_gib": round(total / 2**30, 1), "free_gib": round(free / 2**30, 1),
                             "compute_capability": f"{props['major']}.{props['minor']}", "cupy": cp.__version__,
                             "cuda_runtime": cp.cuda.runtime.runtimeGetVersion(), "kernels": "CuPy RawModule (NVRTC)"}


def synchronize(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------------------- random llama GGUFs

# ggml type -> (weights per block, bytes per block, fill): fill(raw [n, blocks, bytes], std) sets
# the scale fields of random blocks so that weights have about that standard deviation
def _fill_q4_0(raw, std):
    _half(raw, 0, std / 4.6)


def _fill_q4_1(raw, std):
    _half(raw, 0, std / 4.6)
    _half(raw, 2, -7.5 * std / 4.6, spread=False)


def _fill_q8_0(raw, std):
    _half(raw, 0, std / 73.9)


def _fill_q4_k(raw, std):
    raw[..., 4:12] = 8               # every 6-bit scale and min 8 (bytes 0-7 of the 12)
    raw[..., 12:16] = 0x88           # ... and of sub-blocks 4-7
    _half(raw, 0, std / 36.8)
    _half(raw, 2, 7.5 * std / 36.8, spread=False)   # w = 8 d (q - 7.5)


def _fill_q6_k(raw, std):
    raw[..., 192:208] = 8            # int8 scales
    _half(raw, 208, std / (8 * 18.5))


def _half(raw, at, value, spread=True):
    rng = np.random.default_rng(raw.shape[0] + at)
    v = value * (1.0 + 0.2 * rng.standard_normal(raw.shape[:2])) if spread else np.full(raw.shape[:2], value)
    raw[..., at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)


BLOCKS = {"Q4_0": (32, 18, _fill_q4_0), "Q4_1": (32, 20, _fill_q4_1), "Q8_0": (32, 34, _fill_q8_0),
          "Q4_K": (256, 144, _fill_q4_k), "Q6_K": (256, 210, _fill_q6_k)}


def random_blocks(rng, qtype, n, k, std):
    per, size, fill = BLOCKS[qtype]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    fill(raw, std)
    return raw.reshape(n, -1)


def write_llama(path, dim, n_layer, n_head, n_kv_head, ffn, vocab, types, seed=0, ctx=8192):
    """A llama GGUF of random blocks; types: {tensor role: ggml type name} for
    q, k, v, o, gate, up, down, embd, head (norms float32)."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random-llama")
    w.add_block_count(n_layer)
    w.add_context_length(ctx)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(dim // n_head)
    w.add_vocab_size(vocab)

    def mat(name, role, n, k, std=None):
        qt = types[role]
        w.add_tensor(name, random_blocks(rng, qt, n, k, std or 1.0 / np.sqrt(k)),
                     raw_dtype=gguf.GGMLQuantizationType[qt])

    def norm(name):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32))

    hd = dim // n_head
    mat("token_embd.weight", "embd", vocab, dim, std=1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        mat(p + "attn_q.weight", "q", n_head * hd, dim)
        mat(p + "attn_k.weight", "k", n_kv_head * hd, dim)
        mat(p + "attn_v.weight", "v", n_kv_head * hd, dim)
        mat(p + "attn_output.weight", "o", dim, n_head * hd)
        norm(p + "ffn_norm.weight")
        mat(p + "ffn_gate.weight", "gate", ffn, dim)
        mat(p + "ffn_up.weight", "up", ffn, dim)
        mat(p + "ffn_down.weight", "down", dim, ffn)
    norm("output_norm.weight")
    mat("output.weight", "head", vocab, dim, std=2.0 / np.sqrt(dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MIXED = {"q": "Q4_K", "k": "Q6_K", "v": "Q8_0", "o": "Q4_0", "gate": "Q4_1", "up": "Q4_K", "down": "Q6_K",
         "embd": "Q8_0", "head": "Q6_K"}
SPEED = {**{r: "Q4_0" for r in ("q", "k", "v", "o", "gate", "up", "down")}, "embd": "Q8_0", "head": "Q8_0"}


# ---------------------------------------------------------------------------- 3. parity

def load_pair(path, kernels):
    """(numpy float32 reference model, device model) of one GGUF."""
    from turbospark_wsgi.engine.gguf import GGUFFile
    from turbospark_wsgi.engine.gpu.model import load_device_model
    from turbospark_wsgi.engine.loader import load_model
    ref = load_model(path, device="cpu", weights="fp32")
    return ref.model, load_device_model(ref.config, GGUFFile(path), kernels)


def parity(path, kernels, size):
    ref, dev = load_pair(path, kernels)
    vocab = ref.cfg.vocab_size
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, vocab, size["prompt"])
    a = ref.forward(prompt, ref.new_cache(), logits="all")
    b = dev.forward(prompt, dev.new_cache(), logits="all")
    agree, n = greedy_agreement(ref, dev, prompt[:16], size["greedy"])
    batched = batched_vs_solo(dev, rng, *size["batched"])
    return {"model": Path(path).name, "prompt_tokens": len(prompt), "max_abs_dlogit": float(np.abs(a - b).max()),
            "max_abs_logit": float(np.abs(a).max()), "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "greedy_agree": f"{agree}/{n}", **batched}


def greedy_agreement(ref, dev, prompt, steps):
    """Greedy tokens of both models from `prompt`: how many of the first `steps` agree before the
    first difference."""
    tokens = []
    for m in (ref, dev):
        cache, out = m.new_cache(), []
        logits = m.forward(prompt, cache)
        for _ in range(steps):
            out.append(int(np.argmax(logits)))
            logits = m.forward(out[-1:], cache)
        tokens.append(out)
    same = next((i for i, (x, y) in enumerate(zip(*tokens)) if x != y), steps)
    return same, steps


def batched_vs_solo(model, rng, batch, steps):
    """Decode `batch` sequences of different lengths together, then each alone: max |dlogit|."""
    vocab = model.cfg.vocab_size
    prompts = [rng.integers(0, vocab, 5 + 3 * b) for b in range(batch)]
    feeds = rng.integers(0, vocab, (steps, batch))

    def run(group):
        caches = [model.new_cache() for _ in group]
        for c, b in zip(caches, group):
            model.forward(prompts[b], c, logits="none")
        return np.stack([model.decode_batch(feeds[s, group], caches) for s in range(steps)])  # [steps, len, vocab]

    together = run(list(range(batch)))
    alone = np.concatenate([run([b]) for b in range(batch)], axis=1)
    return {"batched_vs_solo_max_abs": float(np.abs(together - alone).max()), "batch": batch, "steps": steps}


# ---------------------------------------------------------------------------- 4. speed

def timed(xp, fn):
    synchronize(xp)
    t = time.perf_counter()
    fn()
    synchronize(xp)
    return time.perf_counter() - t


def speed(path, kernels, size, make_kernels=None):
    from turbospark_wsgi.engine.gguf import GGUFFile, model_config_from_gguf
    from turbospark_wsgi.engine.gpu.model import load_device_model
    from turbospark_wsgi.engine.gpu.weights import weight_bytes
    xp = kernels.xp
    t = time.perf_counter()
    source = GGUFFile(str(path))
    cfg = model_config_from_gguf(source.metadata)
    cfg.tied_embeddings = "output.weight" not in source.names
    model = load_device_model(cfg, source, kernels)
    out = {"model": Path(path).name, "load_s": round(time.perf_counter() - t, 1),
           "params_b": round(_params(cfg) / 1e9, 3), "weight_bytes": weight_bytes(model.w)}
    rng = np.random.default_rng(2)
    model.forward(rng.integers(0, cfg.vocab_size, 32), model.new_cache(64))          # warm-up: compile, cuBLAS
    out.update(kernel_bandwidth(model, xp))
    for n in size["prefill"]:
        ids = rng.integers(0, cfg.vocab_size, n)
        s = min(timed(xp, lambda: model.forward(ids, model.new_cache(n + 1))) for _ in range(2))
        out[f"prefill_{n}_tok_s"] = round(n / s, 1)
    cache = model.new_cache(128 + size["decode_steps"] + 1)
    model.forward(rng.integers(0, cfg.vocab_size, 128), cache, logits="none")
    s = timed(xp, lambda: [model.decode_batch([7], [cache]) for _ in range(size["decode_steps"])])
    out["decode_1_tok_s"] = round(size["decode_steps"] / s, 1)
    for b in size["batches"]:
        caches = [model.new_cache(size["batch_depth"] + size["batch_steps"] + 1) for _ in range(b)]
        for c in caches:
            model.forward(rng.integers(0, cfg.vocab_size, size["batch_depth"]), c, logits="none")
        s = timed(xp, lambda: [model.decode_batch(list(range(b)), caches) for _ in range(size["batch_steps"])])
        out[f"batch_{b}_aggregate_tok_s"] = round(b * size["batch_steps"] / s, 1)
    kv = 2 * cfg.n_layer * (128 + size["decode_steps"] // 2) * cfg.n_kv_head * cfg.head_dim * 4
    out["bytes_per_token_b1"] = out["weight_bytes"] + kv
    if make_kernels is not None:
        out["launch_shapes"] = launch_shapes(model, make_kernels, size["variants"], xp)
    return out


def kernel_bandwidth(model, xp, reps=20):
    """The block products alone at batch 1: one layer's four matrices and the head, each `reps`
    times, as GB/s of weight bytes read (against the copy bandwidth: what the kernels reach
    without the rest of a decode step)."""
    mats = _matrices(model)
    gb_s = product_gb_s(mats, xp, 1, reps)
    share = sum(m.nbytes for m in mats[:4]) / sum(m.nbytes for m in mats)
    return {"kernel_gb_s_b1": gb_s, "kernel_us_per_layer_b1": round(
        sum(m.nbytes for m in mats) / (gb_s * 1e9) * share * 1e6, 1)}


def _matrices(model):
    lw = model.w.layers[0]
    return [lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down, model.w.head]


def product_gb_s(mats, xp, rows, reps):
    """GB/s of weight bytes read by `reps` products of `rows` input rows with each of `mats`."""
    xs = [xp.ones((rows, m.k), dtype=np.float32) for m in mats]
    for m, x in zip(mats, xs):
        x @ m                                                           # warm
    s = timed(xp, lambda: [x @ m for _ in range(reps) for m, x in zip(mats, xs)])
    return float(f"{sum(m.nbytes for m in mats) * reps / s / 1e9:.4g}")


def launch_shapes(model, make_kernels, variants, xp, reps=20):
    """qmatmul built with other launch shapes on the same weights: GB/s at 1 and 8 input rows."""
    from turbospark_wsgi.engine.gpu.weights import DeviceLinear
    out = []
    for shapes in variants:
        try:
            kernels = make_kernels(shapes)
            mats = [DeviceLinear(m.parts, kernels) for m in _matrices(model)]
            out.append({**shapes, "gb_s_b1": product_gb_s(mats, xp, 1, reps),
                        "gb_s_b8": product_gb_s(mats, xp, 8, reps)})
        except Exception as exc:   # one shape failing to build or run leaves the others measured
            out.append({**shapes, "error": f"{type(exc).__name__}: {exc}"})
    return out


def _params(cfg):
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    layer = cfg.dim * (2 * q + 2 * kv) + 3 * cfg.dim * cfg.ffn_dim
    return cfg.n_layer * layer + 2 * cfg.vocab_size * cfg.dim


def copy_bandwidth(xp, mib):
    """Device-to-device copy bandwidth in GB/s (bytes read + written), best of 5."""
    a = xp.ones(mib * 2**20 // 4, dtype=np.float32)
    b = xp.empty_like(a)
    b[...] = a
    best = min(timed(xp, lambda: b.__setitem__(Ellipsis, a)) for _ in range(5))
    return {"copy_mib": mib, "copy_gb_s": round(2 * a.nbytes / best / 1e9, 1)}


def roofline(speed_result, bandwidth):
    """Decode at batch 1 against the bound the copy bandwidth sets for its bytes per token."""
    bound = bandwidth["copy_gb_s"] * 1e9 / speed_result["bytes_per_token_b1"]
    return {"bound_tok_s_b1": round(bound, 1), "measured_tok_s_b1": speed_result["decode_1_tok_s"],
            "fraction_of_bound_b1": round(speed_result["decode_1_tok_s"] / bound, 3),
            "kernel_fraction_of_copy_b1": round(speed_result["kernel_gb_s_b1"] / bandwidth["copy_gb_s"], 3)}


# ---------------------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for gpu_check.json and gpu_check.log")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", action="append", default=[], help="a GGUF to check parity on (repeatable)")
    p.add_argument("--work", help="folder for the generated models (default: a temporary one)")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip steps that would start after this")
    args = p.parse_args(argv)
    report = Report(args.out, args.budget_s)
    report.data.update(device_arg=args.device, python=sys.version.split()[0], numpy=np.__version__,
                       load_1m=os.getloadavg()[0])
    report.run("packages", ensure_packages)
    held = {}

    def device():
        held["kernels"], held["make_kernels"], facts = open_device(args.device)
        return facts

    if report.run("device", device) is None:
        return 1
    kernels = held["kernels"]
    size = SIZES[args.device]
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        mixed = report.run("write_parity_model", lambda: str(write_llama(
            Path(work) / "mixed-types.gguf", **size["parity"], types=MIXED, ctx=1024)))
        for i, path in enumerate(([mixed] if mixed else []) + args.model):
            report.run(f"parity_{i}", parity, path, kernels, size)
        big = report.run("write_speed_model", lambda: str(write_llama(
            Path(work) / "random-llama.gguf", **size["speed"], types=SPEED)))
        bandwidth = report.run("copy_bandwidth", copy_bandwidth, kernels.xp, size["copy_mib"])
        result = report.run("speed", speed, big, kernels, size, held["make_kernels"]) if big else None
        if result and bandwidth:
            report.run("roofline", roofline, result, bandwidth)
    report.data["finished"] = True
    report.put("done", {"elapsed_s": round(time.monotonic() - report.start, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The q8_0 KV cache (TURBOSPARK_KV_CACHE=q8_0; kv_cache.py, NOTE(kv-q8)): rows in GGUF's q8_0 blocks,
written with the same bits by numpy, numba and every C path, each value the nearest step of its
block's scale (gguf's own quantizer gives the same scales); attention over the rows computes what it
computes over their values in float32, bit for bit; a model on it moves its logits by the rounding
alone, keeps NOTE(exact-prefix), and holds 17/32 of a half-float cache's bytes."""
import dataclasses
import os

import numpy as np
import pytest

from turbospark_wsgi.engine.kernels import attention as kernels_attention, isa, native
from turbospark_wsgi.engine.kv_cache import KVCache, dequantize_q8, quantize_q8
from turbospark_wsgi.engine.loader import load_model

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernels_attention.AVAILABLE, reason="needs numba")
PATHS = [p for p in isa.runnable(isa.host_features()) if p != "neon" or os.uname().machine in ("aarch64", "arm64")]
HAVE_CC = native.compiler() is not None


def hard_rows(rng):
    """Rows of 64 values: random spreads over 15 decades, an all-zero block, a block of exact ties
    (scale 0.5: values at k + 1/2 steps), values whose scale is below half's smallest subnormal, a
    block past the half range, and negative zeros."""
    x = rng.standard_normal((40, 64)) * 10.0 ** rng.integers(-9, 6, (40, 1))
    x[1, :32] = 0.0
    x[2, :32] = 0.25 * (2 * np.arange(32) - 31)          # amax 7.75 -> scale ~0.061 (no ties)
    x[3, :32] = np.concatenate([[63.5], 0.5 * (np.arange(31) + 0.5)])    # scale 0.5: x / 0.5 = k + 1/2
    x[4, :32] = 1e-9
    x[5, :32] = 1e10
    x[6] = -0.0
    return x.astype(np.float32)


def test_q8_rows_keep_ggufs_scales_and_each_value_at_its_nearest_step():
    x = hard_rows(np.random.default_rng(0))
    rows = quantize_q8(x)
    assert rows.shape == (40, 68) and rows.dtype == np.int8
    q, scale = rows[:, :64].astype(np.int64), rows[:, 64:].copy().view(np.float16)
    with np.errstate(over="ignore"):
        theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(40, 2, 34)
    their_scale = theirs[..., :2].copy().view(np.float16).reshape(40, 2)
    d = np.abs(x).reshape(40, 2, 32).max(-1) / np.float32(127)
    assert np.array_equal(scale[d <= 65504], their_scale[d <= 65504])  # the file format's scales
    ok = (d >= 2.0 ** -14) & (d <= 65504)       # normal half scales: within 2^-11 of gguf's float32 one
    their_q = theirs[..., 2:].view(np.int8).reshape(40, 64).astype(np.int64)
    fine = np.repeat(ok, 32, axis=1)
    assert np.abs(q - their_q)[fine].max() <= 1                        # llama.cpp: x * (1/d), ties away from 0
    step = np.repeat(scale.astype(np.float32), 32, axis=1)
    back = dequantize_q8(rows)
    assert np.array_equal(back, q * step)                              # q * scale, exact
    inside = fine & (np.abs(x) <= 127 * step)
    assert (np.abs(x - back)[inside] <= step[inside] / 2).all()        # the nearest step
    assert np.abs(q).max() <= 127 and (q[1, :32] == 0).all() and (scale[1, 0] == 0)
    assert q[3, 1:32].tolist() == np.rint(np.arange(31) + 0.5).astype(int).tolist()    # ties to even
    assert np.isfinite(back).all() and (q[5, :32] == 127).all()        # past the half range: held, never inf


def test_every_writer_gives_the_same_q8_bits():
    x = hard_rows(np.random.default_rng(1))
    want = quantize_q8(x)
    got = np.empty_like(want)
    for r in range(len(x)):
        kernels_attention.quantize_q8(x[r], got[r])
    assert np.array_equal(got, want)                                   # numba's K/V store
    if HAVE_CC:
        for path in PATHS:
            assert np.array_equal(native.load(path).quantize_kv(x), want), path    # the C layer's
    cache = KVCache(1, 8, 2, 64, np, np.int8)
    keys, _ = cache.update(0, 0, x[:4].reshape(2, 2, 64), x[4:8].reshape(2, 2, 64))
    assert keys.shape == (2, 2, 68) and np.array_equal(keys.reshape(4, 68), want[:4])
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(1, 8, 2, 40, np, np.int8)


def _case(rng, depth, R, H=6, G=2, D=64):
    k = rng.standard_normal((depth + R, G, D)).astype(np.float32)
    v = rng.standard_normal((depth + R, G, D)).astype(np.float32)
    q = (rng.standard_normal((R, (H + 2 * G) * D)) * 0.3).astype(np.float32)
    return k, v, q, np.zeros(R, np.int64), np.arange(depth, depth + R, dtype=np.int64), H, G, D


def _kv(keys, vals):
    return np.array([[keys.ctypes.data, vals.ctypes.data, keys.shape[1]]], np.int64)


@pytest.mark.parametrize("depth, R, window", [(0, 5, 0), (600, 1, 0), (300, 9, 0), (700, 3, 100)])
def test_attention_over_q8_rows_is_attention_over_their_values(depth, R, window):
    k, v, q, seq, pos, H, G, D = _case(np.random.default_rng(depth + R), depth, R)
    k8, v8 = quantize_q8(k)[None], quantize_q8(v)[None]                # [1 layer, capacity, G, D + D/16]
    kf, vf = dequantize_q8(k8), dequantize_q8(v8)
    out8, outf = (np.empty((R, H * D), np.float32) for _ in range(2))
    kernels_attention.attend_rows(q, seq, pos, _kv(k8, v8), kernels_attention.element(np.int8), 0, window, H, G, D, out8)
    kernels_attention.attend_rows(q, seq, pos, _kv(kf, vf), kernels_attention.element(np.float32), 0, window, H, G, D,
                                  outf)
    np.testing.assert_allclose(out8, outf, rtol=2e-5, atol=2e-6)       # numba: its own lanes' order
    if not HAVE_CC:
        return
    first = None
    for path in PATHS:
        lib = native.load(path)
        a, b = (np.empty((R, H * D), np.float32) for _ in range(2))
        lib.attend_rows(q, seq, pos, _kv(k8, v8), 2, 0, window, H, G, D, a, 2)
        lib.attend_rows(q, seq, pos, _kv(kf, vf), 0, 0, window, H, G, D, b, 2)
        assert np.array_equal(a, b), path                              # the values' own bits
        first = a if first is None else first
        assert np.array_equal(a, first), path                          # every path alike
    np.testing.assert_allclose(first, out8, rtol=2e-5, atol=2e-6)


def _q8_model(tiny_gguf, **kw):
    path = tiny_gguf(qtype="Q8_0", hidden_size=128, name="tiny-hd32.gguf").path     # head_dim 32
    return path, load_model(path, device="cpu", kv_cache="q8_0", **kw).model


def _run(model, prompt, steps, cut=None):
    cache = model.new_cache(64)
    pieces = [prompt] if cut is None else [prompt[:cut], prompt[cut:]]
    logits = [model.forward(p, cache, logits="all") for p in pieces]
    logits += [model.decode_batch([t], [cache]) for t in steps]
    return np.concatenate(logits), cache


def test_a_q8_cache_moves_the_logits_by_its_rounding_and_keeps_exact_prefixes(tiny_gguf, monkeypatch):
    _, model = _q8_model(tiny_gguf)
    prompt, steps = [1, 40, 72, 101, 108, 108, 111, 260, 263, 32], [5, 6, 7]
    q8_logits, q8 = _run(model, prompt, steps)
    assert q8.k.dtype == np.int8 and q8.k.shape[-1] == 34 and "q8_0 KV cache" in model.plan.describe()
    cut_logits, cut = _run(model, prompt, steps, cut=4)
    assert np.array_equal(cut_logits, q8_logits) and np.array_equal(cut.k, q8.k)      # NOTE(exact-prefix)
    monkeypatch.setattr(model, "plan", dataclasses.replace(model.plan, kv="f32"))
    full_logits, full = _run(model, prompt, steps)
    n = len(prompt) + len(steps)
    assert np.array_equal(q8.k[0, 0], quantize_q8(full.k[0, 0]))      # layer 0, position 0: the rounding alone
    for a, b in ((dequantize_q8(q8.k[:, :n]), full.k[:, :n]), (dequantize_q8(q8.v[:, :n]), full.v[:, :n]),
                 (q8_logits, full_logits)):
        assert np.abs(a - b).max() < 3e-2 * max(1.0, float(np.abs(b).max()))
    assert np.abs(q8_logits - full_logits).mean() < 1e-2 * max(1.0, float(np.abs(full_logits).max()))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_q8_cache_gets_the_same_bits_on_every_path_and_follows_numba(tiny_gguf):
    path, _ = _q8_model(tiny_gguf)
    prompt, steps = [1, 5, 9, 2, 7, 3, 11, 4], [6, 8, 10]
    runs = {p: _run(load_model(path, device="cpu", kv_cache="q8_0", kernels="native", int8_isa=p,
                               activations="int8").model,
                    prompt, steps)[0] for p in PATHS}
    first = runs[PATHS[0]]
    assert all(np.array_equal(r, first) for r in runs.values())
    numba_run = _run(load_model(path, device="cpu", kv_cache="q8_0", kernels="numba", int8_isa=PATHS[0],
                                activations="int8").model,
                     prompt, steps)[0]
    assert np.argmax(first, -1).tolist() == np.argmax(numba_run, -1).tolist()
    np.testing.assert_allclose(first, numba_run, atol=0.02 * np.abs(numba_run).max())


def test_the_q8_option_reaches_models_whose_heads_take_it(tiny_gguf):
    path, model = _q8_model(tiny_gguf)
    assert model.new_cache(1).k.dtype == np.int8
    unfused = load_model(path, device="cpu", kv_cache="q8_0", fused_layers=False).model
    assert unfused.new_cache(1).k.dtype == np.float32 and "f32 KV cache" in unfused.plan.describe()
    narrow = load_model(tiny_gguf(qtype="Q8_0").path, device="cpu", kv_cache="q8_0").model     # head_dim 16
    assert narrow.new_cache(1).k.dtype == np.float16
    assert "f16 KV cache (q8_0 takes heads of a multiple of 32 values, not 16)" in narrow.plan.describe()


def test_a_q8_cache_holds_17_32nds_of_a_half_caches_bytes():
    half, q8 = (KVCache(16, 4096, 8, 64, np, dtype) for dtype in (np.float16, np.int8))
    for cache in (half, q8):
        cache.reserve(1000)
    assert q8.nbytes * 32 == half.nbytes * 17

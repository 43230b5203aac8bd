"""The fused layer kernel (kernels_layer): its pieces against the numpy steps, the whole layer stack
against the step-by-step path, and the exactness the prefix cache and batching rely on."""
import dataclasses

import numpy as np
import pytest

from turbospark_wsgi.engine.kernels import cpu as kernels_cpu, layer as kernels_layer
from turbospark_wsgi.engine.kv_cache import KVCache
from turbospark_wsgi.engine.loader import load_model
from turbospark_wsgi.engine.model import gelu_tanh_gate, rms_norm, swiglu

pytestmark = pytest.mark.skipif(not kernels_layer.AVAILABLE, reason="numba is not installed")


@pytest.fixture(autouse=True)
def _int8_fused(monkeypatch):
    monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "int8")


def step_by_step(model, fn, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(model, "plan", dataclasses.replace(model.plan, fused=False))
        assert not model.fused
        return fn()


def test_norm_and_gates_match_the_numpy_steps():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 80)) * [[1.0], [1e-3], [300.0]]).astype(np.float32)   # 80: a ragged lane tail
    w = rng.standard_normal(80).astype(np.float32)
    got = np.empty_like(x)
    kernels_layer._norm_rows(x, w, np.float32(1e-5), got)
    assert np.allclose(got, rms_norm(x, w, 1e-5, np), rtol=2e-6, atol=1e-6)
    gu = np.concatenate([rng.standard_normal((2, 40)) * 6, rng.standard_normal((2, 40))], axis=1).astype(np.float32)
    gu[0, :6] = [-200.0, -90.0, -9.0, 0.0, 9.0, 90.0]                   # past both ends of exp's range
    g, u = gu[:, :40].astype(np.float64), gu[:, 40:].astype(np.float64)
    with np.errstate(over="ignore"):
        silu = g / (1.0 + np.exp(-g)) * u
    gelu = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3))) * u
    for flag, ref, numpy_step in ((False, silu, swiglu), (True, gelu, gelu_tanh_gate)):
        out = np.empty((2, 40), np.float32)
        kernels_layer._gate_rows(gu, flag, out)
        assert np.allclose(out, ref, rtol=2e-6, atol=1e-6), flag
        assert np.allclose(out, numpy_step(gu, 40, np), rtol=2e-6, atol=1e-6), flag


def _run(model, prompt, steps):
    cache = model.new_cache(64)
    logits = [model.forward(prompt, cache, logits="all")]
    logits += [model.decode_batch([t], [cache]) for t in steps]
    return np.concatenate(logits), cache


def fused_and_step_by_step(model, prompt, steps, monkeypatch):
    """Both paths with float32 KV caches (the step-by-step path's), so only the layers differ."""
    monkeypatch.setattr(model, "plan", dataclasses.replace(model.plan, kv="f32"))
    assert model.fused and model.new_cache(1).k.dtype == np.float32
    return _run(model, prompt, steps), step_by_step(model, lambda: _run(model, prompt, steps), monkeypatch)


def assert_fused_follows_step_by_step(model, monkeypatch, prompt=(1, 40, 72, 101, 108, 108, 111, 260, 263, 32)):
    """The two paths agree to float32 noise, but for where the float steps' rounding (which differs
    between them, with the CPU's vector width, and with attention's own rounding) tips an
    activation's int8 rounding the other way: that moves the rows downstream of it (a position's
    logits, the K/V after it) by up to about one int8 step of their block. So: nine rows in ten
    exact to float32 noise, and no value off by more than 2% of the largest."""
    (new, cache_new), (old, cache_old) = fused_and_step_by_step(model, list(prompt), [5, 6, 7], monkeypatch)
    n = cache_new.length
    assert n == cache_old.length == len(prompt) + 3
    for a, b in ((new, old), (cache_new.k[:, :n], cache_old.k[:, :n]), (cache_new.v[:, :n], cache_old.v[:, :n])):
        diff, scale = np.abs(a - b), max(1.0, float(np.abs(b).max()))
        exact_rows = np.mean(diff.reshape(-1, diff.shape[-1]).max(axis=1) < 1e-4)
        assert exact_rows > 0.9 and diff.max() < 2e-2 * scale, (exact_rows, diff.max(), scale)


def test_half_float_kv_caches_move_the_logits_by_their_rounding_alone(tiny_gguf, monkeypatch):
    """NOTE(kv-half): the fused path's default cache holds half floats: its K/V are the float32
    cache's rounded to the nearest half (up to where that rounding tips an activation's int8 rounding
    downstream), and the logits move by that rounding's size, not more."""
    model = load_model(tiny_gguf(qtype="Q8_0").path, device="cpu").model
    prompt, steps = [1, 40, 72, 101, 108, 108, 111, 260, 263, 32], [5, 6, 7]
    half_logits, half = _run(model, prompt, steps)
    assert half.k.dtype == half.v.dtype == np.float16 and "f16 KV cache" in model.plan.describe()
    monkeypatch.setattr(model, "plan", dataclasses.replace(model.plan, kv="f32"))
    full_logits, full = _run(model, prompt, steps)
    assert full.k.dtype == np.float32 and "f32 KV cache" in model.plan.describe()
    n = len(prompt) + 3
    assert np.array_equal(half.k[0, 0], full.k[0, 0].astype(np.float16))    # layer 0, position 0: rounding alone
    for a, b in ((half.k[:, :n], full.k[:, :n]), (half.v[:, :n], full.v[:, :n]), (half_logits, full_logits)):
        a, b = a.astype(np.float32), b
        assert np.abs(a - b).max() < 2e-2 * max(1.0, float(np.abs(b).max()))
    assert np.abs(half_logits - full_logits).mean() < 5e-3 * max(1.0, float(np.abs(full_logits).max()))


def test_the_kv_cache_option_reaches_the_model(tiny_gguf):
    path = tiny_gguf(qtype="Q8_0").path
    dtypes = [load_model(path, device="cpu", **opt).model.new_cache(1).k.dtype
              for opt in ({}, {"kv_cache": "f16"}, {"kv_cache": "f32"}, {"kv_cache": "f16", "fused_layers": False})]
    assert dtypes == [np.float16, np.float16, np.float32, np.float32]      # half floats only where fused


def test_llama_layers_follow_the_step_by_step_path(tiny_gguf, monkeypatch):
    assert_fused_follows_step_by_step(load_model(tiny_gguf(qtype="Q8_0").path, device="cpu").model, monkeypatch)


def test_layers_fuse_only_with_int8_activations_on_the_int8_kernels(tiny_gguf, monkeypatch):
    model = load_model(tiny_gguf(qtype="Q8_0").path, device="cpu").model
    assert model.fused
    monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "float32")
    assert not model.fused                                             # float32 stays the reference path
    assert not load_model(tiny_gguf(qtype="F32").path, device="cpu").model.fused


def test_a_prompt_cut_anywhere_and_decode_steps_give_the_same_bits(tiny_gguf, monkeypatch):
    """Every row on its own, across a cache that grows during the calls."""
    monkeypatch.setattr(KVCache, "INITIAL", 16)
    model = load_model(tiny_gguf(qtype="Q8_0").path, device="cpu").model
    ids = list(np.random.default_rng(3).integers(0, model.cfg.vocab_size, 40))
    whole_cache = model.new_cache(64)
    whole = model.forward(ids, whole_cache, logits="all")
    cache = model.new_cache(64)
    pieces = [model.forward(ids[a:b], cache, logits="all") for a, b in ((0, 7), (7, 20), (20, 21))]
    pieces += [model.decode_batch([t], [cache]) for t in ids[21:]]
    assert np.array_equal(np.concatenate(pieces), whole)
    assert np.array_equal(cache.k[:, :40], whole_cache.k[:, :40])
    assert np.array_equal(cache.v[:, :40], whole_cache.v[:, :40])


def test_batched_rows_at_other_depths_equal_solo_rows(tiny_gguf):
    model = load_model(tiny_gguf(qtype="Q8_0").path, device="cpu").model
    prompts = [[1, 40, 72], [1, 101, 108, 108, 111, 260, 263, 32, 119], [5]]

    def caches():
        out = [model.new_cache(32) for _ in prompts]
        for p, c in zip(prompts, out):
            model.forward(p, c, logits="none")
        return out
    solo = [model.decode_batch([9], [c])[0] for c in caches()]
    together = caches()
    batched = model.decode_batch([9, 9, 9], together)
    assert all(np.array_equal(a, b) for a, b in zip(batched, solo))
    assert [c.length for c in together] == [len(p) + 1 for p in prompts]

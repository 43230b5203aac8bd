"""The forward pass's pieces against written-out math, and the KV cache's contract."""
import numpy as np
import pytest

from turbospark_wsgi.engine import attention as attention_mod
from turbospark_wsgi.engine.attention import ATTN_BLOCK, rope
from turbospark_wsgi.engine.exact_rows import rows_matmul
from turbospark_wsgi.engine.kv_cache import KVCache
from turbospark_wsgi.engine.loader import load_model
from turbospark_wsgi.engine.model import rms_norm, swiglu


def naive_attention(q, keys, vals, pos, window=0):
    """Per head, per query: softmax over visible keys (q already scaled). q [T, H, D], keys [L, G, D].
    With a window the query at position p sees keys max(0, p - window + 1)..p."""
    T, H, D = q.shape
    G = keys.shape[1]
    out = np.zeros((T, H, D))
    for t in range(T):
        lo = max(0, pos + t - window + 1) if window else 0
        for h in range(H):
            kv = h // (H // G)
            s = keys[lo:pos + t + 1, kv] @ q[t, h]
            p = np.exp(s - s.max())
            out[t, h] = p @ vals[lo:pos + t + 1, kv] / p.sum()
    return out.reshape(T, H * D)


ATTENTION_CASES = [(1, 0, 4, 2, 0), (1, 9, 6, 3, 0), (300, 0, 4, 2, 0), (140, 37, 6, 1, 0), (5, 3, 4, 4, 0),
                   (1, 9, 6, 3, 4), (300, 0, 4, 2, 50), (140, 37, 6, 1, 200), (150, 100, 4, 2, 1), (5, 3, 4, 4, 3)]


@pytest.mark.parametrize("T, pos, H, G, window", ATTENTION_CASES)
def test_blocked_attention_matches_naive(tiny_gguf, T, pos, H, G, window):
    rng = np.random.default_rng(T + pos)
    m = load_model(tiny_gguf().path).model
    q = rng.standard_normal((T, H, 8)).astype(np.float32)
    # keys past pos+T (up to the last block's end) hold stale values: the blocks must mask them
    span = -(-(pos + T) // ATTN_BLOCK) * ATTN_BLOCK
    keys = rng.standard_normal((span, G, 8)).astype(np.float32)
    vals = rng.standard_normal((span, G, 8)).astype(np.float32)
    want = naive_attention(q, keys, vals, pos, window)
    assert np.abs(m.attention.blocked(q, keys, vals, pos, window) - want).max() < 1e-5
    if T == 1:
        assert np.abs(m.attention.row(q, keys[:pos + 1], vals[:pos + 1], pos, window) - want).max() < 1e-5


def explicit_window_mask(p0, rows, lo, n, window, m):
    """The sliding-window mask written out for each (row, head, key): row p sees p - window < j <= p."""
    p = np.repeat(np.arange(p0, p0 + rows), m)[:, None]
    j = np.arange(lo, n)[None, :]
    return np.where((j > p) | (j <= p - window), np.float32(-np.inf), np.float32(0.0))


@pytest.mark.parametrize("T, pos, G, window", [(300, 0, 2, 50), (140, 37, 1, 200), (150, 100, 2, 1), (5, 3, 4, 3),
                                               (1, 9, 2, 4), (200, 700, 2, 130), (129, 1000, 1, 700),
                                               (300, 0, 1, 700)])
def test_window_masks_are_views_of_one_band_with_the_written_out_bits(tiny_gguf, monkeypatch, T, pos, G, window):
    """Block attention with a window gives the bits it gives with the mask written out per call,
    and its masks are views of one array per (window, heads per KV head), not rebuilt per block."""
    rng = np.random.default_rng(T + pos)
    m = load_model(tiny_gguf().path).model
    q = rng.standard_normal((T, 4, 8)).astype(np.float32)
    span = -(-(pos + T) // ATTN_BLOCK) * ATTN_BLOCK
    keys = rng.standard_normal((span, G, 8)).astype(np.float32)
    vals = rng.standard_normal((span, G, 8)).astype(np.float32)
    masks, real = [], m.attention._window_mask

    def spy(*args):
        masks.append((args, real(*args)))
        return masks[-1][1]
    monkeypatch.setattr(m.attention, "_window_mask", spy)
    got = m.attention.blocked(q, keys, vals, pos, window)
    for args, mask in masks:
        assert np.array_equal(mask, explicit_window_mask(*args)), args
    monkeypatch.setattr(m.attention, "_window_mask", explicit_window_mask)
    assert np.array_equal(got, m.attention.blocked(q, keys, vals, pos, window))
    bands = {id(mask.base) for _, mask in masks if mask.base is not None}
    assert len(bands) <= 2 and all(mask.base is not None for _, mask in masks)    # a band grows at most once here
    assert masks[-1][1].base is m.attention._masks[("window", window, 4 // G)]


def test_block_attention_rows_do_not_depend_on_the_rows_beside_them(tiny_gguf):
    rng = np.random.default_rng(3)
    m = load_model(tiny_gguf().path).model
    q = rng.standard_normal((300, 4, 8)).astype(np.float32)
    keys = rng.standard_normal((384, 2, 8)).astype(np.float32)
    vals = rng.standard_normal((384, 2, 8)).astype(np.float32)
    whole = m.attention.blocked(q, keys, vals, 0)
    cuts = [(0, 1), (37, 40), (100, 229), (127, 300), (299, 300)]
    if not _blas_rows_exact(q.reshape(2, 600, 8), keys.transpose(1, 2, 0), cuts):
        pytest.skip("this BLAS gives rows of few-row products other bits (the model's rows_exact "
                    "probe turns the row-exact prefix reuse off there)")
    for a, b in cuts:
        assert np.array_equal(m.attention.blocked(q[a:b], keys, vals, a), whole[a:b]), (a, b)


def _blas_rows_exact(x, w, cuts):
    """Whether rows_matmul gives rows a..b of x @ w the bits of the whole product here."""
    whole = rows_matmul(x, w, np)
    return all(np.array_equal(rows_matmul(x[:, a:b], w, np), whole[:, a:b]) for a, b in cuts)


def test_rope_rotates_halves_by_position_angles():
    rng = np.random.default_rng(0)
    T, heads, D, rot = 3, 2, 8, 6
    x = rng.standard_normal((T, heads, D)).astype(np.float32)
    ang = rng.uniform(-3, 3, (T, 1, rot // 2))
    got = rope(x, np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), rot, np)
    z = (x[..., :rot // 2] + 1j * x[..., rot // 2:rot]) * np.exp(1j * ang)   # pair (i, i+rot/2) as complex
    assert np.allclose(got[..., :rot // 2], z.real, atol=1e-5)
    assert np.allclose(got[..., rot // 2:rot], z.imag, atol=1e-5)
    assert np.array_equal(got[..., rot:], x[..., rot:])


def test_swiglu_and_rms_norm():
    g = np.array([[-200.0, -3.0, 0.0, 2.5, 90.0]], dtype=np.float32)
    u = np.array([[1.0, 2.0, 3.0, -1.0, 0.5]], dtype=np.float32)
    with np.errstate(over="ignore"):
        expect = g / (1.0 + np.exp(-g.astype(np.float64))) * u
    assert np.allclose(swiglu(np.concatenate([g, u], axis=1), 5, np), expect, rtol=1e-6, atol=1e-6)
    x = np.array([[3.0, 4.0], [0.0, 1e-3]], dtype=np.float32)
    w = np.array([2.0, 0.5], dtype=np.float32)
    expect = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.allclose(rms_norm(x, w, 1e-5, np), expect, rtol=1e-6)


def test_long_prefill_equals_token_by_token(tiny_gguf, monkeypatch):
    monkeypatch.setattr(attention_mod, "ATTN_BLOCK", 16)  # many blocks, a ragged last one
    m = load_model(tiny_gguf(n_kv_head=1).path).model
    ids = np.random.default_rng(3).integers(0, m.cfg.vocab_size, 70)
    bulk = m.forward(ids, m.new_cache(), logits="all")
    cache = m.new_cache()
    steps = np.stack([m.forward([t], cache) for t in ids])
    assert np.abs(bulk - steps).max() < 1e-4


def test_cache_prefix_reuse_equals_fresh_run(tiny_gguf):
    m = load_model(tiny_gguf().path).model
    a, b, c = [5, 70, 9, 33, 120, 7], [44, 45, 46], [99, 100, 3, 4]
    cache = m.new_cache(64)
    m.forward(a + b, cache, logits="none", row_exact=True)
    cache.truncate(len(a))
    reused = m.forward(c, cache, logits="all", row_exact=True)
    fresh = m.forward(a + c, m.new_cache(64), logits="all", row_exact=True)[len(a):]
    assert cache.length == len(a + c)
    assert np.abs(reused - fresh).max() < 1e-5
    cache.reset()
    assert cache.length == 0
    again = m.forward(a + c, cache, logits="all", row_exact=True)[len(a):]
    assert np.array_equal(again, fresh)                 # same call shapes: same bits on any BLAS
    if not m.rows_exact:
        pytest.skip("this BLAS gives rows of few-row products other bits: the server reuses whole chunks")
    assert np.array_equal(reused, fresh)


def test_cache_bounds():
    cache = KVCache(2, 8, 1, 4, np)
    assert cache.k.shape == cache.v.shape == (2, 8, 1, 4)
    k, v = cache.update(1, 0, np.ones((3, 1, 4)), np.full((3, 1, 4), 2.0))
    assert k.shape == (3, 1, 4) and v[2, 0, 0] == 2.0 and cache.length == 0   # the model advances length
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, 6, np.ones((3, 1, 4)), np.ones((3, 1, 4)))
    with pytest.raises(ValueError):
        cache.truncate(1)


def test_forward_refuses_overflow_and_empty_input(tiny_gguf):
    m = load_model(tiny_gguf().path).model
    cache = m.new_cache(4)
    with pytest.raises(ValueError):
        m.forward([1, 2, 3, 4, 5], cache)
    with pytest.raises(ValueError):
        m.forward([], cache)
    assert cache.length == 0
    assert m.forward([1, 2], cache, logits="all").shape == (2, m.cfg.vocab_size)


@pytest.mark.parametrize("T, pos, H, G, window", ATTENTION_CASES)
def test_fused_attention_matches_naive_and_its_rows_depend_only_on_their_position(T, pos, H, G, window):
    from turbospark_wsgi.engine.kernels import attention as kernels_attention
    if not kernels_attention.AVAILABLE:
        pytest.skip("needs numba")
    rng = np.random.default_rng(T + pos)
    q = rng.standard_normal((T, H, 8)).astype(np.float32)
    keys = rng.standard_normal((pos + T + 7, G, 8)).astype(np.float32)   # keys past the last row: never read
    vals = rng.standard_normal((pos + T + 7, G, 8)).astype(np.float32)
    whole = kernels_attention.attend(q, keys, vals, pos, window)
    assert np.abs(whole - naive_attention(q, keys, vals, pos, window)).max() < 1e-5
    for a, b in [(0, 1), (T // 3, T // 2 + 1), (T - 1, T)]:
        assert np.array_equal(kernels_attention.attend(q[a:b], keys, vals, pos + a, window), whole[a:b]), (a, b)

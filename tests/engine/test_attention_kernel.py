"""The CPU attention kernel (engine/kernels/attention.py): numbers against a naive softmax, and a row's
bits independent of what shares its call (the rows beside it, other sequences, how the key chunks
were scheduled), so a decode step gives what a prefill gives."""
import numpy as np
import pytest

from turbospark_wsgi.engine.kernels import attention

from test_kernels_model import naive_attention  # tests/engine is on the path (no package)

pytestmark = pytest.mark.skipif(not attention.AVAILABLE, reason="needs numba")

CHUNK = attention.CHUNK


def _inputs(T, pos, H, G, D, seed=0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((T, H, D)) / np.sqrt(D)).astype(np.float32)
    keys = rng.standard_normal((pos + T + 5, G, D)).astype(np.float32)
    vals = rng.standard_normal((pos + T + 5, G, D)).astype(np.float32)
    return q, keys, vals


@pytest.mark.parametrize("T, pos, H, G, D, window", [
    (2 * CHUNK + 40, 0, 9, 3, 64, 0),          # a long prompt: many blocks, chunks merged as they come
    (3, 3 * CHUNK + 7, 4, 1, 20, 0),           # few rows deep in the cache: chunks computed in parallel
    (CHUNK + 9, CHUNK - 5, 8, 2, 16, 300),     # a window crossing chunk edges
    (40, 2 * CHUNK, 4, 4, 8, 1),               # a window of one key
])
def test_matches_naive_attention_across_chunks(T, pos, H, G, D, window):
    q, keys, vals = _inputs(T, pos, H, G, D)
    got = attention.attend(q, keys, vals, pos, window)
    assert np.abs(got - naive_attention(q, keys, vals, pos, window)).max() < 2e-5


@pytest.mark.parametrize("window", [0, CHUNK + 3])
def test_a_row_gets_the_same_bits_alone_in_a_block_and_in_a_long_prompt(window):
    T, H, G, D = 2 * CHUNK + 30, 6, 2, 32
    q, keys, vals = _inputs(T, 0, H, G, D, seed=1)
    whole = attention.attend(q, keys, vals, 0, window)
    for p in (0, 7, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 29):          # decode-sized calls
        assert np.array_equal(attention.attend(q[p:p + 1], keys, vals, p, window), whole[p:p + 1]), p
    for a, b in ((0, 5), (3, CHUNK + 11), (CHUNK + 11, T)):                   # other cuts of the prompt
        assert np.array_equal(attention.attend(q[a:b], keys, vals, a, window), whole[a:b]), (a, b)


def _cache(keys, vals, layers=2, layer=1):
    """K and V buffers [layers, capacity, G, D] holding keys/vals at `layer` (others: noise)."""
    rng = np.random.default_rng(7)
    k = rng.standard_normal((layers,) + keys.shape).astype(np.float32)
    v = rng.standard_normal((layers,) + vals.shape).astype(np.float32)
    k[layer], v[layer] = keys, vals
    return k, v


def test_rows_of_several_sequences_in_one_call_get_their_own_bits():
    H, G, D = 4, 2, 16
    depths = [3, CHUNK + 20, 2 * CHUNK + 1, 10]
    seqs = [_inputs(1, d, H, G, D, seed=s) for s, d in enumerate(depths)]
    caches = [_cache(keys, vals) for _, keys, vals in seqs]
    kv = np.array([(k.ctypes.data, v.ctypes.data, k.shape[1]) for k, v in caches], np.int64)
    q = np.concatenate([qs.reshape(1, H * D) for qs, _, _ in seqs])
    out = np.empty((len(seqs), H * D), np.float32)
    attention.attend_rows(q, np.arange(len(seqs)), np.array(depths), kv, attention.element(np.float32), 1, 0, H, G, D, out)
    for s, (qs, keys, vals) in enumerate(seqs):
        assert np.array_equal(out[s], attention.attend(qs, keys, vals, depths[s])[0]), s


def test_exp_is_close_to_numpys_over_the_range_softmax_uses():
    from numba import njit

    @njit
    def many(x):
        out = np.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = attention.exp(x[i])
        return out

    x = np.linspace(-87, 0, 100001).astype(np.float32)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(many(x) - ref) / ref) < 4e-7


def test_half_float_caches_read_as_the_float32_of_their_halves():
    """NOTE(kv-half): a float16 cache gives what a float32 cache of the same (rounded) numbers gives."""
    H, G, D = 6, 2, 64
    depths = [5, 2 * CHUNK + 17]
    seqs = [_inputs(1, d, H, G, D, seed=10 + s) for s, d in enumerate(depths)]
    halves = [tuple(a.astype(np.float16) for a in _cache(keys, vals)) for _, keys, vals in seqs]
    kv = np.array([(k.ctypes.data, v.ctypes.data, k.shape[1]) for k, v in halves], np.int64)
    q = np.concatenate([qs.reshape(1, H * D) for qs, _, _ in seqs])
    out = np.empty((len(seqs), H * D), np.float32)
    attention.attend_rows(q, np.arange(len(seqs)), np.array(depths), kv, attention.element(np.float16), 1, 0, H, G, D, out)
    for s, ((qs, _, _), (k, v)) in enumerate(zip(seqs, halves)):
        ref = attention.attend(qs, k[1].astype(np.float32), v[1].astype(np.float32), depths[s])[0]
        assert np.abs(out[s] - ref).max() < 1e-6, s


def test_cache_writes_round_to_the_nearest_half_and_clamp_to_its_range():
    from numba import njit

    @njit
    def store(x, elem, out):
        for i in range(x.shape[0]):
            out[i] = attention.to_elem(x[i], elem)

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(10000) * 10.0 ** rng.integers(-8, 5, 10000),
                        [0.0, -0.0, 65504.0, 65519.0, 7e4, -1e9, 2.0 ** -24, 3 * 2.0 ** -26]]).astype(np.float32)
    half = np.empty(len(x), np.uint16)
    store(x, attention.element(np.float16), half)
    expect = np.clip(x, -65504, 65504).astype(np.float16)
    assert np.array_equal(half, expect.view(np.uint16))
    assert np.isfinite(half.view(np.float16)).all()
    same = np.empty(len(x), np.float32)
    store(x, attention.element(np.float32), same)
    assert np.array_equal(same, x)
    with pytest.raises(ValueError, match="float32, float16 or q8_0"):
        attention.element(np.float64)

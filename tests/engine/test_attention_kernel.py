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
    attention.attend_rows(q, np.arange(len(seqs)), np.array(depths), kv, 1, 0, H, G, D, out)
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

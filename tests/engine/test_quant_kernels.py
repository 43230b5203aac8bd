"""Quantized block weights: decoding equals gguf's own dequantization, the float numba kernels equal
dequantize-then-matmul for every supported type, batch size and odd shape, and the int8-activation
kernels equal the same computation written in numpy."""
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT, quants  # noqa: E402

from turbospark_wsgi.engine import quant  # noqa: E402
from turbospark_wsgi.engine.kernels import isa, cpu as kernels_cpu, int8 as kernels_q8  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
needs_numba = pytest.mark.skipif(not kernels_cpu.AVAILABLE, reason="numba is not installed")


def kernel_cases(test):
    """Every type, a few row counts, odd shapes and tiles."""
    for mark in (pytest.mark.parametrize("n, k32, tile", [(64, 5, 64), (37, 8, 16), (200, 18, 64), (96, 48, 32)]),
                 pytest.mark.parametrize("B", [1, 3, 8]), pytest.mark.parametrize("qtype", TYPES), needs_numba):
        test = mark(test)
    return test


def random_raw(qtype, n, k, rng):
    """GGUF bytes [n, row_bytes] of a random weight: gguf's quantizer for the types it supports,
    random blocks with small finite float16 scales for the K-quants (gguf cannot quantize them)."""
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GT[qtype])
    size, at = {"Q4_K": (144, slice(0, 4)), "Q6_K": (210, slice(208, 210))}[qtype]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    width = at.stop - at.start
    scales = (rng.random((n, k // 256, width // 2)) * 0.05).astype(np.float16)
    raw[..., at] = scales.view(np.uint8).reshape(n, k // 256, width)
    return raw.reshape(n, -1)


def row_len(qtype, k32):
    return 256 * max(1, k32 // 8) if qtype.endswith("_K") else 32 * k32


def reference(raw, qtype, n, k):
    return quants.dequantize(raw, GT[qtype]).reshape(n, k).astype(np.float32)


def make(qtype, n, k32, seed=0, tile=quant.DEFAULT_TILE):
    rng = np.random.default_rng(seed)
    k = row_len(qtype, k32)
    raw = random_raw(qtype, n, k, rng)
    return quant.pack(quant.decode(raw, GT[qtype].value, (n, k)), tile=tile), reference(raw, qtype, n, k)


def extreme_rows(k, rng):
    """Five activation rows of width k; rows of one large value (q_a = +-127 in every byte where the
    weight is largest) are where vpmaddubsw would saturate without the sign trick."""
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[1] = 3.0
    x[2] = -3.0
    x[3, ::2] = -5.0
    return x


def minus_128_weight():
    """(Q8_0 weight, rows): q = -128 (some +127 beside) times q_a = +-127 in every byte, the largest
    products an 8-bit unit can hold."""
    n, k = 32, 64
    raw = np.zeros((n, k // 32, 34), np.uint8)
    raw[..., :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw[..., 2:] = 0x80                                                # int8 -128
    raw[::2, :, 2::3] = 0x7F                                           # some +127 beside them
    w = quant.pack(quant.decode(raw.reshape(n, -1), GT.Q8_0.value, (n, k)), tile=32)
    x = np.where(np.arange(k) % 5 == 0, -1.0, 1.0).astype(np.float32)[None].repeat(3, 0)
    x[2] *= -1
    return w, x


def close(y, ref):
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n, k32", [(64, 5), (37, 8), (130, 18)])
def test_dequantize_matches_gguf(qtype, n, k32):
    w, ref = make(qtype, n, k32)
    assert w.shape == ref.shape
    np.testing.assert_allclose(quant.dequantize(w), ref, rtol=1e-6, atol=1e-7)


@kernel_cases
def test_kernel_equals_dequantize_then_matmul(qtype, B, n, k32, tile):
    w, ref = make(qtype, n, k32, seed=B, tile=tile)
    x = np.random.default_rng(B + 1).standard_normal((B, ref.shape[1])).astype(np.float32)
    expected = x @ ref.T
    for path in ("gemv", "blas"):
        close(kernels_cpu.qmatmul(x, w, path=path, activations="float32"), expected)
    close(quant.matmul_ref(x, w), expected)


@kernel_cases
def test_int8_kernel_equals_int8_reference(qtype, B, n, k32, tile):
    w, ref = make(qtype, n, k32, seed=B, tile=tile)
    x = np.random.default_rng(B + 1).standard_normal((B, ref.shape[1])).astype(np.float32)
    x[0, :7] *= 40                                           # an outlier block, as real activations have
    want = kernels_q8.matmul_ref(x, w)
    got = kernels_cpu.qmatmul(x, w, activations="int8")
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * float(np.abs(want).max()))
    assert np.abs(got - x @ ref.T).max() < 0.05 * np.abs(x @ ref.T).max()   # and near the float result


@needs_numba
def test_int8_activation_quantization_matches_numpy():
    x = np.random.default_rng(8).standard_normal((5, 96)).astype(np.float32) * 3
    x[1, 32:64] = 0                                          # an all-zero block: scale 0, no NaN
    x[2, 5] = 1e4
    q, d, xs, qsum = kernels_q8.quantize(x)
    q_ref, d_ref = kernels_q8.quantize_rows_ref(x)
    np.testing.assert_allclose(d, d_ref, rtol=1e-6)
    assert np.abs(q.astype(int) - q_ref).max() <= 1 and (q != q_ref).mean() < 0.01   # ties may round apart
    assert np.array_equal(qsum, q.reshape(5, -1, 16).sum(axis=-1))
    # the rounded activations' sums (the q4 mins' term: the product is then exactly w . x_rounded)
    assert np.array_equal(xs, d * q.reshape(5, -1, 32).sum(axis=-1).astype(np.float32))
    assert not d[1, 1] and not q[1, 32:64].any()


@needs_numba
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_int8_rows_do_not_depend_on_the_rows_beside_them(qtype):
    w, ref = make(qtype, 256, 18)
    x = np.random.default_rng(9).standard_normal((300, ref.shape[1])).astype(np.float32)
    whole = kernels_cpu.qmatmul(x, w, activations="int8")             # past GEMV_MAX_B too
    for a, b in ((0, 1), (5, 8), (17, 33), (299, 300)):
        assert np.array_equal(kernels_cpu.qmatmul(x[a:b], w, activations="int8"), whole[a:b])
    assert np.array_equal(kernels_cpu.qmatmul(x[:2], w, threads=1, activations="int8"), whole[:2])


@needs_numba
@pytest.mark.parametrize("path", isa.runnable())
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q4_K"])
def test_every_instruction_path_gives_the_integer_products_exactly(qtype, path):
    """Each path this CPU can run (isa.runnable) against the numpy reference of the same integer
    products, on rows of extreme activations (extreme_rows)."""
    w, ref = make(qtype, 64, 8)
    x = extreme_rows(ref.shape[1], np.random.default_rng(11))
    y = kernels_cpu.qmatmul(x, w, activations="int8", isa=path)
    close(y, kernels_q8.matmul_ref(x, w))                 # float64 sums in the reference
    # the same integers, so the same float steps: bit for bit the generic path's result
    assert np.array_equal(y, kernels_cpu.qmatmul(x, w, activations="int8", isa="generic"))


@needs_numba
@pytest.mark.parametrize("path", isa.runnable())
def test_q8_weights_at_minus_128_do_not_saturate_any_path(path):
    """q = -128 times q_a = +-127 in every byte: the largest products an 8-bit unit can hold."""
    w, x = minus_128_weight()
    y = kernels_cpu.qmatmul(x, w, activations="int8", isa=path)
    close(y, kernels_q8.matmul_ref(x, w))
    assert np.array_equal(y, kernels_cpu.qmatmul(x, w, activations="int8", isa="generic"))


@needs_numba
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_large_batch_uses_blas_path_and_agrees(qtype):
    w, ref = make(qtype, 70, 8)
    x = np.random.default_rng(3).standard_normal((kernels_cpu.GEMV_MAX_B + 9, ref.shape[1])).astype(np.float32)
    close(kernels_cpu.qmatmul(x, w, activations="float32"), x @ ref.T)


@needs_numba
def test_threads_argument_gives_same_result():
    w, ref = make("Q4_1", 256, 18)
    x = np.random.default_rng(4).standard_normal((2, ref.shape[1])).astype(np.float32)
    one = kernels_cpu.qmatmul(x, w, threads=1, activations="float32")
    close(one, x @ ref.T)
    close(kernels_cpu.qmatmul(x, w, threads=2, activations="float32"), one)


def test_fused_parts_of_different_layouts_stack_rows():
    rng = np.random.default_rng(5)
    parts, refs = [], []
    for qtype, n in (("Q4_1", 40), ("Q4_0", 24), ("Q8_0", 8)):
        raw = random_raw(qtype, n, 256, rng)
        parts.append(quant.decode(raw, GT[qtype].value, (n, 256)))
        refs.append(reference(raw, qtype, n, 256))
    w = quant.pack(parts, tile=16)
    assert [p.kind for p in w.parts] == ["q4", "q8"] and w.shape == (72, 256)
    ref = np.concatenate(refs)
    np.testing.assert_allclose(quant.dequantize(w), ref, rtol=1e-6, atol=1e-7)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    if kernels_cpu.AVAILABLE:
        close(kernels_cpu.qmatmul(x, w, activations="float32"), x @ ref.T)
        close(kernels_cpu.qmatmul(x, w, activations="int8"), kernels_q8.matmul_ref(x, w))


@pytest.mark.parametrize("qtype", TYPES)
def test_row_permutation_and_power_of_two_scale(qtype):
    rng = np.random.default_rng(6)
    n, k = 48, row_len(qtype, 8)
    raw = random_raw(qtype, n, k, rng)
    perm = rng.permutation(n)
    b = quant.decode(raw, GT[qtype].value, (n, k)).map_rows(lambda a: a[perm]).scaled(0.125)
    expected = reference(raw, qtype, n, k)[perm] * np.float32(0.125)
    np.testing.assert_allclose(quant.dequantize(quant.pack(b)), expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("qtype, scale, half, kept_mins", [
    ("Q4_0", 1, True, False), ("Q4_0", 0.125, True, False), ("Q4_0", 0.1, False, False), ("Q4_1", 1, True, True),
    ("Q4_1", 0.1, False, True), ("Q5_0", 1, True, False), ("Q8_0", 1, True, False)])
def test_scales_are_half_floats_where_exact_and_q4_0_keeps_no_mins(qtype, scale, half, kept_mins):
    """NOTE(scales-f16): the file's float16 scales stay float16 (a power-of-two scaling too); products
    such as a scaling by 0.1 stay float32; Q4_0's mins (-8d) are not kept. The
    float32 values a QWeight gives back are the decoded ones exactly."""
    rng = np.random.default_rng(9)
    n, k = 48, row_len(qtype, 8)
    b = quant.decode(random_raw(qtype, n, k, rng), GT[qtype].value, (n, k)).scaled(scale)
    p = quant.pack(b, tile=16).parts[0]
    assert p.d.dtype == (np.float16 if half else np.float32)
    assert (p.m is not None) == kept_mins and (p.m is None or p.m.dtype == p.d.dtype)
    back = quant.untile(p)
    np.testing.assert_array_equal(back.d, b.d)
    assert back.d.dtype == np.float32 and (b.m is None) == (back.m is None)
    if b.m is not None:
        np.testing.assert_array_equal(back.m, b.m)
    # the file's bytes per 32 weights: Q4_0 16 + 2, Q4_1 16 + 4, Q8_0 32 + 2
    want = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 34}.get(qtype) if half else None
    if want:
        assert (p.qs.nbytes + p.d.nbytes + (0 if p.m is None else p.m.nbytes)) * 32 == want * n * k


@pytest.mark.parametrize("qtype, scale", [("Q4_K", 1), ("Q4_K", 0.1), ("Q6_K", 1), ("Q6_K", 0.125)])
def test_k_quants_keep_their_scales_in_two_levels(qtype, scale):
    """NOTE(k-scales): Q4_K keeps its 6-bit scales and mins as uint8 and Q6_K its int8 scales, under
    float32 super scales per 256 weights; the float32 values a QWeight gives back are the decoded
    ones exactly (a row scaling, e.g. the folded query scale, scales the super scales), and the
    bytes per 32 weights are 19 (Q4_K) and 34.5 (Q6_K) against the float form's 24 and 40."""
    rng = np.random.default_rng(10)
    n, k = 48, row_len(qtype, 8)
    raw = random_raw(qtype, n, k, rng)
    b = quant.decode(raw, GT[qtype].value, (n, k)).scaled(scale)
    p = quant.pack(b, tile=16).parts[0]
    assert p.d.dtype == (np.uint8 if qtype == "Q4_K" else np.int8) and p.ds.dtype == np.float32
    assert p.group == (8 if qtype == "Q4_K" else 16)
    assert (p.m is None) == (qtype == "Q6_K") and (p.m is None or p.m.dtype == np.uint8)
    back = quant.untile(p)
    np.testing.assert_array_equal(back.d, b.d)
    if b.m is not None:
        np.testing.assert_array_equal(back.m, b.m)
    np.testing.assert_allclose(quant.dequantize(p), reference(raw, qtype, n, k) * np.float32(scale),
                               rtol=1e-6, atol=1e-7)
    held = p.qs.nbytes + sum(a.nbytes for a in (p.d, p.m, p.ds, p.ms) if a is not None)
    assert held * 32 == {"Q4_K": 19, "Q6_K": 34.5}[qtype] * n * k
    t, r = np.array([0, 2, 1]), np.array([3, 15, 0])
    d, m = p.lane_scales(t, r)
    np.testing.assert_array_equal(d, back.d[t * 16 + r])
    if m is not None:
        np.testing.assert_array_equal(m, back.m[t * 16 + r])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q4_0", "Q4_1"])
def test_embed_rows_are_dequantized_rows(qtype):
    w, ref = make(qtype, 100, 8, tile=32)
    ids = [0, 99, 31, 32, 31, 64]
    np.testing.assert_array_equal(quant.embed_rows(w, ids), ref[ids])
    np.testing.assert_array_equal(kernels_cpu.QEmbedding(w)[np.asarray(ids)], ref[ids])


def test_qlinear_is_a_drop_in_for_a_transposed_float_matrix():
    w, ref = make("Q4_1", 96, 6)
    lin = kernels_cpu.QLinear(w)
    assert lin.shape == (192, 96)
    x = np.random.default_rng(7).standard_normal((2, 3, 192)).astype(np.float32)
    y = x @ lin
    assert y.shape == (2, 3, 96)
    close(y.reshape(6, 96), kernels_q8.matmul_ref(x.reshape(6, 192), w) if lin.activations == "int8"
          and kernels_cpu.AVAILABLE else x.reshape(6, 192) @ ref.T)


def test_supported_names_the_types_and_shapes_kept_in_block_form():
    assert quant.supported(GT.Q4_1.value, (576, 576)) and quant.supported(GT.Q6_K.value, (8, 512))
    assert not quant.supported(GT.Q4_K.value, (576, 576))          # 576 is not a multiple of 256
    assert not quant.supported(GT.Q5_K.value, (8, 512)) and not quant.supported(GT.F32.value, (8, 64))
    assert not quant.supported(GT.Q8_0.value, (64,))


def test_unsupported_type_and_bad_shapes_raise():
    with pytest.raises(ValueError, match="no block kernel"):
        quant.decode(np.zeros((4, 24), np.uint8), GT.Q5_1.value, (4, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.decode(np.zeros((4, 144), np.uint8), GT.Q4_K.value, (4, 288))
    w, _ = make("Q8_0", 16, 2)
    with pytest.raises(ValueError, match="does not match"):
        kernels_cpu.qmatmul(np.zeros((1, 32), np.float32), w)


@needs_numba
def test_warmup_compiles_or_loads_every_kernel():
    assert kernels_cpu.warmup() >= 0.0

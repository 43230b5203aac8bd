"""Quantized block weights: decoding equals gguf's own dequantization, and the numba kernels equal
dequantize-then-matmul for every supported type, batch size and odd shape."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT, quants  # noqa: E402

from turbospark_wsgi.engine import kernels_cpu, quant  # noqa: E402

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
needs_numba = pytest.mark.skipif(not kernels_cpu.AVAILABLE, reason="numba is not installed")


def random_raw(qtype, n, k, rng):
    """GGUF bytes [n, row_bytes] of a random weight: gguf's quantizer for the types it supports,
    random blocks with small finite float16 scales for the K-quants (gguf cannot quantize them)."""
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
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


def close(y, ref):
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n, k32", [(64, 5), (37, 8), (130, 18)])
def test_dequantize_matches_gguf(qtype, n, k32):
    w, ref = make(qtype, n, k32)
    assert w.shape == ref.shape
    np.testing.assert_allclose(quant.dequantize(w), ref, rtol=1e-6, atol=1e-7)


@needs_numba
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("n, k32, tile", [(64, 5, 64), (37, 8, 16), (200, 18, 64), (96, 48, 32)])
def test_kernel_equals_dequantize_then_matmul(qtype, B, n, k32, tile):
    w, ref = make(qtype, n, k32, seed=B, tile=tile)
    x = np.random.default_rng(B + 1).standard_normal((B, ref.shape[1])).astype(np.float32)
    expected = x @ ref.T
    for path in ("gemv", "blas"):
        close(kernels_cpu.qmatmul(x, w, path=path), expected)
    close(quant.matmul_ref(x, w), expected)


@needs_numba
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_large_batch_uses_blas_path_and_agrees(qtype):
    w, ref = make(qtype, 70, 8)
    x = np.random.default_rng(3).standard_normal((kernels_cpu.GEMV_MAX_B + 9, ref.shape[1])).astype(np.float32)
    close(kernels_cpu.qmatmul(x, w), x @ ref.T)


@needs_numba
def test_threads_argument_gives_same_result():
    w, ref = make("Q4_1", 256, 18)
    x = np.random.default_rng(4).standard_normal((2, ref.shape[1])).astype(np.float32)
    one = kernels_cpu.qmatmul(x, w, threads=1)
    close(one, x @ ref.T)
    close(kernels_cpu.qmatmul(x, w, threads=2), one)


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
        close(kernels_cpu.qmatmul(x, w), x @ ref.T)


@pytest.mark.parametrize("qtype", TYPES)
def test_row_permutation_and_power_of_two_scale(qtype):
    rng = np.random.default_rng(6)
    n, k = 48, row_len(qtype, 8)
    raw = random_raw(qtype, n, k, rng)
    perm = rng.permutation(n)
    b = quant.decode(raw, GT[qtype].value, (n, k)).map_rows(lambda a: a[perm]).scaled(0.125)
    expected = reference(raw, qtype, n, k)[perm] * np.float32(0.125)
    np.testing.assert_allclose(quant.dequantize(quant.pack(b)), expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K"])
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
    close(y.reshape(6, 96), x.reshape(6, 192) @ ref.T)


def test_supported_names_the_types_and_shapes_kept_in_block_form():
    assert quant.supported(GT.Q4_1.value, (576, 576)) and quant.supported(GT.Q6_K.value, (8, 512))
    assert not quant.supported(GT.Q4_K.value, (576, 576))          # 576 is not a multiple of 256
    assert not quant.supported(GT.Q5_K.value, (8, 512)) and not quant.supported(GT.F32.value, (8, 64))
    assert not quant.supported(GT.Q8_0.value, (64,))


def test_unsupported_type_and_bad_shapes_raise():
    with pytest.raises(ValueError, match="no block kernel"):
        quant.decode(np.zeros((4, 22), np.uint8), GT.Q5_0.value, (4, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.decode(np.zeros((4, 144), np.uint8), GT.Q4_K.value, (4, 288))
    w, _ = make("Q8_0", 16, 2)
    with pytest.raises(ValueError, match="does not match"):
        kernels_cpu.qmatmul(np.zeros((1, 32), np.float32), w)


@needs_numba
def test_warmup_compiles_or_loads_every_kernel():
    assert kernels_cpu.warmup() >= 0.0

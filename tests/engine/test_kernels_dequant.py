"""Dequantization of every supported GGUF type, read back from a written file: against
gguf.quants.dequantize on the same bytes, and against written-out math for the simple types."""
import numpy as np
import pytest

from turbospark_wsgi.engine.gguf import GGML_TYPES, GGUFFile

gguf = pytest.importorskip("gguf")

ROWS, COLS = 6, 512
# byte offsets of the float16 scale fields inside one block (kept finite in the random data)
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
QUANTIZED = sorted(HALF_FIELDS)


def random_blocks(kind, rng):
    """ROWS x COLS values of type `kind` as raw bytes [ROWS, bytes per row] with sane scales."""
    _, block, block_bytes = next(v for v in GGML_TYPES.values() if v[0] == kind)
    n_blocks = ROWS * COLS // block
    data = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for off in HALF_FIELDS[kind]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        data[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return data.reshape(ROWS, -1)


def write_one(path, name, data, qtype):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def test_every_listed_type_is_covered():
    assert {v[0] for v in GGML_TYPES.values()} == set(QUANTIZED) | {"F32", "F16", "BF16"}


@pytest.mark.parametrize("kind", QUANTIZED)
def test_quantized_matches_gguf_dequantize(tmp_path, kind):
    qtype = gguf.GGMLQuantizationType[kind]
    data = random_blocks(kind, np.random.default_rng(len(kind)))
    f = write_one(tmp_path / "q.gguf", "blk.0.ffn_up.weight", data, qtype)
    got = f.tensor("blk.0.ffn_up.weight")
    assert got.shape == (ROWS, COLS) and got.dtype == np.float32 and np.isfinite(got).all()
    assert np.array_equal(got, gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS))
    assert np.abs(got).max() > 0


def _halves(blocks, off):
    return blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32)   # [n_blocks, 1]


def test_q8_0_q4_0_q4_1_written_out(tmp_path):
    rng = np.random.default_rng(1)
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        data = random_blocks(kind, rng)
        got = write_one(tmp_path / f"{kind}.gguf", "t", data, gguf.GGMLQuantizationType[kind]).tensor("t")
        blocks = data.reshape(-1, data.shape[1] * ROWS // (ROWS * COLS // 32))
        d = _halves(blocks, 0)
        if kind == "Q8_0":
            expect = d * blocks[:, 2:].view(np.int8).astype(np.float32)
        else:
            qs = blocks[:, 2 if kind == "Q4_0" else 4:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)   # low nibbles first
            expect = d * (q - 8) if kind == "Q4_0" else d * q + _halves(blocks, 2)
        assert np.allclose(got.reshape(-1, 32), expect, rtol=0, atol=1e-6), kind


def test_float_types(tmp_path):
    rng = np.random.default_rng(2)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    f32 = write_one(tmp_path / "a.gguf", "t", values, gguf.GGMLQuantizationType.F32).tensor("t")
    assert np.array_equal(f32, values)
    half = values.astype(np.float16)
    got = write_one(tmp_path / "b.gguf", "t", half.view(np.uint8), gguf.GGMLQuantizationType.F16).tensor("t")
    assert np.array_equal(got, half.astype(np.float32))
    bf16_bits = (values.view(np.uint32) >> 16).astype(np.uint16)       # truncation: exact bf16 values
    got = write_one(tmp_path / "c.gguf", "t", bf16_bits.view(np.uint8), gguf.GGMLQuantizationType.BF16).tensor("t")
    assert np.array_equal(got, (bf16_bits.astype(np.uint32) << 16).view(np.float32))
    assert np.abs(got - values).max() <= np.abs(values).max() * 2 ** -7

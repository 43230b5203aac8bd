"""The device kernels (engine/gpu/kernels.cu) run on the CPU: the same source built by the host C++
compiler, every thread block's threads in turn. Products are checked against gguf-py's own
dequantization times a float64 matmul, attention against a float64 softmax; mutants of the source
with one index broken must fail the same checks; nvcc, where installed, compiles it for a GPU."""
import shutil
import subprocess

import numpy as np
import pytest

from turbospark_wsgi.engine.gpu import launch
from turbospark_wsgi.engine.gpu.launch import KERNEL_TYPES, Kernels, host_kernels

gguf_quants = pytest.importorskip("gguf.quants")
pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="needs a C++ compiler")

# where each type's scales sit in its block (byte offset, spread): random bytes elsewhere
SCALES = {2: [(0, 0.01)], 3: [(0, 0.01), (2, 0.05)], 8: [(0, 0.01)], 12: [(0, 0.002), (2, 0.002)], 14: [(208, 0.002)]}


def random_blocks(qtype, n, k, seed=0):
    """uint8 [n, row_bytes]: every quant bit random, the half-precision scales finite."""
    rng = np.random.default_rng(seed)
    _, per, size = KERNEL_TYPES[qtype]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at, spread in SCALES[qtype]:
        halves = (rng.standard_normal((n, k // per)) * spread).astype(np.float16)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def reference(raw, qtype):
    return gguf_quants.dequantize(raw, qtype).reshape(raw.shape[0], -1).astype(np.float64)


def matmul_error(kernels, qtype, batch, n=41, k=512, col0=3, scale=0.5):
    """max |kernel - reference| / max |reference| of scale * x @ W.T written at column col0 of a
    wider output; the columns around it must stay untouched."""
    raw = random_blocks(qtype, n, k, seed=qtype)
    x = np.random.default_rng(batch).standard_normal((batch, k)).astype(np.float32)
    out = np.full((batch, n + col0 + 5), np.nan, np.float32)
    kernels.matmul(x, raw, qtype, k, out, col0, scale)
    want = scale * x.astype(np.float64) @ reference(raw, qtype).T
    assert np.isnan(out[:, :col0]).all() and np.isnan(out[:, col0 + n:]).all()
    return float(np.nan_to_num(np.abs(out[:, col0:col0 + n] - want), nan=np.inf).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def kernels():
    return host_kernels()


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: KERNEL_TYPES[t][0])
@pytest.mark.parametrize("batch", [1, 3, 6, launch.GEMV_ROWS + 3])   # partial batch tiles; the dequantize path
def test_matmul_matches_gguf_dequantize(kernels, qtype, batch):
    assert matmul_error(kernels, qtype, batch) < 1e-5


def test_misaligned_inputs_are_copied_or_refused(kernels):
    raw, k = random_blocks(2, 8, 64), 64
    x = np.random.default_rng(0).standard_normal(k + 1).astype(np.float32)[1:][None]   # 4 bytes off
    out, want = np.empty((1, 8), np.float32), np.empty((1, 8), np.float32)
    kernels.matmul(x, raw, 2, k, out)
    kernels.matmul(x.copy(), raw, 2, k, want)
    np.testing.assert_array_equal(out, want)
    shifted = np.empty(raw.size + 1, np.uint8)[1:]                     # numpy allocates 16-aligned
    shifted[:] = raw.reshape(-1)
    with pytest.raises(ValueError, match="aligned"):
        kernels.matmul(x, shifted.reshape(raw.shape), 2, k, out)


@pytest.mark.parametrize("shapes", [{"MM_LANES": 8, "MM_BATCH": 8}, {"MM_THREADS": 128, "MM_LANES": 16}])
def test_other_launch_shapes_compute_the_same_products(shapes):
    other = host_kernels(shapes)
    for qtype in KERNEL_TYPES:
        for batch in (1, 9):
            assert matmul_error(other, qtype, batch) < 1e-5


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES), ids=lambda t: KERNEL_TYPES[t][0])
def test_dequantize_is_gguf_dequantize_bit_for_bit(kernels, qtype):
    raw = random_blocks(qtype, 9, 512, seed=1)
    np.testing.assert_array_equal(kernels.dequantize(raw, qtype, 512), reference(raw, qtype).astype(np.float32))
    rows = np.array([8, 0, 3, 3], np.int32)                               # an embedding lookup
    np.testing.assert_array_equal(kernels.dequantize(raw, qtype, 512, rows=rows, scale=2.0),
                                  2 * reference(raw, qtype)[rows].astype(np.float32))


def attention_reference(q, keys, vals, pos, window):
    H, G = q.shape[1], keys[0].shape[1]
    out = np.empty(q.shape, np.float64)
    for r, p in enumerate(pos):
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            k, v = keys[r][lo:p + 1, h // (H // G)], vals[r][lo:p + 1, h // (H // G)]
            s = k.astype(np.float64) @ q[r, h]
            e = np.exp(s - s.max())
            out[r, h] = e @ v / e.sum()
    return out.reshape(len(pos), -1)


def attention_error(kernels, window=0, D=64, H=6, G=2):
    """Three sequences (one past two key tiles), rows at assorted positions, GQA."""
    rng = np.random.default_rng(D + window)
    caches = [rng.standard_normal((n, G, D)).astype(np.float32) for n in (300, 17, 129)]
    values = [rng.standard_normal((n, G, D)).astype(np.float32) for n in (300, 17, 129)]
    rows = [(0, 299), (1, 0), (2, 128), (0, 130), (1, 16), (2, 127)]
    q = rng.standard_normal((len(rows), H, D)).astype(np.float32) * 0.3
    keys, vals, pos = [caches[s] for s, _ in rows], [values[s] for s, _ in rows], [p for _, p in rows]
    got = kernels.attend(q, kernels.table(keys, vals, pos), G, window)
    return float(np.abs(got - attention_reference(q, keys, vals, pos, window)).max())


@pytest.mark.parametrize("window", [0, 5, 200])
@pytest.mark.parametrize("D", [64, 128])
def test_attention_matches_softmax_reference(kernels, window, D):
    assert attention_error(kernels, window, D) < 1e-5


def test_attention_cuts_the_rows_where_the_grid_ends(kernels, monkeypatch):
    monkeypatch.setattr(launch, "MAX_GRID_Y", 4)                          # 6 rows: 4 + 2
    assert attention_error(kernels, window=5) < 1e-5


def test_attention_rejects_shapes_it_cannot_run(kernels):
    kv = np.zeros((4, 1, 512), np.float32)
    with pytest.raises(ValueError, match="head size 512"):
        kernels.attend(np.zeros((1, 2, 512), np.float32), kernels.table([kv], [kv], [0]), 1)


def test_store_and_attend_address_each_sequence_and_layer(kernels):
    """Whole caches [layers, capacity, G, D] of different capacities: row r's K/V land at its
    position in layer 1 only, and attention of layer 1 reads them back."""
    rng = np.random.default_rng(3)
    G, D, H = 2, 64, 4
    caches = [(rng.standard_normal((3, n, G, D)).astype(np.float32), rng.standard_normal((3, n, G, D)).astype(np.float32))
              for n in (8, 300)]
    before = [(k.copy(), v.copy()) for k, v in caches]
    pos = [5, 260]
    table = kernels.table([k for k, _ in caches], [v for _, v in caches], pos, [k[0].size for k, _ in caches])
    new_k, new_v = rng.standard_normal((2, 2, G, D)).astype(np.float32)
    kernels.store(new_k, new_v, table, layer=1)
    for r, ((k, v), (k0, v0)) in enumerate(zip(caches, before)):
        k0[1, pos[r]], v0[1, pos[r]] = new_k[r], new_v[r]
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)
    q = rng.standard_normal((2, H, D)).astype(np.float32) * 0.3
    got = kernels.attend(q, table, G, layer=1)
    want = attention_reference(q, [k[1] for k, _ in caches], [v[1] for _, v in caches], pos, 0)
    assert np.abs(got - want).max() < 1e-5


# one index broken per kernel (a mutant of the source): the checks above must see each
MUTANTS = {
    "Q4_0": ("w[i + 16] = (float)((int)(BYTE(q, i) >> 4) - 8) * d;", "w[i + 16] = (float)((int)(BYTE(q, i ^ 1) >> 4) - 8) * d;"),
    "Q4_1": ("const u8* b = row + u * 20;", "const u8* b = row + u * 18;"),
    "Q8_0": ("w[i] = (float)(i8)BYTE(q, i) * d;", "w[i] = (float)(i8)BYTE(q, i ^ 1) * d;"),
    "Q4_K": ("ld_words4(b + 16 + (j >> 1) * 32, q, 8);", "ld_words4(b + 16 + (j & 1) * 32, q, 8);"),
    "Q6_K": ("const i8* sc = (const i8*)(b + 192 + h * 8 + qq * 2);", "const i8* sc = (const i8*)(b + 192 + h * 8 + qq);"),
    "qmatmul": ("for (int l = 0; l < MM_LANES; ++l) s += part[b][tid + l];",
                "for (int l = 1; l < MM_LANES; ++l) s += part[b][tid + l];"),
    "attend": ("V[((long)(start + i) * G + g) * D + d]", "V[((long)(start + i) * G) * D + d]"),
    "window": ("p - window + 1 : 0", "p - window : 0"),
    "store": ("+ (long)pos[r] * GD;\n  float* V", "+ (long)pos[r];\n  float* V"),
    "layer": ("const float* K = (const float*)kv[r] + layer * lstride[r];", "const float* K = (const float*)kv[r];"),
    "tree-sum": ("if (tid < w) red[tid] += red[tid + w];", "if (tid < w) red[tid] += red[tid + w - 1];"),
    "norm": ("if (tid < v) red[tid] += red[tid + v];", "if (tid < v) red[tid] += red[tid + v - 1];"),
    "gate": ("const float t = 0.5f * g;", "const float t = 0.5f * u;"),
    "rope": ("xh[i + half] * c + xh[i] * s", "xh[i + half] * c - xh[i] * s"),
}


def mutant(name):
    old, new = MUTANTS[name]
    source = launch.SOURCE.read_text()
    assert source.count(old) == 1, f"mutant {name}: the line it breaks is gone from kernels.cu"
    return Kernels(np, launch._host_launcher(launch._build_host_library(source.replace(old, new))), "mutant")


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_a_broken_block_index_fails_its_check(name):
    qtype = next(t for t, v in KERNEL_TYPES.items() if v[0] == name)
    assert matmul_error(mutant(name), qtype, 1) > 1e-3


def test_a_broken_lane_sum_fails_the_check():
    assert matmul_error(mutant("qmatmul"), 2, 3) > 1e-3


@pytest.mark.parametrize("name", ["store", "layer"])
def test_broken_cache_addressing_fails_the_check(name):
    with pytest.raises(AssertionError):
        test_store_and_attend_address_each_sequence_and_layer(mutant(name))


def test_broken_attention_indexing_fails_the_check():
    assert attention_error(mutant("attend")) > 1e-3       # every head reads KV head 0
    assert attention_error(mutant("window"), window=5) > 1e-3
    assert attention_error(mutant("tree-sum")) > 1e-3


@pytest.mark.parametrize("shape", [(1, 1, 576), (5, 64), (3, 2, 1000)])    # a decode row; q/k heads; D past a block's threads
def test_rms_norm_matches_the_array_code(kernels, shape):
    from turbospark_wsgi.engine.model import rms_norm
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * rng.uniform(1e-3, 30, shape[:-1] + (1,))).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    got, want = kernels.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5, np)
    assert got.shape == want.shape and np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    strided = np.repeat(x, 2, axis=-2)[..., ::2, :] if x.ndim == 3 else x[:, None][:, 0]
    assert np.array_equal(kernels.rms_norm(strided, w, 1e-5), got)          # copied to rows first


@pytest.mark.parametrize("gelu", [False, True])
def test_gate_matches_the_array_code(kernels, gelu):
    from turbospark_wsgi.engine.model import gelu_tanh_gate, swiglu
    F = 300
    gu = (np.random.default_rng(int(gelu)).standard_normal((3, 1, 2 * F)) * 4).astype(np.float32)
    gu[0, 0, :3] = [-100.0, 100.0, 0.0]                                # SiLU's tails without overflow
    got, want = kernels.gate(gu, F, gelu), (gelu_tanh_gate if gelu else swiglu)(gu, F, np)
    assert got.shape == want.shape == (3, 1, F)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("rot", [64, 32])                              # whole heads; partial rotary (phi3)
def test_rope_matches_the_array_code(kernels, rot):
    from turbospark_wsgi.engine.attention import rope
    rng = np.random.default_rng(rot)
    qkv = rng.standard_normal((4, 9, 64)).astype(np.float32)            # 5 q|k heads of 9
    ang = rng.uniform(0, 100, (4, 1, rot // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    got, want = kernels.rope(qkv[:, :5], cos, sin, rot), rope(qkv[:, :5], cos, sin, rot, np)
    assert got.shape == want.shape == (4, 5, 64)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_broken_norm_and_gate_fail_their_checks(kernels):
    with pytest.raises(AssertionError):
        test_rms_norm_matches_the_array_code(mutant("norm"), (5, 64))
    with pytest.raises(AssertionError):
        test_gate_matches_the_array_code(mutant("gate"), False)
    with pytest.raises(AssertionError):
        test_rope_matches_the_array_code(mutant("rope"), 64)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_compiles_the_source_for_a_gpu(tmp_path, arch):
    flags = [f"-D{k}={v}" for k, v in launch.SHAPES.items()]
    done = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", *flags, "-o", str(tmp_path / "k.cubin"),
                           str(launch.SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0

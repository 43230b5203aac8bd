"""The C kernels (kernels/native.c, built by native.py): every instruction path this CPU runs gives the
integer products of the numpy reference exactly and the same bits as every other path, the float
steps follow the numba kernels, a model runs on them bit-exactly across paths, and where they cannot
be built the plan falls back to numba's, saying why."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from turbospark_wsgi.engine.kernels import attention as kernels_attention, cpu as kernels_cpu, int8 as kernels_q8, \
    isa, layer as kernels_layer, native
from turbospark_wsgi.engine.options import EngineOptions, kernel_plan

pytest.importorskip("gguf")
from test_quant_kernels import close, extreme_rows, make, minus_128_weight  # noqa: E402

pytestmark = pytest.mark.skipif(native.compiler() is None or not kernels_cpu.AVAILABLE,
                                reason="no C compiler, or numba is absent")
# the paths this machine runs, on this architecture's C build
PATHS = [p for p in isa.runnable(isa.host_features()) if p != "neon" or os.uname().machine in ("aarch64", "arm64")]


@pytest.fixture(scope="module")
def libs():
    return {p: native.load(p) for p in PATHS}


def reference_dots(w, q):
    """The integer dots of every unit of QWeight w with int8 rows q, in numpy: [B, T, nu, R]."""
    from turbospark_wsgi.engine import quant
    p = w.parts[0]
    b = quant.untile(p)
    n, k = b.q.shape[0], q.shape[1]
    if p.kind == "q4":
        v = np.concatenate([b.q & 15, b.q >> 4], axis=-1).astype(np.int64).reshape(n, k)
        per = 32
    else:
        v = b.q.astype(np.int64).reshape(n, k)
        per = k // p.d.shape[1]
    dots = np.einsum("bup,nup->bnu", q.astype(np.int64).reshape(len(q), k // per, per), v.reshape(n, k // per, per))
    T, R = p.qs.shape[0], p.tile
    padded = np.zeros((len(q), T * R, k // per), np.int64)
    padded[:, :n] = dots
    return padded.reshape(len(q), T, R, k // per).transpose(0, 1, 3, 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q4_K"])
def test_every_path_gives_the_integer_products_exactly(libs, qtype, path):
    w, ref = make(qtype, 64, 8)
    x = extreme_rows(ref.shape[1], np.random.default_rng(11))
    lib = libs[path]
    q, d, xs, qsum = lib.quantize_rows(x)
    qn = kernels_q8.quantize_rows_ref(x)[0]
    assert np.array_equal(q, qn)                                     # rint, ties to even, as numpy
    assert np.array_equal(lib.unit_dots(w.parts[0], q, qsum), reference_dots(w, q))
    y = np.empty((len(x), w.parts[0].qs.shape[0] * w.parts[0].tile), np.float32)
    lib.product_i8(x, w.parts[0], y, 2)
    close(y[:, :w.n], kernels_q8.matmul_ref(x, w))
    first = libs[PATHS[0]]
    y0 = np.empty_like(y)
    first.product_i8(x, w.parts[0], y0, 1)
    assert np.array_equal(y, y0)                                     # every path, any threads: the same bits


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quant_scales_of_the_wrong_shape_are_refused_before_c_reads_them(libs, qtype):
    """The C kernel reads d, m, ds and ms by the weight's T, nu and R alone: a super scale array
    that does not divide the sub-scales into whole groups (or mins that do not match) is an error
    in Python, never a read past an array's end."""
    from turbospark_wsgi.engine import quant
    lib, p = libs[PATHS[0]], make(qtype, 64, 8)[0].parts[0]
    qv = quant.prepare(p)
    lib.weight_from(qv, p)                                          # the weight as made is accepted
    wrong = [dict(ds=p.ds[:, :1, :-1]), dict(ds=p.ds[:, :, :0]), dict(d=p.d[:, :-1]),
             dict(d=p.d.astype(np.float32))]
    if p.m is not None:
        wrong += [dict(ms=p.ms[:, :, :-1]), dict(m=p.m[:, :-1]), dict(ms=None)]
    for change in wrong:
        bad = quant.QWeight(p.kind, p.n, p.k, p.qs, change.get("d", p.d), change.get("m", p.m),
                            ds=change.get("ds", p.ds), ms=change.get("ms", p.ms))
        with pytest.raises(ValueError):
            lib.weight_from(qv, bad)


def float32_form(p):
    """QWeight p with float32 scales and every q4 min stored (the layout before quant.py's
    NOTE(scales-f16))."""
    from turbospark_wsgi.engine import quant
    return quant.QWeight(p.kind, p.n, p.k, p.qs, p.scales.copy(), p.mins)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype, scale", [("Q4_0", 1), ("Q4_0", 0.1), ("Q4_1", 1), ("Q4_1", 0.1), ("Q8_0", 1),
                                          ("Q8_0", 0.1), ("Q5_0", 1), ("Q4_K", 1), ("Q4_K", 0.1),
                                          ("Q6_K", 1), ("Q6_K", 0.1)])
def test_half_scales_and_implied_mins_give_the_float32_layouts_bits(libs, qtype, scale, path):
    """Scales read as half floats (or float32 where a product is no half float exactly), the K-quants'
    integer scales and mins times their super scales (quant, NOTE(k-scales)), and Q4_0's mins
    computed as -8d in the kernel: every product bit for bit what the float32 layout gives, on every
    path, and the reference's numbers."""
    from turbospark_wsgi.engine import quant
    from test_quant_kernels import GT, random_raw, row_len
    n, k = 64, row_len(qtype, 8)
    b = quant.decode(random_raw(qtype, n, k, np.random.default_rng(4)), GT[qtype].value, (n, k)).scaled(scale)
    w = quant.pack(b, tile=64)
    p, wide = w.parts[0], float32_form(w.parts[0])
    x = extreme_rows(k, np.random.default_rng(12))
    y, y32 = (np.empty((len(x), n), np.float32) for _ in range(2))
    libs[path].product_i8(x, p, y, 2)
    libs[path].product_i8(x, wide, y32, 2)
    assert np.array_equal(y, y32)
    close(y, kernels_q8.matmul_ref(x, w))
    for rows in (x[:1], x[:3]):              # below PERF(k-scales-rows)'s count: the scales read as kept
        one = np.empty((len(rows), n), np.float32)
        libs[path].product_i8(rows, p, one, 2)
        assert np.array_equal(one, y32[:len(rows)])
    yn = np.empty_like(y)
    kernels_q8.matmul(x, p, yn, PATHS[0])                           # numba: float32 views of the scales
    close(yn, y)


@pytest.mark.parametrize("path", PATHS)
def test_q8_weights_at_minus_128_do_not_saturate(libs, path):
    w, x = minus_128_weight()
    q, _, _, qsum = libs[path].quantize_rows(x)
    assert np.array_equal(libs[path].unit_dots(w.parts[0], q, qsum), reference_dots(w, q))


@pytest.mark.parametrize("tile", [16, 48, 64, 128])
def test_every_tile_width_gives_the_same_rows(libs, tile):
    """Tiles of 1..8 accumulators (and 3, cut 2 + 1) compute each output row alike."""
    w, ref = make("Q4_1", 96, 8, tile=tile)
    wide, _ = make("Q4_1", 96, 8, tile=32)
    x = np.random.default_rng(2).standard_normal((3, ref.shape[1])).astype(np.float32)
    lib = libs[PATHS[0]]
    out = []
    for m in (w, wide):
        y = np.empty((3, m.parts[0].qs.shape[0] * m.parts[0].tile), np.float32)
        lib.product_i8(x, m.parts[0], y, 2)
        out.append(y[:, :96])
    assert np.array_equal(*out)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "Q4_K"])
def test_a_row_of_a_product_does_not_depend_on_the_rows_beside_it(libs, qtype, path):
    """PERF(rows-4) (AVX2: 4 activation rows a pass, the rest 3, 2 or 1) and PERF(k-scales-rows)
    (K-quant scales converted from 4 rows on): 1 to 9 rows at once give each row the bits it gets
    alone, on every path, and the first path's bits."""
    w, ref = make(qtype, 48, 8, tile=48)
    p, lib = w.parts[0], libs[path]
    x = np.concatenate([extreme_rows(ref.shape[1], np.random.default_rng(13))] * 2)[:9]
    alone = np.empty((len(x), p.qs.shape[0] * p.tile), np.float32)
    for i in range(len(x)):
        lib.product_i8(x[i:i + 1], p, alone[i:i + 1], 1)
    for b in range(1, len(x) + 1):
        y = np.empty((b, alone.shape[1]), np.float32)
        lib.product_i8(x[:b], p, y, 2)
        assert np.array_equal(y, alone[:b]), b
    first = np.empty_like(alone)
    libs[PATHS[0]].product_i8(x, p, first, 2)
    assert np.array_equal(first, alone)


def test_q6_k_keeps_6_bits_and_reads_back_as_the_8_bit_layout():
    """NOTE(q6): a Q6_K weight's int8 layout is 3 blocks a unit (three quarters of the bytes), and
    the tiled blocks, the rows a token lookup gathers and the 8-bit layout read back from it exactly."""
    from turbospark_wsgi.engine import quant
    w, _ = make("Q6_K", 40, 8, tile=32)
    p = w.parts[0]
    qs = p.qs.copy()
    qv = quant.prepare(p)
    assert quant.is_six(qv) and qv.shape[3] == quant.SIX_BLOCKS
    wide = quant.widen(qv)
    assert wide.shape[3] == 4 and qv.nbytes * 4 == wide.nbytes * 3
    assert np.array_equal(quant.unprepare(p), qs)
    t, r = np.array([0, 0, 1, 1]), np.array([0, 17, 3, 7])
    assert np.array_equal(quant.block_rows(p, t, r), quant.untile(p).q[t * p.tile + r])
    assert not quant.is_six(quant.prepare(make("Q8_0", 40, 8)[0].parts[0]))      # Q8_0: 8 bits, as before


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
def test_6_bit_blocks_on_any_weight_but_q6_k_are_refused_before_c_reads_them(libs, qtype):
    """A weight cache whose arrays claim 6-bit units (NOTE(q6)) for a weight that is not Q6_K's is an
    error in Python: C would read its blocks with the wrong unit size."""
    from turbospark_wsgi.engine import quant
    lib, p = libs[PATHS[0]], make(qtype, 32, 8, tile=32)[0].parts[0]
    qv = quant.prepare(p)
    forged = np.zeros(qv.shape[:3] + (quant.SIX_BLOCKS,) + qv.shape[4:], np.uint8)
    with pytest.raises(ValueError):
        lib.weight_from(forged, p)


@pytest.mark.parametrize("path", PATHS)
def test_q6_k_in_6_bits_gives_the_8_bit_layouts_bits(libs, path):
    """NOTE(q6): the same weight in 6 bits and widened to 8 gives every product the same bits, for
    1 to 9 rows (B < 4: widened in registers; from 4 on: a tile widened once), and numba's too."""
    import dataclasses
    from turbospark_wsgi.engine import quant
    w, ref = make("Q6_K", 48, 8, tile=48)
    six = w.parts[0]
    quant.prepare(six)
    eight = dataclasses.replace(six)
    eight.qv = quant.widen(six.qv)
    x = np.concatenate([extreme_rows(ref.shape[1], np.random.default_rng(14))] * 2)[:9]
    for b in range(1, len(x) + 1):
        y6, y8 = (np.empty((b, six.tiles * six.tile), np.float32) for _ in range(2))
        libs[path].product_i8(x[:b], six, y6, 2)
        libs[path].product_i8(x[:b], eight, y8, 2)
        assert np.array_equal(y6, y8), b
    yn = np.empty((len(x), six.tiles * six.tile), np.float32)
    kernels_q8.matmul(x, six, yn, PATHS[0])
    close(yn[:, :six.n], kernels_q8.matmul_ref(x, w))


@pytest.mark.parametrize("path", PATHS)
def test_q6_k_at_its_largest_products_does_not_overflow_the_16_bit_sums(libs, path):
    """PERF(narrow): q = -32 (the lowest 6-bit value, |q| the largest) times q_a = +-127 in every byte
    puts 4 quads' pairs at -+32512 in one 16-bit lane; 4 to 9 rows at once (the widened tile's
    path) give the bits each row gets alone and the dequantized product's numbers."""
    from turbospark_wsgi.engine import quant
    from test_quant_kernels import GT, reference
    n, k = 32, 256
    raw = np.zeros((n, 1, 210), np.uint8)                          # ql = qh = 0: q = -32 everywhere
    raw[1::2, :, :128] = 0xFF                                      # odd rows: q = +31 (ql 15, qh 3)
    raw[1::2, :, 128:192] = 0xFF
    raw[..., 192:208] = 127                                        # the largest int8 sub-scales
    raw[..., 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    raw = raw.reshape(n, -1)
    w = quant.pack(quant.decode(raw, GT.Q6_K.value, (n, k)), tile=32)
    x = np.ones((9, k), np.float32)
    x[1::2] = -1.0                                                 # q_a = +127 and -127 in every byte
    x[4, ::3] = -1.0
    p, lib = w.parts[0], libs[path]
    alone = np.empty((len(x), p.tiles * p.tile), np.float32)
    for i in range(len(x)):
        lib.product_i8(x[i:i + 1], p, alone[i:i + 1], 1)
    for b in (4, 5, 8, 9):
        y = np.empty((b, alone.shape[1]), np.float32)
        lib.product_i8(x[:b], p, y, 2)
        assert np.array_equal(y, alone[:b]), b
    close(alone[:, :n], x @ reference(raw, "Q6_K", n, k).T)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_float_products_and_dequantizers_follow_the_reference(libs, qtype):
    w, ref = make(qtype, 70, 8)
    p, lib = w.parts[0], libs[PATHS[0]]
    x = np.random.default_rng(3).standard_normal((4, ref.shape[1])).astype(np.float32)
    y = np.empty((4, p.qs.shape[0] * p.tile), np.float32)
    lib.product_f32(x, p, y, 2)
    close(y[:, :70], x @ ref.T)
    wt = np.empty((ref.shape[1], p.qs.shape[0] * p.tile), np.float32)
    lib.dequant_t(p, 0, wt, 2)
    np.testing.assert_allclose(wt[:, :70], ref.T, rtol=1e-6, atol=1e-7)
    big = np.random.default_rng(4).standard_normal((kernels_cpu.GEMV_MAX_B + 3, ref.shape[1])).astype(np.float32)
    close(kernels_cpu.qmatmul(big, w, activations="float32", lib=lib), big @ ref.T)     # the BLAS path's slabs


def test_half_floats_round_as_numpy_on_every_path(libs):
    """The K/V store: ties to even, subnormals, and values past the half range clamped (never inf)."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000),
                        [65504.0, 65520.0, 1e9, -1e9, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 0.0, -0.0, 1 + 2.0 ** -11]])
    x = x.astype(np.float32)
    want = np.clip(x, -65504, 65504).astype(np.float16).view(np.uint16)
    for path, lib in libs.items():
        got = lib.to_half(x)
        assert np.array_equal(got, want), path
        assert np.array_equal(lib.from_half(got), want.view(np.float16).astype(np.float32)), path


def _attention_case(rng, depth, R, half):
    H, G, D = 6, 2, 40                           # D = 40: whole lanes of 16 and a tail
    k = rng.standard_normal((depth + R, G, D)).astype(np.float32)
    v = rng.standard_normal((depth + R, G, D)).astype(np.float32)
    dtype = np.float16 if half else np.float32
    keys, vals = k.astype(dtype)[None], v.astype(dtype)[None]                 # [1 layer, capacity, G, D]
    kv = np.array([[keys.ctypes.data, vals.ctypes.data, depth + R]], np.int64)
    q = (rng.standard_normal((R, (H + 2 * G) * D)) * 0.3).astype(np.float32)
    seq, pos = np.zeros(R, np.int64), np.arange(depth, depth + R, dtype=np.int64)
    return (keys, vals), q, seq, pos, kv, H, G, D


@pytest.mark.parametrize("depth, R, window", [(0, 5, 0), (600, 1, 0), (300, 9, 0), (700, 3, 100)])
@pytest.mark.parametrize("half", [False, True])
def test_attention_follows_the_numba_kernel(libs, depth, R, window, half):
    keep, q, seq, pos, kv, H, G, D = _attention_case(np.random.default_rng(depth + R), depth, R, half)
    outs = {}
    for path, lib in libs.items():
        outs[path] = np.empty((R, H * D), np.float32)
        lib.attend_rows(q, seq, pos, kv, half, 0, window, H, G, D, outs[path], 2)
    want = np.empty((R, H * D), np.float32)
    elem = kernels_attention.element(np.float16 if half else np.float32)
    kernels_attention.attend_rows(np.ascontiguousarray(q), seq, pos, kv, elem, 0, window, H, G, D, want)
    first = outs[PATHS[0]]
    np.testing.assert_allclose(first, want, rtol=2e-5, atol=2e-6)
    assert all(np.array_equal(o, first) for o in outs.values())


def test_a_row_of_attention_does_not_depend_on_the_rows_beside_it(libs):
    keep, q, seq, pos, kv, H, G, D = _attention_case(np.random.default_rng(0), 500, 9, True)
    lib = libs[PATHS[0]]
    together = np.empty((9, H * D), np.float32)
    lib.attend_rows(q, seq, pos, kv, True, 0, 0, H, G, D, together, 2)
    for r in (0, 4, 8):
        alone = np.empty((1, H * D), np.float32)
        lib.attend_rows(np.ascontiguousarray(q[r:r + 1]), seq[r:r + 1], pos[r:r + 1], kv, True, 0, 0, H, G, D, alone, 1)
        assert np.array_equal(alone[0], together[r])


def _model(gguf_path, path, kernels="native", **kw):
    from turbospark_wsgi.engine.loader import load_model
    return load_model(gguf_path, device="cpu", kernels=kernels, int8_isa=path, activations="int8", **kw).model


def _logits(model, prompt=(1, 5, 9, 2, 7, 3, 11, 4), steps=(6, 8, 10)):
    cache = model.new_cache(64)
    out = [model.forward(list(prompt), cache, logits="all")]
    out += [model.decode_batch([t], [cache]) for t in steps]
    return np.concatenate(out)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_model_gets_the_same_bits_on_every_path_and_follows_numba(tiny_gguf, qtype):
    path = tiny_gguf(qtype=qtype).path
    runs = {p: _logits(_model(path, p)) for p in PATHS}
    first = runs[PATHS[0]]
    assert all(np.array_equal(r, first) for r in runs.values()), [p for p, r in runs.items() if not np.array_equal(r, first)]
    numba_run = _logits(_model(path, PATHS[0], kernels="numba"))
    assert np.argmax(first, -1).tolist() == np.argmax(numba_run, -1).tolist()
    np.testing.assert_allclose(first, numba_run, atol=0.02 * np.abs(numba_run).max())


def _k_quant_rows(rng, gtype, n, k):
    """Random GGUF Q4_K (12) or Q6_K (14) rows of an [n, k] weight with small super scales."""
    size, at = {12: (144, (0, 2)), 14: (210, (208,))}[gtype]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for a in at:
        d = np.float16(rng.uniform(1e-4, 1e-3, (n, k // 256)))
        raw[..., a:a + 2] = np.frombuffer(d.tobytes(), np.uint8).reshape(n, k // 256, 2)
    return raw.reshape(n, -1), gtype


def k_quant_llama(tiny_gguf):
    """A tiny llama whose matrices are Q4_K, with attn_v and ffn_down in Q6_K, as a Q4_K_M file
    mixes them (q|k and v: two parts of one product, NOTE(layer-parts))."""
    rng = np.random.default_rng(21)
    dims = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_output": (256, 256), "ffn_gate": (512, 256),
            "ffn_up": (512, 256), "attn_v": (128, 256), "ffn_down": (256, 512)}
    raw = {f"blk.{i}.{name}.weight": _k_quant_rows(rng, 14 if name in ("attn_v", "ffn_down") else 12, n, k)
           for i in range(2) for name, (n, k) in dims.items()}
    return tiny_gguf(qtype="Q8_0", raw=raw, hidden_size=256, intermediate_size=512).path


def test_a_k_quant_model_gets_the_same_bits_on_every_path_and_follows_numba(tiny_gguf):
    """NOTE(k-scales) in the C layer: Q4_K and Q6_K matrices (as a Q4_K_M file mixes them), a prompt
    of 8 rows (PERF(k-scales-rows)'s converted scales) and decode rows (the integers read directly)."""
    path = k_quant_llama(tiny_gguf)
    runs = {p: _logits(_model(path, p)) for p in PATHS}
    first = runs[PATHS[0]]
    assert np.isfinite(first).all()
    assert all(np.array_equal(r, first) for r in runs.values()), [p for p, r in runs.items() if not np.array_equal(r, first)]
    numba_run = _logits(_model(path, PATHS[0], kernels="numba"))
    assert np.argmax(first, -1).tolist() == np.argmax(numba_run, -1).tolist()
    np.testing.assert_allclose(first, numba_run, atol=0.02 * np.abs(numba_run).max())


def test_gemma_features_run_on_the_c_layer(tmp_path):
    """Post norms, q/k norms, the GELU gate and local windows: the C layer follows the numba one."""
    from test_families import family_gguf
    path, _, _ = family_gguf(tmp_path, "gemma3", "Q8_0")
    c, n = _logits(_model(path, PATHS[0])), _logits(_model(path, PATHS[0], kernels="numba"))
    assert np.argmax(c, -1).tolist() == np.argmax(n, -1).tolist()
    np.testing.assert_allclose(c, n, atol=0.02 * np.abs(n).max())


def test_the_plan_names_the_c_kernels_and_falls_back_to_numba(tmp_path, monkeypatch):
    plan = kernel_plan(EngineOptions())
    assert plan.native is not None and "C kernels" in plan.describe()
    assert kernel_plan(EngineOptions(kernels="numba")).native is None
    assert "numba kernels (requested)" in kernel_plan(EngineOptions(kernels="numba")).describe()
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setattr(native, "compiler", lambda: None)
    plan = kernel_plan(EngineOptions())
    assert plan.native is None and "no C compiler" in plan.describe()


def test_a_source_that_does_not_compile_falls_back_saying_why(tmp_path, monkeypatch):
    bad = tmp_path / "native.c"
    bad.write_text("int ts_abi(void) { return 1 }\n")
    monkeypatch.setattr(native, "SOURCE", str(bad))
    monkeypatch.setattr(native, "_LOADED", {})
    lib, words = __import__("turbospark_wsgi.engine.options", fromlist=["x"]).native_kernels("auto", PATHS[0])
    assert lib is None and "did not compile" in words
    with pytest.raises(ValueError, match="kernels must be auto, native or numba"):
        EngineOptions(kernels="fortran")


def test_a_build_is_kept_and_found_again(tmp_path):
    file, built = native.build(PATHS[0], str(tmp_path))
    assert built and os.path.exists(file)
    again, built_again = native.build(PATHS[0], str(tmp_path))
    assert again == file and not built_again
    assert native.Library(PATHS[0], file).path == PATHS[0]


def _cross_compiler():
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ziglang", "cc"]


def test_the_aarch64_kernels_compile_to_sdot(tmp_path):
    """The NEON path cannot run here; it is compiled for aarch64 (zig's clang) and must use sdot."""
    cc = _cross_compiler() if os.uname().machine not in ("aarch64", "arm64") else [native.compiler()]
    if cc is None:
        pytest.skip("no aarch64 C compiler (pip install ziglang)")
    out = tmp_path / "neon.s"
    target = ["-target", "aarch64-linux-gnu", "-mcpu=generic+dotprod"] if len(cc) > 1 else list(native.FLAGS["neon"])
    done = subprocess.run([*cc, *target, "-O2", "-std=gnu11", "-ffp-contract=off", "-Wno-unknown-pragmas",
                           f"-DTS_PATH={isa.IDS['neon']}", "-S", native.SOURCE, "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text(errors="replace")
    assert "sdot" in text and "fmla" not in text and "fmadd" not in text    # no contracted float steps


def test_the_x86_paths_compile_to_their_instructions(tmp_path):
    if os.uname().machine != "x86_64" or shutil.which("objdump") is None:
        pytest.skip("x86-64 with objdump only")
    want = {"vnni512": "vpdpbusd", "avx2": "vpmaddubsw", "avxvnni": "vpdpbusd"}
    for path, mnemonic in want.items():
        out = tmp_path / f"{path}.so"
        done = subprocess.run(native.command(native.compiler(), path, str(out)), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        dis = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True).stdout
        assert mnemonic in dis, path
        assert "vfmadd" not in dis, path


_GEVENT_BUILD = """
from gevent import monkey; monkey.patch_all()
import sys
from gevent.threadpool import ThreadPoolExecutor
from turbospark_wsgi.engine.kernels import children, native, warm
with ThreadPoolExecutor(1) as pool:          # a thread with a hub of its own, as gevent's worker loads
    file, built = pool.submit(native.build, sys.argv[1], sys.argv[2]).result()
    child = pool.submit(warm._start, "none", sys.argv[1]).result()
    code = pool.submit(children.wait, child).result()
print(built, code, flush=True)
# NOTE(exit): what is checked has run; the interpreter's teardown of gevent's pool threads (each with a
# hub of its own) crashed once in CI after this line (SIGSEGV, output complete) and is no part of it
import os; os._exit(0)
"""


def test_a_build_runs_on_a_gevent_workers_loading_thread(tmp_path):
    """gevent's subprocess cannot watch a child from a thread's own hub; the build (and numba's
    warm-up child) must start and wait for theirs there all the same."""
    pytest.importorskip("gevent")
    done = subprocess.run([sys.executable, "-c", _GEVENT_BUILD, PATHS[0], str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    built, code = done.stdout.split()
    assert built == "True" and code in ("0", "None")        # the warm child ran (compiling no group)

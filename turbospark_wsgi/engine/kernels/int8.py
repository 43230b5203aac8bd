"""Integer kernels (numba) for y = x @ W.T with int8 activations, as llama.cpp's Q8 activations.

Each activation row is quantized once per product, per block of 32: d_a = max|x| / 127,
q_a = round(x / d_a) (int8). Per weight block the dot product of the integer weights with q_a is
exact in int32; it is scaled by d_w * d_a (plus m_w * d_a * sum(q_a) for a q4 block's min) and
summed in float32 per output row (one SIMD lane per row, as the float kernels in cpu.py). The integer
dots compile to the CPU's own instructions (int8_dot.py, isa.py); every path gives the same integers,
so the same bits.

NOTE(accuracy): the min term takes the sum of the *quantized* activations, so a product is exactly
the dequantized weight times the rounded activations: the rounding errors e_j then meet the weights
w_j = d q_j + m, which are centred near 0, and largely cancel. With the float sum(x) (as before) they
met d q_j alone, all of one sign within a block. SmolLM2-135M Q4_1 (every layer has mins), along a
teacher-forced text against the float32 path (tools/accuracy.py), step by step: KL 0.0144 -> 0.0029,
top-1 agreement 93.2% -> 97.0%. llama.cpp's q8_1 blocks carry the same d * sum(q) for this term.

NOTE(exact-batching): a row's quantization and every step after it depend on that row alone and run
the same code for any row count, so a sequence's numbers never depend on its neighbours or on how a
prompt was cut. The results differ from the float32 reference by the activations' rounding (about
1/254 of each block's largest value); `quantize_rows` + `matmul_ref` is that computation in numpy.

Weight layout (`prepare`): for tile t, scale unit u (one q4 block of 32 weights, or one q8 scale
group of 16 or 32) and lane chunk c of 16 output rows, the unit's bytes as `[quads, 16 rows, 4]`:
four consecutive weights of one row fill one 32-bit lane, the operand shape of `vpdpbusd`. q4 bytes
keep both nibbles (byte j: weight j low, weight j+16 high); q8 bytes are q + 128 (unsigned), the
128 * sum(q_a) that adds taken off again per unit. A Q6_K weight keeps its units of 16 in 6 bits,
3 blocks where 8 bits take 4 quads (quant.py, NOTE(q6)), widened to this form before its dots.
"""

import numpy as np

from .. import quant
from ..quant import LANES, block_rows, fits, prepare, unprepare  # noqa: F401 (the layout, quant.py)
from . import isa, threads

try:
    import numba
    from numba import literally, njit, prange
except ImportError:            # pragma: no cover - exercised only where numba is absent
    numba = None

AVAILABLE = numba is not None
if AVAILABLE:
    from .int8_dot import _q8_bias, _unit_dot
QA = 32         # activation block (int8 values per scale)


def choose(want="auto", allow_vnni=True):
    """isa.Choice of the integer-dot instructions for the compile target (see isa.py)."""
    if not AVAILABLE:
        return isa.Choice("generic", "numba absent: numpy reference")
    return isa.choose(want, allow_vnni)


# The path of kernels compiled for callers that name none (EngineOptions pick their own; see options).
DEFAULT = choose()


def quantize_rows_ref(x):
    """numpy reference of `quantize_rows`: x float32 [B, K] -> (q int8 [B, K], d float32 [B, K/32])."""
    x = np.asarray(x, dtype=np.float32)
    B, K = x.shape
    blocks = x.reshape(B, K // QA, QA)
    amax = np.abs(blocks).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int8)
    return q.reshape(B, K), d


def matmul_ref(x, w):
    """The int8-activation reference in numpy: x's rows quantized as the kernels do, times the
    dequantized weight, in float64 -> float32 [B, n] (the q4 min term, too, takes the rounded
    activations, as the kernels do)."""
    x = np.asarray(x, dtype=np.float32)
    q, d = quantize_rows_ref(x)
    B, K = x.shape
    out = []
    for p in (w.parts if isinstance(w, quant.QMatrix) else [w]):
        b = quant.untile(p)
        n = b.q.shape[0]
        xa = (q.reshape(B, K // QA, QA).astype(np.float64) * d[..., None]).reshape(B, K)
        if p.kind == "q4":
            v = np.concatenate([b.q & 15, b.q >> 4], axis=-1).astype(np.float64)      # [n, nb, 32]
            y = xa @ (v * b.d[..., None]).reshape(n, K).T
            y += xa.reshape(B, K // QA, QA).sum(axis=-1) @ b.m.T.astype(np.float64)
        else:
            group = b.q.shape[1] // b.d.shape[1]
            v = b.q.astype(np.float64).reshape(n, b.d.shape[1], group * quant.SUB)
            y = xa @ (v * b.d[..., None]).reshape(n, K).T
        out.append(y)
    return np.concatenate(out, axis=1).astype(np.float32)


if AVAILABLE:
    _JIT = dict(parallel=True, fastmath=True, cache=True, nogil=True)
    @njit(**_JIT)
    def quantize_rows(x, q, d, xs, qsum):   # pragma: no cover - compiled
        # x [B, K] f32 -> q [B, K] i8, d [B, K/32] scales, xs [B, K/32] sums of the rounded
        # activations (d * sum(q), for q4 mins: see NOTE(accuracy)), qsum [B, K/16] sums of q
        B, K = x.shape
        for i in prange(B):
            for b in range(K // 32):
                xb = x[i, b * 32:b * 32 + 32]
                amax = np.float32(0)
                for j in range(32):
                    amax = max(amax, abs(xb[j]))
                db = amax / np.float32(127)
                inv = np.float32(1) / db if db > 0 else np.float32(0)
                qb = q[i, b * 32:b * 32 + 32]
                s0 = 0
                s1 = 0
                for j in range(16):
                    v = np.int32(np.rint(xb[j] * inv))
                    qb[j] = v
                    s0 += v
                for j in range(16, 32):
                    v = np.int32(np.rint(xb[j] * inv))
                    qb[j] = v
                    s1 += v
                d[i, b], xs[i, b] = db, db * np.float32(s0 + s1)
                qsum[i, 2 * b], qsum[i, 2 * b + 1] = s0, s1

    # NOTE(exact-batching): no reassociation: the float steps run in the written order (one product
    # per sum, fused or not alike everywhere), so every instruction path gives the same bits.
    @njit(**dict(_JIT, fastmath={"nnan", "ninf", "nsz", "contract"}))
    def _matmul_i8(qv, d, m, q, da, xs, qsum, y, isa_id):   # pragma: no cover - compiled
        # qv [T, nu, R/16, quads, 16, 4] u8 (see prepare); d, m [T, nu, R] f32 (m: q4 mins, or an
        # empty array for q8); q [B, K] i8; da, xs [B, K/32]; qsum [B, K/16] i32; y [B, T*R]
        T, nu, R = d.shape
        B, K = q.shape
        per = K // nu                       # weights per unit: 32 (q4, Q8_0) or 16 (Q6_K)
        nib = m.shape[0] > 0
        six = qv.shape[3] == 3              # Q6_K in 6 bits (quant.py, NOTE(q6))
        step = R * (16 if nib else 12 if six else per)     # bytes per unit of one tile
        w, qf = qv.reshape(-1), q.reshape(-1)
        for t in prange(T):
            acc = np.zeros((B, R), np.float32)
            isum = np.empty(R, np.int32)
            wide = np.empty(R * 16 if six else 0, np.uint8)
            for u in range(nu):
                base, k0 = (t * nu + u) * step, u * per
                du = d[t, u]
                src = w
                if six:                     # the unit widened to 8 bits once for every row
                    for c in range(R // 16):
                        for g in range(4):
                            for at in range(64):
                                n = np.int32(w[base + c * 192 + 64 * (g & 1) + at])
                                lo = n & 15 if g < 2 else n >> 4
                                top = (np.int32(w[base + c * 192 + 128 + at]) >> (2 * g)) & 3
                                wide[(c * 4 + g) * 64 + at] = np.uint8((lo | top << 4) + 96)
                    src, base = wide, 0
                for i in range(B):
                    a = i * K + k0
                    if nib:
                        isum[:] = 0
                        for c in range(R // 16):
                            _unit_dot(src, base + c * 256, qf, a, isum, c * 16, 4, True, isa_id)
                    else:                   # bytes hold q + 128: take 128 * sum(q_a) off again
                        isum[:] = -_q8_bias(isa_id) * (qsum[i, k0 // 16] + (qsum[i, k0 // 16 + 1] if per == 32 else 0))
                        for c in range(R // 16):
                            if per == 32:
                                _unit_dot(src, base + c * 512, qf, a, isum, c * 16, 8, False, isa_id)
                            else:
                                _unit_dot(src, base + c * 256, qf, a, isum, c * 16, 4, False, isa_id)
                    ai, s = acc[i], da[i, k0 // 32]
                    for r in range(R):
                        ai[r] += (du[r] * s) * np.float32(isum[r])
                    if nib:
                        mu, x = m[t, u], xs[i, u]
                        for r in range(R):
                            ai[r] += mu[r] * x
            for i in range(B):
                y[i, t * R:t * R + R] = acc[i]


    @njit(cache=True, nogil=True)
    def product(x, qv, d, m, y, isa_id):   # pragma: no cover - compiled
        # y [B, n] = x [B, K] times the weight (qv, d, m as _matmul_i8 takes them), x's rows quantized
        # PERF(dispatch): quantizing inside the one call saves a dispatch and four arrays a product
        B, K = x.shape
        q = np.empty((B, K), np.int8)
        da, xs = np.empty((B, K // 32), np.float32), np.empty((B, K // 32), np.float32)
        qsum = np.empty((B, K // 16), np.int32)
        quantize_rows(x, q, da, xs, qsum)
        _matmul_i8(qv, d, m, q, da, xs, qsum, y, literally(isa_id))


if AVAILABLE:
    def _product_on(isa_id):
        """`product` with its instruction path fixed: a plain call from Python (a literal argument
        would take numba's slow dispatch on every call, ~24 ms), cached per path by numba (a
        closure's cache key holds its cell values)."""
        @njit(cache=True, nogil=True)
        def product_on(x, qv, d, m, y):   # pragma: no cover - compiled
            product(x, qv, d, m, y, isa_id)
        return product_on

    PRODUCT = {path: _product_on(isa.IDS[path]) for path in isa.PATHS}


def quantize(x):
    """x float32 [B, K] (K a multiple of 32) -> (q int8, d, xs, qsum) as `quantize_rows` fills them."""
    B, K = x.shape
    q = np.empty((B, K), np.int8)
    d, xs = np.empty((B, K // QA), np.float32), np.empty((B, K // QA), np.float32)
    qsum = np.empty((B, K // 16), np.int32)
    quantize_rows(x, q, d, xs, qsum)
    return q, d, xs, qsum


def matmul(x, p, y, path=None, lib=None):
    """y [B, T*R] = x (float32 [B, K], C-contiguous) times QWeight p, with x's rows quantized to int8,
    the integer dots on instruction path `path` (an isa.PATHS name; default DEFAULT's), on the C
    kernels `lib` (native.Library: its own path) where given."""
    if lib is not None:
        lib.product_i8(x, p, y, threads.count())
        return
    d, m = quant.float_scales(p)                  # numba reads float32 scales (NOTE(scales-f16))
    PRODUCT[path or DEFAULT.path](x, prepare(p), d, NO_MINS if m is None else m, y)


NO_MINS = np.zeros((0, 0, 0), np.float32)

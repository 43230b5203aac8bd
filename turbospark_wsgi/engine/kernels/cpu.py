"""Multi-threaded CPU kernels (numba) for y = x @ W.T with W held as tiled quantized blocks.

Up to GEMV_MAX_B rows (decode steps and prefill chunks) run fused dequantize-and-dot kernels:
each SIMD lane is one output row (see quant.QWeight), so there are no horizontal sums, and the
weights are streamed from memory once per call (each block is unpacked once into a small float32
tile that all rows reuse; q8 with B <= 2 unpacks per row). A row's result never depends on the
rows beside it. Larger calls dequantize slabs of W.T to float32 and hand them to BLAS. These
keep activations float32: the results equal the dequantize-then-matmul reference up to float32
summation order. With int8 activations (the model's KernelPlan) every product of any row count goes to the
integer kernels of int8.py instead.
"""
import contextlib

import numpy as np

from .. import quant
from . import attention, int8
from .threads import count as thread_count, use as _use_threads  # noqa: F401 (thread_count: the engine's)

try:
    import numba
    from numba import njit, prange
except ImportError:            # pragma: no cover - exercised only where numba is absent
    numba = None

AVAILABLE = numba is not None
# PERF(prefill): with BLAS on one thread (see limit_blas_threads) the fused kernels beat dequantize +
# GEMM up to a whole prefill chunk: SmolLM2 Q4_1 forward, 2 cores, 24/64/128 rows: 48/118/231 ms
# against 66/144/263 ms (and 100/134/207 ms with BLAS on both cores, its spinning threads slowing
# the kernels around it). Only longer calls (TURBOSPARK_PREFILL_CHUNK above this) use BLAS.
# Set by `configure` (EngineOptions.gemv_max_b, TURBOSPARK_GEMV_MAX_B).
GEMV_MAX_B = 256               # larger batches use BLAS
SLAB_ROWS = 1024               # rows dequantized per BLAS call in the large-batch path
# PERF(threads): a cap on the threads of a single-row product (one stream decoding); 0 = none.
# With passive waiting one thread was best for the layers' 50-150 us products, the 49152x576 head
# still halving on two (hence BIG_SINGLE_ROW: products that large ignore the cap). Set by
# `configure` (EngineOptions.single_row_threads, TURBOSPARK_SINGLE_ROW_THREADS).
SINGLE_ROW_THREADS = 0
BIG_SINGLE_ROW = 8 * 2 ** 20      # weights
# A process-wide override of every model's activations (KernelPlan.activations): None, or "int8" /
# "float32" inside `activations_as` (embeddings run float32 whatever the model generates with).
ACTIVATIONS = None


@contextlib.contextmanager
def activations_as(kind):
    """Every model's products on `kind` ("int8" or "float32") inside the block (on the compute
    thread, which alone runs products once a model is loaded), then back to what it was."""
    global ACTIVATIONS
    before, ACTIVATIONS = ACTIVATIONS, kind
    try:
        yield
    finally:
        ACTIVATIONS = before


def configure(gemv_max_b=GEMV_MAX_B, single_row_threads=SINGLE_ROW_THREADS):
    """Sets the kernels' process-wide tuning (EngineOptions.gemv_max_b, single_row_threads)."""
    global GEMV_MAX_B, SINGLE_ROW_THREADS
    GEMV_MAX_B, SINGLE_ROW_THREADS = int(gemv_max_b), int(single_row_threads)


if AVAILABLE:
    _JIT = dict(parallel=True, fastmath=True, cache=True, nogil=True)

    @njit(**_JIT)
    def _q8_gemv(x, qs, d, y):   # pragma: no cover - compiled
        # x [B, K]; qs [T, K/16, 16, R] i8; d [T, K/(16*g), R]; y [B, T*R]
        B = x.shape[0]
        T, ns, _, R = qs.shape
        g = ns // d.shape[1]
        for t in prange(T):
            acc = np.empty(R, np.float32)
            for i in range(B):
                acc[:] = 0
                for b in range(ns):
                    k, gb = b * 16, b // g
                    for r in range(R):
                        s = np.float32(0)
                        for j in range(16):
                            s += np.float32(np.int32(qs[t, b, j, r])) * x[i, k + j]
                        acc[r] += d[t, gb, r] * s
                for r in range(R):
                    y[i, t * R + r] = acc[r]

    @njit(**_JIT)
    def _q4_batch(x, xsum, qs, d, m, y):   # pragma: no cover - compiled
        # x [B, K]; xsum [B, K/32]; qs [T, K/32, 16, R] u8; d, m [T, K/32, R]; y [B, T*R].
        # Each block is unpacked once into w [32, R] and reused by all B rows.
        B = x.shape[0]
        T, nb, S, R = qs.shape
        for t in prange(T):
            acc = np.zeros((B, R), np.float32)
            w = np.empty((32, R), np.float32)
            for b in range(nb):
                k = b * 32
                for j in range(S):
                    qj, lo, hi = qs[t, b, j], w[j], w[16 + j]
                    for r in range(R):
                        q = np.int32(qj[r])
                        lo[r] = np.float32(np.int32(q & 15))
                        hi[r] = np.float32(np.int32(q >> 4))
                db, mb = d[t, b], m[t, b]
                for i in range(B):
                    xi, ai, xs = x[i, k:k + 32], acc[i], xsum[i, b]
                    for r in range(R):
                        s = np.float32(0)
                        for j in range(32):
                            s += w[j, r] * xi[j]
                        ai[r] += db[r] * s + mb[r] * xs
            for i in range(B):
                y[i, t * R:t * R + R] = acc[i]

    @njit(**_JIT)
    def _q8_batch(x, qs, d, y):   # pragma: no cover - compiled
        B = x.shape[0]
        T, ns, S, R = qs.shape
        g = ns // d.shape[1]
        for t in prange(T):
            acc = np.zeros((B, R), np.float32)
            w = np.empty((16, R), np.float32)
            for b in range(ns):
                k = b * 16
                for j in range(S):
                    qj, wj = qs[t, b, j], w[j]
                    for r in range(R):
                        wj[r] = np.float32(np.int32(qj[r]))
                db = d[t, b // g]
                for i in range(B):
                    xi, ai = x[i, k:k + 16], acc[i]
                    for r in range(R):
                        s = np.float32(0)
                        for j in range(16):
                            s += w[j, r] * xi[j]
                        ai[r] += db[r] * s
            for i in range(B):
                y[i, t * R:t * R + R] = acc[i]

    # NOTE(compile): unpack loops run to qs.shape[2] (16) rather than a literal 16, so LLVM does
    # not fully unroll them around the vectorised row loop: the literal form took 65-95 s to
    # compile for _q8_dequant_t (5 s now) at no measurable run-time gain.
    # NOTE(slices): indexing 1-D row slices (not out[i, j] with two computed indices) is what lets
    # LLVM vectorise these loops; the 2-D form compiled to scalar code, ~7x slower.
    @njit(**_JIT)
    def _q4_dequant_t(qs, d, m, t0, out):   # pragma: no cover - compiled
        # tiles t0.. of qs -> out [K, rows] float32, i.e. W.T (rows a multiple of R)
        T, nb, S, R = qs.shape
        for tt in prange(out.shape[1] // R):
            t, c = t0 + tt, tt * R
            for b in range(nb):
                db, mb = d[t, b], m[t, b]
                for j in range(S):
                    qj = qs[t, b, j]
                    lo, hi = out[b * 32 + j, c:c + R], out[b * 32 + 16 + j, c:c + R]
                    for r in range(R):
                        q = np.int32(qj[r])
                        lo[r] = np.float32(np.int32(q & 15)) * db[r] + mb[r]
                        hi[r] = np.float32(np.int32(q >> 4)) * db[r] + mb[r]

    @njit(**_JIT)
    def _q8_dequant_t(qs, d, t0, out):   # pragma: no cover - compiled
        T, ns, S, R = qs.shape
        g = ns // d.shape[1]
        for tt in prange(out.shape[1] // R):
            t, c = t0 + tt, tt * R
            for b in range(ns):
                db, qb = d[t, b // g], qs[t, b]
                for j in range(S):
                    qj, o = qb[j], out[b * S + j, c:c + R]
                    for r in range(R):
                        o[r] = np.float32(np.int32(qj[r])) * db[r]


class QLinear:
    """A quantized weight that numpy's `@` accepts on the right: `x @ QLinear(w)` == x @ W.T, with
    x [..., k] float32 -> [..., n]. Stands in for a pre-transposed float32 (k, n) matrix."""

    __array_ufunc__ = None   # NOTE(dispatch): makes ndarray.__matmul__ defer to __rmatmul__

    def __init__(self, w, threads=None, plan=None):
        self.w, self.threads = w, threads
        # the model's KernelPlan: activations and the int8 dots' instruction path
        self.activations = plan.activations if plan else "int8"
        self.isa = plan.isa if plan else int8.DEFAULT.path
        self.lib = plan.native if plan else None        # the C kernels (native.py), or None: numba's
        self.shape = (w.k, w.n)   # the float32 matrix it replaces is (in, out)
        if self.activations == "int8" and int8.AVAILABLE:
            # the int8 kernels' layout, built at load rather than by a first request (~1 s for SmolLM2),
            # and the only one kept (quant, NOTE(one-layout))
            for p in w.parts:
                if int8.fits(p):
                    int8.prepare(p)
                    p.drop_tiled()
        # the parts a fused layer runs on the int8 kernels (no padding rows in any), or None
        self.int8_parts = tuple(w.parts) if int8.AVAILABLE and all(
            p.tiles * p.tile == p.n and int8.fits(p) for p in w.parts) else None
        # the part int8 products go to straight (one part, no padding rows), fixed for the weight
        self._int8_part = self.int8_parts[0] if self.int8_parts and len(w.parts) == 1 else None
        self.nbytes = w.nbytes

    def __rmatmul__(self, x):
        return self._matmul(x, "auto")

    def matmul_rows(self, x):
        """x @ W.T with each row's bits independent of the rows beside it and of the row count
        (prefill: a position's K/V bits do not depend on how the prompt was cut): the fused
        kernels compute every row on its own, with the same code for any count."""
        return self._matmul(x, "gemv")

    def use_threads(self, rows):
        """Sets the calling thread's numba threads as a product of `rows` rows with this weight does."""
        _use_threads(_threads_for(rows, self.w, self.threads))

    def _matmul(self, x, path):
        x = np.asarray(x, dtype=np.float32)
        lead = x.shape[:-1]
        if not AVAILABLE:
            return quant.matmul_ref(x.reshape(-1, self.w.k), self.w).reshape(*lead, self.w.n)
        x = x.reshape(-1, self.w.k)
        p, activations = self._int8_part, ACTIVATIONS or self.activations
        if p is not None and activations == "int8":
            # PERF(dispatch): the common case (one part, no padding rows) straight to its kernel,
            # what qmatmul would do with a few Python steps less for each of a token's ~120 products
            x, y = np.ascontiguousarray(x), np.empty((x.shape[0], p.n), np.float32)
            self.use_threads(x.shape[0])
            int8.matmul(x, p, y, self.isa, self.lib)
        else:
            y = qmatmul(x, self.w, threads=self.threads, path=path, activations=activations, isa=self.isa, lib=self.lib)
        return y.reshape(*lead, self.w.n)


class QEmbedding:
    """Row lookup `emb[ids]` -> float32 [len(ids), k] from a quantized [vocab, k] QMatrix."""

    def __init__(self, w):
        self.w, self.shape, self.nbytes = w, (w.n, w.k), w.nbytes

    def __getitem__(self, ids):
        return quant.embed_rows(self.w, ids)


def qmatmul(x, w, out=None, threads=None, path="auto", activations=None, isa=None, lib=None):
    """y = x @ W.T for x float32 [B, k] and a quant.QMatrix W [n, k] -> float32 [B, n].
    `threads` caps the numba threads for this call (default: NUMBA_NUM_THREADS / all cores);
    `path` forces "gemv" (fused kernel) or "blas" (dequantize slabs + GEMM); `activations`
    ("int8" or "float32", default ACTIVATIONS or int8) picks the kernels of every path but "blas",
    `isa` the int8 dots' instruction path (isa.PATHS; default int8.DEFAULT's), `lib` the C kernels
    (native.Library) that run them instead of numba's."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.k:
        raise ValueError(f"activation shape {x.shape} does not match weight {w.shape}")
    y = np.empty((x.shape[0], w.n), np.float32) if out is None else out
    use_gemv = path == "gemv" or (path == "auto" and x.shape[0] <= GEMV_MAX_B)
    _use_threads(_threads_for(x.shape[0], w, threads))
    # NOTE(exact-batching): int8 activations take the integer kernels for any row count, prompt
    # chunks and decode steps alike, so a row's bits never depend on the call it came in.
    integer = path != "blas" and (activations or ACTIVATIONS or "int8") == "int8" and int8.AVAILABLE
    start = 0
    for p in w.parts:
        part = y[:, start:start + p.n]
        if use_gemv or integer:
            _gemv(x, p, part, integer, isa, lib)
        else:
            _blas(x, p, part, lib)
        start += p.n
    return y


def _threads_for(rows, w, threads):
    if threads is None and rows == 1 and SINGLE_ROW_THREADS and w.n * w.k < BIG_SINGLE_ROW:
        return SINGLE_ROW_THREADS
    return threads


def _gemv(x, p, y, integer=False, isa=None, lib=None):
    direct = p.tiles * p.tile == p.n and y.flags.c_contiguous
    buf = y if direct else np.empty((x.shape[0], p.tiles * p.tile), np.float32)
    if integer and int8.fits(p):
        int8.matmul(x, p, buf, isa, lib)
    elif lib is not None:
        lib.product_f32(x, p, buf, thread_count())
    # NOTE(exact-batching): a sequence must get the same numbers alone or in a batch, and a prompt
    # position the same in a prefill of any cut or a decode step, so each layout has kernels whose
    # rows do not depend on B. q4 always takes the tile kernel (each block unpacked once into a
    # float32 tile all rows reuse): the per-row one rounds differently, and SmolLM2's q4 products
    # measured 0.96x / 1.05x / 1.23x / 1.55x its speed at B = 1 / 8 / 16 / 128 (2 cores, loaded).
    # For q8, B <= 2 re-unpacks per row (fastest for decode); the two agree bit for bit.
    elif p.kind == "q4":
        xsum = x.reshape(x.shape[0], -1, 32).sum(axis=-1)          # [B, K/32] for the mins
        _q4_batch(x, xsum, p.qs, *quant.float_scales(p), buf)
    else:
        (_q8_batch if x.shape[0] > 2 else _q8_gemv)(x, p.qs, quant.float_scales(p)[0], buf)
    if not direct:
        y[...] = buf[:, :p.n]


def _blas(x, p, y, lib=None):
    T, R = p.tiles, p.tile
    per = max(1, SLAB_ROWS // R)                                   # tiles per slab
    slab = np.empty((p.k, min(T, per) * R), np.float32)            # W.T for the slab's rows
    for t0 in range(0, T, per):
        cols = min(per, T - t0) * R
        wt = slab if cols == slab.shape[1] else np.empty((p.k, cols), np.float32)
        if lib is not None:
            lib.dequant_t(p, t0, wt, thread_count())
        elif p.kind == "q4":
            _q4_dequant_t(p.qs, *quant.float_scales(p), t0, wt)
        else:
            _q8_dequant_t(p.qs, quant.float_scales(p)[0], t0, wt)
        n0 = t0 * R
        n1 = min(p.n, n0 + cols)
        y[:, n0:n1] = x @ wt[:, :n1 - n0]


def limit_blas_threads(n=1):
    """Caps BLAS (numpy's OpenBLAS) at `n` threads for the process.

    PERF(threads): with quantized weights the fused kernels are the parallel part of every product
    and BLAS runs only attention's small ones; its idle threads spin after each call and take the
    cores from the kernels around it. SmolLM2 Q4_1, 2 cores, BLAS on 2 threads -> 1: decode at depth
    300 went 40 -> 8 ms a token (B = 1) and 65 -> 36 ms a step (B = 8), a 24-token prompt 110 -> 48 ms."""
    from threadpoolctl import threadpool_limits
    threadpool_limits(n, user_api="blas")


WARM_GROUPS = ("int8", "float")


def warmup(isa=None, groups=WARM_GROUPS):
    """Compiles (or loads from numba's on-disk cache) the kernels of `groups` on tiny inputs: "int8"
    the integer products on instruction path `isa` (default int8.DEFAULT's), "float" the float
    kernels, the BLAS path's dequantizers and attention; returns seconds. The groups compile apart
    (engine/warm.py runs "float" in a second process while this one compiles the rest)."""
    import time
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    raw4 = rng.integers(0, 256, (16, 20), dtype=np.uint8)
    raw4[:, 0:4] = np.frombuffer(np.float16([0.01, -0.02]).tobytes(), np.uint8)
    raw8 = rng.integers(0, 256, (16, 34), dtype=np.uint8)
    raw8[:, 0:2] = np.frombuffer(np.float16([0.01]).tobytes(), np.uint8)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    kinds = [a for a, g in (("int8", "int8"), ("float32", "float")) if g in groups]
    for raw, gtype in ((raw4, 3), (raw8, 8)):
        w = quant.pack(quant.decode(raw, gtype, (16, 32)), tile=16)
        for rows in (x[:1], x):
            for activations in kinds:
                qmatmul(rows, w, path="gemv", activations=activations, isa=isa)
        if "float" in groups:
            qmatmul(x, w, path="blas")
    if "float" in groups:
        kv = rng.standard_normal((4, 1, 8)).astype(np.float32)
        attention.attend(rng.standard_normal((2, 2, 8)).astype(np.float32), kv, kv, 1, window=2)
    return time.perf_counter() - t0

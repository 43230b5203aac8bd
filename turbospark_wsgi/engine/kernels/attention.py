"""Causal attention over the KV caches (numba, CPU): rows of query heads against the keys and values
of their sequence, each key and value row read once for all the query heads that share its KV head.

The work is cut into tasks of (block, KV head, key chunk): a block is up to ROWS consecutive rows of
one sequence (a prompt's rows; a decode step's rows are one block each), a key chunk is CHUNK
positions aligned to absolute position (chunk c holds keys c*CHUNK .. c*CHUNK + CHUNK - 1). A task
computes, for each query head of its block's rows that reads the KV head, the scores over its
chunk's keys, their maximum m, the sum t of exp(score - m) and o = sum of exp(score - m) * v; the
chunks' partials are then merged in chunk order. Many tasks (long prompts, large batches) merge
as they go; few (one stream decoding at depth) compute every chunk in parallel first.

NOTE(exact-prefix): a row's numbers are a function of its query, its position and the keys up to it
alone, the same whatever rows share its block and whichever way the chunks were scheduled: the
chunks are fixed by absolute position, every per-row step (its dots, exps, sums and the merge) runs
in the same order on the same code. So cached K/V can be reused token by token, a reply's included,
and a prompt gets the same bits in one call or cut in pieces.

PERF(attention): the per-head loop before it split a decode step into only H tasks (9 on 2 threads for
SmolLM2-135M) and took libm's expf once per score. SmolLM2 Q4_1, Zen 4, 2 threads, quiet: a decode
step after 2,000 tokens (tools/bench_decode.py --depth 2000, fused) 18.9 -> 13-15 ms; over HTTP
(tools/bench.py --vs-llama-cpp --deep-context 2000) 32 -> 57 tok/s. Reading each K/V row once for all
of a row's query heads measured 3-8% slower for that decode (the rows come from the core's cache).

The KV caches are reached by address: `kv` [S, 3] int64 holds each sequence's K buffer address, V
buffer address and capacity (buffers C-contiguous [n_layer, capacity, G, row], kept alive and large
enough by the caller for the call's length). Their element type is that of `elem`, an empty array
passed beside `kv`: float32, uint16 holding IEEE half floats (a float16 cache: see NOTE(kv-half)),
or int8 for rows of GGUF's q8_0 numbers (D int8 values, then D/32 half-float scales: kv_cache.py,
NOTE(kv-q8)). `exp` is the vectorisable e^x the layer's gates share.

PERF(kv-half): a decode step at depth reads every K/V row of every layer once, and those rows do not
stay in the core's caches between steps (SmolLM2-135M at 2,000 tokens: 92 MB of float32 K/V a step).
Attention over 30 layers' distinct buffers took 9-11 ms a step where the same layer's 30 times took
3.6-5 ms (Zen 4, 2 threads, quiet). Half floats halve those bytes; the conversion is one vcvtph2ps
per 16 values (F16C: every AVX2 CPU has it), and the scores per key cost the same in cache (4.8 ns
with half, 5.0 with float32, one thread).
"""
import numpy as np

from . import threads

try:
    from llvmlite import ir
    from numba import carray, njit, prange
    from numba.core import cgutils, types
    from numba.extending import intrinsic, overload
except ImportError:            # pragma: no cover - exercised only where numba is absent
    njit = None

AVAILABLE = njit is not None
ROWS = 8        # rows of one sequence in a block
CHUNK = 256     # keys in a chunk; NOTE(exact-prefix): changing it changes every long row's bits
# PERF(kv-prefetch): keys ahead whose K/V lines a row's passes ask for. Past the last level cache a
# decode step is bound by the latency of those rows, not by bandwidth (46 MB of half K/V in 7-9 ms
# at depth 2,000, where the machine streams 36 GB/s): 30 layers' attention there, interleaved A/B
# in one process, 15 rounds each, took 8-10% less with the hints (8, 16 or 32 keys ahead alike)
AHEAD = 16
SPREAD_BELOW = 32   # fewer (block, KV head) pairs than this: a call computes its chunks in parallel
EMPTY = np.float32(-3.0e38)    # a partial's m where the chunk holds no key of the row (the kernels assume no inf)
KV_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8))     # what a KV cache may hold
KINDS = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.int8): 2}    # native.c's KV_F32, KV_F16, KV_Q8


def element(dtype):
    """The `elem` the kernels take for KV buffers of numpy `dtype`: float32, float16 passed as its
    bits (NOTE(kv-half)), or int8 for q8_0 rows (kv_cache.py, NOTE(kv-q8))."""
    dtype = np.dtype(dtype)
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV caches hold float32, float16 or q8_0 rows, not {dtype}")
    return np.empty(0, np.uint16 if dtype == np.float16 else dtype)


def kind(elem):
    """The C kernels' number for `elem`'s KV rows (native.c: KV_F32, KV_F16, KV_Q8)."""
    return KINDS[elem.dtype]


if AVAILABLE:
    # NOTE(exact-prefix): no reassociation in the row loops; the one reassociated loop is `_dot`,
    # a function of its two vectors only.
    _JIT = dict(cache=True, nogil=True, error_model="numpy")
    _FM = dict(_JIT, fastmath={"nnan", "ninf", "nsz", "contract"})

    @intrinsic
    def _at(typingctx, addr, elem):
        """The pointer to `elem`'s element type at integer address `addr`."""
        sig = types.CPointer(elem.dtype)(types.int64, elem)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(elem.dtype).as_pointer())
        return sig, codegen

    @intrinsic
    def _prefetch(typingctx, addr):
        """Asks for the cache line at integer address `addr` (a hint: never faults)."""
        sig = types.void(types.int64)

        def codegen(context, builder, signature, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0i8")
            builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return sig, codegen

    @njit(inline="always", **_JIT)
    def _ahead(rows, j, g):   # pragma: no cover - compiled
        # prefetch the row of key j of KV head g (its D elements, in 64-byte lines)
        at = rows.ctypes.data + (j * rows.shape[1] + g) * rows.shape[2] * rows.itemsize
        for line in range(0, rows.shape[2] * rows.itemsize, 64):
            _prefetch(at + line)

    @intrinsic
    def as_f32(typingctx, x):
        """A cache element as float32: itself, or the half float whose bits a uint16 holds."""
        if x == types.float32:
            return types.float32(x), lambda context, builder, signature, args: args[0]
        if x == types.uint16:
            def codegen(context, builder, signature, args):
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
            return types.float32(x), codegen
        return None

    @intrinsic
    def _half_bits(typingctx, x):
        """The bits of the half float nearest float32 x (ties to even, as numpy's astype(float16))."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32), codegen

    def to_elem(x, elem):
        """float32 x as a K/V element of `elem`'s type (numba code only: see the overload)."""
        raise NotImplementedError("to_elem runs inside numba kernels only")

    @overload(to_elem, inline="always")
    def _to_elem(x, elem):
        # NOTE(kv-half): a half is clamped to its range first, so no K/V element is ever inf
        if elem.dtype == types.uint16:
            return lambda x, elem: _half_bits(min(max(x, np.float32(-65504.0)), np.float32(65504.0)))
        return lambda x, elem: x

    def row_len(elem, D):
        """Elements of `elem`'s type in one KV row of D values (numba code only: see the overload)."""
        raise NotImplementedError("row_len runs inside numba kernels only")

    @overload(row_len, inline="always")
    def _row_len(elem, D):
        if elem.dtype == types.int8:                 # NOTE(kv-q8): D values, then D/32 half scales
            return lambda elem, D: D + D // 16
        return lambda elem, D: D

    def kv_at(row, d):
        """Value d of a KV row as float32 (numba code only: see the overload)."""
        raise NotImplementedError("kv_at runs inside numba kernels only")

    @overload(kv_at, inline="always")
    def _kv_at(row, d):
        if row.dtype == types.int8:
            def q8(row, d):
                at = row.shape[0] * 16 // 17 + 2 * (d // 32)
                bits = (np.int32(row[at]) & 0xFF) | ((np.int32(row[at + 1]) & 0xFF) << 8)
                return as_f32(np.uint16(bits)) * np.float32(row[d])
            return q8
        return lambda row, d: as_f32(row[d])

    @njit(**_JIT)
    def quantize_q8(x, out):   # pragma: no cover - compiled
        # NOTE(kv-q8): the q8_0 row of x [D] into out [D + D/16] int8 (no fast-math: the bits of
        # native.c's ts_quantize_kv and kv_cache.quantize_q8)
        D = x.shape[0]
        for b in range(D // 32):
            amax = np.float32(0)
            for e in range(32):
                amax = max(amax, abs(x[32 * b + e]))
            h = _half_bits(min(amax / np.float32(127), np.float32(65504.0)))
            d = as_f32(h)
            for e in range(32):
                r = np.rint(x[32 * b + e] / d) if d > 0 else np.float32(0)
                out[32 * b + e] = np.int8(min(max(r, np.float32(-127)), np.float32(127)))
            out[D + 2 * b] = np.int8(np.int32(h & 0xFF) - (256 if h & 0x80 else 0))
            out[D + 2 * b + 1] = np.int8(np.int32(h >> 8) - (256 if h & 0x8000 else 0))

    def store_kv(row, x):
        """Stores float32 values x [D] as KV row `row` of its type (numba code only: see the overload)."""
        raise NotImplementedError("store_kv runs inside numba kernels only")

    @overload(store_kv, inline="always")
    def _store_kv(row, x):
        if row.dtype == types.int8:
            return lambda row, x: quantize_q8(x, row)

        def plain(row, x):
            # NOTE(compile): an element loop; slice assignments took 7 s more to compile
            for d in range(x.shape[0]):
                row[d] = to_elem(x[d], row)
        return plain

    @njit(**_JIT)
    def layer_view(kv, elem, s, which, li, G, D):   # pragma: no cover - compiled
        # sequence s's K (which 0) or V (1) buffer of layer li as [capacity, G, row]
        cap, n = kv[s, 2], row_len(elem, D)
        return carray(_at(kv[s, which] + elem.itemsize * li * cap * G * n, elem), (cap, G, n))

    @intrinsic
    def _pow2(typingctx, n):
        """2**n as float32 for an int32 n in [-126, 127]: the exponent bits set directly."""
        sig = types.float32(types.int32)

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
            return builder.bitcast(bits, ir.FloatType())
        return sig, codegen

    @njit(**_FM)
    def exp(x):   # pragma: no cover - compiled
        # e^x for float32 x (clamped to [-87, 88]): x = n ln2 + r, |r| <= ln2/2, e^r by Cephes' expf
        # polynomial (within 1.4 float32 ulps), times 2^n. Plain arithmetic that vectorises where
        # libm's expf or tanhf, one call per value, does not: the SwiGLU of 8 rows took 118 us with
        # tanhf against numpy's 9 us, and 2.5 us with this.
        x = min(max(x, np.float32(-87.0)), np.float32(88.0))
        n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
        r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        return (p * r * r + r + np.float32(1)) * _pow2(np.int32(n))

    @njit(fastmath=True, cache=True, nogil=True)
    def _dot(q, k):   # pragma: no cover - compiled
        # vectorised with reassociation: the lanes' order is fixed by this loop alone
        acc = np.float32(0)
        for d in range(q.shape[0]):
            acc += q[d] * kv_at(k, d)
        return acc

    @njit(fastmath=True, cache=True, nogil=True)
    def _total(e):   # pragma: no cover - compiled
        acc = np.float32(0)
        for j in range(e.shape[0]):
            acc += e[j]
        return acc

    @njit(inline="always", **_FM)
    def _span(pos, window, r, j0, j1):   # pragma: no cover - compiled
        # the keys a..b-1 of chunk j0..j1-1 that the row at position pos[r] reads
        p = pos[r]
        lo = max(0, p - window + 1) if window > 0 else 0
        return max(lo, j0), min(p + 1, j1)

    @njit(**_FM)
    def _vector(qv, keys, vals, g, a, b, s, o):   # pragma: no cover - compiled
        # one query vector over keys a..b-1 (a < b) of KV head g: o = sum e * v, -> (max score, sum e)
        for j in range(a, b):
            _ahead(keys, j + AHEAD, g)
            s[j - a] = _dot(qv, keys[j, g])
        best = s[0]
        for j in range(1, b - a):
            best = max(best, s[j])
        for j in range(b - a):
            s[j] = exp(s[j] - best)
        for d in range(o.shape[0]):
            o[d] = 0
        # PERF(attention): four values a pass, so o is loaded and stored a quarter as often
        j = a
        while j + 4 <= b:
            for x in range(4):
                _ahead(vals, j + AHEAD + x, g)
            e0, e1, e2, e3 = s[j - a], s[j + 1 - a], s[j + 2 - a], s[j + 3 - a]
            v0, v1, v2, v3 = vals[j, g], vals[j + 1, g], vals[j + 2, g], vals[j + 3, g]
            for d in range(o.shape[0]):
                o[d] += (e0 * kv_at(v0, d) + e1 * kv_at(v1, d)) + (e2 * kv_at(v2, d) + e3 * kv_at(v3, d))
            j += 4
        for j in range(j, b):
            e, vj = s[j - a], vals[j, g]
            for d in range(o.shape[0]):
                o[d] += e * kv_at(vj, d)
        return best, _total(s[:b - a])

    @njit(**_FM)
    def _partial(q, pos, window, r0, r1, keys, vals, g, M, D, j0, j1, o, m, t):   # pragma: no cover - compiled
        # For vector i = (row r0 + i // M, query head g*M + i % M) over keys j0..j1-1 of KV head g:
        # m[i] the highest score (EMPTY: no key of the chunk), t[i] = sum e, o[i] = sum e * v. The M
        # vectors of a row read the chunk's K/V one after another, from the core's cache.
        s = np.empty(j1 - j0, np.float32)
        for i in range((r1 - r0) * M):
            r, h = r0 + i // M, g * M + i % M
            a, b = _span(pos, window, r, j0, j1)
            if a >= b:
                m[i], t[i] = EMPTY, 0
                for d in range(D):
                    o[i, d] = 0
            else:
                m[i], t[i] = _vector(q[r, h * D:(h + 1) * D], keys, vals, g, a, b, s, o[i])

    @njit(inline="always", **_FM)
    def _merge(o, m, t, oc, mc, tc):   # pragma: no cover - compiled
        # the running (o [n, D], m, t) of every vector with one more chunk's partial, in place
        for i in range(m.shape[0]):
            if mc[i] == EMPTY:
                continue
            if m[i] == EMPTY:
                m[i], t[i] = mc[i], tc[i]
                for d in range(o.shape[1]):
                    o[i, d] = oc[i, d]
                continue
            best = max(m[i], mc[i])
            a, b = exp(m[i] - best), exp(mc[i] - best)
            m[i], t[i] = best, t[i] * a + tc[i] * b
            for d in range(o.shape[1]):
                o[i, d] = o[i, d] * a + oc[i, d] * b

    @njit(inline="always", **_FM)
    def _store(o, t, r0, g, M, D, out):   # pragma: no cover - compiled
        for i in range(o.shape[0]):
            r, h = r0 + i // M, g * M + i % M
            inv = np.float32(1) / t[i]
            for d in range(D):
                out[r, h * D + d] = o[i, d] * inv

    @njit(**_JIT)
    def _blocks(seq, pos, window):   # pragma: no cover - compiled
        # [nb, 4]: each block's first row, end row, first chunk and chunk count
        R = seq.shape[0]
        out = np.empty((R, 4), np.int64)
        nb, r = 0, 0
        while r < R:
            e = r + 1
            while e < R and e - r < ROWS and seq[e] == seq[r]:
                e += 1
            c0, c1 = 1 << 62, 0
            for x in range(r, e):
                a, b = _span(pos, window, x, 0, pos[x] + 1)
                c0, c1 = min(c0, a // CHUNK), max(c1, (b - 1) // CHUNK)
            out[nb, 0], out[nb, 1], out[nb, 2], out[nb, 3] = r, e, c0, c1 - c0 + 1
            nb, r = nb + 1, e
        return out[:nb]

    @njit(inline="always", **_JIT)
    def _chunk(q, seq, pos, kv, elem, li, window, H, G, D, blocks, b, g, c, o, m, t):   # pragma: no cover - compiled
        # the partial (o, m, t) of block b's rows over chunk c of KV head g
        r0, r1 = blocks[b, 0], blocks[b, 1]
        k, v = layer_view(kv, elem, seq[r0], 0, li, G, D), layer_view(kv, elem, seq[r0], 1, li, G, D)
        _partial(q, pos, window, r0, r1, k, v, g, H // G, D, c * CHUNK, (c + 1) * CHUNK, o, m, t)

    @njit(**_JIT)
    def _block_head(q, seq, pos, kv, elem, li, window, H, G, D, blocks, b, g, po, pm, pt, task, out):   # pragma: no cover - compiled
        # block b's rows for KV head g into out, from its chunks' partials: those at po/pm/pt[task..]
        # (task >= 0), or else computed here chunk by chunk, each merged as it comes
        r0, r1, c0, nc = blocks[b, 0], blocks[b, 1], blocks[b, 2], blocks[b, 3]
        rows = (r1 - r0) * (H // G)
        o, m, t = np.empty((rows, D), np.float32), np.empty(rows, np.float32), np.empty(rows, np.float32)
        for i in range(rows):
            m[i] = EMPTY
        if task >= 0:
            for c in range(nc):
                _merge(o, m, t, po[task + c], pm[task + c], pt[task + c])
        else:
            oc, mc, tc = np.empty((rows, D), np.float32), np.empty(rows, np.float32), np.empty(rows, np.float32)
            for c in range(nc):
                _chunk(q, seq, pos, kv, elem, li, window, H, G, D, blocks, b, g, c0 + c, oc, mc, tc)
                _merge(o, m, t, oc, mc, tc)
        _store(o, t, r0, g, H // G, D, out)

    @njit(**_JIT)
    def _plan(seq, pos, window, H, G, D):   # pragma: no cover - compiled
        # The call's tasks: spread, one per (block, KV head, chunk), block b's at G * first[b] + g * nc
        # + c, their partials in po/pm/pt; else one per (block, KV head). owner: each task's block.
        blocks = _blocks(seq, pos, window)
        nb = blocks.shape[0]
        spread = nb * G < SPREAD_BELOW
        first = np.empty(nb + 1, np.int64)
        first[0] = 0
        for b in range(nb):
            first[b + 1] = first[b] + (blocks[b, 3] if spread else 1)
        owner = np.empty(G * first[nb], np.int64)
        for b in range(nb):
            for x in range(G * first[b], G * first[b + 1]):
                owner[x] = b
        n, tasks = (ROWS * (H // G), owner.shape[0]) if spread else (0, 0)
        po = np.empty((tasks, n, D), np.float32)
        return blocks, first, owner, spread, po, np.empty((tasks, n), np.float32), np.empty((tasks, n), np.float32)

    @njit(**_JIT)
    def _task(x, q, seq, pos, kv, elem, li, window, H, G, D, blocks, first, owner, spread, po, pm, pt, out):   # pragma: no cover - compiled
        b = owner[x]
        nc = blocks[b, 3] if spread else 1
        g, c = (x - G * first[b]) // nc, (x - G * first[b]) % nc
        if spread:
            _chunk(q, seq, pos, kv, elem, li, window, H, G, D, blocks, b, g, blocks[b, 2] + c, po[x], pm[x], pt[x])
        else:
            _block_head(q, seq, pos, kv, elem, li, window, H, G, D, blocks, b, g, po, pm, pt, np.int64(-1), out)

    @njit(**_JIT)
    def _gather(q, seq, pos, kv, elem, li, window, H, G, D, blocks, first, po, pm, pt, out):   # pragma: no cover - compiled
        # spread: every (block, KV head) merged from its chunks' partials (a few, small: one thread)
        for bg in range(blocks.shape[0] * G):
            b, g = bg // G, bg % G
            _block_head(q, seq, pos, kv, elem, li, window, H, G, D, blocks, b, g, po, pm, pt,
                        G * first[b] + g * blocks[b, 3], out)

    @njit(parallel=True, **_JIT)
    def attend_rows(q, seq, pos, kv, elem, li, window, H, G, D, out):   # pragma: no cover - compiled
        # out [R, H*D]: row r's query heads (q[r, :H*D], pre-scaled, rotated) at position pos[r] of
        # sequence seq[r] over its keys lo..pos[r] of layer li (lo = pos[r] - window + 1, or 0);
        # query head h reads KV head h // (H/G)
        # NOTE(compile): the parallel function holds only the loop (numba's parallel passes took
        # seconds longer over the planning)
        blocks, first, owner, spread, po, pm, pt = _plan(seq, pos, window, H, G, D)
        for x in prange(owner.shape[0]):
            _task(np.int64(x), q, seq, pos, kv, elem, li, window, H, G, D, blocks, first, owner, spread, po, pm, pt, out)
        if spread:
            _gather(q, seq, pos, kv, elem, li, window, H, G, D, blocks, first, po, pm, pt, out)


def attend(q, keys, vals, pos, window=0, lib=None):
    """Causal attention of rows q `[T, H, D]` (pre-scaled) at positions pos.. over keys/values
    `[n, G, D]` (or q8_0 rows `[n, G, D + D/16]` int8; n >= pos + T; query head h reads KV head h // (H/G)) -> `[T, H*D]` float32.
    With a sliding `window` the row at position p reads only keys max(0, p - window + 1)..p.
    A row gets the same bits as in `attend_rows` (see NOTE(exact-prefix) above); on the C kernels
    `lib` (native.Library) where given, as its `attend_rows`."""
    T, H, D = q.shape
    G = keys.shape[1]
    # half-float caches (NOTE(kv-half)) and q8_0 rows (int8: NOTE(kv-q8)) are read as they are, as
    # the fused layers read them
    dtype = keys.dtype if keys.dtype == vals.dtype and keys.dtype in (np.float16, np.int8) else np.float32
    keys, vals = np.ascontiguousarray(keys, dtype=dtype), np.ascontiguousarray(vals, dtype=dtype)
    kv = np.array([[keys.ctypes.data, vals.ctypes.data, keys.shape[0]]], np.int64)
    out = np.empty((T, H * D), np.float32)
    rows = np.ascontiguousarray(q, dtype=np.float32).reshape(T, H * D)
    seq, at = np.zeros(T, np.int64), np.arange(pos, pos + T, dtype=np.int64)
    if lib is not None:
        lib.attend_rows(rows, seq, at, kv, kind(element(dtype)), 0, int(window), H, G, D, out, threads.count())
    else:
        attend_rows(rows, seq, at, kv, element(dtype), 0, int(window), H, G, D, out)
    return out

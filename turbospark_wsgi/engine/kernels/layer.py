"""One numba call per transformer layer (CPU, int8 activations): the norms, the four quantized
products, q/k head norms and biases, rotary, the K/V cache writes, attention and the residual adds
of R rows, each row a position of one sequence (a prompt's rows, or one row per sequence of a
decode step).

PERF(fused-layer): step by step a layer is ~25 Python steps around its 4 products (norms, rope, a
cache write and an attention call per sequence, residual adds, SiLU*up); on SmolLM2-135M that was
~2.3 ms of a 5.8 ms decode step at B = 1 (2,450 Python calls a step; 97 fused), each step also a GIL
hand-off between nogil kernels. tools/bench_decode.py, 2 cores shared with other jobs (load 4-4.8),
medians of 7 interleaved rounds: B = 1 23.6 -> 15.8 ms a step (1.49x), B = 8 53.9 -> 47.8 ms
(1.13x), B = 16 105.7 -> 104.8 ms (1.01x). A fresh numba cache compiles these kernels in ~3-4 s more.

NOTE(exact-batching): every step is computed row by row by the same code whatever R is and whatever
rows stand beside it (the products are int8.py's, attention attention.py's), so a
position's numbers never depend on its neighbours or on how a prompt was cut. The float steps
(norms, rope, gates) round differently from the numpy ones of the unfused path, so a model runs
every call, prompt and decode alike, on this path or every call on the other (`Transformer.fused`).

The KV caches of the R rows' sequences are reached by address: `kv` [S, 3] int64 holds each
sequence's K buffer address, V buffer address and capacity (buffers C-contiguous [n_layer,
capacity, G, row] of `elem`'s type, float32, half floats or q8_0 rows: attention.py, NOTE(kv-half),
kv_cache.py, NOTE(kv-q8); kept alive and large enough by the caller for the call's length).
"""
import numpy as np

from .. import quant
from . import attention, int8, isa

try:
    import numba
    from numba import literally, njit
except ImportError:            # pragma: no cover - exercised only where numba is absent
    numba = None

AVAILABLE = numba is not None and int8.AVAILABLE


if AVAILABLE:
    # NOTE(exact-batching): no reassociation in the row loops (as int8.py's float steps).
    # PERF(fused-layer): numpy's error model drops the zero check of each division, which kept
    # LLVM from vectorising every loop that divides (SwiGLU of 8 rows: 29 us -> 1.3 us).
    _JIT = dict(cache=True, nogil=True, error_model="numpy")
    _FM = dict(_JIT, fastmath={"nnan", "ninf", "nsz", "contract"})

    @njit(**_FM)
    def _norm(x, w, eps, out):   # pragma: no cover - compiled
        # out = x / sqrt(mean(x^2) + eps) * w over one row (out may be x)
        # PERF(norm): the squares summed in 16 lanes, in a fixed order LLVM can vectorise without
        # reassociating; one running sum took twice as long (8 rows of 576: 6.4 -> 3.3 us)
        n = x.shape[0]
        lanes = np.zeros(16, np.float32)
        for j0 in range(0, n - n % 16, 16):
            for k in range(16):
                lanes[k] += x[j0 + k] * x[j0 + k]
        s = np.float32(0)
        for k in range(16):
            s += lanes[k]
        for j in range(n - n % 16, n):
            s += x[j] * x[j]
        rms = np.float32(np.sqrt(s * (np.float32(1) / np.float32(n)) + eps))
        for j in range(n):
            out[j] = x[j] / rms * w[j]

    @njit(**_JIT)
    def _norm_rows(x, w, eps, out):   # pragma: no cover - compiled
        for r in range(x.shape[0]):
            _norm(x[r], w, eps, out[r])

    @njit(**_FM)
    def _gate_rows(gu, gelu, out):   # pragma: no cover - compiled
        # out [R, F] = silu(gate) * up, or gelu_tanh(gate) * up, gu [R, 2F] = gate | up; both as
        # g * sigmoid(z) (z = g, or 2 sqrt(2/pi) (g + 0.044715 g^3): 0.5 (1 + tanh(z/2)) = sigmoid(z))
        R, F = out.shape
        c = np.float32(2 * np.sqrt(2.0 / np.pi))
        for r in range(R):
            g, u, o = gu[r, :F], gu[r, F:], out[r]
            if gelu:
                for j in range(F):
                    z = c * (g[j] + np.float32(0.044715) * g[j] * g[j] * g[j])
                    o[j] = g[j] / (np.float32(1) + attention.exp(-z)) * u[j]
            else:
                for j in range(F):
                    o[j] = g[j] / (np.float32(1) + attention.exp(-g[j])) * u[j]

    @njit(**_FM)
    def _heads_to_cache(qkv, seq, pos, kv, elem, li, cos, sin, qk_norm, eps, H, G, D):   # pragma: no cover - compiled
        # qkv [R, (H+2G)*D], in place: q/k head norms (qk_norm [2, D], or [0, D] for none), rotary
        # on the first 2*half dims of the q and k heads; k and v heads stored at pos[r] of layer li
        R = qkv.shape[0]
        half = cos.shape[-1]
        for r in range(R):
            s, p = seq[r], pos[r]
            for h in range(H + G):
                x = qkv[r, h * D:(h + 1) * D]
                if qk_norm.shape[0]:
                    _norm(x, qk_norm[0] if h < H else qk_norm[1], eps, x)
                for i in range(half):
                    x1, x2, c, sn = x[i], x[half + i], cos[p, 0, i], sin[p, 0, i]
                    x[i] = x1 * c - x2 * sn
                    x[half + i] = x2 * c + x1 * sn
            keys, vals = attention.layer_view(kv, elem, s, 0, li, G, D), attention.layer_view(kv, elem, s, 1, li, G, D)
            for g in range(G):
                attention.store_kv(keys[p, g], qkv[r, (H + g) * D:(H + g + 1) * D])
                attention.store_kv(vals[p, g], qkv[r, (H + G + g) * D:(H + G + g + 1) * D])

    @njit(**_FM)
    def _residual(x, y, norms, post, eps):   # pragma: no cover - compiled
        # x += y, y RMS-normed first with norms[post] where the model has post norms
        for r in range(x.shape[0]):
            xr, yr = x[r], y[r]
            if norms.shape[0] > post:
                _norm(yr, norms[post], eps, yr)
            for j in range(xr.shape[0]):
                xr[j] += yr[j]

    @njit(**_JIT)
    def _product(x, qvs, ds, ms, parts, widths, p, y, isa_id):   # pragma: no cover - compiled
        # y [R, n] = x times product p of the layer: its parts parts[p]..parts[p+1]-1 of qvs/ds/ms,
        # each int8.product's weight, their columns side by side (part k's first widths[k] of its T*R)
        literally(isa_id)
        off = 0
        for k in range(parts[p], parts[p + 1]):
            padded = ds[k].shape[0] * ds[k].shape[2]
            if parts[p + 1] - parts[p] == 1 and padded == y.shape[1]:
                int8.product(x, qvs[k], ds[k], ms[k], y, isa_id)
                return
            part = np.empty((x.shape[0], padded), np.float32)
            int8.product(x, qvs[k], ds[k], ms[k], part, isa_id)
            y[:, off:off + widths[k]] = part[:, :widths[k]]
            off += widths[k]

    @njit(**_JIT)
    def layer(x, seq, pos, kv, elem, li, window, cos, sin, eps, gelu, H, G, D,
              norms, bqkv, qk_norm, qvs, ds, ms, parts, widths, isa_id):   # pragma: no cover - compiled
        # x [R, dim] in place. norms [2 or 4, dim]: the attention and MLP norms, then the post norms
        # where the model has them; bqkv [(H+2G)*D] or [0]; qvs/ds/ms: the parts of wqkv, wo,
        # w_gate_up and w_down as int8.product takes them (PARTS of each, padded with empty ones),
        # product p being parts parts[p]..parts[p+1]-1, part k widths[k] columns (NOTE(layer-parts)
        # in native.c); isa_id: the integer dots' instruction path (isa.IDS)
        literally(isa_id)
        R, dim = x.shape
        h = np.empty_like(x)
        _norm_rows(x, norms[0], eps, h)
        qkv = np.empty((R, (H + 2 * G) * D), np.float32)
        _product(h, qvs, ds, ms, parts, widths, 0, qkv, isa_id)
        for r in range(R if bqkv.shape[0] else 0):
            qr = qkv[r]
            for j in range(qr.shape[0]):
                qr[j] += bqkv[j]
        _heads_to_cache(qkv, seq, pos, kv, elem, li, cos, sin, qk_norm, eps, H, G, D)
        att = np.empty((R, H * D), np.float32)
        attention.attend_rows(qkv, seq, pos, kv, elem, li, window, H, G, D, att)
        _product(att, qvs, ds, ms, parts, widths, 1, h, isa_id)
        _residual(x, h, norms, 2, eps)
        _norm_rows(x, norms[1], eps, h)
        gu = np.empty((R, widths[parts[2]:parts[3]].sum()), np.float32)
        _product(h, qvs, ds, ms, parts, widths, 2, gu, isa_id)
        a = np.empty((R, gu.shape[1] // 2), np.float32)
        _gate_rows(gu, gelu, a)
        _product(a, qvs, ds, ms, parts, widths, 3, h, isa_id)
        _residual(x, h, norms, 3, eps)

if AVAILABLE:
    def _layer_on(isa_id):
        """`layer` with its integer dots' instruction path fixed (see int8._product_on)."""
        @njit(**_JIT)
        def layer_on(x, seq, pos, kv, elem, li, window, cos, sin, eps, gelu, H, G, D,
                     norms, bqkv, qk_norm, qvs, ds, ms, parts, widths):   # pragma: no cover - compiled
            layer(x, seq, pos, kv, elem, li, window, cos, sin, eps, gelu, H, G, D, norms, bqkv, qk_norm, qvs, ds, ms,
                  parts, widths, isa_id)
        return layer_on

    # the layer kernel per instruction path (isa.PATHS): LAYER[path](x, seq, pos, kv, elem, li, window, cos,
    # sin, *numba_args(layer_args(cfg, lw)))
    LAYER = {path: _layer_on(isa.IDS[path]) for path in isa.PATHS}


def layer_args(cfg, lw):
    """The per-layer arguments for LayerWeights `lw`: `layer`'s after `sin` up to the weights, then
    the four products' QWeights (wqkv, wo, w_gate_up, w_down), each a tuple of its parts
    (NOTE(layer-parts) in native.c; `numba_args` turns them into `layer`'s), or None
    where a product is not on the int8 kernels."""
    parts = [getattr(getattr(lw, n), "int8_parts", None) for n in ("wqkv", "wo", "w_gate_up", "w_down")]
    if not AVAILABLE or None in parts:
        return None
    f32 = np.float32
    norms = [lw.attn_norm, lw.ffn_norm]
    if lw.post_attn_norm is not None:
        norms += [lw.post_attn_norm, lw.post_ffn_norm]
    qk = np.stack([lw.q_norm, lw.k_norm]) if lw.q_norm is not None else np.zeros((0, cfg.head_dim), f32)
    bias = lw.bqkv if lw.bqkv is not None else np.zeros(0, f32)
    return (f32(cfg.norm_eps), bool(cfg.gelu_gate), cfg.n_head, cfg.n_kv_head, cfg.head_dim,
            np.ascontiguousarray(np.stack(norms), f32), np.ascontiguousarray(bias, f32), np.ascontiguousarray(qk, f32),
            tuple(parts))


PARTS = 8           # parts a layer's four products have between them at most (native.py LAYER_PARTS too)
_EMPTY = (np.zeros((0,) * 6, np.uint8), np.zeros((0, 0, 0), np.float32), int8.NO_MINS)


def numba_args(args):
    """`layer`'s arguments after `sin` from layer_args's tuple: the products' parts as int8.product
    takes them (float32 scales: quant.float_scales), PARTS of each kind (so every layer compiles to
    one signature), then where each product's parts start and each part's width."""
    *head, products = args
    parts = [p for ps in products for p in ps]
    if len(parts) > PARTS:
        raise ValueError(f"a layer of {len(parts)} product parts; numba's layer takes {PARTS}")
    scales = [quant.float_scales(p) for p in parts]
    held = [(int8.prepare(p), np.ascontiguousarray(d, np.float32),
             int8.NO_MINS if m is None else np.ascontiguousarray(m, np.float32)) for p, (d, m) in zip(parts, scales)]
    held += [_EMPTY] * (PARTS - len(held))
    starts = np.cumsum([0] + [len(ps) for ps in products]).astype(np.int64)
    widths = np.array([p.n for p in parts] + [0] * (PARTS - len(parts)), np.int64)
    return (*head, *(tuple(_read_only(h[i]) for h in held) for i in range(3)), starts, widths)


def _read_only(a):
    """A read-only view: a tuple's arrays must share one numba type, and the packed weights file maps
    its blocks read-only (engine/packed.py) where a freshly built layout is writable."""
    v = a.view()
    v.flags.writeable = False
    return v


def addresses(caches):
    """(`kv`, `elem`) for `layer`: each cache's K and V buffer addresses and capacity, int64 [S, 3],
    and their element type (every cache of one call holds the same)."""
    dtypes = {c.k.dtype for c in caches} | {c.v.dtype for c in caches}
    if len(dtypes) != 1:
        raise ValueError(f"one call's KV caches must share their dtype, not {sorted(map(str, dtypes))}")
    kv = np.array([(c.k.__array_interface__["data"][0], c.v.__array_interface__["data"][0], c.capacity)
                   for c in caches], np.int64)
    return kv, attention.element(dtypes.pop())

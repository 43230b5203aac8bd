"""The transformer's attention apart from its products: the rotary tables that place the query and
key heads, and the causal (optionally windowed) softmax of query rows over the K/V cache, in the
array module `xp` or on the CPU kernel."""
import numpy as np

from .exact_rows import rows_matmul
from .kernels import attention as kernels_attention

ATTN_BLOCK = 128   # prefill attention blocks: positions [k*128, (k+1)*128) see keys up to the block's end


class Attention:
    """Attention of pre-scaled query heads over keys/values `[n, G, D]`; query head h reads KV head
    h // (H // G). `kernel`: every row runs on kernels/attention.py's `attend` (the C kernels `native`
    where given, else numba's), which computes
    each row on its own; otherwise prompts run blockwise (`blocked`) and decode rows one by one
    (`row`) in `xp`. The causal masks are made once per shape and kept."""

    def __init__(self, xp, kernel, native=None):
        self.xp, self.kernel, self.native = xp, kernel, native      # native: the C kernels (or None)
        self._masks = {}

    @staticmethod
    def span(end):
        """How many cache positions a prompt ending before position `end` reads: to the end of its
        last row's block (the keys past `end` are masked)."""
        return -(-end // ATTN_BLOCK) * ATTN_BLOCK

    def prompt(self, q, keys, vals, pos, window):
        """Prompt rows q `[T, H, D]` at positions pos.. -> `[T, H*D]` (keys: at least `span(pos+T)`)."""
        if self.kernel:
            return kernels_attention.attend(q, keys, vals, pos, window, self.native)
        return self.blocked(q, keys, vals, pos, window)

    def decode(self, q, keys, vals, pos, window):
        """One decode row q `[1, H, D]` at position pos over keys `[pos+1, G, D]` -> `[1, H*D]`."""
        if self.kernel:
            return kernels_attention.attend(q, keys, vals, pos, window, self.native)
        return self.row(q, keys, vals, pos, window)

    def row(self, q, keys, vals, pos, window=0):
        """Attention of one decode row q `[1, H, D]` (pre-scaled) at position pos over keys/values
        `[pos+1, G, D]` (with a sliding `window`, only the last `window` of them). Query head h
        reads KV head h // kv_mul. Returns `[1, H*D]`."""
        H, D = q.shape[1:]
        G = keys.shape[1]
        lo = max(0, pos - window + 1) if window else 0
        keys, vals = keys[lo:pos + 1], vals[lo:pos + 1]
        qg = q.reshape(G, H // G, D)                                    # [G, M, D]
        s = qg @ keys.transpose(1, 2, 0)                                # [G, M, pos+1]  scores
        s -= s.max(axis=-1, keepdims=True)
        self.xp.exp(s, out=s)
        o = s @ vals.transpose(1, 0, 2)                                 # [G, M, D]
        o /= s.sum(axis=-1, keepdims=True)
        return o.reshape(1, H * D)

    def blocked(self, q, keys, vals, pos, window=0):
        """Causal attention of prompt rows q `[T, H, D]` (pre-scaled) at positions pos.. over
        keys/values `[n, G, D]` (n: at least the end of the last row's block). Returns `[T, H*D]`.
        With a sliding `window` the row at position p sees keys max(0, p - window + 1)..p only.

        Rows are taken in blocks aligned to multiples of ATTN_BLOCK; every row of a block reads the
        keys up to the block's end (from the first key the block's window reaches), the ones it
        must not see masked. So a row's numbers depend on its position only, not on which other
        rows came in the same call (see `Transformer.rows_exact`)."""
        xp = self.xp
        T, H, D = q.shape
        G = keys.shape[1]
        M = H // G                                                      # query heads per KV head
        qg = q.reshape(T, G, M, D).transpose(1, 0, 2, 3).reshape(G, T * M, D)   # rows: (t, m)
        kt = keys.transpose(1, 2, 0)                                    # [G, D, n]
        vg = vals.transpose(1, 0, 2)                                    # [G, n, D]
        out = xp.empty((G, T * M, D), dtype=q.dtype)
        # PERF(attention): a block skips the keys after it, the causal mask touches only the block's
        # diagonal square, and the softmax divides the [rows, D] result, not the scores.
        first = pos - pos % ATTN_BLOCK
        for start in range(first, pos + T, ATTN_BLOCK):
            r0, r1 = max(start, pos) - pos, min(start + ATTN_BLOCK, pos + T) - pos   # rows in this call
            n = min(start + ATTN_BLOCK, keys.shape[0])                  # keys read by this block
            lo = max(0, start - window + 1) if window else 0            # from the block's first window
            s = rows_matmul(qg[:, r0 * M:r1 * M], kt[:, :, lo:n], xp)   # [G, rows, n - lo]  scores
            i0 = pos + r0 - start                                       # first row's place in the block
            if window:
                s += self._window_mask(pos + r0, r1 - r0, lo, n, window, M)
            else:
                s[:, :, start:n] += self._causal_mask(ATTN_BLOCK, M)[i0 * M:(i0 + r1 - r0) * M, :n - start]
            s -= s.max(axis=-1, keepdims=True)
            xp.exp(s, out=s)
            o = rows_matmul(s, vg[:, lo:n], xp)                         # [G, rows, D]
            o /= s.sum(axis=-1, keepdims=True)
            out[:, r0 * M:r1 * M] = o
        return out.reshape(G, T, M, D).transpose(1, 0, 2, 3).reshape(T, H * D)

    def row_cases(self, cfg, rng):
        """The products `blocked` runs through rows_matmul, on random operands of `cfg`'s head
        shapes, for the row-exactness probe; none where the kernel (exact by construction) runs."""
        if self.kernel:
            return []
        G, M, D, n = cfg.n_kv_head, cfg.n_head // cfg.n_kv_head, cfg.head_dim, 2 * ATTN_BLOCK + 5
        return [(rng.standard_normal((G, ATTN_BLOCK * M, D), dtype=np.float32),
                 rng.standard_normal((G, n, D), dtype=np.float32).transpose(0, 2, 1)),
                (rng.random((G, ATTN_BLOCK * M, n), dtype=np.float32), rng.standard_normal((G, n, D), dtype=np.float32))]

    def _causal_mask(self, t, m):
        """[t*m, t] additive mask: row (i, head) sees block keys j <= i."""
        if (t, m) not in self._masks:
            i = np.repeat(np.arange(t), m)[:, None]
            mask = np.where(np.arange(t)[None, :] > i, -np.inf, 0.0).astype(np.float32)
            self._masks[(t, m)] = self.xp.asarray(mask)
        return self._masks[(t, m)]

    def _window_mask(self, p0, rows, lo, n, window, m):
        """[rows*m, n-lo] additive mask for rows at positions p0.. (each repeated for m heads) over
        keys lo..n-1: row p sees keys p - window < j <= p. A view into one band per (window, m)."""
        # NOTE(window-mask): whether row r sees key column c depends on c - r only. The band
        # [ATTN_BLOCK*m, a + ATTN_BLOCK] masks c - r > a and c - r <= a - window, and this call's
        # mask is its columns from a - (p0 - lo): they fit, as a block reads keys at most to its
        # own end (n - p0 <= ATTN_BLOCK). `a` grows (doubling) as positions move further from lo.
        d = p0 - lo
        band = self._masks.get(("window", window, m))
        if band is None or band.shape[1] - ATTN_BLOCK < d:
            a = max(d, ATTN_BLOCK if band is None else 2 * (band.shape[1] - ATTN_BLOCK))
            r = np.repeat(np.arange(ATTN_BLOCK), m)[:, None]
            c = np.arange(a + ATTN_BLOCK)[None, :]
            band = np.where((c - r > a) | (c - r <= a - window), np.float32(-np.inf), np.float32(0.0))
            band = self._masks[("window", window, m)] = self.xp.asarray(band.astype(np.float32))
        shift = band.shape[1] - ATTN_BLOCK - d
        return band[:rows * m, shift:shift + n - lo]


class RotaryTables:
    """The rotary embedding's cos/sin tables on the device, grown (doubling) when positions outrun
    them: kind 0 for global layers, kind 1 for local (sliding-window) layers where they have their
    own base (Gemma 3). `layer_kind[i]`: the kind layer i reads."""

    def __init__(self, cfg, freq_factors, xp):
        self.xp = xp
        self.inv_freq = rope_inv_freq(cfg, freq_factors)              # host float64 [rope_dim / 2]
        self.inv_freqs = [self.inv_freq] + ([rope_inv_freq(cfg, theta=cfg.rope_local_theta)]
                                            if cfg.rope_local_theta else [])
        self.layer_kind = [int(i in cfg.local_layers and len(self.inv_freqs) > 1) for i in range(cfg.n_layer)]
        self._tables = {}
        self.table(min(cfg.max_seq_len, 4096))                         # grows on demand

    def table(self, n, kind=0):
        """cos/sin `[>=n, 1, rope_dim/2]` on the device for table `kind` (0 global, 1 local)."""
        have = self._tables.get(kind)
        if have is None or have[0].shape[0] < n:
            size = max(n, 2 * (0 if have is None else have[0].shape[0]))
            angles = np.arange(size, dtype=np.float64)[:, None] * self.inv_freqs[kind][None, :]
            self._tables[kind] = (self.xp.asarray(np.cos(angles).astype(np.float32)[:, None, :]),
                                  self.xp.asarray(np.sin(angles).astype(np.float32)[:, None, :]))
        return self._tables[kind]

    def layers(self, n, rows=None):
        """Each layer's cos/sin pair from tables of at least n positions: whole, or their `rows`
        (a slice or an index array) -> `[rows, 1, rope_dim/2]` x2."""
        kinds = [self.table(n, k) for k in range(len(self.inv_freqs))]
        if rows is not None:
            kinds = [(cos[rows], sin[rows]) for cos, sin in kinds]
        return [kinds[k] for k in self.layer_kind]


def rope(x, cos, sin, rot, xp):
    """Rotary embedding, Hugging Face layout: the pairs are (i, i + rot/2) of the first `rot` dims
    of each head. x: [T, heads, D] (any strides); cos, sin: [T, 1, rot/2]. Returns a new array."""
    half = rot // 2
    x1, x2 = x[..., :half], x[..., half:rot]
    out = xp.empty(x.shape, dtype=x.dtype)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rot] = x2 * cos + x1 * sin
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out


def rope_inv_freq(cfg, freq_factors=None, theta=None):
    """Rotary inverse frequencies (float64, [rope_dim/2]) with the config's scaling applied;
    `freq_factors` (GGUF rope_freqs) divide them when present. `theta`: a local layers' own base,
    which is never scaled (Gemma 3)."""
    dim = cfg.rope_dim
    inv = 1.0 / (theta or cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = {} if theta else cfg.rope_scaling or {}
    kind = scaling.get("type", "")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3_inv_freq(inv, scaling)
    elif kind:
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    return inv


def _llama3_inv_freq(inv, s):
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    orig = float(s["original_max_position_embeddings"])
    wavelen = 2 * np.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelen > orig / low, inv / factor, inv)             # long waves: scaled
    return np.where((wavelen <= orig / low) & (wavelen >= orig / high), mid, out)

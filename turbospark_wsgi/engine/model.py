"""The transformer forward pass (llama family), written against an array module `xp`."""
import numpy as np

from .backend import to_host
from .kv_cache import KVCache

ATTN_BLOCK = 128   # query rows per attention block in prefill (keys beyond the block's end are skipped)


class Transformer:
    """A decoder-only transformer: RMSNorm, rotary attention with GQA, SwiGLU, tied or separate head."""

    def __init__(self, cfg, weights, xp):
        self.cfg, self.w, self.xp = cfg, weights, xp
        self.inv_freq = rope_inv_freq(cfg, weights.rope_freqs)    # host float64 [rope_dim / 2]
        self._cos = self._sin = None
        self._masks = {}
        self._rope_table(min(cfg.max_seq_len, 4096))                   # grows on demand

    def new_cache(self, max_seq=None):
        """An empty KVCache for up to `max_seq` positions (default: the model's context length)."""
        c = self.cfg
        return KVCache(c.n_layer, max_seq or c.max_seq_len, c.n_kv_head, c.head_dim, self.xp)

    def forward(self, tokens, cache, logits="last"):
        """Runs `tokens` (ids) at positions cache.length.. and advances cache.length by len(tokens).
        Returns host float32 logits: "last" -> [vocab], "all" -> [T, vocab], "none" -> None."""
        c, w, xp = self.cfg, self.w, self.xp
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T, pos, H, G = len(ids), cache.length, c.n_head, c.n_kv_head
        if logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
        if T == 0 or pos + T > cache.max_seq:
            raise ValueError(f"cannot run {T} tokens at position {pos} with a cache of {cache.max_seq}")
        cos, sin = self._rope_table(pos + T)
        cos, sin = cos[pos:pos + T], sin[pos:pos + T]                   # [T, 1, rope_dim/2]
        x = self._embed(ids)                                            # [T, dim]
        for i, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, c.norm_eps, xp)               # [T, dim]
            qkv = (h @ lw.wqkv).reshape(T, H + 2 * G, c.head_dim)       # [T, H+2G, D]  q|k|v heads
            qk = rope(qkv[:, :H + G], cos, sin, c.rope_dim, xp)         # [T, H+G, D]  rotated q and k
            keys, vals = cache.update(i, pos, qk[:, H:], qkv[:, H + G:])  # [pos+T, G, D] each
            att = self._attention(qk[:, :H], keys, vals, pos)           # [T, H*D]
            x += att @ lw.wo                                            # [T, dim]  residual
            h = rms_norm(x, lw.ffn_norm, c.norm_eps, xp)                # [T, dim]
            x += swiglu(h @ lw.w_gate_up, c.ffn_dim, xp) @ lw.w_down    # [T, dim]  residual
        cache.length = pos + T
        if logits == "none":
            return None
        x = x[-1:] if logits == "last" else x                           # [1 or T, dim]
        out = to_host(rms_norm(x, w.norm, c.norm_eps, xp) @ w.head)     # [1 or T, vocab]
        return out[0] if logits == "last" else out

    def decode_batch(self, tokens, caches):
        """One decode step for B sequences: token b runs at position caches[b].length of its own
        cache, which advances by one. Returns host float32 logits [B, vocab].

        NOTE(exact-batching): every matmul is a stack of B single-row products and attention runs
        per sequence, so row b is bit-for-bit what a batch of one computes: batching never changes
        a sequence's output."""
        c, w, xp = self.cfg, self.w, self.xp
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        B, H, G, D = len(ids), c.n_head, c.n_kv_head, c.head_dim
        pos = [cache.length for cache in caches]
        cos, sin = self._rope_table(max(pos) + 1)
        at = xp.asarray(np.asarray(pos, dtype=np.int64))
        cos, sin = cos[at], sin[at]                                     # [B, 1, rope_dim/2]
        x = self._embed(ids)[:, None, :]                                # [B, 1, dim]
        for i, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, c.norm_eps, xp)               # [B, 1, dim]
            qkv = (h @ lw.wqkv).reshape(B, H + 2 * G, D)                # [B, H+2G, D]  q|k|v heads
            qk = rope(qkv[:, :H + G], cos, sin, c.rope_dim, xp)         # [B, H+G, D]
            att = xp.empty((B, 1, H * D), dtype=x.dtype)                # [B, 1, H*D]
            for b, cache in enumerate(caches):
                keys, vals = cache.update(i, pos[b], qk[b:b + 1, H:], qkv[b:b + 1, H + G:])
                att[b] = self._attention(qk[b:b + 1, :H], keys, vals, pos[b])
            x += att @ lw.wo                                            # [B, 1, dim]  residual
            h = rms_norm(x, lw.ffn_norm, c.norm_eps, xp)                # [B, 1, dim]
            x += swiglu(h @ lw.w_gate_up, c.ffn_dim, xp) @ lw.w_down    # [B, 1, dim]  residual
        for b, cache in enumerate(caches):
            cache.length = pos[b] + 1
        return to_host(rms_norm(x, w.norm, c.norm_eps, xp) @ w.head)[:, 0]   # [B, vocab]

    def _embed(self, ids):
        w, xp = self.w, self.xp
        ids = xp.asarray(ids)
        if w.tok_embd is not None:
            return w.tok_embd[ids]                                      # [T, dim]
        return xp.ascontiguousarray(w.head[:, ids].T)                   # tied: columns of the head

    def _attention(self, q, keys, vals, pos):
        """Causal attention of q `[T, H, D]` (pre-scaled) at positions pos.. over keys/values
        `[pos+T, G, D]`. Query head h reads KV head h // kv_mul. Returns `[T, H*D]`."""
        xp = self.xp
        T, H, D = q.shape
        G = keys.shape[1]
        M = H // G                                                      # query heads per KV head
        qg = q.reshape(T, G, M, D).transpose(1, 0, 2, 3).reshape(G, T * M, D)   # rows: (t, m)
        kt = keys.transpose(1, 2, 0)                                    # [G, D, pos+T]
        vg = vals.transpose(1, 0, 2)                                    # [G, pos+T, D]
        out = xp.empty((G, T * M, D), dtype=q.dtype)
        # PERF(attention): query blocks skip the keys after the block, the causal mask touches only
        # the block's diagonal square, and the softmax divides the [rows, D] result, not the scores.
        for b0 in range(0, T, ATTN_BLOCK):
            b1 = min(T, b0 + ATTN_BLOCK)
            n = pos + b1                                                # keys visible in this block
            s = qg[:, b0 * M:b1 * M] @ kt[:, :, :n]                     # [G, rows, n]  scores
            if b1 - b0 > 1:
                s[:, :, pos + b0:n] += self._causal_mask(b1 - b0, M)    # -inf above the diagonal
            s -= s.max(axis=-1, keepdims=True)
            xp.exp(s, out=s)
            o = s @ vg[:, :n]                                           # [G, rows, D]
            o /= s.sum(axis=-1, keepdims=True)
            out[:, b0 * M:b1 * M] = o
        return out.reshape(G, T, M, D).transpose(1, 0, 2, 3).reshape(T, H * D)

    def _causal_mask(self, t, m):
        """[t*m, t] additive mask: row (i, head) sees block keys j <= i."""
        if (t, m) not in self._masks:
            i = np.repeat(np.arange(t), m)[:, None]
            mask = np.where(np.arange(t)[None, :] > i, -np.inf, 0.0).astype(np.float32)
            self._masks[(t, m)] = self.xp.asarray(mask)
        return self._masks[(t, m)]

    def _rope_table(self, n):
        """cos/sin `[n, 1, rope_dim/2]` on the device, grown (doubling) when positions outrun it."""
        if self._cos is None or self._cos.shape[0] < n:
            size = max(n, 2 * (0 if self._cos is None else self._cos.shape[0]))
            angles = np.arange(size, dtype=np.float64)[:, None] * self.inv_freq[None, :]
            self._cos = self.xp.asarray(np.cos(angles).astype(np.float32)[:, None, :])
            self._sin = self.xp.asarray(np.sin(angles).astype(np.float32)[:, None, :])
        return self._cos, self._sin


def rms_norm(x, weight, eps, xp):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis. x: [T, dim]."""
    # PERF(norm): in-place steps on the [T, 1] column; half the time of mean() + temporaries at T=1
    rms = xp.square(x).sum(axis=-1, keepdims=True)                     # [T, 1]
    rms *= 1.0 / x.shape[-1]
    rms += eps
    xp.sqrt(rms, out=rms)
    out = x / rms                                                      # [T, dim]
    out *= weight
    return out


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


def swiglu(gu, ffn_dim, xp):
    """silu(gate) * up for gu = [T, 2*ffn_dim] (gate | up). silu(g) = t * (1 + tanh(t)), t = g/2:
    the same function as g * sigmoid(g), without exp overflow for very negative g."""
    t = gu[..., :ffn_dim] * 0.5                                        # [T, F]
    a = xp.tanh(t)
    a += 1.0
    a *= t
    a *= gu[..., ffn_dim:]
    return a


def rope_inv_freq(cfg, freq_factors=None):
    """Rotary inverse frequencies (float64, [rope_dim/2]) with the config's scaling applied;
    `freq_factors` (GGUF rope_freqs) divide them when present."""
    dim = cfg.rope_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = cfg.rope_scaling or {}
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

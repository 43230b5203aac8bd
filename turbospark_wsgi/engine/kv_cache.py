"""The key/value cache of one sequence: preallocated, filled position by position."""
import numpy as np


class KVCache:
    """Keys and values `[n_layer, max_seq, n_kv_head, row]` for positions 0..length-1: a row is one
    KV head's head_dim values as float32 or float16, or (dtype int8) their q8_0 numbers (NOTE(kv-q8)).

    `update` writes one layer's new rows; the model advances `length` once all layers are written.
    `truncate(n)` keeps the first n positions, so a new prompt that shares a prefix reuses them.

    NOTE(memory): the buffers start at `INITIAL` positions and double as positions arrive (up to
    `max_seq`). Preallocating the whole context per sequence touched a huge page per layer for even
    a short sequence, and eight slots of an 8k-context model held ~2 GB for a few hundred tokens.
    """

    __slots__ = ("k", "v", "length", "max_seq", "xp")
    INITIAL = 256

    def __init__(self, n_layer, max_seq, n_kv_head, head_dim, xp, dtype="float32"):
        self.xp = xp
        self.max_seq = int(max_seq)
        shape = (n_layer, min(self.INITIAL, self.max_seq), n_kv_head, row_len(head_dim, dtype))
        self.k = xp.zeros(shape, dtype=dtype)
        self.v = xp.zeros(shape, dtype=dtype)
        self.length = 0

    @property
    def capacity(self):
        return self.k.shape[1]

    @property
    def nbytes(self):
        """The bytes both buffers hold now (all positions allocated, used or not)."""
        return self.k.nbytes + self.v.nbytes

    def _grow(self, end):
        size = min(self.max_seq, max(end, 2 * self.capacity))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self.xp.zeros((old.shape[0], size) + old.shape[2:], dtype=old.dtype)
            new[:, :self.length] = old[:, :self.length]
            setattr(self, name, new)

    def reset(self):
        """Forgets every position (the buffers stay allocated)."""
        self.length = 0

    def truncate(self, n):
        """Keeps positions 0..n-1; n may not exceed the current length."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def copy_prefix(self, other, n):
        """Holds `other`'s first n positions (a cache of the same shape and dtype) in place of its own."""
        self.reserve(n)
        self.k[:, :n] = other.k[:, :n]
        self.v[:, :n] = other.v[:, :n]
        self.length = n

    def reserve(self, end, n=0):
        """Makes the buffers hold positions up to `end` (and `n`); past max_seq raises ValueError."""
        if end > self.max_seq:
            raise ValueError(f"KV cache overflow: position {end - 1} does not fit in {self.max_seq}")
        if max(end, n) > self.capacity:
            self._grow(max(end, n))

    def update(self, layer, pos, k, v, span=0):
        """Stores k, v `[T, n_kv_head, head_dim]` at positions pos..pos+T-1 of `layer` and returns
        that layer's keys and values for positions 0..max(pos+T, span)-1 (views, `[n, n_kv_head,
        row]`: as the cache holds them). Positions past pos+T hold zeros or stale, finite values:
        callers mask them."""
        end = pos + k.shape[0]
        n = min(max(end, span), self.max_seq)
        self.reserve(end, n)
        if self.k.dtype == np.int8:
            k, v = quantize_q8(k), quantize_q8(v)
        self.k[layer, pos:end] = k
        self.v[layer, pos:end] = v
        return self.k[layer, :n], self.v[layer, :n]


def row_len(head_dim, dtype):
    """Elements of `dtype` in one KV row of head_dim values (int8: q8_0's, NOTE(kv-q8))."""
    if np.dtype(dtype) != np.int8:
        return head_dim
    if head_dim % 32:
        raise ValueError(f"a q8_0 KV cache takes heads of a multiple of 32 values, not {head_dim}")
    return head_dim + head_dim // 16


def quantize_q8(x):
    """float32 rows x `[..., D]` (D a multiple of 32) as q8_0 rows int8 `[..., D + D/16]`.

    NOTE(kv-q8): each 32 values keep a half-float scale, the half float nearest amax / 127, and
    q = rint(x / scale) (ties to even) held to +-127, 0 where the scale is 0; the row is the D values
    q, then the D/32 scales' bits: 34 bytes for 32 values (GGUF's q8_0 block, the format of
    llama.cpp's -ctk/-ctv q8_0, 53% of a float16 cache). Value d reads back as q[d] * scale[d // 32],
    exact in float32, so attention over these rows computes what it computes over float32 rows of
    those values, bit for bit. The C kernels (native.c ts_quantize_kv) and numba's
    (attention.quantize_q8) write the same bits as this. llama.cpp multiplies by 1/scale and rounds
    ties away from zero: a value may land one step apart there."""
    x = np.asarray(x, np.float32)
    D = x.shape[-1]
    blocks = x.reshape(x.shape[:-1] + (D // 32, 32))
    amax = np.abs(blocks).max(axis=-1)
    scale = np.minimum(amax / np.float32(127), np.float32(65504)).astype(np.float16)
    d = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.rint(blocks / np.where(d > 0, d, 1)), 0)
    out = np.empty(x.shape[:-1] + (D + D // 16,), np.int8)
    out[..., :D] = np.clip(q, -127, 127).astype(np.int8).reshape(x.shape)
    out[..., D:] = scale.view(np.int8).reshape(x.shape[:-1] + (D // 16,))
    return out


def dequantize_q8(rows):
    """q8_0 rows int8 `[..., D + D/16]` -> their values float32 `[..., D]` (q * scale, exact)."""
    rows = np.asarray(rows, np.int8)
    D = rows.shape[-1] * 16 // 17
    scale = np.ascontiguousarray(rows[..., D:]).view(np.float16).astype(np.float32)
    return (rows[..., :D].astype(np.float32).reshape(rows.shape[:-1] + (D // 32, 32)) * scale[..., None]).reshape(
        rows.shape[:-1] + (D,))

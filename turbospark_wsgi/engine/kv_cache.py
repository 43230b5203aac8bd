"""The key/value cache of one sequence: preallocated, filled position by position."""


class KVCache:
    """Keys and values `[n_layer, max_seq, n_kv_head, head_dim]` for positions 0..length-1.

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
        shape = (n_layer, min(self.INITIAL, self.max_seq), n_kv_head, head_dim)
        self.k = xp.zeros(shape, dtype=dtype)
        self.v = xp.zeros(shape, dtype=dtype)
        self.length = 0

    @property
    def capacity(self):
        return self.k.shape[1]

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

    def reserve(self, end, n=0):
        """Makes the buffers hold positions up to `end` (and `n`); past max_seq raises ValueError."""
        if end > self.max_seq:
            raise ValueError(f"KV cache overflow: position {end - 1} does not fit in {self.max_seq}")
        if max(end, n) > self.capacity:
            self._grow(max(end, n))

    def update(self, layer, pos, k, v, span=0):
        """Stores k, v `[T, n_kv_head, head_dim]` at positions pos..pos+T-1 of `layer` and returns
        that layer's keys and values for positions 0..max(pos+T, span)-1 (views, `[n, n_kv_head,
        head_dim]`). Positions past pos+T hold zeros or stale, finite values: callers mask them."""
        end = pos + k.shape[0]
        n = min(max(end, span), self.max_seq)
        self.reserve(end, n)
        self.k[layer, pos:end] = k
        self.v[layer, pos:end] = v
        return self.k[layer, :n], self.v[layer, :n]

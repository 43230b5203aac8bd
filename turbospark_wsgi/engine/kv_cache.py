"""The key/value cache of one sequence: preallocated, filled position by position."""


class KVCache:
    """Keys and values `[n_layer, max_seq, n_kv_head, head_dim]` for positions 0..length-1.

    `update` writes one layer's new rows; the model advances `length` once all layers are written.
    `truncate(n)` keeps the first n positions, so a new prompt that shares a prefix reuses them.
    """

    __slots__ = ("k", "v", "length", "max_seq", "xp")

    def __init__(self, n_layer, max_seq, n_kv_head, head_dim, xp, dtype="float32"):
        self.xp = xp
        self.max_seq = int(max_seq)
        self.k = xp.zeros((n_layer, self.max_seq, n_kv_head, head_dim), dtype=dtype)
        self.v = xp.zeros((n_layer, self.max_seq, n_kv_head, head_dim), dtype=dtype)
        self.length = 0

    def reset(self):
        """Forgets every position (the buffers stay allocated)."""
        self.length = 0

    def truncate(self, n):
        """Keeps positions 0..n-1; n may not exceed the current length."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    def update(self, layer, pos, k, v):
        """Stores k, v `[T, n_kv_head, head_dim]` at positions pos..pos+T-1 of `layer` and returns
        that layer's keys and values for positions 0..pos+T-1 (views, `[pos+T, n_kv_head, head_dim]`)."""
        end = pos + k.shape[0]
        if end > self.max_seq:
            raise ValueError(f"KV cache overflow: position {end - 1} does not fit in {self.max_seq}")
        self.k[layer, pos:end] = k
        self.v[layer, pos:end] = v
        return self.k[layer, :end], self.v[layer, :end]

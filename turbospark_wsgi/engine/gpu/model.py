"""The transformer of engine/model.py for weights from gpu/weights.py, a decode step's K/V stores and
attention on the kernels: every other step is the model's own `xp` code."""
import numpy as np

from .. import yielding
from ..model import Transformer, rms_norm, rope
from .weights import load_device_weights


class DeviceTransformer(Transformer):
    """engine.model.Transformer on `kernels.xp` (CuPy on a GPU, numpy for the host build).

    A decode step stores every sequence's new K/V and runs every sequence's attention over its own
    cache as one launch each per layer (the base class loops over the sequences in Python).

    PERF(prefill-attention): prompts keep the model's blockwise attention, batched GEMMs (cuBLAS on
    a GPU): the kernel gives each (row, head) one thread block walking the keys, about T^2/2 key
    visits in tiles, far slower than a GEMM for thousands of rows."""

    def __init__(self, cfg, weights, kernels):
        super().__init__(cfg, weights, kernels.xp)
        self.kernels = kernels

    # the CPU-only fused paths never run here, whatever the array module
    fused = False
    fused_attention = False
    rows_exact = False

    def _decode_layers(self, ids, pos, caches):
        """Token b at position pos[b] of caches[b] through every layer -> x `[B, 1, dim]`."""
        c, w, xp, kern = self.cfg, self.w, self.xp, self.kernels
        B, H, G = len(ids), c.n_head, c.n_kv_head
        for cache, p in zip(caches, pos):
            cache.reserve(p + 1)                        # before the addresses: growing moves the buffers
        table = kern.table([cache.k for cache in caches], [cache.v for cache in caches], pos,
                           [cache.k.strides[0] // 4 for cache in caches])
        at = xp.asarray(np.asarray(pos, dtype=np.int64))
        ropes = [tuple(t[at] for t in self._rope_table(max(pos) + 1, k))   # [B, 1, rope_dim/2] x2
                 for k in range(len(self._inv_freqs))]
        x = self._embed(ids)[:, None, :]                                # [B, 1, dim]
        for i, lw in enumerate(w.layers):
            yielding.point()
            h = rms_norm(x, lw.attn_norm, c.norm_eps, xp)               # [B, 1, dim]
            qkv = self._heads(h @ lw.wqkv, lw, B)                       # [B, H+2G, D]  q|k|v heads
            qk = rope(qkv[:, :H + G], *ropes[self._layer_rope[i]], c.rope_dim, xp)   # [B, H+G, D]
            kern.store(qk[:, H:], qkv[:, H + G:], table, i)
            att = kern.attend(qk[:, :H], table, G, self._layer_window[i], i)[:, None]   # [B, 1, H*D]
            x += self._post(att @ lw.wo, lw.post_attn_norm)             # [B, 1, dim]  residual
            h = rms_norm(x, lw.ffn_norm, c.norm_eps, xp)
            x += self._post(self._gate(h @ lw.w_gate_up) @ lw.w_down, lw.post_ffn_norm)
        return x


def load_device_model(cfg, source, kernels):
    """A DeviceTransformer of GGUF `source` with its weights in block form for `kernels`."""
    return DeviceTransformer(cfg, load_device_weights(cfg, source, kernels), kernels)

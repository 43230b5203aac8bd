"""The transformer of engine/model.py with its attention on the `attend` kernel, for weights from
gpu/weights.py: every other step is the model's own `xp` code."""
import numpy as np

from ..model import Transformer
from .weights import load_device_weights


class DeviceTransformer(Transformer):
    """engine.model.Transformer on `kernels.xp` (CuPy on a GPU, numpy for the host build), its
    attention over the KV cache on the kernels."""

    def __init__(self, cfg, weights, kernels):
        super().__init__(cfg, weights, kernels.xp)
        self.kernels = kernels

    # the CPU-only fused paths never run here, whatever the array module
    fused = False
    fused_attention = False
    rows_exact = False

    def _prompt_attention(self, q, keys, vals, pos, window):
        T = q.shape[0]
        return self._attend(q, [keys] * T, [vals] * T, np.arange(pos, pos + T), window)

    def _decode_attention(self, q, keys, vals, pos, window):
        return self._attend(q, [keys], [vals], [pos], window)

    def _attend(self, q, keys, vals, pos, window):
        """Rows of q `[R, H, D]` at positions `pos`, row r over keys[r] / vals[r] `[n, G, D]`."""
        k = self.kernels
        kv = [k.address(a) for a in keys] + [k.address(a) for a in vals]
        q = self.xp.ascontiguousarray(q, dtype=np.float32)
        return k.attend(q, kv, pos, keys[0].shape[1], window)


def load_device_model(cfg, source, kernels):
    """A DeviceTransformer of GGUF `source` with its weights in block form for `kernels`."""
    return DeviceTransformer(cfg, load_device_weights(cfg, source, kernels), kernels)

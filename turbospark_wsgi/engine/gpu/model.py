"""The transformer of engine/model.py for weights from gpu/weights.py, its decode attention on the
`attend` kernel: every other step is the model's own `xp` code."""
import numpy as np

from ..model import Transformer
from .weights import load_device_weights


class DeviceTransformer(Transformer):
    """engine.model.Transformer on `kernels.xp` (CuPy on a GPU, numpy for the host build), a decode
    row's attention over its KV cache on the kernel.

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

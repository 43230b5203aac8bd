"""The transformer of engine/model.py for weights from gpu/weights.py, a decode step's K/V stores and
attention on the kernels: every other step is the model's own `xp` code."""
from ..model import Transformer
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
        # PERF(gpu-launches): a decode step is bound by launches, not bytes (README "GPU": 1.3% of
        # the bandwidth bound, the products 1.1 ms of 11.5): each norm is one kernel instead of
        # seven array ops, each gate one instead of five, rotary one (and a copy) instead of eight
        self.layers.norm = kernels.rms_norm
        self.layers.gate = kernels.gate
        self.layers.rope = kernels.rope

    # the CPU-only fused attention never runs here, whatever the array module; the layers are the
    # "device" variant (layer_variants.py), chosen because `kernels` is set
    fused_attention = False
    rows_exact = False

    def _decode_state(self, pos, caches):
        """The kernels' table of every row's K/V buffers and position (after growing them: growing
        moves the buffers)."""
        for cache, p in zip(caches, pos):
            cache.reserve(p + 1)
        return self.kernels.table([cache.k for cache in caches], [cache.v for cache in caches], pos,
                                  [cache.k.strides[0] // 4 for cache in caches])

    def _decode_attend(self, i, qk, qkv, pos, caches, table):
        """Layer i's K/V stores for every row as one launch, and every row's attention as another."""
        H, G = self.cfg.n_head, self.cfg.n_kv_head
        self.kernels.store(qk[:, H:], qkv[:, H + G:], table, i)
        return self.kernels.attend(qk[:, :H], table, G, self._layer_window[i], i)[:, None]   # [B, 1, H*D]


def load_device_model(cfg, source, kernels):
    """A DeviceTransformer of GGUF `source` with its weights in block form for `kernels`."""
    return DeviceTransformer(cfg, load_device_weights(cfg, source, kernels), kernels)

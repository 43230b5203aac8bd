"""Which code runs a model's decoder layers: the specification or one of its variants, chosen here.

The specification is `model.DecoderLayers.run`: one layer written once, top to bottom, in the array
module (RMSNorm, q|k|v heads, rotary, attention, the output projection, the gated MLP, residuals).
Every other way of running the layers is a variant of it, registered in VARIANTS below with what
it must equal; tests/engine/test_layer_variants.py runs every registered variant this machine can
run against what it names, so a variant added here without passing that check fails the suite.

`choose(model)` picks, at every forward call, the first variant in VARIANTS that runs the model
(embeddings switch a generation model to float32 activations for one call: kernels/cpu.py
`activations_as`, so the choice is not fixed at load). The Transformer asks nothing else.

Contracts (`Variant.equals`, `Variant.within`):
- "int8": the integer dots are exact, the float steps round differently (vector width, fused
  exp/tanh), which can tip an activation's int8 rounding: nine rows in ten equal to float32 noise,
  none off by more than 2% of the largest value (test_kernels_layer.assert_fused_follows_step_by_step).
- "float": the same float32 arithmetic in another order: within 1e-4 of the largest logit.
- "bits": the specification itself.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import yielding
from .kernels import attention as kernels_attention, cpu as kernels_cpu, layer as kernels_layer


@dataclass(frozen=True)
class Variant:
    name: str
    runs: Callable          # runs(model) -> bool: this variant runs the model's next call
    equals: str             # the variant (or "spec") it is tested against
    within: str             # the contract: "int8", "float" or "bits"
    where: str              # the code, for a reader
    run: Callable = None    # the fused variants' layer loop (model._fused_layers), else DecoderLayers.run

    @property
    def fused(self):
        """One kernel call per layer."""
        return self.run is not None


def fusable(model):
    """Whether the model's layers can run as one CPU kernel call each: numpy backend, int8
    activations, every product's parts on the int8 kernels, and the plan's switch on."""
    if model.kernels is not None or model.xp is not np:
        return False
    if not (model.plan.fused and (kernels_cpu.ACTIVATIONS or model.plan.activations) == "int8"):
        return False
    if model._layer_args is None:
        args = [kernels_layer.layer_args(model.cfg, lw) for lw in model.w.layers]
        model._layer_args = False if None in args else args
    return model._layer_args is not False


def native_layers(model, x, seq, at, kv, elem, ropes):
    """The "native" variant: every layer one C call (kernels/native.c ts_layer), on the layers' C
    views of their weights (made on first use)."""
    lib = model.native
    if model._native_layers is None:
        model._native_layers = [lib.layer_weights(args, model.cfg.dim) for args in model._layer_args]
    kind, threads = kernels_attention.kind(elem), kernels_cpu.thread_count()
    for i, lw in enumerate(model._native_layers):
        yielding.point()                                                # NOTE(front-door): see yielding.py
        cos, sin = ropes[i]
        lib.layer(lw, x, seq, at, kv, kind, i, model.layer_window(i), cos, sin, threads)
    return x


def numba_layers(model, x, seq, at, kv, elem, ropes):
    """The "numba" variant: every layer one call of numba's kernel (kernels/layer.py), on its
    arguments (made on first use)."""
    if model._numba_args is None:
        model._numba_args = [kernels_layer.numba_args(args) for args in model._layer_args]
    layer = kernels_layer.LAYER[model.plan.isa]
    for i, args in enumerate(model._numba_args):
        yielding.point()                                                # NOTE(front-door): see yielding.py
        layer(x, seq, at, kv, elem, i, model.layer_window(i), *ropes[i], *args)
    return x


def warm_numba(model):
    """Compiles (or loads from numba's cache) numba's layer kernel: one token through the first
    layer into a scratch cache, outside any forward pass (so no yielding gate is asked)."""
    one, cache = np.zeros(1, np.int64), model.new_cache(1)
    kernels_layer.LAYER[model.plan.isa](model._embed(one), one, one, *kernels_layer.addresses([cache]), 0,
                                        model.layer_window(0), *model.rotary.layers(1)[0],
                                        *kernels_layer.numba_args(model._layer_args[0]))


VARIANTS = (
    Variant("native", lambda m: fusable(m) and m.native is not None, "spec", "int8",
            "kernels/native.c ts_layer", native_layers),
    Variant("numba", lambda m: fusable(m) and m.native is None, "spec", "int8", "kernels/layer.py layer",
            numba_layers),
    Variant("device", lambda m: m.kernels is not None, "spec", "float",
            "the specification's steps with gpu/launch.py kernels for norms, gates, rotary, decode "
            "K/V stores and attention (gpu/model.py DeviceTransformer)"),
    Variant("spec", lambda m: True, "spec", "bits", "model.DecoderLayers.run on the array module"),
)


def choose(model):
    """The Variant that runs `model`'s next call: the first in VARIANTS whose `runs` holds."""
    return next(v for v in VARIANTS if v.runs(model))


def by_name(name):
    return next(v for v in VARIANTS if v.name == name)

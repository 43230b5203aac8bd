"""Every layer variant registered in engine/layer_variants.py against what it names (the specification,
model.DecoderLayers.run), under its contract, on every model kind here that it runs: a variant added
to the registry without a way to run it here fails instead of passing unchecked."""
import shutil

import numpy as np
import pytest

from turbospark_wsgi.engine import layer_variants
from turbospark_wsgi.engine.gguf import GGUFFile
from turbospark_wsgi.engine.kernels import cpu as kernels_cpu, native
from turbospark_wsgi.engine.loader import load_model

pytest.importorskip("gguf")
from test_families import family_gguf  # noqa: E402
from test_gpu_model import assert_same_model  # noqa: E402
from test_kernels_layer import assert_fused_follows_step_by_step  # noqa: E402
from test_native_kernels import k_quant_llama  # noqa: E402

NAMES = [v.name for v in layer_variants.VARIANTS]


MODELS = {
    "llama Q8_0": lambda tiny_gguf, tmp_path: tiny_gguf(qtype="Q8_0").path,
    "llama Q4_0 tied": lambda tiny_gguf, tmp_path: tiny_gguf(qtype="Q4_0", tied=True).path,
    "llama Q4_K/Q6_K": lambda tiny_gguf, tmp_path: k_quant_llama(tiny_gguf),
    "gemma3 Q8_0": lambda tiny_gguf, tmp_path: family_gguf(tmp_path, "gemma3", "Q8_0")[0],
}


def _needs(name):
    """Skips where this machine cannot run variant `name`; an unknown name fails."""
    if name in ("native", "numba") and not kernels_cpu.AVAILABLE:
        pytest.skip("numba is absent")
    if name == "native" and native.compiler() is None:
        pytest.skip("no C compiler")
    if name == "device" and not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler for the host build of the device kernels")
    assert name in ("native", "numba", "device", "spec"), f"variant {name!r} has no check here: add one"


def check(name, path, monkeypatch):
    """Variant `name` on the GGUF at `path` against its `equals`, under its `within` contract."""
    variant = layer_variants.by_name(name)
    assert variant.equals == "spec"
    if name in ("native", "numba"):                     # int8: against the spec on the same int8 products
        monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "int8")
        model = load_model(path, device="cpu", kernels=name, activations="int8").model
        assert model.variant is variant and variant.within == "int8"
        assert_fused_follows_step_by_step(model, monkeypatch)
    elif name == "device":                              # float: against the spec on the same weights in f32
        from turbospark_wsgi.engine.gpu.launch import host_kernels
        from turbospark_wsgi.engine.gpu.model import load_device_model
        ref = load_model(path, device="cpu", weights="fp32")
        dev = load_device_model(ref.config, GGUFFile(str(path)), host_kernels())
        assert dev.variant is variant and ref.model.variant.name == "spec" and variant.within == "float"
        assert_same_model(ref.model, dev, prompt_len=40)
    else:                                               # the specification itself
        model = load_model(path, device="cpu", fused_layers=False).model
        assert model.variant is variant and not model.fused


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", NAMES)
def test_each_variant_equals_the_specification(name, kind, tiny_gguf, tmp_path, monkeypatch):
    _needs(name)
    check(name, MODELS[kind](tiny_gguf, tmp_path), monkeypatch)


@pytest.mark.parametrize("name", ["native", "numba"])
def test_a_layer_that_mixes_block_kinds_runs_fused(tiny_gguf, name):
    """NOTE(layer-parts): q|k in Q4_K and v in Q6_K (a Q4_K_M layer) are two parts of one product;
    the C and the numba layers run them, each in its own blocks (check() above: equal to the spec)."""
    _needs(name)
    model = load_model(k_quant_llama(tiny_gguf), device="cpu", kernels=name, activations="int8").model
    assert [len(ps) for ps in model._layer_args[0][-1]] == [2, 1, 1, 1]
    assert model.variant.name == name and model.new_cache(1).k.dtype == np.float16


def test_the_choice_follows_the_call(tiny_gguf, monkeypatch):
    """One place picks the variant, at each call: embeddings' float32 activations run the spec."""
    if not kernels_cpu.AVAILABLE:
        pytest.skip("numba is absent")
    model = load_model(tiny_gguf(qtype="Q8_0").path, device="cpu", activations="int8").model
    first = model.variant
    assert first.fused and first.name in ("native", "numba") and model.fused
    with kernels_cpu.activations_as("float32"):
        assert model.variant.name == "spec" and not model.fused
    assert model.variant is first


def test_every_variant_names_a_registered_reference_and_a_contract():
    for v in layer_variants.VARIANTS:
        assert v.equals in NAMES and v.within in ("int8", "float", "bits") and v.where
        assert v.fused == (v.name in ("native", "numba"))       # the CPU layer kernels alone
    assert NAMES[-1] == "spec" and layer_variants.VARIANTS[-1].runs(None)   # the spec runs whatever else does not

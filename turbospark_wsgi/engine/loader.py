"""load_model: a .gguf file or a Hugging Face directory -> config, weights on the device, Transformer."""
import os
from dataclasses import dataclass

from .backend import select_backend
from .config import ModelConfig
from . import layer_variants, packed
from .kernels import cpu as kernels_cpu, warm
from .gguf import GGUFFile, ggml_type_name, model_config_from_gguf
from .model import Transformer
from .model_json import read_object
from .options import apply, kernel_plan, resolve
from .safetensors_io import SafetensorsDir, model_config_from_hf
from .weights import layer_shapes, load_quantized_weights, load_weights, tensor_name

HF_JSON_FILES = ("config", "tokenizer_config", "generation_config")


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run. metadata: the GGUF key/values, or for a Hugging Face directory
    {"config": ..., "tokenizer_config": ..., "generation_config": ...} (None where a file is absent)."""

    config: ModelConfig
    model: Transformer
    metadata: dict
    kind: str            # "gguf" | "hf"
    path: str
    backend: str         # "numpy" | "cupy"
    backend_reason: str
    kernels: str = ""    # the CPU kernels it runs and why (KernelPlan.describe); "" on a GPU
    weights: str = ""    # how the block matrices are held: mapped from the weight cache, or why not


def load_model(path, options=None, **overrides):
    """Loads a .gguf file or a Hugging Face model directory as `options` (an EngineOptions; keyword
    `overrides` replace its fields, e.g. device="cpu") say: onto the backend chosen for `device`
    ("auto" | "cpu" | "cuda"), with `weights` "auto" | "quant" | "fp32" (auto keeps GGUF matrices
    quantized on the CPU when the block kernels are available, float32 otherwise). Unsupported
    architectures, tensor types, missing tensors and corrupt files raise ValueError naming them; a
    missing path raises FileNotFoundError. No message holds a directory path: they reach clients."""
    path = os.fspath(path)
    options = resolve(options, overrides)
    try:
        return _load(path, options)
    except OSError as e:
        if e.filename is None:
            raise
        raise _without_path(e) from e


def _load(path, options):
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model file or directory named {os.path.basename(path)!r}")
    apply(options)
    backend = select_backend(options.device)
    if os.path.isdir(path):
        kind, metadata, cfg, source = "hf", *_open_hf(path)
    else:
        kind, metadata, cfg, source = "gguf", *_open_gguf(path)
    _check_shapes(cfg, source, kind)
    plan = kernel_plan(options).for_heads(cfg.head_dim)
    if backend.kernels is not None and kind == "gguf" and options.weights != "fp32":
        from .gpu.model import load_device_model     # GGUF blocks on the device
        model, held = load_device_model(cfg, source, backend.kernels), ""
    elif _quantized(options.weights, kind, backend.name):
        weights, held = _packed_weights(cfg, source, plan, options.weight_cache)
        model = Transformer(cfg, weights, backend.xp, plan)
        kernels_cpu.limit_blas_threads(1)
    else:
        model, held = Transformer(cfg, load_weights(cfg, source, kind, backend.xp), backend.xp, plan), ""
    if getattr(model, "native", None) is not None:
        _first_pass(model)          # the C kernels were built with the plan
    elif model.fused_attention:
        # NOTE(cold-start): the numba kernels compile (or load from numba's cache) here, so a server
        # says it is ready only once its first request runs at full speed; once per machine, the
        # float kernels in a second process (kernels/warm.py).
        with warm.compiling(plan.isa):
            kernels_cpu.warmup(plan.isa, groups=("int8",))
            if model.variant.name == "numba":
                layer_variants.warm_numba(model)
        kernels_cpu.warmup(plan.isa, groups=("float",))
    return LoadedModel(cfg, model, metadata, kind, path, backend.name, backend.reason,
                       plan.describe() if backend.name == "numpy" else "", held)


def _packed_weights(cfg, source, plan, directory):
    """(Weights, how they are held): the block matrices mapped from the weight cache `directory`
    where it has them, written there where it does not (engine/packed.py), else built here."""
    store = packed.store(directory, source, plan.activations)
    try:
        weights = load_quantized_weights(cfg, source, plan, store)
    except BaseException:
        store.abort()
        raise
    return weights, store.finish()


def _first_pass(model):
    """One token through every layer and the head into a scratch cache, so that the kernel threads
    start, the weights are paged in and the C views of every weight are made before the server says
    it is ready (NOTE(cold-start)): a first request right after a cold start took 0.2-0.9 s where a
    warm one took 0.14-0.22 s (tools/cold_start.py, the avx2 build on Zen 4)."""
    model.forward([0], model.new_cache(1), logits="last")


def weight_storage(path):
    """How the CPU engine holds a GGUF file's tensors, by type: "kept quantized: Q4_K x27, ...",
    "float32: F32 x108" (stored so), "dequantized to float32: Q5_K x9" (types without a block
    kernel, and every matrix when numba is missing). "" for a directory or an unreadable file."""
    from . import quant
    try:
        tensors = GGUFFile(path).tensors.values() if os.path.isfile(path) else ()
    except (OSError, ValueError):
        return ""
    groups = {}
    for info in tensors:
        name = ggml_type_name(info.ggml_type)
        if kernels_cpu.AVAILABLE and quant.supported(info.ggml_type, info.shape):
            where = "kept quantized"
        else:
            where = "float32" if name == "F32" else "dequantized to float32"
        counts = groups.setdefault(where, {})
        counts[name] = counts.get(name, 0) + 1
    order = ("kept quantized", "dequantized to float32", "float32")
    return "; ".join(f"{where}: " + ", ".join(f"{t} x{n}" for t, n in sorted(groups[where].items()))
                     for where in order if where in groups)


def _without_path(e):
    """The same OSError naming only the file's base name: open() puts the whole path in its message."""
    text = f"{e.strerror or 'cannot read'}: {os.path.basename(os.fspath(e.filename))!r}"
    try:
        return type(e)(e.errno, text) if e.errno is not None else type(e)(text)
    except TypeError:   # an OSError subclass with its own constructor
        return OSError(e.errno, text)


def _quantized(choice, kind, backend):
    if choice == "fp32" or kind != "gguf" or backend != "numpy":
        return False
    from .kernels import cpu as kernels_cpu
    if choice == "quant" and not kernels_cpu.AVAILABLE:
        raise ValueError("quantized weights need numba (pip install numba)")
    return kernels_cpu.AVAILABLE


def _open_gguf(path):
    source = GGUFFile(path)
    cfg = model_config_from_gguf(source.metadata)
    cfg.tied_embeddings = tensor_name("head", "gguf") not in source.names
    return source.metadata, cfg, source


def _open_hf(directory):
    metadata = {name: _read_json(directory, name + ".json") for name in HF_JSON_FILES}
    if metadata["config"] is None:
        raise FileNotFoundError("the model directory has no config.json")
    return metadata, model_config_from_hf(metadata["config"]), SafetensorsDir(directory)


def _read_json(directory, name):
    """A JSON object from `directory`/`name`, None when the file is absent."""
    return read_object(os.path.join(directory, name), name)


def _check_shapes(cfg, source, kind):
    """Every tensor the model uses has the shape its config implies, checked before any is read,
    so a corrupt dimension or config value is a clear error rather than a failed reshape or a
    huge allocation later. A missing layer tensor is named at once (the layer count may be corrupt)."""
    model = {"tok_embd": (cfg.vocab_size, cfg.dim), "head": (cfg.vocab_size, cfg.dim), "norm": (cfg.dim,),
             "rope_freqs": (cfg.rope_dim // 2,)}
    layer = layer_shapes(cfg)   # the architecture's fused or separate matrices
    for ours, want in model.items():
        _check_shape(source, tensor_name(ours, kind), want, required=False)
    for i in range(cfg.n_layer):
        for ours, want in layer.items():
            _check_shape(source, tensor_name(ours, kind, i), want, required=True, layer=i)


def _check_shape(source, name, want, required, layer=None):
    if name is None or name not in source.names:
        if required:
            raise ValueError(f"model file lacks tensor {name!r} (layer {layer})")
        return   # optional, or named by weights.fetch when it is needed
    got = tuple(source.shape(name))
    if got != want:
        raise ValueError(f"tensor {name!r} has shape {got}, the model's config implies {want}")

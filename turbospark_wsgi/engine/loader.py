"""load_model: a .gguf file or a Hugging Face directory -> config, weights on the device, Transformer."""
import json
import os
from dataclasses import dataclass

from .backend import select_backend
from .config import ModelConfig
from .gguf import GGUFFile, model_config_from_gguf
from .model import Transformer
from .safetensors_io import SafetensorsDir, model_config_from_hf
from .weights import load_quantized_weights, load_weights, tensor_name

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


def load_model(path, device="auto", weights=None):
    """Loads a .gguf file or a Hugging Face model directory onto the backend chosen for `device`
    ("auto" | "cpu" | "cuda"). Unsupported architectures, tensor types and missing tensors raise
    ValueError naming them; a missing path raises FileNotFoundError. `weights` ("auto" | "quant" |
    "fp32", default TURBOSPARK_WEIGHTS or auto): auto keeps GGUF matrices quantized on the CPU when
    the block kernels are available, float32 otherwise."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model at {path}")
    backend = select_backend(device)
    if os.path.isdir(path):
        kind, metadata, cfg, source = "hf", *_open_hf(path)
    else:
        kind, metadata, cfg, source = "gguf", *_open_gguf(path)
    if _quantized(weights, kind, backend.name):
        tensors = load_quantized_weights(cfg, source)
    else:
        tensors = load_weights(cfg, source, kind, backend.xp)
    model = Transformer(cfg, tensors, backend.xp)
    return LoadedModel(cfg, model, metadata, kind, path, backend.name, backend.reason)


def _quantized(choice, kind, backend):
    choice = choice or os.environ.get("TURBOSPARK_WEIGHTS", "auto")
    if choice not in ("auto", "quant", "fp32"):
        raise ValueError(f"weights must be auto, quant or fp32, not {choice!r}")
    if choice == "fp32" or kind != "gguf" or backend != "numpy":
        return False
    from . import kernels_cpu
    if choice == "quant" and not kernels_cpu.AVAILABLE:
        raise ValueError("quantized weights need numba (pip install numba)")
    return kernels_cpu.AVAILABLE


def _open_gguf(path):
    source = GGUFFile(path)
    cfg = model_config_from_gguf(source.metadata)
    cfg.tied_embeddings = tensor_name("head", "gguf") not in source.names
    return source.metadata, cfg, source


def _open_hf(directory):
    metadata = {name: _read_json(os.path.join(directory, name + ".json")) for name in HF_JSON_FILES}
    if metadata["config"] is None:
        raise FileNotFoundError(f"{directory} has no config.json")
    return metadata, model_config_from_hf(metadata["config"]), SafetensorsDir(directory)


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)

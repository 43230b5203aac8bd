"""Hugging Face model directories: safetensors tensors (JSON header + memory map) and config.json."""
import json
import os
import struct

import numpy as np

from .config import ModelConfig
from .gguf import widen_bf16

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama"}
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFormatError(ValueError):
    pass


class SafetensorsFile:
    """One .safetensors file: the tensor table from its JSON header, data memory-mapped."""

    def __init__(self, path):
        self.path = str(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsFormatError(f"{self.path}: truncated safetensors file (no header)")
            n = struct.unpack("<Q", head)[0]
            raw = f.read(n)
        if len(raw) != n:
            raise SafetensorsFormatError(f"{self.path}: truncated safetensors file (header ends early)")
        try:
            header = json.loads(raw)
        except ValueError as exc:
            raise SafetensorsFormatError(f"{self.path}: bad safetensors header ({exc})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.tensors = header
        for name, entry in header.items():
            if self.data_start + entry["data_offsets"][1] > size:
                raise SafetensorsFormatError(f"{self.path}: truncated safetensors file (tensor {name!r})")
        self._map = None

    @property
    def names(self):
        return self.tensors.keys()

    def tensor(self, name):
        """The tensor as a new float32 array (F32, F16 or BF16 stored)."""
        entry = self.tensors[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported safetensors dtype {entry['dtype']}")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        data = self._map[self.data_start + begin:self.data_start + end].view(dtype).reshape(entry["shape"])
        if entry["dtype"] == "BF16":
            return widen_bf16(data)
        return np.array(data, dtype=np.float32)


class SafetensorsDir:
    """All tensors of a Hugging Face directory: one model.safetensors, or shards named by the index."""

    def __init__(self, directory):
        self.directory = str(directory)
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(n for n in os.listdir(self.directory) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        self._files = [SafetensorsFile(os.path.join(self.directory, n)) for n in files]
        self._where = {name: f for f in self._files for name in f.names}

    @property
    def names(self):
        return self._where.keys()

    def tensor(self, name):
        return self._where[name].tensor(name)


def model_config_from_hf(config):
    """A ModelConfig from a parsed config.json (Llama and Mistral causal LMs)."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported model architecture {archs[0]!r} (supported: {', '.join(_ARCHITECTURES)})")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if k not in config:
            raise ValueError(f"config.json lacks required key {k!r}")
    rope = dict(config.get("rope_parameters") or {})   # transformers >= 5 keeps theta and scaling here
    rope.update(config.get("rope_scaling") or {})
    n_head = config["num_attention_heads"]
    max_seq = config.get("max_position_embeddings", 2048)
    if config.get("sliding_window"):
        # NOTE(window): attention here is global; capping the context at the window keeps it exact
        max_seq = min(max_seq, config["sliding_window"])
    return ModelConfig(
        arch=arch, n_layer=config["num_hidden_layers"], dim=config["hidden_size"], n_head=n_head,
        n_kv_head=config.get("num_key_value_heads") or n_head, ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"], max_seq_len=max_seq,
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)), head_dim=config.get("head_dim") or 0,
        rope_scaling=_hf_rope_scaling(rope), tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        name=config.get("_name_or_path", ""))


def _hf_rope_scaling(rope):
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}
    scaling["type"] = kind
    return scaling

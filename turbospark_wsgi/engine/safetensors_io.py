"""Hugging Face model directories: safetensors tensors (JSON header + memory map) and config.json."""
import math
import os
import struct

import numpy as np

from . import model_json
from .config import MAX_COUNT, MAX_LAYERS, ModelConfig
from .gguf import short_repr, widen_bf16

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
# every dtype the safetensors format defines -> bytes per element: enough to check a tensor's extent
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
                  "Gemma3ForCausalLM": "gemma3"}
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2 ** 20   # the safetensors format's own limit
MAX_DIMS = 8


class SafetensorsFormatError(ValueError):
    pass


class SafetensorsFile:
    """One .safetensors file: the tensor table from its JSON header, data memory-mapped. The header
    is checked against the file's size before it is read, and every entry before any is used.
    Messages name the file by its base name only (they may reach clients)."""

    def __init__(self, path):
        self.path = str(path)
        self.name = os.path.basename(self.path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise self._error("truncated safetensors file (no header)")
            n = struct.unpack("<Q", head)[0]
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise self._error(f"corrupt safetensors file: header length {n} runs past the end of the "
                                  f"file (size {size}) or over {MAX_HEADER_BYTES} bytes")
            raw = f.read(n)
        if len(raw) != n:
            raise self._error("truncated safetensors file (header ends early)")
        try:
            header = model_json.loads(raw, "the safetensors header")
        except ValueError as exc:
            raise self._error(f"bad safetensors header: {exc}") from None
        if not isinstance(header, dict):
            raise self._error("corrupt safetensors file: the header is not a JSON object")
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        for name, entry in header.items():
            self._check(name, entry, size - self.data_start)
        self.tensors = header
        self._map = None

    def _error(self, message):
        return SafetensorsFormatError(f"{self.name}: {message}")

    def _check(self, name, entry, data_bytes):
        """One header entry: a known dtype, a shape of whole elements and offsets inside the data
        that hold exactly that shape."""
        tensor = f"tensor {short_repr(name)}"
        if not isinstance(entry, dict):
            raise self._error(f"corrupt safetensors file: {tensor} is {short_repr(entry)}, not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ITEM_BYTES:
            raise self._error(f"corrupt safetensors file: {tensor} has unknown dtype {short_repr(dtype)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_natural(d) for d in shape)):
            raise self._error(f"corrupt safetensors file: {tensor} has shape {short_repr(shape)}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise self._error(f"corrupt safetensors file: {tensor} has data_offsets {short_repr(offsets)}")
        if offsets[1] > data_bytes:
            raise self._error(f"truncated safetensors file: {tensor} data ends at {offsets[1]}, past the end "
                              f"of the {data_bytes} data bytes")
        count = 1
        for d in shape:
            count *= d
        if count * _ITEM_BYTES[dtype] != offsets[1] - offsets[0]:
            raise self._error(f"corrupt safetensors file: {tensor} of shape {shape} and dtype {dtype} does not "
                              f"fit its {offsets[1] - offsets[0]} bytes")

    @property
    def names(self):
        return self.tensors.keys()

    def shape(self, name):
        return tuple(self.tensors[name]["shape"])

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


def _natural(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SafetensorsDir:
    """All tensors of a Hugging Face directory: one model.safetensors, or shards named by the index."""

    def __init__(self, directory):
        self.directory = str(directory)
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            files = _shards(index)
        else:
            files = sorted(n for n in os.listdir(self.directory) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError("the model directory has no *.safetensors files")
        self._files = [SafetensorsFile(os.path.join(self.directory, n)) for n in files]
        self._where = {name: f for f in self._files for name in f.names}

    @property
    def names(self):
        return self._where.keys()

    def shape(self, name):
        return self._where[name].shape(name)

    def tensor(self, name):
        return self._where[name].tensor(name)


def _shards(index):
    """The shard file names an index lists: plain names inside the model directory, each present."""
    try:
        weight_map = model_json.read_object(index, INDEX_FILE)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{INDEX_FILE} lacks a weight_map of tensor names to files "
                         f"({type(exc).__name__}: {short_repr(str(exc))})") from None
    directory = os.path.dirname(index)
    for name in files:
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name \
                or "\\" in name:
            raise ValueError(f"{INDEX_FILE} names shard {short_repr(name)}, which is not a file in the "
                             "model directory")
        if not os.path.isfile(os.path.join(directory, name)):
            raise FileNotFoundError(f"{INDEX_FILE} names shard {name!r}, which is missing")
    return files


def model_config_from_hf(config):
    """A ModelConfig from a parsed config.json (Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 3 text causal LMs). An unsupported
    architecture, a missing key or a value that cannot describe a model raises ValueError naming it."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json architectures must be a list of names, not {short_repr(archs)}")
    arch = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported model architecture {short_repr(archs[0])} "
                         f"(supported: {', '.join(_ARCHITECTURES)})")

    for k in ("attention_bias", "mlp_bias"):   # biases the weight table has no place for
        if config.get(k) and arch != "qwen2":
            raise ValueError(f"config.json {k} is set: biased {arch} projections are not supported")

    def count(k, default=KeyError, least=1, most=MAX_COUNT - 1):
        value = config.get(k)
        if value is None:
            if default is KeyError:
                raise ValueError(f"config.json lacks required key {k!r}")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
            raise ValueError(f"config.json {k!r} must be an integer from {least} to {most}, not {short_repr(value)}")
        return value

    def number(where, k, default, least=0.0):
        value = where.get(k, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not least <= value < math.inf:
            raise ValueError(f"config.json {k!r} must be a number of at least {least}, not {short_repr(value)}")
        return float(value)

    rope = {}
    for k in ("rope_parameters", "rope_scaling"):   # transformers >= 5 keeps theta and scaling in the first
        part = config.get(k) or {}
        if not isinstance(part, dict):
            raise ValueError(f"config.json {k!r} must be an object, not {short_repr(part)}")
        rope.update(part)
    # transformers >= 5 nests Gemma 3's two rotary settings by layer type
    local_rope = rope.pop("sliding_attention", None)
    rope.update(rope.pop("full_attention", None) or {})
    n_layer, dim, n_head = count("num_hidden_layers", most=MAX_LAYERS), count("hidden_size"), count("num_attention_heads")
    ffn_dim, vocab = count("intermediate_size"), count("vocab_size")
    n_kv_head = count("num_key_value_heads", 0, least=0) or n_head
    if n_head % n_kv_head:
        raise ValueError(f"config.json num_key_value_heads {n_kv_head} does not divide "
                         f"num_attention_heads {n_head}")
    max_seq = count("max_position_embeddings", 2048)
    head_dim = count("head_dim", 0, least=0) or dim // n_head
    partial = number(rope, "partial_rotary_factor", number(config, "partial_rotary_factor", 1.0), 1e-9)
    if partial > 1.0:
        raise ValueError(f"config.json partial_rotary_factor must be at most 1, not {partial}")
    rope_dim = int(head_dim * partial)
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"config.json partial_rotary_factor {partial} gives the odd rotary size {rope_dim}")
    name = config.get("_name_or_path", "")
    extra = _gemma3_fields(config, local_rope, number) if arch == "gemma3" else {}
    return ModelConfig(**extra, **_window_fields(config, arch, n_layer, count),
        arch=arch, n_layer=n_layer, dim=dim, n_head=n_head, n_kv_head=n_kv_head, ffn_dim=ffn_dim,
        vocab_size=vocab, max_seq_len=max_seq,
        rope_theta=number(rope, "rope_theta", number(config, "rope_theta", 10000.0, 1e-9), 1e-9),
        norm_eps=number(config, "rms_norm_eps", 1e-6), head_dim=head_dim, rope_dim=rope_dim,
        rope_scaling=_hf_rope_scaling(rope), tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        name=name if isinstance(name, str) else "")


def _window_fields(config, arch, n, count):
    """The sliding window and the layers it applies to, as transformers reads them: `layer_types`
    where the file has it, else Gemma 3's every-6th-layer-is-global pattern, Qwen's layers from
    max_window_layers on, every layer for the others (Mistral, Phi-3). Qwen's window is off unless
    use_sliding_window is set. Gemma 3 keeps its local layers without a window (their rotary base)."""
    window = count("sliding_window") if config.get("sliding_window") and config.get("use_sliding_window", True) else 0
    kinds = config.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != n:
        if arch == "gemma3":
            pattern = count("sliding_window_pattern", 6)
            kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        elif arch in ("qwen2", "qwen3"):
            first = count("max_window_layers", 28, least=0)
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        else:
            kinds = ["sliding_attention"] * n
    local = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
    return {"sliding_window": window, "local_layers": local if window or arch == "gemma3" else ()}


def _gemma3_fields(config, local_rope, number):
    """Gemma 3's ModelConfig fields: the local layers' rotary base, query_pre_attn_scalar, final
    logit soft-capping."""
    if config.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    local_theta = number(local_rope or {}, "rope_theta", number(config, "rope_local_base_freq", 10000.0, 1e-9), 1e-9)
    return {"rope_local_theta": local_theta,
            "query_scalar": number(config, "query_pre_attn_scalar", 0.0) if config.get("query_pre_attn_scalar") else 0.0,
            "final_softcap": number(config, "final_logit_softcapping", 0.0) if config.get("final_logit_softcapping") else 0.0}


def _hf_rope_scaling(rope):
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str):
        raise ValueError(f"config.json rope_type must be a name, not {short_repr(kind)}")
    if kind == "default":
        return {}
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")}
    for k in _ROPE_NUMBERS.intersection(scaling):
        if not isinstance(scaling[k], (int, float)) or isinstance(scaling[k], bool):
            raise ValueError(f"config.json rope scaling {k!r} must be a number, not {short_repr(scaling[k])}")
    scaling["type"] = kind
    return scaling


_ROPE_NUMBERS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}

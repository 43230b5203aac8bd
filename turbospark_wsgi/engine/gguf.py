"""GGUF files: metadata (a small stdlib reader, fast), tensor table and dequantization."""
import os
import struct
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig

GGUF_MAGIC = b"GGUF"

# value type -> struct format (scalars)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


class _Cursor:
    def __init__(self, f):
        self.f = f

    def take(self, fmt):
        size = struct.calcsize(fmt)
        raw = self.f.read(size)
        if len(raw) != size:
            raise GGUFFormatError("truncated GGUF file (metadata ends early)")
        return struct.unpack(fmt, raw)[0]

    def string(self):
        n = self.take("<Q")
        raw = self.f.read(n)
        if len(raw) != n:
            raise GGUFFormatError("truncated GGUF file (string ends early)")
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, n = self.take("<I"), self.take("<Q")
            if item_type in _SCALARS and item_type != 7:
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                raw = self.f.read(size * n)
                if len(raw) != size * n:
                    raise GGUFFormatError("truncated GGUF file (array ends early)")
                return list(struct.unpack("<%d%s" % (n, fmt[1]), raw))
            return [self.value(item_type) for _ in range(n)]
        raise GGUFFormatError(f"unknown GGUF metadata value type {vtype}")


def read_header(f):
    """Reads magic, version, counts and every metadata key/value; leaves `f` at the tensor table."""
    if f.read(4) != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cur = _Cursor(f)
    version = cur.take("<I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    return version, n_tensors, metadata


def read_metadata(path):
    """All metadata key/values of a GGUF file as plain Python values."""
    with open(path, "rb") as f:
        return read_header(f)[2]


# ---------------------------------------------------------------------------- tensors

# ggml type id -> (name, elements per block, bytes per block) for the types we dequantize
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}


@dataclass(slots=True)
class TensorInfo:
    name: str
    shape: tuple        # numpy order (outermost first): a weight is (out_features, in_features)
    ggml_type: int
    offset: int         # absolute byte offset in the file
    nbytes: int         # 0 when the type is unsupported (size unknown)


class GGUFFile:
    """A GGUF file's metadata and tensor table, with tensor data memory-mapped on first use."""

    def __init__(self, path):
        self.path = str(path)
        with open(self.path, "rb") as f:
            _, n_tensors, self.metadata = read_header(f)
            infos = [_read_tensor_info(_Cursor(f)) for _ in range(n_tensors)]
            table_end = f.tell()
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-table_end // align) * align
        size = os.path.getsize(self.path)
        self.tensors = {}
        for name, shape, gtype, rel in infos:
            info = TensorInfo(name, shape, gtype, data_start + rel, _nbytes(shape, gtype))
            if info.offset + info.nbytes > size:
                raise GGUFFormatError(f"truncated GGUF file: tensor {name!r} needs bytes up to "
                                      f"{info.offset + info.nbytes}, the file has {size}")
            self.tensors[name] = info
        self._map = None

    @property
    def names(self):
        return self.tensors.keys()

    def raw(self, name):
        """The tensor's bytes as stored (uint8, one row of blocks per output row), memory-mapped."""
        info = self.tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        data = self._map[info.offset:info.offset + info.nbytes]
        return data.reshape(*info.shape[:-1], -1) if info.shape else data

    def tensor(self, name):
        """The tensor dequantized to a new float32 array of shape `TensorInfo.shape`."""
        info = self.tensors[name]
        if info.ggml_type not in GGML_TYPES:
            raise ValueError(f"tensor {name!r} has unsupported GGUF type {ggml_type_name(info.ggml_type)}")
        kind = GGML_TYPES[info.ggml_type][0]
        raw = self.raw(name)
        if kind == "F32":
            return np.array(raw.view(np.float32).reshape(info.shape))
        if kind == "F16":
            return raw.view(np.float16).reshape(info.shape).astype(np.float32)
        if kind == "BF16":
            return widen_bf16(raw.view(np.uint16).reshape(info.shape))
        from gguf import quants   # NOTE(import): ~0.2 s, only needed for quantized files
        out = quants.dequantize(np.asarray(raw), info.ggml_type)
        return np.ascontiguousarray(out.reshape(info.shape), dtype=np.float32)


def widen_bf16(u16):
    """bfloat16 bits (uint16) -> float32: the bf16 bits are the float32's high half."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def ggml_type_name(gtype):
    if gtype in GGML_TYPES:
        return GGML_TYPES[gtype][0]
    try:
        from gguf import GGMLQuantizationType
        return GGMLQuantizationType(gtype).name
    except (ImportError, ValueError):
        return f"#{gtype}"


def _read_tensor_info(cur):
    name = cur.string()
    dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
    gtype, offset = cur.take("<I"), cur.take("<Q")
    return name, tuple(reversed(dims)), gtype, offset   # GGUF lists the innermost dimension first


def _nbytes(shape, gtype):
    if gtype not in GGML_TYPES:
        return 0
    _, block, block_bytes = GGML_TYPES[gtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * block_bytes


# ---------------------------------------------------------------------------- config

_ARCHITECTURES = {"llama": "llama"}   # GGUF general.architecture -> ModelConfig.arch


def model_config_from_gguf(metadata):
    """A ModelConfig from GGUF metadata alone (tied_embeddings is decided by the loader from the
    tensor table). An unsupported architecture or a missing key raises ValueError naming it."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {arch!r} (supported: {', '.join(_ARCHITECTURES)})")

    def key(name, default=KeyError):
        value = metadata.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise ValueError(f"GGUF metadata lacks required key '{arch}.{name}'")
        return value

    n_head = _uniform(key("attention.head_count"), "attention.head_count")
    vocab = key("vocab_size", 0) or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ValueError(f"GGUF metadata lacks '{arch}.vocab_size' and tokenizer.ggml.tokens")
    return ModelConfig(
        arch=_ARCHITECTURES[arch], n_layer=key("block_count"), dim=key("embedding_length"),
        n_head=n_head, n_kv_head=_uniform(key("attention.head_count_kv", n_head), "head_count_kv"),
        ffn_dim=key("feed_forward_length"), vocab_size=vocab, max_seq_len=key("context_length", 2048),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        head_dim=key("attention.key_length", 0), rope_dim=key("rope.dimension_count", 0),
        rope_scaling=_gguf_rope_scaling(key), name=str(metadata.get("general.name", "")))


def _uniform(value, what):
    if isinstance(value, list):   # per-layer arrays: only uniform ones are supported
        if len(set(value)) != 1:
            raise ValueError(f"per-layer {what} values differ ({sorted(set(value))}); not supported")
        return value[0]
    return value


def _gguf_rope_scaling(key):
    kind = key("rope.scaling.type", "")
    factor = float(key("rope.scaling.factor", 0.0) or key("rope.scale_linear", 0.0) or 0.0)
    if not kind and factor:
        kind = "linear"   # older files carry only rope.scale_linear
    if kind in ("", "none") or (kind == "linear" and factor in (0.0, 1.0)):
        return {}
    scaling = {"type": kind, "factor": factor}
    orig = key("rope.scaling.original_context_length", 0)
    if orig:
        scaling["original_max_position_embeddings"] = orig
    return scaling

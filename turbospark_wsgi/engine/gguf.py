"""GGUF files: metadata (a small stdlib reader, fast), tensor table and dequantization."""
import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from .config import MAX_COUNT, MAX_LAYERS, ModelConfig

GGUF_MAGIC = b"GGUF"

# value type -> struct (scalars)
_SCALARS = {t: struct.Struct(fmt) for t, fmt in {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}.items()}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U32, _U64 = _SCALARS[4], _SCALARS[10]
# the fewest bytes one value of each type takes: what a count is checked against before reading
_MIN_BYTES = {**{t: st.size for t, st in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_KV_MIN_BYTES = 8 + 4 + 1            # key length, value type, the smallest value
_TENSOR_MIN_BYTES = 8 + 4 + 4 + 8    # name length, n_dims, type, offset
MAX_ARRAY_DEPTH = 4                  # nested metadata arrays; real files use one level
MAX_DIMS = 4                         # GGML_MAX_DIMS
MAX_NAME_CHARS = 256                 # tensor names (ggml's own limit is 63 bytes)
MAX_ALIGNMENT = 1 << 20


class GGUFFormatError(ValueError):
    pass


def short_repr(value, limit=80):
    """repr(value), cut to `limit` characters: names from a file may be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Cursor:
    """Reads a GGUF header's little-endian fields. Every length and count is checked against the
    bytes left in the file before anything is read or allocated, so a corrupt field is an error
    and never a huge read. `pos` is tracked here rather than asked of the file (faster)."""

    def __init__(self, f, size, pos=0):
        self.f, self.size, self.pos = f, size, pos

    def _read(self, n):
        raw = self.f.read(n)
        if len(raw) != n:   # only when the file shrank under us: sizes were checked against `size`
            raise GGUFFormatError(f"truncated GGUF file (ends at offset {self.pos + len(raw)})")
        self.pos += n
        return raw

    def take(self, st):
        if st.size > self.size - self.pos:
            raise GGUFFormatError(f"truncated GGUF file (the header runs past its end, size {self.size})")
        return st.unpack(self._read(st.size))[0]

    def fits(self, n, each, what, at):
        """Raises unless n values of at least `each` bytes fit in what is left of the file."""
        if n * each > self.size - self.pos:
            raise GGUFFormatError(f"corrupt GGUF: {what} {n} at offset {at} runs past the end of the file "
                                  f"(size {self.size})")

    def string(self):
        at = self.pos
        n = self.take(_U64)
        self.fits(n, 1, "string length", at)
        return self._read(n).decode("utf-8", errors="replace")

    def value(self, vtype, depth=0):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(depth)
        raise GGUFFormatError(f"corrupt GGUF: unknown metadata value type {vtype} at offset {self.pos - 4}")

    def array(self, depth):
        at = self.pos
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFFormatError(f"corrupt GGUF: nested arrays deeper than {MAX_ARRAY_DEPTH} levels at offset {at}")
        item_type, n = self.take(_U32), self.take(_U64)
        if item_type not in _MIN_BYTES:
            raise GGUFFormatError(f"corrupt GGUF: unknown array element type {item_type} at offset {at}")
        self.fits(n, _MIN_BYTES[item_type], "array count", at)
        if item_type in _SCALARS and item_type != _BOOL:
            st = _SCALARS[item_type]
            return list(struct.unpack("<%d%s" % (n, st.format[1:]), self._read(st.size * n)))
        if item_type == _STRING:
            return [self.string() for _ in range(n)]
        return [self.value(item_type, depth + 1) for _ in range(n)]


def read_header(f, size=None):
    """Reads magic, version, counts and every metadata key/value; leaves `f` at the tensor table.
    `size`: the file's size (default: fstat). Returns (version, n_tensors, metadata)."""
    return _read_header(_Cursor(f, os.fstat(f.fileno()).st_size if size is None else size))


def _read_header(cur):
    if cur.f.read(4) != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.take(_U32)
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.take(_U64), cur.take(_U64)
    cur.fits(n_tensors, _TENSOR_MIN_BYTES, "tensor count", 8)
    cur.fits(n_kv, _KV_MIN_BYTES, "key/value count", 16)
    metadata = {}
    for _ in range(n_kv):
        at = cur.pos
        key = cur.string()
        if key in metadata:
            raise GGUFFormatError(f"corrupt GGUF: duplicate metadata key {short_repr(key)} at offset {at}")
        metadata[key] = cur.value(cur.take(_U32))
    _check_standard_keys(metadata)
    return version, n_tensors, metadata


# standard keys whose kind the GGUF spec fixes; checked here so the code reading them can trust them
_STR, _INT, _BOOL_KIND, _STRS, _INTS, _NUMS = "a string", "an integer", "a bool", \
    "an array of strings", "an array of integers", "an array of numbers"
_STANDARD_KEYS = {
    "general.architecture": _STR, "general.name": _STR, "general.alignment": _INT,
    "tokenizer.ggml.model": _STR, "tokenizer.ggml.pre": _STR, "tokenizer.chat_template": _STR,
    "tokenizer.ggml.tokens": _STRS, "tokenizer.ggml.merges": _STRS,
    "tokenizer.ggml.token_type": _INTS, "tokenizer.ggml.scores": _NUMS,
    "tokenizer.ggml.add_bos_token": _BOOL_KIND, "tokenizer.ggml.add_eos_token": _BOOL_KIND,
    "tokenizer.ggml.add_space_prefix": _BOOL_KIND,
}


def _kind_ok(value, kind):
    if kind == _STR:
        return isinstance(value, str)
    if kind == _BOOL_KIND:
        return isinstance(value, bool)
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if not isinstance(value, list):
        return False
    if not value:
        return True
    # an array holds one element type, so its first element speaks for all
    if kind == _NUMS:
        return isinstance(value[0], (int, float)) and not isinstance(value[0], bool)
    return _kind_ok(value[0], _STR if kind == _STRS else _INT)


def _check_standard_keys(metadata):
    for key, value in metadata.items():
        kind = _STANDARD_KEYS.get(key)
        if kind is None and key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            kind = _INT
        if kind is not None and not _kind_ok(value, kind):
            raise GGUFFormatError(f"corrupt GGUF: metadata key {key!r} must be {kind}, not {short_repr(value)}")


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
# every other type ggml knows, with its block size: enough to check a tensor's extent in the file
_OTHER_GGML_TYPES = {
    9: ("Q8_1", 32, 40), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4),
    27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
_ALL_GGML_TYPES = {**GGML_TYPES, **_OTHER_GGML_TYPES}


@dataclass(slots=True)
class TensorInfo:
    name: str
    shape: tuple        # numpy order (outermost first): a weight is (out_features, in_features)
    ggml_type: int
    offset: int         # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's metadata and tensor table, with tensor data memory-mapped on first use.
    Every size, count, offset and alignment is checked against the file's size at open."""

    def __init__(self, path):
        self.path = str(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            cur = _Cursor(f, size)
            _, n_tensors, self.metadata = _read_header(cur)
            infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
        align = _alignment(self.metadata)
        data_start = -(-cur.pos // align) * align
        self.tensors = {}
        for name, shape, gtype, rel in infos:
            if name in self.tensors:
                raise GGUFFormatError(f"corrupt GGUF: duplicate tensor {short_repr(name)}")
            self.tensors[name] = _tensor_info(name, shape, gtype, rel, data_start, align, size)
        self._map = None

    @property
    def names(self):
        return self.tensors.keys()

    def shape(self, name):
        return self.tensors[name].shape

    def raw(self, name):
        """The tensor's bytes as stored (uint8, one row of blocks per output row), memory-mapped."""
        info = self.tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        data = self._map[info.offset:info.offset + info.nbytes]
        return data.reshape(*info.shape[:-1], -1) if info.shape else data

    def release(self, name):
        """Lets go of the pages of tensor `name` this process has read (they stay in the page cache):
        a loader that has copied a tensor out calls it, so that a load does not keep the whole file
        resident beside what it built (engine/packed.py)."""
        info = self.tensors[name]
        if self._map is None or info.nbytes == 0:
            return
        page = mmap.PAGESIZE
        start = info.offset // page * page
        self._map._mmap.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

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
    return _ALL_GGML_TYPES[gtype][0] if gtype in _ALL_GGML_TYPES else f"#{gtype}"


def _alignment(metadata):
    align = metadata.get("general.alignment", 32)
    if not (isinstance(align, int) and 0 < align <= MAX_ALIGNMENT and align & (align - 1) == 0):
        raise GGUFFormatError(f"corrupt GGUF: general.alignment {short_repr(align)} is not a power of two "
                              f"from 1 to {MAX_ALIGNMENT}")
    return align


def _read_tensor_info(cur):
    at = cur.pos
    name = cur.string()
    if len(name) > MAX_NAME_CHARS:
        raise GGUFFormatError(f"corrupt GGUF: a tensor name of {len(name)} characters at offset {at}")
    n_dims = cur.take(_U32)
    if n_dims > MAX_DIMS:
        raise GGUFFormatError(f"corrupt GGUF: tensor {short_repr(name)} has {n_dims} dimensions "
                              f"(at most {MAX_DIMS})")
    dims = [cur.take(_U64) for _ in range(n_dims)]
    gtype, offset = cur.take(_U32), cur.take(_U64)
    return name, tuple(reversed(dims)), gtype, offset   # GGUF lists the innermost dimension first


def _tensor_info(name, shape, gtype, rel, data_start, align, size):
    """The checked TensorInfo of one tensor-table entry: a known type, whole blocks, an aligned
    offset and bytes that lie inside the file."""
    shown = short_repr(name)
    if gtype not in _ALL_GGML_TYPES:
        raise GGUFFormatError(f"corrupt GGUF: tensor {shown} has unknown type id {gtype}")
    type_name, block, block_bytes = _ALL_GGML_TYPES[gtype]
    if shape and shape[-1] % block:
        raise GGUFFormatError(f"corrupt GGUF: tensor {shown} rows of {shape[-1]} values are not whole "
                              f"{type_name} blocks of {block}")
    if rel % align:
        raise GGUFFormatError(f"corrupt GGUF: tensor {shown} data offset {rel} is not a multiple of the "
                              f"alignment {align}")
    count = 1
    for d in shape:
        count *= d
    nbytes = count // block * block_bytes
    offset = data_start + rel
    if offset + nbytes > size:   # a wild offset or dimension reads the same as a cut file
        raise GGUFFormatError(f"truncated GGUF file: tensor {shown} (shape {shape}, data offset {rel}) "
                              f"needs bytes up to {offset + nbytes}, the file has {size}")
    return TensorInfo(name, shape, gtype, offset, nbytes)


# ---------------------------------------------------------------------------- config

# GGUF general.architecture -> ModelConfig.arch (llama.cpp writes Mistral models as "llama")
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3"}
# llama.cpp's Gemma 3: every 6th layer global, the others local with the rotary base 10 000
_GEMMA3_PATTERN, _GEMMA3_LOCAL_THETA = 6, 10000.0


def model_config_from_gguf(metadata):
    """A ModelConfig from GGUF metadata alone (tied_embeddings is decided by the loader from the
    tensor table). An unsupported architecture, a missing key or a value that cannot describe a
    model raises ValueError naming it."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {short_repr(arch)} "
                         f"(supported: {', '.join(_ARCHITECTURES)})")

    def key(name, default=KeyError):
        value = metadata.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise ValueError(f"GGUF metadata lacks required key '{arch}.{name}'")
        return value

    def count(name, default=KeyError, least=1, most=MAX_COUNT - 1):
        value = key(name, default)
        if isinstance(value, list):   # per-layer arrays: only uniform ones are supported
            value = _uniform(value, name)
        if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
            raise ValueError(f"GGUF metadata '{arch}.{name}' must be an integer from {least} to {most}, "
                             f"not {short_repr(value)}")
        return value

    def number(name, default, least=0.0):
        value = key(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not least <= value < math.inf:
            raise ValueError(f"GGUF metadata '{arch}.{name}' must be a number of at least {least}, "
                             f"not {short_repr(value)}")
        return float(value)

    n_head = count("attention.head_count")
    n_kv_head = count("attention.head_count_kv", n_head)
    if n_head % n_kv_head:
        raise ValueError(f"GGUF metadata '{arch}.attention.head_count_kv' {n_kv_head} does not divide "
                         f"'{arch}.attention.head_count' {n_head}")
    vocab = count("vocab_size", 0, least=0) or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ValueError(f"GGUF metadata lacks '{arch}.vocab_size' and tokenizer.ggml.tokens")
    max_seq = count("context_length", 2048)
    cfg = ModelConfig(
        arch=_ARCHITECTURES[arch], n_layer=count("block_count", most=MAX_LAYERS), dim=count("embedding_length"),
        n_head=n_head, n_kv_head=n_kv_head, ffn_dim=count("feed_forward_length"), vocab_size=vocab,
        max_seq_len=max_seq, rope_theta=number("rope.freq_base", 10000.0, 1e-9),
        norm_eps=number("attention.layer_norm_rms_epsilon", 1e-5),
        head_dim=count("attention.key_length", 0, least=0), rope_dim=count("rope.dimension_count", 0, least=0),
        rope_scaling=_gguf_rope_scaling(key, number, count), name=str(metadata.get("general.name", "")),
        final_softcap=number("final_logit_softcapping", 0.0),
        sliding_window=count("attention.sliding_window", 0, least=0))
    if cfg.arch == "gemma3":
        cfg.local_layers = tuple(i for i in range(cfg.n_layer) if (i + 1) % _GEMMA3_PATTERN)
        cfg.rope_local_theta = _GEMMA3_LOCAL_THETA
    elif cfg.sliding_window:      # Mistral, Phi-3: every layer is windowed
        cfg.local_layers = tuple(range(cfg.n_layer))
    if cfg.head_dim < 1 or cfg.rope_dim > cfg.head_dim or cfg.rope_dim % 2:
        raise ValueError(f"GGUF metadata gives head size {cfg.head_dim} and rotary size {cfg.rope_dim}: "
                         "the rotary size must be even and at most the head size")
    return cfg


def _uniform(value, what):
    """The one value of a per-layer array: only uniform arrays are supported."""
    if not value or any(v != value[0] for v in value):
        raise ValueError(f"per-layer {what} values differ ({short_repr(value)}); not supported")
    return value[0]


def _gguf_rope_scaling(key, number, count):
    kind = key("rope.scaling.type", "")
    if not isinstance(kind, str):
        raise ValueError(f"GGUF metadata rope.scaling.type must be a string, not {short_repr(kind)}")
    factor = number("rope.scaling.factor", 0.0) or number("rope.scale_linear", 0.0)
    if not kind and factor:
        kind = "linear"   # older files carry only rope.scale_linear
    if kind in ("", "none") or (kind == "linear" and factor in (0.0, 1.0)):
        return {}
    scaling = {"type": kind, "factor": factor}
    orig = count("rope.scaling.original_context_length", 0, least=0)
    if orig:
        scaling["original_max_position_embeddings"] = orig
    return scaling

"""GGUF files: metadata (a small stdlib reader, fast), tensor table and dequantization."""
import struct

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

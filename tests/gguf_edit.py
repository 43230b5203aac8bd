"""Rewrites a GGUF file's metadata, its tensor data copied byte for byte: the way a model file with a
stranger's chat template (or any other key) is made from a real one, with gguf-py's reader."""
import struct

import numpy as np

GGUF_STRING = 8


def _string(text):
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def with_metadata(src, dst, strings=None, drop=()):
    """Writes `dst`: `src` with each key of `strings` set to that string value (replaced or added)
    and the keys in `drop` left out; every other key, the tensor table and the data are unchanged."""
    from gguf import GGUFReader

    strings = dict(strings or {})
    reader = GGUFReader(str(src))
    kv = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in strings or name in drop:
            continue
        kv.append(b"".join(np.asarray(part).tobytes() for part in field.parts))
    kv += [_string(k) + struct.pack("<I", GGUF_STRING) + _string(v) for k, v in strings.items()]
    tensors = [b"".join(np.asarray(part).tobytes() for part in t.field.parts) for t in reader.tensors]
    align = int(reader.alignment)
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv)) + b"".join(kv) + b"".join(tensors)
    head += b"\0" * (-len(head) % align)
    with open(src, "rb") as f:
        f.seek(reader.data_offset)
        data = f.read()
    with open(dst, "wb") as f:
        f.write(head + data)
    return dst

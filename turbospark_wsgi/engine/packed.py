"""Packed weights: the int8 kernels' layout of a GGUF's matrices, written once into a cache file and
mapped read-only, so that every worker and replica on the machine reads one copy from the page cache.

The kernels do not read the file's blocks as stored (quant.py tiles rows so that one SIMD lane holds
one row, quant.prepare interleaves them for `vpdpbusd`), so each process used to build the layout
and hold it privately: two gunicorn workers of a model paid for it twice. A `Store` makes the first
process to load a model write the layout (`Writer`, matrix by matrix, each mapped back as soon as it
is written, so a load never holds more than one matrix privately) and every later one map it
(`Reader`); a process that finds it half-written waits on its lock, then maps it.

File: the arrays, each 64-byte aligned, then a JSON index, its length (8 bytes, little-endian) and
MAGIC. The index names the GGUF it was made from (real path, size, mtime, inode) and a hash of the
code that decides the layout, so a changed model file or an upgrade makes a new one (the stale one
is removed when its replacement is written). Anything unexpected in a file (truncated, a foreign
index, arrays outside it) is a miss: the file is rebuilt, never trusted.

NOTE(one-layout): what is mapped is `qv` (and the scales as the weight keeps them): the float kernels'
`qs` is rebuilt from it only where a float path runs (quant.QWeight.qs).
"""
import fcntl
import hashlib
import json
import os
import shutil

import numpy as np

from . import quant

MAGIC = b"TSPACK01"
ALIGN = 64
PREFIX = "turbospark-weights-"
# the modules whose code decides the bytes written (a change to any of them makes a new file)
_LAYOUT_CODE = ("quant.py", "weights.py", "packed.py")
_DTYPES = {"uint8", "int8", "float16", "float32"}
# PERF(one-layout): Q4_K / Q6_K keep float32 scales (quant, NOTE(scales-f16)): up to ~1.6x the file's bytes
_GROWTH = 1.6


class Private:
    """No packed file: every matrix is built and held by this process (`why` says why)."""

    def __init__(self, why):
        self.why = why

    def matrix(self, key, make):
        return make()

    def finish(self):
        return f"weights held by this process ({self.why})"

    def abort(self):
        pass


def store(directory, source, activations):
    """The Store for GGUFFile `source` in cache directory `directory` ("" = none): a Reader where a
    valid packed file is there, a Writer (holding its lock) where this process is to write it, or
    Private with the reason."""
    if not directory:
        return Private("no weight cache configured")
    if activations != "int8":
        return Private(f"{activations} activations read the tiled blocks, which are not packed")
    try:
        ident = identity(source.path)
        os.makedirs(directory, exist_ok=True)
        name = os.path.join(directory, f"{PREFIX}{ident['tag']}-{ident['key']}.bin")
        lock = open(os.path.join(directory, f"{PREFIX}{ident['tag']}.lock"), "a+")
    except OSError as e:
        return Private(f"weight cache unusable: {e.strerror or e}")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = Reader.open(name, ident)
        if found is not None:
            lock.close()
            return found
        need = int(_GROWTH * sum(t.nbytes for t in source.tensors.values() if quant.supported(t.ggml_type, t.shape)))
        free = shutil.disk_usage(directory).free
        if free < need + (64 << 20):
            lock.close()
            return Private(f"the weight cache has {free >> 20} MiB free, the packed weights need ~{need >> 20} MiB")
        return Writer(name, ident, lock)
    except OSError as e:
        lock.close()
        return Private(f"weight cache unusable: {e.strerror or e}")


def identity(path):
    """What a packed file must match: the GGUF as a file (real path, size, mtime, inode) and the
    layout code; `key` hashes all of it, `tag` the real path alone (the lock, stale files)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for rel in _LAYOUT_CODE:
        with open(os.path.join(here, rel), "rb") as f:
            h.update(f.read())
    code = h.hexdigest()[:16]
    source = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    key = hashlib.sha256(json.dumps([source, code], sort_keys=True).encode()).hexdigest()[:16]
    return {"source": source, "code": code, "key": key, "tag": hashlib.sha256(real.encode()).hexdigest()[:16]}


def _arrays(p):
    """The arrays of QWeight p a packed file keeps, by field name: its int8 layout where the int8
    kernels take it (prepared here), else its tiled blocks; the scales and mins as it keeps them."""
    held = {}
    if quant.fits(p):
        quant.prepare(p)
        held["qv"] = p.qv
    else:
        held["tiled"] = p.tiled
    held["d"] = p.d
    for name in ("m", "ds", "ms"):
        if getattr(p, name) is not None:
            held[name] = getattr(p, name)
    return held


def _weight(part, view):
    """A QWeight from an index entry, its arrays made by `view(offset, dtype, shape)`."""
    a = {name: view(*spec) for name, spec in part["arrays"].items()}
    return quant.QWeight(part["kind"], part["n"], part["k"], a.get("tiled"), a["d"], a.get("m"),
                         qv=a.get("qv"), ds=a.get("ds"), ms=a.get("ms"))


class Writer:
    """Writes the packed file (under its lock) as the load builds each matrix; `finish` commits it."""

    def __init__(self, name, ident, lock):
        self.name, self.ident, self.lock = name, ident, lock
        self.tmp = f"{name}.{os.getpid()}.tmp"
        # under the lock no one else writes this model's file: a .tmp left is a killed writer's
        directory = os.path.dirname(name)
        for entry in os.listdir(directory):
            if entry.startswith(f"{PREFIX}{ident['tag']}-") and entry.endswith(".tmp"):
                _unlink(os.path.join(directory, entry))
        self.file = open(self.tmp, "wb")
        self.index, self.failed = {}, None

    def matrix(self, key, make):
        m = make()
        if self.failed is not None:
            return m
        try:
            parts = [self._write(p) for p in m.parts]
        except OSError as e:
            self.failed = e.strerror or str(e)
            return m
        self.index[key] = {"n": m.n, "k": m.k, "parts": parts}
        # mapped back at once: the private arrays go as each matrix is written (a load's peak)
        return quant.QMatrix([_weight(part, self._view) for part in parts], m.n, m.k)

    def _write(self, p):
        specs = {}
        for field, a in _arrays(p).items():
            pad = -self.file.tell() % ALIGN
            self.file.write(b"\0" * pad)
            specs[field] = [self.file.tell(), str(a.dtype), list(a.shape)]
            self.file.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)   # no copy of it
        self.file.flush()
        return {"kind": p.kind, "n": p.n, "k": p.k, "arrays": specs}

    def _view(self, offset, dtype, shape):
        return np.memmap(self.tmp, dtype=np.dtype(dtype), mode="r", offset=offset, shape=tuple(shape))

    def finish(self):
        try:
            if self.failed is not None:
                raise OSError(self.failed)
            head = json.dumps({"source": self.ident["source"], "code": self.ident["code"],
                               "matrices": self.index}).encode()
            self.file.write(head + len(head).to_bytes(8, "little") + MAGIC)
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.name)
            _remove_stale(os.path.dirname(self.name), self.ident, keep=self.name)
            return "weights packed into the shared weight cache (the next workers map them)"
        except OSError as e:
            self.abort()
            return f"weights held by this process (the weight cache could not be written: {e.strerror or e})"
        finally:
            self.lock.close()

    def abort(self):
        self.file.close()
        _unlink(self.tmp)
        self.lock.close()


class Reader:
    """A valid packed file, mapped once; `matrix` serves its matrices as read-only views."""

    def __init__(self, name, index, data_end):
        self.name, self.index = name, index
        self.map = np.memmap(name, dtype=np.uint8, mode="r")[:data_end]

    @classmethod
    def open(cls, name, ident):
        """The Reader of packed file `name` if it is there and matches `ident`, else None (a file
        that does not is removed, to be written again)."""
        try:
            with open(name, "rb") as f:
                index, data_end = read_index(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            index = None
        if index is None or index.get("source") != ident["source"] or index.get("code") != ident["code"] \
                or not _entries_fit(index, data_end):
            _unlink(name)
            return None
        return cls(name, index["matrices"], data_end)

    def matrix(self, key, make):
        entry = self.index.get(key)
        if entry is None:        # a matrix this file lacks (another loader's choice): built here
            return make()
        return quant.QMatrix([_weight(part, self._view) for part in entry["parts"]], entry["n"], entry["k"])

    def _view(self, offset, dtype, shape):
        dt = np.dtype(dtype)
        return np.frombuffer(self.map, dtype=dt, count=int(np.prod(shape, dtype=np.int64)), offset=offset).reshape(shape)

    def finish(self):
        return "weights mapped from the shared weight cache"

    def abort(self):
        pass


def read_index(f):
    """(index dict, where the arrays end) of an open packed file; ValueError where it is not one."""
    size = os.fstat(f.fileno()).st_size
    if size < 16:
        raise ValueError("too short")
    f.seek(size - 16)
    tail = f.read(16)
    length = int.from_bytes(tail[:8], "little")
    if tail[8:] != MAGIC or length > size - 16:
        raise ValueError("no packed-weights trailer")
    f.seek(size - 16 - length)
    index = json.loads(f.read(length))
    if not isinstance(index, dict) or not isinstance(index.get("matrices"), dict):
        raise ValueError("not a packed-weights index")
    return index, size - 16 - length


def _entries_fit(index, data_end):
    """Whether every array the index names is a known type, a consistent shape and inside the data."""
    try:
        for entry in index["matrices"].values():
            for part in entry["parts"]:
                for off, dtype, shape in part["arrays"].values():
                    if dtype not in _DTYPES or off % ALIGN or any(int(s) < 0 for s in shape):
                        return False
                    if off + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize > data_end:
                        return False
                if part["kind"] not in ("q4", "q8") or "d" not in part["arrays"]:
                    return False
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    return True


def _remove_stale(directory, ident, keep):
    """Removes the packed files of this GGUF other than `keep` (an older file or older code), and
    those whose GGUF is gone or changed."""
    for entry in os.listdir(directory):
        path = os.path.join(directory, entry)
        if not entry.startswith(PREFIX) or not entry.endswith(".bin") or path == keep:
            continue
        if entry.startswith(f"{PREFIX}{ident['tag']}-") or not _source_current(path):
            _unlink(path)


def _source_current(path):
    try:
        with open(path, "rb") as f:
            source = read_index(f)[0].get("source") or {}
        st = os.stat(source["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (st.st_size, st.st_mtime_ns, st.st_ino) == (source.get("size"), source.get("mtime_ns"), source.get("inode"))


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass

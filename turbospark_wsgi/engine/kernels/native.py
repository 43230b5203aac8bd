"""The C kernels (native.c): compiled by the machine's C compiler, once per instruction path, into the
kernel cache directory, and called through ctypes (which lets go of the GIL around each call).

PERF(cold-start): the numba kernels compile at a machine's first load: 20 s to /health 200 on a
2-vCPU Zen 4 with an empty cache (int8 products 4.4 s, the fused layer 13.3 s, the float kernels
14-15 s in a second process). The C source builds in 2.3-2.9 s for one path (gcc 12, -O3) and
computes the same steps; `turbospark serve` starts that build beside gunicorn's start (cli.py), so a
first start takes 3.3-4.5 s to /health 200 (README, "Cold start"). Where no C compiler
works, or TURBOSPARK_KERNELS=numba, the numba kernels run as before (KernelPlan says which and why).

`load(path)` returns the Library of instruction path `path` (isa.PATHS): built if its cached file
is missing (under a file lock, so N workers starting together build once), loaded once per process.
The file's name holds a hash of the source, the path's flags and the compiler's file (path, size,
time), so an upgrade never loads a stale build.

NOTE(scratch): the kernels keep their working buffers in a block per calling thread, grown when a
call needs more and kept for the next (native.c); a call whose memory is not there does nothing and
raises MemoryError here. `release_scratch()` frees the calling thread's blocks (the registry has the
compute thread run it after it unloads a model).
"""
import ctypes
import hashlib
import os
import platform
import shutil
import threading

import numpy as np

from .. import quant
from . import isa
from .children import spawn, wait

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.c")
ABI = 7
_BASE = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
# what each path compiles with (x86: F16C converts the half-float KV caches; every AVX2 CPU has it)
FLAGS = {
    "vnni512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mf16c"),
    "avxvnni": ("-mavxvnni", "-mavx2", "-mf16c"),
    "avx2": ("-mavx2", "-mf16c"),
    "neon": ("-march=armv8.2-a+dotprod",),
    "generic": (),
}
# AVX-512 VNNI CPUs without AVX-VNNI (Zen 4, Ice Lake) run the 256-bit path's EVEX form
_AVXVNNI_EVEX = ("-mavx512vl", "-mavx512vnni", "-mavx2", "-mf16c")


class NativeUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (the message says why)."""


def compiler():
    """The C compiler's path, or None."""
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def flags(path, features=None):
    """The compiler flags of instruction path `path` on this CPU."""
    if path not in FLAGS:
        raise ValueError(f"no C kernels for instruction path {path!r}")
    if path == "avxvnni":
        feats = isa.host_features() if features is None else set(features)
        if "avxvnni" not in feats and {"avx512vnni", "avx512vl"} <= feats:
            return _AVXVNNI_EVEX
    return FLAGS[path]


def command(cc, path, out):
    """The compiler command building path `path`'s library at `out`."""
    return [cc, *_BASE, *flags(path), f"-DTS_PATH={isa.IDS[path]}", SOURCE, "-o", out, "-lm"]


def _key(cc, path):
    # the compiler as the file it is (an upgrade changes its size or time), not its --version: no
    # process to start on every load
    real = os.path.realpath(cc)
    st = os.stat(real)
    compiler_id = f"{real}|{st.st_size}|{st.st_mtime_ns}"
    h = hashlib.sha256(f"{ABI}|{path}|{' '.join(command('cc', path, 'x'))}|{compiler_id}|{platform.machine()}".encode())
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    return h.hexdigest()[:16]


def library_file(path, directory=None):
    """Where path `path`'s library is kept (built or not)."""
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH")
    from . import warm
    return os.path.join(directory or warm.cache_dir(), f"turbospark-native-{_key(cc, path)}-{path}.so")


def build(path, directory=None):
    """Builds path `path`'s library unless it is there; returns (its file, whether this call built
    it). Raises NativeUnavailable."""
    import fcntl
    out = library_file(path, directory)
    if os.path.exists(out):
        return out, False
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(os.path.join(os.path.dirname(out), "turbospark-native.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(out):
                return out, False
            tmp = f"{out}.{os.getpid()}.tmp"
            ok, text = _run(command(compiler(), path, tmp), tmp)
            if not ok:
                tail = text.strip().splitlines()[-3:]
                raise NativeUnavailable(f"the C kernels did not compile for {path}: {' | '.join(tail)}")
            os.replace(tmp, out)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out, True


def _run(cmd, out, timeout=300):
    """(succeeded, output) of the compiler command `cmd`, which writes the file `out`: where the exit
    status is lost (ECHILD) the file decides, as a compiler writes its output only when it succeeds."""
    import tempfile
    with tempfile.TemporaryFile() as log:
        try:
            status = wait(spawn(cmd, log.fileno()), timeout)
        except OSError as e:
            raise NativeUnavailable(f"the C compiler failed to run: {e}") from None
        except TimeoutError:
            raise NativeUnavailable(f"the C compiler ran past {timeout} s") from None
        log.seek(0)
        text = log.read().decode(errors="replace")
    ok = status == 0 if status is not None else os.path.exists(out) and os.path.getsize(out) > 0
    return ok, text


_LOADED = {}
_LOCK = threading.Lock()


def load(path, directory=None):
    """The Library of instruction path `path` (built first where needed), once per process."""
    with _LOCK:
        lib = _LOADED.get(path)
        if lib is None:
            lib = _LOADED[path] = Library(path, *build(path, directory))
        return lib


def release_scratch():
    """Frees the calling thread's scratch blocks in every Library this process loaded."""
    with _LOCK:
        libs = list(_LOADED.values())
    for lib in libs:
        lib.release_scratch()


# ---- the C structures ---------------------------------------------------------------------------

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class Weight(ctypes.Structure):
    _fields_ = [("qv", _p), ("d", _p), ("m", _p), ("T", _i64), ("nu", _i64), ("R", _i64), ("K", _i64),
                ("half", _i64), ("mins", _i64), ("ds", _p), ("ms", _p), ("group", _i64), ("six", _i64)]


class FloatWeight(ctypes.Structure):
    _fields_ = [("qs", _p), ("d", _p), ("m", _p), ("T", _i64), ("nb", _i64), ("nd", _i64), ("R", _i64), ("K", _i64)]


LAYER_PARTS = 8     # native.c LAYER_PARTS: the parts of a layer's four products, at most


class LayerWeights(ctypes.Structure):
    _fields_ = [("norms", _p), ("n_norms", _i64), ("bqkv", _p), ("qk_norm", _p), ("eps", ctypes.c_float),
                ("gelu", ctypes.c_int), ("H", _i64), ("G", _i64), ("D", _i64), ("dim", _i64), ("ffn", _i64),
                ("w", Weight * LAYER_PARTS), ("parts", _i64 * 4)]


def _addr(a):
    return a.__array_interface__["data"][0]


def _c(a, dtype):
    """`a` as a C-contiguous array of `dtype` (itself when it is one already)."""
    return np.ascontiguousarray(a, dtype=dtype)


class _Held:
    """A C structure and the arrays its pointers point into (kept alive with it)."""

    __slots__ = ("struct", "arrays", "ref")

    def __init__(self, struct, arrays):
        self.struct, self.arrays = struct, arrays
        self.ref = ctypes.byref(struct)


class Library:
    """One instruction path's C kernels. Array arguments are C-contiguous numpy arrays of the types
    named; `threads` is the number of threads a call may use."""

    def __init__(self, path, file, built=False):
        self.path, self.file, self.built = path, file, built     # built: compiled by this process
        try:
            lib = ctypes.CDLL(file)
        except OSError as e:
            raise NativeUnavailable(f"the C kernels did not load: {e}") from None
        if lib.ts_abi() != ABI or lib.ts_path() != isa.IDS[path]:
            raise NativeUnavailable(f"{os.path.basename(file)} is not the {path} build of this source")
        i64, p, i32 = _i64, _p, ctypes.c_int
        lib.ts_quantize_rows.argtypes = [p, i64, i64, p, p, p, p, i32]
        lib.ts_product_i8.argtypes = [p, i64, p, p, i32]
        lib.ts_unit_dots.argtypes = [p, p, p, i64, p]
        lib.ts_product_f32.argtypes = [p, i64, p, p, i32]
        lib.ts_dequant_t.argtypes = [p, i64, p, i64, i32]
        lib.ts_attend_rows.argtypes = [p, i64, i64, p, p, p, i32, i64, i64, i64, i64, i64, p, i32]
        lib.ts_layer.argtypes = [p, p, i64, p, p, p, i32, i64, i64, p, p, i64, i32]
        lib.ts_to_half.argtypes = lib.ts_from_half.argtypes = [p, i64, p]
        lib.ts_quantize_kv.argtypes = [p, i64, p]
        lib.ts_fail_next_alloc.argtypes = [i64]
        lib.ts_release_scratch.argtypes = []
        for f in (lib.ts_to_half, lib.ts_from_half, lib.ts_quantize_kv, lib.ts_quantize_rows, lib.ts_unit_dots, lib.ts_dequant_t,
                  lib.ts_release_scratch, lib.ts_fail_next_alloc):
            f.restype = None
        for f in (lib.ts_product_i8, lib.ts_product_f32, lib.ts_attend_rows, lib.ts_layer):   # TS_OK or TS_NOMEM
            f.restype = i32
        lib.ts_scratch_bytes.restype = lib.ts_failed_bytes.restype = i64
        self._lib = lib

    def __repr__(self):
        return f"Library({self.path!r}, {os.path.basename(self.file)!r})"

    # -- scratch memory (NOTE(scratch))

    def release_scratch(self):
        """Frees the calling thread's scratch block (the next call makes it again)."""
        self._lib.ts_release_scratch()

    def scratch_bytes(self):
        """The bytes the calling thread's scratch block holds."""
        return self._lib.ts_scratch_bytes()

    def fail_next_alloc(self, n):
        """Tests: the n-th allocation the calling thread makes from now fails (0: none)."""
        self._lib.ts_fail_next_alloc(n)

    def _check(self, status, kernel):
        if status:
            wanted = self._lib.ts_failed_bytes()
            size = f"{wanted} bytes" if wanted >= 0 else "a size out of range"
            raise MemoryError(f"the C kernel {kernel} could not allocate its scratch memory ({size}); it did nothing")

    # -- weights, converted once and kept on the QWeight (`p.cw`)

    def weight(self, p):
        """The int8 kernels' C view of QWeight p (int8.prepare's layout)."""
        from . import int8
        held = p.cw.get("i8") if p.cw else None
        if held is None:
            held = self.weight_from(int8.prepare(p), p)
            p.cw = {**(p.cw or {}), "i8": held}
        return held

    def float_weight(self, p):
        """The float kernels' C view of QWeight p (its tiled blocks, float32 scales)."""
        from .. import quant
        held = p.cw.get("f32") if p.cw else None
        if held is None:
            qs = np.ascontiguousarray(p.qs)
            d, m = quant.float_scales(p)
            s = FloatWeight(_addr(qs), _addr(d), None if m is None else _addr(m), qs.shape[0], qs.shape[1],
                            d.shape[1], p.tile, p.k)
            held = _Held(s, (qs, d, m))
            p.cw = {**(p.cw or {}), "f32": held}
        return held

    # -- products

    def product_i8(self, x, p, y, threads):
        """y [B, T*R] float32 = x [B, K] float32 (C-contiguous) times QWeight p, int8 activations."""
        self._check(self._lib.ts_product_i8(_addr(x), x.shape[0], self.weight(p).ref, _addr(y), threads),
                    "ts_product_i8")

    def unit_dots(self, p, q, qsum):
        """The exact int32 dots of every unit: [B, T, nu, R] for int8 rows q [B, K] and qsum [B, K/16]."""
        w = self.weight(p).struct
        q, qsum = _c(q, np.int8), _c(qsum, np.int32)
        out = np.empty((q.shape[0], w.T, w.nu, w.R), np.int32)
        self._lib.ts_unit_dots(ctypes.byref(w), _addr(q), _addr(qsum), q.shape[0], _addr(out))
        return out

    def quantize_rows(self, x, threads=1):
        """x float32 [B, K] -> (q int8, d, xs, qsum) as int8.quantize_rows fills them."""
        x = _c(x, np.float32)
        B, K = x.shape
        q, d = np.empty((B, K), np.int8), np.empty((B, K // 32), np.float32)
        xs, qsum = np.empty((B, K // 32), np.float32), np.empty((B, K // 16), np.int32)
        self._lib.ts_quantize_rows(_addr(x), B, K, _addr(q), _addr(d), _addr(xs), _addr(qsum), threads)
        return q, d, xs, qsum

    def to_half(self, x):
        """The bits of the half floats the K/V store writes for float32 values x (clamped to the range)."""
        x = _c(x, np.float32)
        out = np.empty(x.shape, np.uint16)
        self._lib.ts_to_half(_addr(x), x.size, _addr(out))
        return out

    def quantize_kv(self, x):
        """The q8_0 rows the K/V store writes for float32 rows x [..., D] -> int8 [..., D + D/16]
        (kv_cache.py, NOTE(kv-q8))."""
        from ..kv_cache import row_len
        x = _c(x, np.float32)
        D = x.shape[-1]
        n = row_len(D, np.int8)                     # refuses heads that are not whole blocks
        rows = x.reshape(-1, D)
        out = np.empty((len(rows), n), np.int8)
        for i, row in enumerate(rows):
            self._lib.ts_quantize_kv(_addr(row), D, _addr(out[i]))
        return out.reshape(x.shape[:-1] + (n,))

    def from_half(self, h):
        """float32 values of half-float bits h, as attention reads them."""
        h = _c(h, np.uint16)
        out = np.empty(h.shape, np.float32)
        self._lib.ts_from_half(_addr(h), h.size, _addr(out))
        return out

    def product_f32(self, x, p, y, threads):
        """y [B, T*R] = x [B, K] times QWeight p with float32 activations (cpu.py's fused kernels)."""
        self._check(self._lib.ts_product_f32(_addr(x), x.shape[0], self.float_weight(p).ref, _addr(y), threads),
                    "ts_product_f32")

    def dequant_t(self, p, t0, out, threads):
        """Tiles t0.. of QWeight p -> out [K, cols] float32 (W.T; cols a multiple of p.tile)."""
        self._lib.ts_dequant_t(self.float_weight(p).ref, t0, _addr(out), out.shape[1], threads)

    # -- attention and layers

    def attend_rows(self, q, seq, pos, kv, kind, li, window, H, G, D, out, threads):
        """out [R, H*D] = attention.attend_rows's rows: q [R, >= H*D] (row stride q.shape[1]); `kind`
        the caches' rows (attention.kind: 0 float32, 1 half floats, 2 q8_0)."""
        self._check(self._lib.ts_attend_rows(_addr(q), q.shape[1], q.shape[0], _addr(seq), _addr(pos), _addr(kv),
                                             int(kind), li, window, H, G, D, _addr(out), threads), "ts_attend_rows")

    def layer_weights(self, args, dim):
        """The C view of one layer from layer.layer_args's tuple (NOTE(layer-parts) in native.c)."""
        eps, gelu, H, G, D, norms, bqkv, qk, products = args
        parts = [self.weight(p) for ps in products for p in ps]
        if len(parts) > LAYER_PARTS:
            raise ValueError(f"a layer of {len(parts)} product parts; the C layer takes {LAYER_PARTS}")
        ffn = sum(p.n for p in products[2]) // 2
        s = LayerWeights(_addr(norms), norms.shape[0], _addr(bqkv) if bqkv.shape[0] else None,
                         _addr(qk) if qk.shape[0] else None, float(eps), int(gelu), H, G, D, dim, ffn,
                         (Weight * LAYER_PARTS)(*[h.struct for h in parts]), (_i64 * 4)(*map(len, products)))
        return _Held(s, (norms, bqkv, qk, parts))

    def weight_from(self, qv, p):
        """A Weight over int8.prepare's arrays `qv` and QWeight p's scales and mins as it keeps them
        (float16 or float32, or K-quant integers under float32 super scales: quant, NOTE(k-scales);
        no mins for q8, none kept for Q4_0's -8d: quant, NOTE(scales-f16))."""
        d = np.ascontiguousarray(p.d)
        m = None if p.m is None else np.ascontiguousarray(p.m)
        ds, ms = (None if a is None else np.ascontiguousarray(a, np.float32) for a in (p.ds, p.ms))
        _check_shapes(qv, d, m, ds, ms)
        T, nu, R = d.shape
        mins = 0 if p.kind == "q8" else 2 if m is None else 1
        six = int(quant.is_six(qv))                # NOTE(q6): 3 blocks a unit of 16
        per = 32 if mins else 16 if six else qv.shape[3] * 4    # q4 blocks of 32, q8 units of 4 bytes a quad
        half = 2 if ds is not None else int(d.dtype == np.float16)
        if half == 2 and not (mins == 1 and ms is not None or mins == 0 and per == 16):
            raise ValueError(f"no int8 kernel for K-quant scales on a {p.kind} weight in units of {per}")
        if six and (mins or half != 2):
            raise ValueError("6-bit blocks are a Q6_K weight's: q8 with K-quant scales")
        s = Weight(_addr(qv), _addr(d), None if m is None else _addr(m), T, nu, R, nu * per, half, mins,
                   None if ds is None else _addr(ds), None if ms is None else _addr(ms), p.group, six)
        return _Held(s, (qv, d, m, ds, ms))

    def layer(self, weights, x, seq, pos, kv, kind, li, window, cos, sin, threads):
        """One transformer layer on x [R, dim] (in place) as layer.layer computes it."""
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError("the layer runs in place on a C-contiguous float32 x")
        seq, pos, cos, sin = _c(seq, np.int64), _c(pos, np.int64), _c(cos, np.float32), _c(sin, np.float32)
        self._check(self._lib.ts_layer(weights.ref, _addr(x), x.shape[0], _addr(seq), _addr(pos), _addr(kv), int(kind),
                                       li, window, _addr(cos), _addr(sin), cos.shape[-1], threads), "ts_layer")


def _check_shapes(qv, d, m, ds, ms):
    """ValueError unless the arrays weight_from hands to C agree on their shapes: the kernel reads
    them by the weight's T, nu and R alone, so a mismatch would read past an array's end.
    qv [T, nu, R/16, quads, 16, 4]; d, m [T, nu, R]; ds, ms [T, nu/group, R] with a whole group."""
    if d.ndim != 3 or qv.ndim != 6 or qv.shape[:3] != (d.shape[0], d.shape[1], d.shape[2] // qv.shape[4]) \
            or d.shape[2] % qv.shape[4]:
        raise ValueError(f"int8 blocks {qv.shape} do not match scales {d.shape}")
    if m is not None and m.shape != d.shape:
        raise ValueError(f"mins {m.shape} do not match scales {d.shape}")
    if ds is None:
        if ms is not None:
            raise ValueError("super mins without super scales")
        return
    T, nu, R = d.shape
    if ds.ndim != 3 or ds.shape[0] != T or ds.shape[2] != R or not ds.shape[1] or nu % ds.shape[1]:
        raise ValueError(f"super scales {ds.shape} do not divide scales {d.shape} into whole groups")
    if d.dtype not in (np.uint8, np.int8):
        raise ValueError(f"K-quant sub-scales are 8-bit integers, not {d.dtype}")
    if (ms is None) != (m is None) or ms is not None and ms.shape != ds.shape:
        raise ValueError(f"super mins {None if ms is None else ms.shape} do not match super scales {ds.shape}")


def main(argv=None):
    """`python -m turbospark_wsgi.engine.kernels.native [WANT] [VNNI]`: builds the C kernels of the
    path isa.choose takes for WANT (auto, or an isa.PATHS name; VNNI 1 or 0) into the kernel cache
    (`turbospark serve` runs it beside gunicorn's start)."""
    import sys
    argv = sys.argv[1:] if argv is None else argv
    path = isa.choose(argv[0] if argv else "auto", (argv[1] if len(argv) > 1 else "1") != "0").path
    try:
        file, built = build(path)
    except NativeUnavailable as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{'built' if built else 'found'} {file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

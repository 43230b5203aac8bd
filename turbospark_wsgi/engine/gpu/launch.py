"""The kernels of kernels.cu, launched on a GPU (CuPy RawModule, NVRTC) or on the host (the same
source built by a C++ compiler, each thread block's threads run in turn). Both builds take the
same Python arguments and the same launch shapes; only `xp` and the way a launch is made differ."""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("kernels.cu")

# ggml type id -> (name, weights per block, bytes per block): the types kept in block form
KERNEL_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
                14: ("Q6_K", 256, 210)}
UNIT = 32                       # weights a thread decodes at once (kernels.cu UNIT)
# launch shapes, passed to both builds as -D flags (kernels.cu holds the same defaults); a build
# may override some (tools/gpu_check.py tries other qmatmul shapes)
SHAPES = {"MM_THREADS": 256, "MM_LANES": 32, "MM_BATCH": 4, "DQ_THREADS": 256, "AT_THREADS": 128, "AT_DMAX": 256,
          "ST_THREADS": 128, "NM_THREADS": 256, "EW_THREADS": 256}
# PERF(gemv): products of at most this many input rows run on qmatmul (weights read once per
# MM_BATCH rows); longer ones dequantize the matrix and multiply with the BLAS (cuBLAS on a GPU).
GEMV_ROWS = 16
MAX_GRID_Y = 65535

# argument kinds of each kernel after the grid: p pointer (array or None), i int32, l int64, f float32
SIGNATURES = {"qmatmul": "ipiilpiipiif", "dequant": "ipiilppif", "attend": "pppipiiiiip", "store": "ppppipii",
              "rmsnorm": "pipfipi", "gate": "piipl", "rope": "pippiiipl"}


def supported(ggml_type, shape):
    """Whether a 2-D GGUF tensor of this type and shape (n, k) is kept in block form on the device."""
    return ggml_type in KERNEL_TYPES and len(shape) == 2 and shape[1] % KERNEL_TYPES[ggml_type][1] == 0


def _flags(shapes):
    return [f"-D{k}={v}" for k, v in shapes.items()]


@dataclass(slots=True)
class KVTable:
    """Device arrays naming each row's keys and values (Kernels.table)."""

    n: int
    kv: object          # uint64 [2, n]: key then value addresses
    stride: object      # int64 [n]: floats between layers
    pos: object         # int32 [n]

    def rows(self, r0, r1, xp):
        return KVTable(r1 - r0, xp.ascontiguousarray(self.kv[:, r0:r1]), self.stride[r0:r1], self.pos[r0:r1])


class Kernels:
    """The kernels on `xp` arrays, built with launch `shapes`. `launch(name, grid, threads, args)`
    runs one of them."""

    def __init__(self, xp, launch, name, shapes=None):
        self.xp, self._launch, self.name = xp, launch, name
        self.shapes = dict(shapes or SHAPES)

    def matmul(self, x, blocks, qtype, k, out, col0=0, scale=1.0):
        """out[:, col0:col0+n] = scale * x @ W.T for W = `blocks` (uint8 [n, row_bytes] of `qtype`
        with rows of k weights) and x float32 [B, k] (contiguous)."""
        n, B = blocks.shape[0], x.shape[0]
        if self.address(blocks) % 4:                                    # kernels.cu: wide loads
            raise ValueError("weight blocks must start 4-byte aligned")
        if B <= GEMV_ROWS:
            if self.address(x) % 16:                                    # read as float4
                x = x.copy()
            sh = self.shapes
            grid = (-(-B // sh["MM_BATCH"]), -(-n // (sh["MM_THREADS"] // sh["MM_LANES"])))   # (inputs, rows)
            self._launch("qmatmul", grid, sh["MM_THREADS"],
                         [qtype, blocks, n, k, blocks.shape[1], x, k, B, out, out.shape[1], col0, scale])
        else:
            out[:, col0:col0 + n] = x @ self.dequantize(blocks, qtype, k, scale=scale).T

    def rms_norm(self, x, weight, eps):
        """x / sqrt(mean(x^2) + eps) * weight over the last axis of float32 x (any leading shape,
        rows contiguous): one launch, a thread block per row (model.rms_norm's numbers to float32
        rounding; the sum of squares is reduced in another order)."""
        xp, D = self.xp, x.shape[-1]
        x = xp.ascontiguousarray(x, dtype=np.float32)
        out = xp.empty(x.shape, dtype=np.float32)
        rows = x.size // D
        if rows:
            self._launch("rmsnorm", (rows, 1), self.shapes["NM_THREADS"],
                         [x, D, xp.ascontiguousarray(weight, dtype=np.float32), eps, D, out, D])
        return out

    def rope(self, x, cos, sin, rot):
        """model.rope on the kernel: x [R, heads, D] (any strides; copied to rows first), cos/sin
        [R, 1, rot/2] -> a new float32 [R, heads, D]; one launch where the array code took eight."""
        xp = self.xp
        R, heads, D = x.shape
        x = xp.ascontiguousarray(x, dtype=np.float32)
        half = rot // 2
        cs = xp.ascontiguousarray(cos, dtype=np.float32).reshape(R, half)
        sn = xp.ascontiguousarray(sin, dtype=np.float32).reshape(R, half)
        out = xp.empty((R, heads, D), dtype=np.float32)
        n = out.size
        if n:
            self._launch("rope", (-(-n // self.shapes["EW_THREADS"]), 1), self.shapes["EW_THREADS"],
                         [x, heads * D, cs, sn, half, heads, D, out, n])
        return out

    def gate(self, gu, ffn_dim, gelu=False):
        """act(gate) * up for gu = [..., 2*ffn_dim] (gate | up): SiLU, or GELU's tanh form; one launch
        (model.swiglu / gelu_tanh_gate's numbers to float32 rounding)."""
        xp = self.xp
        gu = xp.ascontiguousarray(gu, dtype=np.float32)
        out = xp.empty(gu.shape[:-1] + (ffn_dim,), dtype=np.float32)
        n = out.size
        if n:
            self._launch("gate", (-(-n // self.shapes["EW_THREADS"]), 1), self.shapes["EW_THREADS"],
                         [gu, ffn_dim, int(bool(gelu)), out, n])
        return out

    def dequantize(self, blocks, qtype, k, rows=None, scale=1.0):
        """float32 [n, k]: rows `rows` (int32 device array; default all) of W, times `scale`."""
        n = blocks.shape[0] if rows is None else rows.shape[0]
        out = self.xp.empty((n, k), dtype=np.float32)
        grid = (-(-n * (k // UNIT) // self.shapes["DQ_THREADS"]), 1)
        self._launch("dequant", grid, self.shapes["DQ_THREADS"],
                     [qtype, blocks, n, k, blocks.shape[1], rows, out, k, scale])
        return out

    def table(self, keys, vals, pos, layer_stride=None):
        """The rows' KV addresses on the device for `attend` and `store`: row r's keys and values
        are the contiguous float32 arrays keys[r] and vals[r] (`[*, G, D]`, or a whole cache
        `[n_layer, *, G, D]` with layer_stride[r] its floats per layer), its position pos[r]."""
        R, xp = len(pos), self.xp
        kv = np.array([self.address(a) for a in keys] + [self.address(a) for a in vals], np.uint64).reshape(2, R)
        stride = np.zeros(R, np.int64) if layer_stride is None else np.asarray(layer_stride, np.int64)
        return KVTable(R, xp.asarray(kv), xp.asarray(stride), xp.asarray(np.asarray(pos, np.int32)))

    def attend(self, q, table, G, window=0, layer=0):
        """Attention of query rows q `[R, H, D]` (pre-scaled): row r at position table.pos[r] over
        its keys and values (see `table`), of layer `layer`. Returns `[R, H*D]`."""
        R, H, D = q.shape
        if D > self.shapes["AT_DMAX"] or H % G:
            raise ValueError(f"attention kernel: head size {D} (max {self.shapes['AT_DMAX']}), {H} heads over {G}")
        xp = self.xp
        q = xp.ascontiguousarray(q, dtype=np.float32)
        out = xp.empty((R, H * D), dtype=np.float32)
        for r0 in range(0, R, MAX_GRID_Y):                              # grid.y is at most 65535
            r1 = min(R, r0 + MAX_GRID_Y)
            part = table if (r0, r1) == (0, R) else table.rows(r0, r1, xp)
            self._launch("attend", (H, r1 - r0), self.shapes["AT_THREADS"],
                         [q[r0:r1], part.kv, part.stride, layer, part.pos, r1 - r0, H, G, D, window, out[r0:r1]])
        return out

    def store(self, k, v, table, layer=0):
        """Writes k, v `[R, G, D]` (any strides) at each row's position of layer `layer` (see `table`)."""
        xp, R = self.xp, k.shape[0]
        k = xp.ascontiguousarray(k, dtype=np.float32).reshape(R, -1)
        v = xp.ascontiguousarray(v, dtype=np.float32).reshape(R, -1)
        self._launch("store", (R, 1), self.shapes["ST_THREADS"], [k, v, table.kv, table.stride, layer, table.pos, R,
                                                              k.shape[1]])

    def address(self, a):
        """The device (or host) address of a contiguous array's first element."""
        if not a.flags.c_contiguous:
            raise ValueError("kernel arrays must be contiguous")
        return a.data.ptr if self.xp is not np else a.ctypes.data


# ---------------------------------------------------------------------------- GPU build

def device_kernels(cupy, shapes=None):
    """The kernels compiled by NVRTC for the current CUDA device, `cupy` the module backend.py
    imported (raises when CuPy cannot compile or load them); `shapes` overrides some of SHAPES."""
    shapes = {**SHAPES, **(shapes or {})}
    module = cupy.RawModule(code=SOURCE.read_text(), options=tuple(_flags(shapes)) + ("--std=c++14",))
    scalars = {"i": np.int32, "l": np.int64, "f": np.float32}
    functions = {name: module.get_function(name) for name in SIGNATURES}   # compiles and loads now

    def launch(name, grid, threads, args):
        fn = functions[name]
        kinds = SIGNATURES[name]
        fn(grid, (threads,), tuple(np.uint64(0) if a is None and c == "p" else a if c == "p" else scalars[c](a)
                                   for c, a in zip(kinds, args)))

    return Kernels(cupy, launch, "cuda", shapes)


# ---------------------------------------------------------------------------- host build

_HOST_LOCK = threading.Lock()
_HOST = {}


def host_kernels(shapes=None):
    """The kernels built for the host by a C++ compiler (for tests and `tools/gpu_check.py
    --device cpu`), `shapes` overriding some of SHAPES; raises RuntimeError without a compiler."""
    shapes = {**SHAPES, **(shapes or {})}
    key = tuple(sorted(shapes.items()))
    with _HOST_LOCK:
        if key not in _HOST:
            _HOST[key] = Kernels(np, _host_launcher(_build_host_library(shapes=shapes)), "host", shapes)
        return _HOST[key]


def _build_host_library(source=None, shapes=None):
    """Builds `source` (default kernels.cu) as a shared library (cached by content) and loads it."""
    text = (source if source is not None else SOURCE.read_text()).encode()
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ or $CXX) to build the host kernels")
    args = ["-O2", "-shared", "-fPIC", "-x", "c++", *_flags(shapes or SHAPES)]
    key = hashlib.sha256(text + " ".join(args).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"turbospark-gpu-kernels-{key}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src, lib = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.so"
            src.write_bytes(text)
            done = subprocess.run([cxx, *args, "-o", str(lib), str(src)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"host build of the kernels failed:\n{done.stderr[-2000:]}")
            shutil.move(str(lib), str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)
    return ctypes.CDLL(str(path))


def _host_launcher(lib):
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int, "l": ctypes.c_long, "f": ctypes.c_float}
    for name, kinds in SIGNATURES.items():
        getattr(lib, name).argtypes = [ctypes.c_int, ctypes.c_int] + [types[c] for c in kinds]
        getattr(lib, name).restype = None

    def launch(name, grid, threads, args):
        kinds = SIGNATURES[name]
        values = []
        for c, a in zip(kinds, args):
            if c == "p" and a is not None:
                if not a.flags.c_contiguous:
                    raise ValueError("kernel arrays must be contiguous")
                a = a.ctypes.data
            values.append(a)
        getattr(lib, name)(grid[0], grid[1], *values)

    return launch

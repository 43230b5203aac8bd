"""Array backend: numpy on the CPU, CuPy on a usable CUDA GPU. The only module that imports cupy."""
from dataclasses import dataclass

import numpy as np

from .options import DEVICES


@dataclass(slots=True)
class Backend:
    """The array module the engine computes with, and why it was chosen."""

    xp: object          # numpy or cupy
    name: str           # "numpy" | "cupy"
    reason: str
    kernels: object = None   # cupy: gpu.launch.Kernels for GGUF blocks (None when they do not compile)

    def synchronize(self):
        if self.name == "cupy":
            self.xp.cuda.get_current_stream().synchronize()


def select_backend(device=None):
    """Picks the backend for `device` ("auto" | "cpu" | "cuda"; None is auto: CuPy when a GPU works,
    else numpy). "cuda" raises RuntimeError with the reason when unusable."""
    device = (device or "auto").lower()
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        return Backend(np, "numpy", "cpu requested")
    cupy, problem = _probe_cupy()
    if cupy is not None:
        kernels, why = _device_kernels(cupy)
        return Backend(cupy, "cupy", "CUDA device usable" + why, kernels)
    if device == "cuda":
        raise RuntimeError(f"device 'cuda' requested but unusable: {problem}")
    return Backend(np, "numpy", f"no usable GPU: {problem}")


def _probe_cupy():
    """(cupy, None) when a smoke computation runs on the GPU, else (None, why not)."""
    try:
        import cupy
    except Exception as exc:   # ImportError, or a broken CUDA install raising at import
        return None, f"cupy not importable ({type(exc).__name__}: {exc})"
    try:
        if not cupy.cuda.is_available():
            return None, "cupy imported but no CUDA device is available"
        x = cupy.arange(16, dtype=cupy.float32).reshape(4, 4)
        float(((x * 2.0) @ x).sum())
        cupy.cuda.get_current_stream().synchronize()
    except Exception as exc:
        return None, f"CUDA smoke computation failed ({type(exc).__name__}: {exc})"
    return cupy, None


def _device_kernels(cupy):
    """(the block kernels compiled for the device, "") or (None, why not): without them the
    device runs float32 weights."""
    from .gpu.launch import device_kernels
    try:
        return device_kernels(cupy), ""
    except Exception as exc:   # NVRTC or driver errors, of CuPy's own types
        return None, f"; quantized kernels unavailable ({type(exc).__name__}: {exc})"


def to_host(a):
    """A numpy array from a numpy or cupy array (no copy for numpy)."""
    if a is None or isinstance(a, np.ndarray):
        return a
    return a.get()

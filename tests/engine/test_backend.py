"""Backend choice: numpy with a reason when no GPU is usable; a forced "cuda" that cannot work raises."""
import sys
import types

import numpy as np
import pytest

from turbospark_wsgi.config import Config
from turbospark_wsgi.engine.backend import select_backend, to_host
from turbospark_wsgi.engine.loader import load_model


def _cupy_usable():
    try:
        select_backend("cuda")
    except RuntimeError:
        return False
    return True


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif("not _cupy_usable()", reason="needs cupy and a usable CUDA device")


def fake_cupy(monkeypatch, available=True, broken=False):
    def arange(*a, **k):
        if broken:
            raise RuntimeError("CUDA driver version is insufficient")
        return np.arange(*a, **k)
    cuda = types.SimpleNamespace(is_available=lambda: available)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, arange=arange, float32=np.float32))


def test_auto_without_gpu_is_numpy_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)          # import fails, as on a CPU-only machine
    backend = select_backend("auto")
    assert backend.xp is np and backend.name == "numpy"
    assert "cupy not importable" in backend.reason


@pytest.mark.skipif("_cupy_usable()", reason="this machine has a usable GPU")
def test_auto_on_this_machine_is_numpy():
    backend = select_backend()
    assert backend.name == "numpy" and backend.reason.startswith("no usable GPU")


def test_forced_cuda_raises_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(RuntimeError, match="device 'cuda' requested but unusable: cupy not importable"):
        select_backend("cuda")
    fake_cupy(monkeypatch, available=False)
    with pytest.raises(RuntimeError, match="no CUDA device is available"):
        select_backend("cuda")
    fake_cupy(monkeypatch, broken=True)
    with pytest.raises(RuntimeError, match="smoke computation failed.*driver version"):
        select_backend("cuda")
    assert "smoke computation failed" in select_backend("auto").reason


def test_env_and_cpu():
    assert select_backend("cpu").name == "numpy"
    device = Config.from_env({"TURBOSPARK_DEVICE": "cpu"}).engine_options().device    # the server's path
    assert select_backend(device).reason == "cpu requested"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        select_backend("tpu")


def test_to_host_passes_numpy_through():
    a = np.ones(3, dtype=np.float32)
    assert to_host(a) is a and to_host(None) is None


def test_only_backend_imports_cupy():
    import ast
    import importlib
    import pathlib
    engine = pathlib.Path(importlib.import_module("turbospark_wsgi.engine").__file__).parent
    for path in engine.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        if path.name != "backend.py":
            assert not any(n.split(".")[0] == "cupy" for n in names), path.name
        else:   # never at import time: only inside functions
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not any("cupy" in ast.dump(n) for n in top)


@gpu
@needs_gpu
def test_cupy_backend_is_chosen():
    backend = select_backend("auto")
    assert backend.name == "cupy"
    backend.synchronize()


@gpu
@needs_gpu
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_cupy_matches_numpy(tiny_gguf, qtype):
    path = tiny_gguf(qtype=qtype, tied=qtype == "Q8_0").path
    # the float32 numpy path: the device computes in float32 from the same dequantized values (the
    # CPU's quantized path rounds activations to int8)
    cpu, gpu_model = load_model(path, device="cpu", weights="fp32").model, load_model(path, device="cuda").model
    ids = list(np.random.default_rng(0).integers(0, cpu.cfg.vocab_size, 40))
    a = cpu.forward(ids, cpu.new_cache(), logits="all")
    b = gpu_model.forward(ids, gpu_model.new_cache(), logits="all")
    assert isinstance(b, np.ndarray) and np.abs(a - b).max() < 1e-3
    caches, tokens = (cpu.new_cache(), gpu_model.new_cache()), ([], [])
    logits = [m.forward(ids, c) for m, c in zip((cpu, gpu_model), caches)]
    for _ in range(32):
        for i, m in enumerate((cpu, gpu_model)):
            tokens[i].append(int(np.argmax(logits[i])))
            logits[i] = m.forward(tokens[i][-1:], caches[i])
    assert tokens[0] == tokens[1]

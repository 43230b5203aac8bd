"""The device forward pass (engine/gpu: blocks kept as the file stores them, attention on the
kernel) run with the kernels built for the host, against the numpy float32 path on the same file;
and the loader choosing it only where the backend brings kernels."""
import shutil

import numpy as np
import pytest

from turbospark_wsgi.engine import loader
from turbospark_wsgi.engine.backend import Backend
from turbospark_wsgi.engine.gguf import GGUFFile
from turbospark_wsgi.engine.gpu.launch import host_kernels
from turbospark_wsgi.engine.gpu.model import DeviceTransformer, load_device_model
from turbospark_wsgi.engine.gpu.weights import DeviceLinear
from turbospark_wsgi.engine.loader import load_model
from turbospark_wsgi.engine.model import Transformer

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="needs a C++ compiler")


def pair(path):
    ref = load_model(path, device="cpu", weights="fp32")
    return ref.model, load_device_model(ref.config, GGUFFile(str(path)), host_kernels())


def assert_same_model(ref, dev, prompt_len=150, tol=1e-4):
    ids = np.random.default_rng(0).integers(0, ref.cfg.vocab_size, prompt_len)
    a = ref.forward(ids, ref.new_cache(), logits="all")
    b = dev.forward(ids, dev.new_cache(), logits="all")
    assert np.abs(a - b).max() < tol * max(1.0, np.abs(a).max())
    caches = [[m.new_cache() for _ in range(3)] for m in (ref, dev)]
    for m, cs in zip((ref, dev), caches):
        for n, c in zip((5, 140, 3), cs):                             # one decodes past a key tile
            m.forward(ids[:n], c, logits="none")
    for step in range(3):
        a, b = (m.decode_batch([step, 7, 11], cs) for m, cs in zip((ref, dev), caches))
        assert np.abs(a - b).max() < tol * max(1.0, np.abs(a).max())


@pytest.mark.parametrize("qtype, tied", [("Q4_0", False), ("Q8_0", True), ("Q4_1", False), ("F32", False)])
def test_device_model_matches_numpy(tiny_gguf, qtype, tied):
    ref, dev = pair(tiny_gguf(qtype=qtype, tied=tied).path)
    kept = {p.qtype for lw in dev.w.layers for p in lw.wqkv.parts + lw.w_down.parts}
    assert kept == ({0} if qtype == "F32" else {dict(Q4_0=2, Q4_1=3, Q8_0=8)[qtype]})   # blocks as stored
    assert_same_model(ref, dev)


def test_device_model_matches_numpy_on_stories(stories_gguf):
    assert_same_model(*pair(stories_gguf))


def test_loader_picks_the_device_model_only_with_kernels(tiny_gguf, monkeypatch):
    path = tiny_gguf(qtype="Q8_0").path
    with_kernels = Backend(np, "numpy", "test: host-built kernels", host_kernels())
    monkeypatch.setattr(loader, "select_backend", lambda device: with_kernels)
    model = load_model(path).model
    assert isinstance(model, DeviceTransformer) and isinstance(model.w.layers[0].wo, DeviceLinear)
    assert type(load_model(path, weights="fp32").model) is Transformer   # float32 asked: the float path
    monkeypatch.setattr(loader, "select_backend", lambda device: Backend(np, "numpy", "cpu requested"))
    assert type(load_model(path).model) is Transformer                   # no kernels: as before

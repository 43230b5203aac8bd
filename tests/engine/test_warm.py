"""Compiling the CPU kernels once per machine (kernels/warm.py for numba's, kernels/native.py for the
C kernels): workers starting together compile once, and a warm cache is only loaded."""
import json
import os
import subprocess
import sys

import pytest

from turbospark_wsgi.engine.kernels import cpu as kernels_cpu

pytestmark = pytest.mark.skipif(not kernels_cpu.AVAILABLE, reason="numba is not installed")

_LOAD = """
import json, sys, time
t = time.perf_counter()
from turbospark_wsgi.engine.kernels import attention, cpu as kernels_cpu, layer as kernels_layer, int8 as kernels_q8, warm
from turbospark_wsgi.engine.loader import load_model
m = load_model(sys.argv[1], device="cpu", kernels=sys.argv[2]).model
ds = [kernels_layer.LAYER[m.plan.isa], kernels_q8.PRODUCT[m.plan.isa], kernels_cpu._q4_batch, attention.attend_rows]
print(json.dumps({"misses": sum(sum(d.stats.cache_misses.values()) for d in ds), "native": m.plan.native is not None,
                  "built": bool(m.plan.native and m.plan.native.built),
                  "warm": warm.is_warm(m.plan.isa), "seconds": time.perf_counter() - t}))
"""


def _start(model, cache, kernels="numba"):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    return subprocess.Popen([sys.executable, "-c", _LOAD, str(model), kernels], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.splitlines()[-1])


@pytest.mark.slow
def test_workers_starting_together_compile_once_and_a_restart_only_loads(stories_gguf, tmp_path):
    first, second = _start(stories_gguf, tmp_path), _start(stories_gguf, tmp_path)
    a, b = _result(first), _result(second)
    assert sorted([a["misses"] > 0, b["misses"] > 0]) == [False, True], (a, b)   # one compiled, one loaded
    assert a["warm"] and b["warm"]
    again = _result(_start(stories_gguf, tmp_path))
    assert again["misses"] == 0 and again["warm"]


def test_workers_starting_together_build_the_c_kernels_once_and_compile_nothing(stories_gguf, tmp_path):
    from turbospark_wsgi.engine.kernels import native
    if native.compiler() is None:
        pytest.skip("no C compiler")
    first, second = _start(stories_gguf, tmp_path, "native"), _start(stories_gguf, tmp_path, "native")
    a, b = _result(first), _result(second)
    assert a["native"] and b["native"], (a, b)
    assert sorted([a["built"], b["built"]]) == [False, True], (a, b)        # one built, one loaded it
    assert a["misses"] == 0 and b["misses"] == 0                            # and numba compiled nothing
    again = _result(_start(stories_gguf, tmp_path, "native"))
    assert again["native"] and not again["built"] and again["misses"] == 0


def test_a_new_cache_is_not_taken_for_warm(tmp_path, monkeypatch):
    import numba
    from turbospark_wsgi.engine.kernels import warm
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    assert warm.cache_dir() == str(tmp_path) and not warm.is_warm("avx2")
    warm._mark("avx2")
    assert warm.is_warm("avx2") and not warm.is_warm("generic")


def test_kernels_cached_from_other_sources_are_dropped(tmp_path, monkeypatch):
    """numba checks only a function's own file: a layer kernel cached before int8.py changed would
    keep the old product inside it, so every kernel cache goes when any kernel source differs."""
    import numba
    from turbospark_wsgi.engine.kernels import warm
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    ours, other = tmp_path / "kernels_0123", tmp_path / "elsewhere"
    ours.mkdir(), other.mkdir()
    files = [ours / "layer.layer-183.py311.nbi", ours / "int8.product-1.py311.1.nbc", other / "layer.x-1.py311.nbi",
             ours / "encoder._gelu-1.py311.nbi", tmp_path / "turbospark-warm-0000000000000000-avx2"]
    for f in files:
        f.write_text("x")
    warm._mark("avx2")                                  # a complete warm-up of these sources: nothing goes
    warm.purge_stale()
    assert all(f.exists() for f in files)
    os.remove(warm._marker("avx2"))
    warm.purge_stale()                                  # compiled from other sources: ours go, others stay
    assert [f.exists() for f in files] == [False, False, True, True, False]

"""engine/ reads no environment variable and sets no process state when imported: its settings come
as EngineOptions, and load_model puts the process-wide ones in force (read with `ast`, and run)."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turbospark_wsgi.engine import EngineOptions

ENGINE = Path(__file__).resolve().parents[2] / "turbospark_wsgi" / "engine"
MODULES = sorted(ENGINE.glob("*.py"))


def _environ_uses(tree):
    """(line, how) for each use of os.environ / os.getenv / os.putenv, `how` naming the call made on
    it (setdefault, get, ...) and whether it sits inside a function."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            up, in_function = parents.get(node), False
            how = up.attr if isinstance(up, ast.Attribute) else node.attr
            while up is not None:
                in_function |= isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
                up = parents.get(up)
            yield node.lineno, how, in_function


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_engine_modules_never_read_the_environment(path):
    for line, how, in_function in _environ_uses(ast.parse(path.read_text(), str(path))):
        # the only use allowed: a default for libgomp, written by a function load_model calls
        assert how == "setdefault" and in_function, f"{path.name}:{line} uses os.{how}"


_PROBE = """
import importlib, json, os, pkgutil, sys
import turbospark_wsgi.engine as pkg
before = dict(os.environ)
for m in pkgutil.iter_modules(pkg.__path__):
    importlib.import_module("turbospark_wsgi.engine." + m.name)
from turbospark_wsgi.engine import load_engine
from turbospark_wsgi.engine.kernels import cpu as kernels_cpu
imported = (dict(os.environ) == before, kernels_cpu.GEMV_MAX_B, kernels_cpu.SINGLE_ROW_THREADS,
            kernels_cpu.ACTIVATIONS)
engine = load_engine(sys.argv[1], device="cpu", gemv_max_b=7, single_row_threads=3, activations="float32")
changed = sorted(k for k in set(before) | set(os.environ)
                 if before.get(k) != os.environ.get(k) and k != "KMP_DUPLICATE_LIB_OK")   # threadpoolctl's own
print(json.dumps({"imported": imported, "loaded": [changed, kernels_cpu.GEMV_MAX_B,
                                                   kernels_cpu.SINGLE_ROW_THREADS, kernels_cpu.ACTIVATIONS,
                                                   engine.model.plan.activations, engine.backend]}))
"""


def test_importing_the_engine_changes_nothing_and_loading_applies_the_options(stories_gguf):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(TURBOSPARK_GEMV_MAX_B="5", TURBOSPARK_SINGLE_ROW_THREADS="2", TURBOSPARK_DEVICE="cuda",
               TURBOSPARK_WEIGHTS="nonsense", TURBOSPARK_ACTIVATIONS="float32",
               TURBOSPARK_ENCODER_THREADS="3")       # ignored by the engine: only Config reads them
    out = subprocess.run([sys.executable, "-c", _PROBE, str(stories_gguf)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["imported"] == [True, 256, 0, None]         # no environment written, none read
    assert got["loaded"] == [[], 7, 3, None, "float32", "numpy"]   # the model's plan, nothing process-wide


def test_options_refuse_unknown_weights_and_overrides_keep_the_rest():
    with pytest.raises(ValueError, match="weights must be auto, quant or fp32, not 'int4'"):
        EngineOptions(weights="int4")
    with pytest.raises(ValueError, match="activations must be auto, int8 or float32"):
        EngineOptions(activations="int4")
    with pytest.raises(ValueError, match="kv_cache must be auto, f16, f32 or q8_0, not 'f8'"):
        EngineOptions(kv_cache="f8")
    from turbospark_wsgi.engine.options import resolve
    base = EngineOptions(device="cpu", max_batch=2)
    assert resolve(base, {"max_batch": 4, "device": None}) == EngineOptions(device="cpu", max_batch=4)
    assert resolve(None, {}) == EngineOptions()

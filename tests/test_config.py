"""config.py owns every TURBOSPARK_* variable: the engine's settings reach it as EngineOptions,
gunicorn.conf.py takes Config's thread count, and the default model is named once."""
import os
import runpy
from pathlib import Path

import pytest

from turbospark_wsgi import cli
from turbospark_wsgi.config import DEFAULT_MODEL, Config, ConfigError, setting_from_env, weight_cache_dir, worker_threads
from turbospark_wsgi.engine import EngineOptions

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "turbospark_wsgi"


def test_config_defaults_and_env():
    assert Config().max_waiting == 16 and Config().threads == 16 + 8 + 8 + 4 and Config().model == "smollm2-135m-instruct"
    c = Config.from_env({"TURBOSPARK_MODELS": "~/m", "TURBOSPARK_MAX_WAITING": "3", "TURBOSPARK_DEVICE": "CPU",
                         "TURBOSPARK_API_KEYS": "a, b,,", "TURBOSPARK_QUEUE_TIMEOUT": "2.5",
                         "TURBOSPARK_WORKER_CLASS": "gevent", "TURBOSPARK_PORT": "9000",
                         "TURBOSPARK_MAX_PAUSED": "2", "TURBOSPARK_FRONT_DOOR": "off"})
    assert Config().front_door and not c.front_door
    assert c.models_dir == os.path.expanduser("~/m") and c.max_waiting == 3 and c.device == "cpu"
    assert c.api_keys == ("a", "b") and c.queue_timeout == 2.5 and c.worker_class == "gevent" and c.port == 9000
    assert c.threads == 3 + 8 + 2 + 4 and c.max_paused == 2


@pytest.mark.parametrize("env, words", [
    ({"TURBOSPARK_MAX_WAITING": "lots"}, "TURBOSPARK_MAX_WAITING must be an integer"),
    ({"TURBOSPARK_MAX_WAITING": "-1"}, "TURBOSPARK_MAX_WAITING must be >= 0"),
    ({"TURBOSPARK_DEVICE": "tpu"}, "TURBOSPARK_DEVICE must be one of"),
    ({"TURBOSPARK_KEEPALIVE": "0"}, "keepalive"),
    ({"TURBOSPARK_QUEUE_TIMEOUT": "nan"}, "TURBOSPARK_QUEUE_TIMEOUT"),
    ({"TURBOSPARK_MAX_BODY": "0"}, "TURBOSPARK_MAX_BODY must be >= 1"),
    ({"TURBOSPARK_WORKER_CLASS": "sync"}, "TURBOSPARK_WORKER_CLASS"),
    ({"TURBOSPARK_LOAD_DEFAULT": "maybe"}, "true or false"),
    ({"TURBOSPARK_WEIGHTS": "int4"}, "TURBOSPARK_WEIGHTS must be one of auto, quant, fp32"),
    ({"TURBOSPARK_GEMV_MAX_B": "many"}, "TURBOSPARK_GEMV_MAX_B must be an integer"),
    ({"TURBOSPARK_SINGLE_ROW_THREADS": "-1"}, "TURBOSPARK_SINGLE_ROW_THREADS must be >= 0"),
    ({"TURBOSPARK_COMPUTE_NICE": "-5"}, "TURBOSPARK_COMPUTE_NICE must be >= 0"),
    ({"TURBOSPARK_ACTIVATIONS": "int4"}, "TURBOSPARK_ACTIVATIONS must be one of auto, int8, float32"),
    ({"TURBOSPARK_ENCODER_THREADS": "0"}, "TURBOSPARK_ENCODER_THREADS must be >= 1"),
    ({"TURBOSPARK_FRONT_DOOR": "maybe"}, "TURBOSPARK_FRONT_DOOR must be true or false"),
    ({"TURBOSPARK_FRONT_DOOR": "\ud800"}, "TURBOSPARK_FRONT_DOOR must be true or false"),
    ({"TURBOSPARK_FUSED_LAYERS": "2"}, "TURBOSPARK_FUSED_LAYERS must be true or false"),
    ({"TURBOSPARK_INT8_ISA": "sse9"}, "TURBOSPARK_INT8_ISA must be one of auto, vnni512, avxvnni, avx2, neon"),
    ({"TURBOSPARK_INT8_ISA": "\ud800"}, "TURBOSPARK_INT8_ISA must be one of"),
    ({"TURBOSPARK_KV_CACHE": "f8"}, "TURBOSPARK_KV_CACHE must be one of auto, f16, f32, q8_0"),
    ({"TURBOSPARK_KV_CACHE": "\ud800"}, "TURBOSPARK_KV_CACHE must be one of"),
    ({"TURBOSPARK_KV_CACHE": "f16" * 10000}, "TURBOSPARK_KV_CACHE must be one of"),
    ({"TURBOSPARK_KERNELS": "fortran"}, "TURBOSPARK_KERNELS must be one of auto, native, numba"),
    ({"TURBOSPARK_KERNELS": "\ud800"}, "TURBOSPARK_KERNELS must be one of"),
    ({"TURBOSPARK_KERNELS": "c" * 30000}, "TURBOSPARK_KERNELS must be one of"),
    ({"TURBOSPARK_SPECULATIVE": "ngram"}, "TURBOSPARK_SPECULATIVE must be one of auto, on, off"),
    ({"TURBOSPARK_SPECULATIVE_TOKENS": "-1"}, "TURBOSPARK_SPECULATIVE_TOKENS must be >= 0"),
    ({"TURBOSPARK_SPECULATIVE_TOKENS": "8.5"}, "TURBOSPARK_SPECULATIVE_TOKENS must be an integer"),
])
def test_config_errors_name_the_variable(env, words):
    with pytest.raises(ConfigError) as e:
        Config.from_env(env)
    assert words in str(e.value)


def test_engine_settings_reach_the_engine_as_options():
    # the server keeps paused slots; activations are auto (int8 where the CPU has integer dots)
    assert Config().engine_options() == EngineOptions(max_paused=8 + 2, activations="auto",   # + batch lines
                                                      weight_cache=weight_cache_dir(Config()))
    c = Config.from_env({"TURBOSPARK_DEVICE": "cpu", "TURBOSPARK_WEIGHTS": "FP32", "TURBOSPARK_GEMV_MAX_B": "64",
                         "TURBOSPARK_SINGLE_ROW_THREADS": "1", "TURBOSPARK_MAX_CONTEXT": "512",
                         "TURBOSPARK_PREFILL_CHUNK": "32", "TURBOSPARK_MAX_BATCH": "4", "TURBOSPARK_MAX_PAUSED": "0",
                         "TURBOSPARK_COMPUTE_NICE": "0", "TURBOSPARK_ACTIVATIONS": "Float32",
                         "TURBOSPARK_ENCODER_THREADS": "2", "TURBOSPARK_INT8_VNNI": "0",
                         "TURBOSPARK_FUSED_LAYERS": "0", "TURBOSPARK_INT8_ISA": "AVX2", "TURBOSPARK_SPECULATIVE": "Off", "TURBOSPARK_KV_CACHE": "F32",
                         "TURBOSPARK_SPECULATIVE_TOKENS": "3", "TURBOSPARK_KERNELS": "Numba",
                         "TURBOSPARK_WEIGHT_CACHE": "/srv/weights"})
    assert c.engine_options() == EngineOptions(device="cpu", weights="fp32", max_context=512, prefill_chunk=32,
                                               max_batch=4, max_paused=0 + 2, gemv_max_b=64, single_row_threads=1,
                                               activations="float32", encoder_threads=2, int8_vnni=False,
                                               int8_isa="avx2", fused_layers=False, kv_cache="f32", speculative="off",
                                               speculative_tokens=3, kernels="numba", weight_cache="/srv/weights")
    assert c.compute_nice == 0 and Config().compute_nice == 5


@pytest.mark.parametrize("env", [{}, {"TURBOSPARK_THREADS": "5"}, {"TURBOSPARK_THREADS": "100"},
                                 {"TURBOSPARK_MAX_WAITING": "2", "TURBOSPARK_MAX_BATCH": "1"},
                                 {"TURBOSPARK_THREADS": "19", "TURBOSPARK_MAX_WAITING": "16"}])
def test_gunicorn_runs_the_configs_thread_count(env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in {"TURBOSPARK_THREADS", "TURBOSPARK_MAX_WAITING", "TURBOSPARK_MAX_BATCH", "TURBOSPARK_MAX_PAUSED"} - set(env):
        monkeypatch.delenv(name, raising=False)
    settings = runpy.run_path(str(REPO / "gunicorn.conf.py"))
    assert settings["threads"] == Config.from_env().threads


def test_thread_count_rule():
    assert worker_threads(0, 16, 8, 8) == 36       # max_waiting + max_batch + max_paused + 4
    assert worker_threads(100, 16, 8, 8) == 100
    assert worker_threads(5, 16, 8, 8) == 20       # never below max_waiting + 4: each open stream holds one


def test_one_setting_without_the_rest():
    env = {"TURBOSPARK_MODELS": "~/m", "TURBOSPARK_API_KEY_FILE": "/nonexistent", "TURBOSPARK_PORT": "x"}
    assert setting_from_env("models_dir", env) == str(Path("~/m").expanduser())
    assert setting_from_env("model", env) == DEFAULT_MODEL
    assert setting_from_env("index_url", {"TURBOSPARK_INDEX_URL": "http://h/simple/"}) == "http://h/simple/"


def test_the_default_model_is_named_once():
    """In config.py as the default, and in pull.py's table of what can be pulled; nowhere else."""
    holders = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if DEFAULT_MODEL in p.read_text()}
    assert holders == {"config.py", "pull.py"}
    assert cli.build_parser().parse_args(["pull"]).name == DEFAULT_MODEL
    assert cli.build_parser().parse_args(["check", "--prompt", "x"]).model == DEFAULT_MODEL

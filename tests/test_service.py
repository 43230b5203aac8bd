"""The registry and the service seam, on the fake engine (Config: test_config.py)."""
import json
import os
import struct
import threading
import time

import pytest

from turbospark_wsgi.serving import compute
from turbospark_wsgi.serving.cancel import CancelToken
from turbospark_wsgi.config import Config
from turbospark_wsgi.serving.params import Sampling
from turbospark_wsgi.serving.registry import Registry
from turbospark_wsgi.errors import (ContextLengthExceeded, EngineError, InvalidRequest, ModelLoadError,
                                    ModelNotFound, Overloaded)
from turbospark_wsgi.serving.generation import Finished, KeepAlive, TextDelta
from turbospark_wsgi.serving.service import GenerationRequest


def collect(events):
    """Drains a Generation's events: (text, Finished), or (text, None) when it was cancelled."""
    parts, finished = [], None
    for event in events:
        if isinstance(event, TextDelta):
            parts.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    return "".join(parts), finished


def request(**kw):
    kw.setdefault("prompt", "hi")
    return GenerationRequest(**kw)


# ---- registry --------------------------------------------------------------------------------

def test_registry_lists_files_dirs_and_aliases(harness):
    (harness.root / "hf-model").mkdir()
    (harness.root / "hf-model" / "config.json").write_text("{}")
    (harness.root / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    (harness.root / "aliases.json").write_text(json.dumps({"tiny": "fake.gguf", "gone": "missing.gguf"}))
    infos = {i.id: i for i in harness.registry.list()}
    assert set(infos) == {"fake", "other", "hf-model", "SmolLM2-135M-Instruct.Q4_1", "smollm2-135m-instruct", "tiny"}
    assert infos["tiny"].alias_of == "fake" and infos["smollm2-135m-instruct"].alias_of == "SmolLM2-135M-Instruct.Q4_1"
    assert not infos["fake"].loaded and infos["fake"].created > 0


def test_registry_resolves_once_by_id_alias_case_and_the_configured_default_path(harness):
    default = str(harness.root / "fake.gguf")       # the operator may name the default by its path
    registry = Registry(Config(models_dir=str(harness.root), model=default, load_default=False), harness.load)
    (harness.root / "aliases.json").write_text(json.dumps({"tiny": "fake"}))
    first = registry.resolve("fake")
    assert registry.resolve("tiny") is first and registry.resolve("FAKE") is first
    assert registry.resolve(default) is first and registry.resolve(None) is first and len(harness.loads) == 1
    assert registry.loaded("fake") is first


def _hostile_model_names(root, outside):
    inside = str(root / "fake.gguf")
    return [inside, str(root / "other.gguf"), str(root / "fake"), str(root) + "//fake.gguf", "./fake.gguf",
            "fake.gguf", "../" + root.name + "/fake.gguf", outside, os.path.dirname(outside),
            "/etc/passwd", "../../etc/passwd", "/proc/self/environ", "//etc//passwd", "/etc/", "/nonexistent.gguf",
            "~/" + os.path.basename(outside), "file://" + inside, inside + "\x00", " fake", "fake ", "fake/"]


def test_a_request_can_name_only_installed_models_never_a_path(harness, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "other.gguf"
    outside.write_bytes(b"GGUF")
    for name in _hostile_model_names(harness.root, str(outside)):
        with pytest.raises(ModelNotFound) as e:
            harness.registry.resolve(name)
        assert e.value.message == f"The model '{name}' does not exist or is not installed", name
    assert harness.loads == []


def test_a_path_model_gets_the_same_404_whether_or_not_the_file_exists(harness):
    client = harness.client()
    bodies = []
    for name in ("/etc/passwd", "/etc/no-such-file", "../../etc/passwd", "../../etc/no-such-file"):
        r = client.post_json("/v1/completions", {"model": name, "prompt": "hi"}, expect_errors=True)
        assert r.status_int == 404 and r.json["error"]["code"] == "model_not_found"
        bodies.append(r.json["error"]["message"].replace(name, "NAME"))
    assert len(set(bodies)) == 1 and harness.loads == []


def test_registry_loads_on_the_compute_thread_once_under_concurrency(harness):
    threads_seen, results = [], []
    real = harness.load

    def slow_load(path, **kw):
        threads_seen.append(threading.current_thread().name)
        time.sleep(0.05)
        return real(path, **kw)

    harness.registry._loader = slow_load
    workers = [threading.Thread(target=lambda: results.append(harness.registry.resolve("fake"))) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(5)
    assert len(threads_seen) == 1 and threads_seen[0].startswith("turbospark-compute")
    assert len({id(r) for r in results}) == 1


def test_registry_unknown_and_broken_models(harness):
    with pytest.raises(ModelNotFound) as e:
        harness.registry.resolve("nope")
    assert e.value.status == 404 and e.value.code == "model_not_found" and "nope" in e.value.message
    (harness.root / "broken.gguf").write_bytes(b"x")
    for _ in range(2):
        with pytest.raises(ModelLoadError) as e:
            harness.registry.resolve("broken")
        assert "broken" in e.value.message and "Q3_XX" in e.value.message
    assert harness.loads.count(os.path.realpath(harness.root / "broken.gguf")) == 1   # failure remembered
    (harness.root / "aliases.json").write_text(json.dumps({"shaky": "broken.gguf"}))
    with pytest.raises(ModelLoadError) as e:                # each caller sees its own name
        harness.registry.resolve("shaky")
    assert e.value.message.startswith("The model 'shaky' could not be loaded") and "'broken'" not in e.value.message


@pytest.mark.parametrize("error", [OSError(13, "Permission denied"), FileNotFoundError(2, "No such file", "X"),
                                   ValueError("corrupt GGUF at X"), struct.error("X"),
                                   MemoryError(), RecursionError("X")])
def test_a_failed_load_is_a_load_error_that_names_no_path(harness, error):
    path = os.path.realpath(harness.root / "fake.gguf")

    def failing(p, **kw):
        harness.loads.append(p)
        for arg in range(len(error.args)):
            if error.args[arg] == "X" or (isinstance(error.args[arg], str) and "X" in error.args[arg]):
                error.args = tuple(a.replace("X", p) if isinstance(a, str) else a for a in error.args)
        raise error

    harness.registry._loader = failing
    for _ in range(2):
        with pytest.raises(ModelLoadError) as e:
            harness.registry.resolve("fake")
        assert e.value.code == "model_load_failed" and "'fake'" in e.value.message
        assert path not in e.value.message and str(harness.root) not in e.value.message
    assert harness.loads == [path]


def test_a_bare_word_is_never_a_file_in_the_cwd(harness, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "word").write_text("x")
    assert harness.registry.find("word") is None


# ---- admission -------------------------------------------------------------------------------

def test_admission_is_eager_and_generation_lazy(harness):
    engine = harness.engine("fake")
    events = harness.service.run(request(), CancelToken())
    assert engine.runs == [] and harness.service.queue.running == 1
    text, finished = collect(events)
    events.close()
    assert text == "Hello world" and finished.reason == "stop"
    assert finished.usage.prompt_tokens == 3 and finished.usage.completion_tokens == 11
    assert engine.runs[0].thread.name.startswith("turbospark-compute") and harness.service.queue.running == 0


def test_context_overflow_names_the_numbers(harness):
    harness.engine("fake", max_context=20)
    with pytest.raises(ContextLengthExceeded) as e:
        harness.service.run(request(prompt="0123456789", max_tokens=12), CancelToken())
    msg = e.value.message
    assert e.value.code == "context_length_exceeded" and e.value.status == 400
    assert "20 tokens" in msg and "23 tokens" in msg and "11 in the prompt" in msg and "12 for the completion" in msg
    with pytest.raises(ContextLengthExceeded) as e:
        harness.service.run(request(prompt="x" * 30), CancelToken())
    assert e.value.param == "prompt" and "31 tokens" in e.value.message
    assert harness.service.queue.running == 0


def test_config_max_context_caps_the_engine(make_harness):
    h = make_harness(max_context=10)
    h.engine("fake", max_context=64)
    with pytest.raises(ContextLengthExceeded):
        h.service.run(request(prompt="abcdef", max_tokens=5), CancelToken())


def test_no_max_tokens_means_up_to_the_context(harness):
    engine = harness.engine("fake", max_context=20, reply="x" * 40)
    text, finished = collect(harness.service.run(request(max_tokens=None), CancelToken()))
    assert engine.runs[0].params.max_new_tokens == 17 and finished.reason == "length" and len(text) == 17


def test_token_ids_and_logit_bias_are_checked_against_the_vocabulary(harness):
    harness.engine("fake")
    with pytest.raises(InvalidRequest) as e:
        harness.service.run(request(prompt=None, prompt_ids=[5, 999]), CancelToken())
    assert e.value.param == "prompt" and "999" in e.value.message
    with pytest.raises(InvalidRequest) as e:
        harness.service.run(request(sampling=Sampling(logit_bias={5000: 1.0})), CancelToken())
    assert e.value.param == "logit_bias"


def test_queue_full_is_refused_at_admission(make_harness):
    h = make_harness(max_waiting=1)
    h.engine("fake")
    first = h.service.run(request(), CancelToken())
    second = h.service.run(request(), CancelToken())
    with pytest.raises(Overloaded) as e:
        h.service.run(request(), CancelToken())
    assert e.value.headers["Retry-After"]
    first.close()
    second.close()
    assert h.service.queue.running == 0


def test_keepalives_while_queued_and_while_a_step_is_slow(harness):
    harness.engine("fake", reply="ab", prefill_delay=0.2)
    holder = harness.service.queue.enqueue()
    holder.wait(0)
    events = harness.service.run(request(), CancelToken())
    assert next(events) == KeepAlive("queued")
    holder.release()
    seen = list(events)
    assert KeepAlive("running") in seen and seen[-1].reason == "stop"
    assert [e.text for e in seen if isinstance(e, TextDelta)] == ["a", "b"]


def test_keepalives_during_many_quick_silent_steps(harness):
    harness.engine("fake", reply="a", prefill_delay=0.02, prefill_chunks=15)     # 0.3 s, 20 ms per step
    seen = list(harness.service.run(request(), CancelToken()))
    assert seen.count(KeepAlive("running")) >= 3 and seen[-1].reason == "stop"


def test_generations_never_overlap(harness):
    engine = harness.engine("fake", reply="abcdef", step_delay=0.005)
    results = []

    def one():
        events = harness.service.run(request(), CancelToken())
        try:
            results.append(collect(events)[0])
        finally:
            events.close()

    workers = [threading.Thread(target=one) for _ in range(5)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(10)
    assert results == ["abcdef"] * 5 and engine.overlaps == 0 and engine.closed == 5


def test_an_engine_failure_becomes_a_generic_engine_error(harness, caplog):
    engine = harness.engine("fake", fail_at=2)
    events = harness.service.run(request(request_id="req-42"), CancelToken())
    with pytest.raises(EngineError) as e:
        collect(events)
    assert "req-42" in e.value.message and "exploded" not in e.value.message
    assert "req-42" in caplog.text and "exploded" in caplog.text
    events.close()
    assert harness.service.queue.running == 0 and engine.closed == 1


def test_cancel_mid_run_ends_without_finished(harness):
    harness.engine("fake", reply="x" * 50, step_delay=0.01)
    token = CancelToken()
    events = harness.service.run(request(max_tokens=50), token)
    got = [next(events) for _ in range(3)]
    token.cancel("client disconnected")
    rest = list(events)
    assert all(isinstance(e, TextDelta) for e in got + rest) and len(got + rest) < 50
    assert events.finish_reason == "cancelled" and harness.service.queue.running == 0


def test_stop_strings_and_finish_text(harness):
    harness.engine("fake", reply="Hello world")
    text, finished = collect(harness.service.run(request(sampling=Sampling(stop=("wor",))), CancelToken()))
    assert finished.stop_string == "wor" and finished.reason == "stop" and "wor" not in text


# ---- health and background load ---------------------------------------------------------------

def test_health_loading_then_ok(harness):
    assert harness.service.health()["status"] == "loading"
    harness.service.start_loading()
    deadline = time.monotonic() + 5
    while harness.service.health()["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.01)
    body = harness.service.health()
    assert body["status"] == "ok" and body["backend"] == "fake" and body["queue"]["waiting"] == 0
    harness.service.start_loading()         # once per process
    assert len(harness.loads) == 1


def test_health_reports_a_failed_default_load(make_harness):
    h = make_harness(model="broken")
    (h.root / "broken.gguf").write_bytes(b"x")
    h.service._load_default()
    body = h.service.health()
    assert body["status"] == "error" and "Q3_XX" in body["error"]


def test_compute_executor_is_one_thread_per_process():
    assert compute.executor() is compute.executor()
    names = {compute.run(lambda: threading.current_thread().name) for _ in range(5)}
    assert len(names) == 1


def test_embedding_chunks_bound_inputs_and_tokens():
    from turbospark_wsgi.serving.service import _chunks, keep_last
    seqs = [[1] * n for n in (3, 3, 3, 9, 1, 1, 1, 1)]
    assert [[len(s) for s in c] for c in _chunks(seqs, 3, 8)] == [[3, 3], [3], [9], [1, 1, 1], [1]]
    assert keep_last([0, 1, 2, 3, 4, 9], 4, head=1, tail=1) == [0, 3, 4, 9]
    assert keep_last([0, 1, 2, 3, 4, 9], 2, head=1, tail=1) == [4, 9]       # no room for text: the plain tail
    assert keep_last([0, 1, 2], 5, head=1) == [0, 1, 2]


def test_a_full_waiting_room_still_admits_a_client_below_its_share_in_a_spare_place(make_harness):
    h = make_harness(max_batch=1, max_paused=1, max_waiting=1)
    h.engine("fake", reply="abc" * 20, step_delay=0.01)

    def start(client):
        return h.service.run(request(prompt="hi", max_tokens=60, stream=True, client=client), CancelToken())

    gens = [start("a"), start("a")]                         # a runs one and waits with one: full for a
    with pytest.raises(Overloaded):
        h.service.check_room("a")
    h.service.check_room("b")
    gens.append(start("b"))
    text, finished = collect(gens[-1])
    assert finished.reason == "length" and len(text) == 60 and h.service.queue.running == 1
    with pytest.raises(Overloaded):
        start("a")
    for gen in gens:
        gen.close()

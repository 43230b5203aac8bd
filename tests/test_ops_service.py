"""Operations on the fake engine: several models under a memory budget, leases, limits, the
wall-clock limit, shutdown of the queue, and the metrics each of them leaves behind."""
import threading
import time

import pytest
from prometheus_client import REGISTRY

from turbospark_wsgi.serving.cancel import CancelToken
from turbospark_wsgi.errors import InvalidRequest, ModelLoadError, Overloaded
from turbospark_wsgi.serving.queue import LockQueue
from test_service import collect
from turbospark_wsgi.serving.generation import Finished
from turbospark_wsgi.serving.service import GenerationRequest


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def sized(harness, **sizes):
    """Rewrites the fake model files with the given byte sizes."""
    for name, size in sizes.items():
        (harness.root / f"{name}.gguf").write_bytes(b"GGUF" + b"\0" * (size - 4))


# ---- several models, budget, LRU, leases ------------------------------------------------------

def test_models_load_on_request_and_list_loaded(make_harness):
    h = make_harness()
    client = h.client()
    assert [m["loaded"] for m in client.get("/v1/models").json["data"]] == [False, False]
    client.post_json("/v1/completions", {"model": "other", "prompt": "hi", "max_tokens": 2})
    loaded = {m["id"]: m["loaded"] for m in client.get("/v1/models").json["data"]}
    assert loaded == {"fake": False, "other": True}
    assert client.get("/v1/models/other").json["loaded"] is True


def test_idle_models_are_unloaded_least_recently_used_first(make_harness):
    h = make_harness(model_memory=2500)
    for name in ("a", "b", "c"):
        (h.root / f"{name}.gguf").write_bytes(b"GGUF" + b"\0" * 996)
    before = sample("turbospark_model_unloads_total", model="a")
    for name in ("a", "b", "a", "c"):           # "b" is the least recently used when "c" arrives
        h.registry.resolve(name)
    loaded = {i.id for i in h.registry.list() if i.loaded}
    assert loaded == {"a", "c"}
    assert sample("turbospark_model_unloads_total", model="b") == 1
    assert sample("turbospark_model_unloads_total", model="a") == before


def test_a_model_in_use_is_never_unloaded(make_harness):
    h = make_harness(model_memory=1500)
    sized(h, fake=1000, other=1000)
    lease = h.registry.acquire("fake")          # a generation holds it
    with pytest.raises(Overloaded, match="in use"):
        h.registry.acquire("other")
    assert h.registry.loaded("fake") is not None
    lease.release()
    lease.release()                             # idempotent
    h.registry.acquire("other").release()
    assert h.registry.loaded("fake") is None and h.registry.loaded("other") is not None


def test_a_generation_holds_its_model_until_closed(make_harness):
    h = make_harness(model_memory=1500)
    sized(h, fake=1000, other=1000)
    events = h.service.run(GenerationRequest(prompt="hi", max_tokens=2), CancelToken())
    with pytest.raises(Overloaded):
        h.service.run(GenerationRequest(model="other", prompt="hi"), CancelToken())
    events.close()
    collect(h.service.run(GenerationRequest(model="other", prompt="hi", max_tokens=2), CancelToken()))


def test_an_unload_frees_the_kernels_scratch_on_the_compute_thread(make_harness, monkeypatch):
    from turbospark_wsgi.engine.kernels import native
    from turbospark_wsgi.serving import compute
    ran = []
    monkeypatch.setattr(native, "release_scratch", lambda: ran.append(threading.get_ident()))
    h = make_harness(model_memory=1500)
    sized(h, fake=1000, other=1000)
    h.registry.resolve("fake")
    assert ran == []
    h.registry.resolve("other")                 # unloads "fake"
    assert ran == [compute.run(threading.get_ident)]


def test_a_model_larger_than_the_budget_is_refused_by_name(make_harness):
    h = make_harness(model_memory=100)
    sized(h, other=1000)
    with pytest.raises(ModelLoadError, match="'other' needs about 1000 bytes.*TURBOSPARK_MODEL_MEMORY=100"):
        h.registry.resolve("other")


def test_a_broken_model_fails_alone_and_others_keep_serving(make_harness):
    h = make_harness()
    (h.root / "broken.gguf").write_bytes(b"GGUF")
    client = h.client()
    failed = sample("turbospark_model_loads_total", model="broken", outcome="failed")
    r = client.post_json("/v1/completions", {"model": "broken", "prompt": "hi"}, status=500)
    assert r.json["error"]["code"] == "model_load_failed" and "Q3_XX" in r.json["error"]["message"]
    assert sample("turbospark_model_loads_total", model="broken", outcome="failed") == failed + 1
    client.post_json("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 2}, status=200)


# ---- limits -----------------------------------------------------------------------------------

def test_prompt_token_cap(make_harness):
    h = make_harness(max_prompt_tokens=5)
    r = h.client().post_json("/v1/completions", {"prompt": "far too long a prompt"}, status=400)
    assert r.json["error"]["code"] == "prompt_too_long" and r.json["error"]["param"] == "prompt"
    assert "TURBOSPARK_MAX_PROMPT_TOKENS" in r.json["error"]["message"]


def test_max_tokens_cap_refuses_before_loading_and_caps_an_absent_max_tokens(make_harness):
    h = make_harness(max_tokens_cap=3)
    r = h.client().post_json("/v1/completions", {"prompt": "hi", "max_tokens": 4}, status=400)
    assert r.json["error"]["code"] == "max_tokens_too_large" and r.json["error"]["param"] == "max_tokens"
    assert h.loads == []                        # refused before the model was resolved
    text, finished = collect(h.service.run(GenerationRequest(prompt="hi", max_tokens=None), CancelToken()))
    assert finished.reason == "length" and finished.usage.completion_tokens == 3


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4},
     "max_tokens"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "max_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4}, "max_output_tokens"),
])
def test_a_chat_request_over_the_max_tokens_cap_is_refused_before_any_model_loads(make_harness, path, body, param):
    h = make_harness(max_tokens_cap=3)
    r = h.client().post_json(path, body, status=400)
    error = r.json["error"]
    assert error.get("param", param) == param and "TURBOSPARK_MAX_TOKENS_CAP" in error["message"]
    assert h.loads == [] and h.registry.loaded() is None    # the model was neither loaded nor resolved


def test_wall_clock_limit_ends_with_length_and_a_header(make_harness):
    h = make_harness(max_generation_seconds=0.15)
    h.engine(reply="x" * 40, step_delay=0.02)
    client = h.client()
    r = client.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 40})
    choice = r.json["choices"][0]
    assert choice["finish_reason"] == "length" and 3 <= len(choice["text"]) < 20
    assert r.json["usage"]["completion_tokens"] == len(choice["text"])
    assert r.headers["x-turbospark-time-limited"] == "true"
    assert h.service.queue.running == 0
    r = client.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 40, "stream": True})
    assert '"finish_reason":"length"' in r.text and r.text.rstrip().endswith("data: [DONE]")


# ---- shutdown -----------------------------------------------------------------------------------

def test_shutdown_drops_waiters_and_refuses_new_but_keeps_the_runner():
    queue = LockQueue(max_waiting=4)
    runner = queue.enqueue()
    assert runner.wait(1)
    waiter = queue.enqueue()
    outcome = []

    def wait():
        try:
            outcome.append(waiter.wait(5))
        except Overloaded as e:
            outcome.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    queue.shut_down()
    t.join(2)
    assert isinstance(outcome[0], Overloaded) and outcome[0].code == "server_shutting_down"
    assert outcome[0].headers["Retry-After"] and "shutting down" in outcome[0].message
    with pytest.raises(Overloaded, match="shutting down"):
        queue.enqueue()
    assert runner.holding and queue.depth == 0
    runner.release()
    assert queue.running == 0


def test_a_queued_stream_gets_an_error_event_on_shutdown(make_harness):
    gate = threading.Event()
    h = make_harness()
    h.engine(gate=gate)
    running = h.service.run(GenerationRequest(prompt="hi", max_tokens=3), CancelToken())
    first = threading.Thread(target=collect, args=(running,))
    first.start()
    while h.service.queue.running == 0 or not h.engine().runs:
        time.sleep(0.01)
    client = h.client()
    result = {}
    t = threading.Thread(target=lambda: result.update(r=client.post_json(
        "/v1/completions", {"prompt": "hi", "stream": True}, status="*")))
    t.start()
    while h.service.queue.depth == 0:
        time.sleep(0.01)
    h.service.queue.shut_down()
    t.join(5)
    gate.set()
    first.join(5)
    body = result["r"].text
    assert "event: error" in body and "server_shutting_down" in body and "[DONE]" not in body
    assert running.usage is not None            # the one running finished normally


# ---- metrics -----------------------------------------------------------------------------------

def test_metrics_exposition_counts_requests_tokens_and_queue(make_harness):
    h = make_harness()
    client = h.client()
    before = sample("turbospark_requests_total", route="/v1/completions", method="POST", status="200")
    tokens = sample("turbospark_generation_tokens_total", model="fake")
    client.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 3})
    client.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True})
    client.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 0}, status=400)
    text = client.get("/metrics").text
    assert "turbospark_queue_waiting 0.0" in text and "turbospark_queue_running 0.0" in text
    assert sample("turbospark_requests_total", route="/v1/completions", method="POST", status="200") == before + 2
    assert sample("turbospark_requests_total", route="/v1/completions", method="POST", status="400") >= 1
    assert sample("turbospark_generation_tokens_total", model="fake") == tokens + 6
    assert sample("turbospark_time_to_first_token_seconds_count", model="fake") >= 2
    assert sample("turbospark_time_per_output_token_seconds_count", model="fake") >= 2
    for name in ("turbospark_prompt_tokens_total", "turbospark_prefix_cache_hits_total",
                 "turbospark_model_loads_total", "turbospark_request_duration_seconds_bucket"):
        assert name in text


def test_prefix_cache_hits_come_from_finish_cached_tokens(make_harness):
    h = make_harness()
    engine = h.engine()
    real = engine._run

    def cached(ids, params, should_stop):
        for event in real(ids, params, should_stop):
            if type(event).__name__ == "Finish":
                event.cached_tokens = 2
            yield event

    engine._run = cached
    hits = sample("turbospark_prefix_cache_hits_total", model="fake")
    tokens = sample("turbospark_prefix_cache_tokens_total", model="fake")
    r = h.client().post_json("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    assert sample("turbospark_prefix_cache_hits_total", model="fake") == hits + 1
    assert sample("turbospark_prefix_cache_tokens_total", model="fake") == tokens + 2


def test_unmatched_routes_share_one_label(client):
    client.get("/nope/1", status=404)
    client.get("/nope/2", status=404)
    assert sample("turbospark_requests_total", route="unmatched", method="GET", status="404") >= 2


# ---- the heap after a load: long-lived objects out of the collector's way ----------------------

def test_a_load_and_an_unload_leave_the_heap_frozen_and_an_unloaded_models_cycles_freed(make_harness, monkeypatch):
    import gc
    import weakref

    from turbospark_wsgi.serving import registry

    monkeypatch.setattr(registry, "_freeze_after_load", True)     # as the server's workers set it

    class Cyclic:           # an engine part kept alive only by a cycle once the registry drops it
        pass

    h = make_harness(model_memory=2500)
    for name in ("a", "b"):
        (h.root / f"{name}.gguf").write_bytes(b"GGUF" + b"\0" * 1496)
    gc.unfreeze()
    try:
        h.registry.resolve("a")
        assert gc.get_freeze_count() > 0, "a load left the heap unfrozen"
        engine = h.registry.loaded("a")
        part = Cyclic()
        part.engine, part.self = engine, part
        engine.cyclic_part = part
        alive = weakref.ref(part)
        del part, engine
        h.engines.pop("a")                  # the harness's own reference: the registry's stays
        gc.freeze()                         # frozen with the model, as a load would leave it
        h.registry.resolve("b")             # unloads "a": its cycle must not stay frozen
        assert alive() is None, "an unloaded model's cycles stayed frozen"
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()

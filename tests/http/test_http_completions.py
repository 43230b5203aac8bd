"""POST /v1/completions through the whole app (webtest), on the fake engine."""
import json
import threading
import wsgiref.util

import pytest


def sse_frames(body):
    return [f for f in body.decode().split("\n\n") if f]


def data_chunks(body):
    return [json.loads(f[6:]) for f in sse_frames(body) if f.startswith("data: {")]


def test_non_streaming_body(client):
    r = client.post_json("/v1/completions", {"model": "fake", "prompt": "hi", "max_tokens": 5})
    body = r.json
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "fake"
    assert body["choices"] == [{"text": "Hello", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert "x-anyllm-degradation" not in r.headers and r.headers["x-request-id"].startswith("req-")


def test_the_model_defaults_to_the_configured_one(client):
    assert client.post_json("/v1/completions", {"prompt": "hi"}).json["model"] == "fake"


def test_streaming_chunks_then_finish_then_done(client):
    r = client.post_json("/v1/completions", {"model": "fake", "prompt": "hi", "stream": True, "max_tokens": 5})
    assert r.content_type == "text/event-stream"
    assert r.headers["Cache-Control"].startswith("no-cache") and r.headers["X-Accel-Buffering"] == "no"
    frames = sse_frames(r.body)
    assert frames[0] == ": ok" and frames[-1] == "data: [DONE]"
    chunks = data_chunks(r.body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert chunks[-1]["choices"][0]["text"] == "" and len({c["id"] for c in chunks}) == 1
    assert all("usage" not in c for c in chunks)


def test_streaming_text_equals_non_streaming_text(client):
    body = {"model": "fake", "prompt": "hi", "temperature": 0}
    plain = client.post_json("/v1/completions", body).json["choices"][0]["text"]
    streamed = client.post_json("/v1/completions", dict(body, stream=True)).body
    assert "".join(c["choices"][0]["text"] for c in data_chunks(streamed)) == plain


def test_include_usage_adds_one_trailing_chunk(client):
    r = client.post_json("/v1/completions", {"prompt": "hi", "stream": True,
                                             "stream_options": {"include_usage": True}})
    chunks = data_chunks(r.body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 11
    assert all(c["choices"] for c in chunks[:-1])


def test_no_hop_by_hop_headers(client):
    for stream in (False, True):
        r = client.post_json("/v1/completions", {"prompt": "hi", "stream": stream})
        assert not [k for k in r.headers if wsgiref.util.is_hop_by_hop(k)]


def test_honoured_fields_are_not_reported_as_degraded(client):
    r = client.post_json("/v1/completions", {"prompt": "hi", "logprobs": None, "best_of": 1, "echo": True})
    assert "x-anyllm-degradation" not in r.headers and r.json["choices"][0]["text"].startswith("hi")
    r = client.post_json("/v1/completions", {"prompt": "hi", "echo": False, "stream": True})
    assert "x-anyllm-degradation" not in r.headers


def test_keepalive_comments_while_queued(harness):
    harness.engine("fake", reply="ab")
    client = harness.client()
    holder = harness.service.queue.enqueue()
    holder.wait(0)
    threading.Timer(0.2, holder.release).start()
    r = client.post_json("/v1/completions", {"prompt": "hi", "stream": True})
    frames = sse_frames(r.body)
    assert frames[0] == ": ok" and frames[1] == ": keep-alive" and frames[-1] == "data: [DONE]"


def test_a_mid_stream_failure_is_an_error_event_without_done(harness):
    harness.engine("fake", fail_at=2)
    r = harness.client().post_json("/v1/completions", {"prompt": "hi", "stream": True},
                                   headers={"x-request-id": "abc-1"})
    frames = sse_frames(r.body)
    assert "data: [DONE]" not in frames and frames[-1].startswith("event: error\ndata: ")
    error = json.loads(frames[-1].split("data: ", 1)[1])["error"]
    assert error["type"] == "server_error" and "abc-1" in error["message"] and "exploded" not in error["message"]
    assert len(data_chunks(r.body)) == 2 and harness.service.queue.running == 0


def test_a_non_streaming_failure_is_a_generic_500(harness):
    harness.engine("fake", fail_at=0)
    r = harness.client().post_json("/v1/completions", {"prompt": "hi"}, status=500)
    assert r.json["error"]["type"] == "server_error" and "exploded" not in r.text


def test_context_overflow_is_a_400_with_numbers(harness):
    harness.engine("fake", max_context=16)
    r = harness.client().post_json("/v1/completions", {"prompt": "hello", "max_tokens": 12}, status=400)
    err = r.json["error"]
    assert err["code"] == "context_length_exceeded" and "16 tokens" in err["message"] and "18" in err["message"]


def test_queue_full_is_503_with_retry_after(make_harness):
    h = make_harness(max_waiting=0)
    h.engine("fake")
    holder = h.service.queue.enqueue()
    r = h.client().post_json("/v1/completions", {"prompt": "hi", "stream": True}, status=503)
    assert r.headers["Retry-After"] == "1" and r.json["error"]["code"] == "server_overloaded"
    holder.release()


def test_cheap_checks_run_before_the_model_is_resolved(harness):
    client = harness.client()
    for body in ({"model": "other", "prompt": "hi", "n": 2, "best_of": 1}, {"model": "other", "prompt": "hi", "suffix": "x"},
                 {"model": "other", "prompt": ["a", 1]}, {"model": "other", "prompt": "hi", "max_tokens": 0},
                 {"model": "other", "prompt": "hi", "temperature": -1}):
        client.post_json("/v1/completions", body, status=400)
    assert harness.loads == []


def test_unknown_model_is_404_model_not_found(client):
    r = client.post_json("/v1/completions", {"model": "nope", "prompt": "hi"}, status=404)
    assert r.json["error"]["code"] == "model_not_found" and r.json["error"]["param"] == "model"


def test_a_model_that_fails_to_load_names_it(harness):
    (harness.root / "broken.gguf").write_bytes(b"x")
    r = harness.client().post_json("/v1/completions", {"model": "broken", "prompt": "hi"}, status=500)
    assert "broken" in r.json["error"]["message"] and r.json["error"]["code"] == "model_load_failed"


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_id_prompts(client, prompt):
    r = client.post_json("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert r.json["usage"]["prompt_tokens"] == 3 and r.json["choices"][0]["text"] == "He"

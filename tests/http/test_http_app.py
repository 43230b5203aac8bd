"""The app around the endpoints: routing errors, envelopes, auth, request ids, models, health, logs."""
import json
import logging
import time

import pytest

from turbospark_wsgi.http.app import envelope_for


def test_unknown_route_is_an_openai_404(client):
    r = client.get("/v1/nothing", status=404, headers={"Accept": "text/html"})
    assert r.json["error"] == {"message": "Unknown route: GET /v1/nothing", "type": "invalid_request_error",
                               "param": None, "code": "not_found"}


def test_routes_under_v1_messages_use_the_anthropic_envelope(client):
    r = client.post_json("/v1/messages/nothing", {}, status=404)
    assert r.json == {"type": "error", "error": {"type": "not_found_error", "message": r.json["error"]["message"]}}
    assert envelope_for("/v1/messages").__name__ == "anthropic_error_body"


def test_wrong_method_is_405_with_allow(client):
    r = client.delete("/v1/completions", status=405)
    assert r.json["error"]["code"] == "method_not_allowed" and "POST" in r.headers["Allow"]


def test_an_unexpected_exception_is_a_generic_500_logged_with_the_request_id(harness, caplog):
    def explode():
        raise RuntimeError("secret internal detail")

    harness.service.models = explode
    r = harness.client().get("/v1/models", headers={"x-request-id": "trace-7"}, status=500)
    assert r.json["error"]["type"] == "server_error" and "trace-7" in r.json["error"]["message"]
    assert "secret" not in r.text and "secret internal detail" in caplog.text and "trace-7" in caplog.text


def test_request_ids_are_echoed_or_generated(client):
    assert client.get("/health", status="*").headers["x-request-id"].startswith("req-")
    assert client.get("/health", headers={"x-request-id": "abc.DEF-1"}, status="*").headers["x-request-id"] == "abc.DEF-1"
    bad = client.get("/health", headers={"x-request-id": "has space"}, status="*").headers["x-request-id"]
    assert bad.startswith("req-")


@pytest.fixture
def keyed(make_harness):
    return make_harness(api_keys=("k1", "k2")).client()


def test_api_keys_bearer_or_x_api_key(keyed):
    keyed.get("/health", status=503)                # open (503: nothing loaded yet)
    r = keyed.get("/v1/models", status=401)
    assert r.json["error"]["type"] == "authentication_error" and r.headers["WWW-Authenticate"] == "Bearer"
    keyed.get("/v1/models", headers={"Authorization": "Bearer nope"}, status=401)
    keyed.get("/v1/models", headers={"Authorization": "Bearer k2"}, status=200)
    keyed.get("/v1/models", headers={"x-api-key": "k1"}, status=200)
    keyed.post_json("/v1/completions", {"prompt": "hi"}, status=401)
    keyed.post_json("/v1/completions", {"prompt": "hi"}, headers={"Authorization": "bearer k1"}, status=200)


def test_the_anthropic_routes_get_their_401_envelope(keyed):
    r = keyed.post_json("/v1/messages", {}, status=401)
    assert r.json["type"] == "error" and r.json["error"]["type"] == "authentication_error"


def test_models_list_includes_aliases(harness):
    (harness.root / "aliases.json").write_text(json.dumps({"tiny": "fake.gguf"}))
    r = harness.client().get("/v1/models")
    assert r.json["object"] == "list"
    ids = [m["id"] for m in r.json["data"]]
    assert ids == ["fake", "other", "tiny"]
    assert r.json["data"][0] == {"id": "fake", "object": "model", "created": r.json["data"][0]["created"],
                                 "owned_by": "turbospark", "loaded": False, "kind": "generation",
                                 "capabilities": ["generation", "embedding"]}


def test_one_model_or_404(harness):
    (harness.root / "aliases.json").write_text(json.dumps({"org/tiny": "fake.gguf"}))
    client = harness.client()
    assert client.get("/v1/models/fake").json["id"] == "fake"
    assert client.get("/v1/models/org/tiny").json["id"] == "org/tiny"
    r = client.get("/v1/models/nope", status=404)
    assert r.json["error"]["code"] == "model_not_found"


def test_health_is_503_until_the_default_model_loads(make_harness):
    h = make_harness(load_default=True)
    client = h.client()
    deadline = time.monotonic() + 5
    r = client.get("/health", status="*")
    while r.status_int != 200 and time.monotonic() < deadline:
        assert r.status_int == 503 and r.json["status"] == "loading"
        time.sleep(0.01)
        r = client.get("/health", status="*")
    assert r.json["status"] == "ok" and r.json["model"] == "fake" and r.json["backend"] == "fake"
    assert r.json["queue"] == {"waiting": 0, "running": 0, "max_waiting": 16}


def test_health_503_body_before_loading(client):
    r = client.get("/health", status=503)
    assert r.json["status"] == "loading" and r.json["model"] == "fake"


def test_one_access_log_line_per_request_with_tokens(client, caplog):
    caplog.set_level(logging.INFO, logger="turbospark.access")
    client.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 3}, headers={"x-request-id": "log-1"})
    client.post_json("/v1/completions", {"prompt": "hi", "stream": True}, headers={"x-request-id": "log-2"})
    lines = [r.getMessage() for r in caplog.records if r.name == "turbospark.access"]
    assert len(lines) == 2
    assert lines[0].startswith('log-1 "POST /v1/completions" 200') and "completion_tokens=3" in lines[0]
    assert "prompt_tokens=3" in lines[0] and "finish=length" in lines[0]
    assert lines[1].startswith("log-2") and "completion_tokens=11" in lines[1] and "ttft_ms=" in lines[1]

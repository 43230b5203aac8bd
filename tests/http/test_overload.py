"""A full server refuses a generation at once: 503 + Retry-After in the route's envelope, before
the body is parsed, the model resolved (maybe loaded) or the prompt tokenized."""
import pytest

from turbospark_wsgi.serving.cancel import CancelToken
from turbospark_wsgi.serving.service import GenerationRequest

ROUTES = {
    "/v1/chat/completions": {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/completions": {"model": "fake", "prompt": "Hi", "max_tokens": 4},
    "/v1/messages": {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/responses": {"model": "fake", "input": "Hi", "max_output_tokens": 4},
}


@pytest.fixture
def full(make_harness):
    """A server whose one slot is taken and which lets nobody wait (max_waiting 0)."""
    h = make_harness(max_waiting=0)
    holder = h.service.queue.enqueue()
    yield h
    holder.release()


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_full_server_refuses_before_any_model_work(full, path):
    resp = full.client().post_json(path, ROUTES[path], status=503)
    assert resp.headers["Retry-After"] == "1"
    if path == "/v1/messages":
        assert resp.json["type"] == "error" and resp.json["error"]["type"] == "overloaded_error"
    else:
        assert resp.json["error"]["code"] == "server_overloaded"
        assert set(resp.json["error"]) == {"message", "type", "param", "code"}
    assert full.loads == [], "the model was resolved (loaded) for a request the server had no room for"


@pytest.mark.parametrize("path", sorted(ROUTES))
def test_a_full_server_refuses_even_a_body_it_would_not_accept(full, path):
    # NOTE(order): load is shed before the body is read; the client learns of the 400 on its retry.
    resp = full.client().post(path, b"{not json", content_type="application/json", status=503)
    assert resp.headers["Retry-After"]


def test_auth_still_comes_before_the_overload_answer(make_harness):
    h = make_harness(max_waiting=0, api_keys=("secret",))
    holder = h.service.queue.enqueue()
    try:
        h.client().post_json("/v1/chat/completions", ROUTES["/v1/chat/completions"], status=401)
    finally:
        holder.release()


def test_a_request_that_fits_is_still_admitted(make_harness):
    h = make_harness(max_waiting=1)
    h.engine("fake")
    holder = h.service.queue.enqueue()              # the slot is taken, one waiting place is left
    try:
        h.service.check_room()
        gen = h.service.run(GenerationRequest(model="fake", prompt_ids=[5, 6], max_tokens=2), CancelToken())
        assert h.service.queue.depth == 1
        gen.close()
    finally:
        holder.release()


def test_the_queue_knows_whose_request_it_is_without_holding_the_key(harness):
    seen = []
    real = harness.service.queue.enqueue

    def recording(cancel=None, client="", background=False):
        seen.append(client)
        return real(cancel, client=client, background=background)

    harness.service.queue.enqueue = recording
    client = harness.client()
    body = ROUTES["/v1/completions"]
    for headers in ({"Authorization": "Bearer sk-one"}, {"x-api-key": "sk-two"}, {"Authorization": "Bearer sk-one"}, {}):
        client.post_json("/v1/completions", body, headers=headers)
    assert seen[0] == seen[2] and len(set(seen)) == 3
    assert seen[0].startswith("key:") and seen[3].startswith("addr:")
    assert not any("sk-" in s for s in seen)

"""The fields the generation APIs share get one verdict: the same value posted to /v1/completions,
/v1/chat/completions, /v1/messages and /v1/responses is accepted everywhere or refused everywhere
(naming the field), except where the APIs themselves differ (Anthropic's temperature <= 1)."""
import pytest

USER = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/messages": {"messages": USER, "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}
RENAMED = {("/v1/messages", "stop"): "stop_sequences", ("/v1/responses", "max_tokens"): "max_output_tokens"}
ALL = tuple(BODIES)
OPENAI = ("/v1/completions", "/v1/chat/completions", "/v1/responses")     # the sampling extensions
CHOICES = ("/v1/completions", "/v1/chat/completions")                       # n, stream_options with streams

# (field, value, routes that take the field, verdict: True = accepted, False = 400 naming the field)
TABLE = [
    ("temperature", 0, ALL, True), ("temperature", 1, ALL, True), ("temperature", -0.1, ALL, False),
    ("temperature", "hot", ALL, False),
    ("top_p", 0.5, ALL, True), ("top_p", 1.5, ALL, False), ("top_p", -1, ALL, False),
    ("top_k", -1, ALL, True), ("top_k", 0, ALL, True), ("top_k", 40, ALL, True), ("top_k", -2, ALL, False),
    ("top_k", 1.5, ALL, False), ("top_k", True, ALL, False),
    ("stop", ["x"], ALL, True), ("stop", "x", ALL, True), ("stop", ["", "x"], ALL, True), ("stop", [1], ALL, False),
    ("stop", ["s"] * 17, ALL, False), ("stop", ["x" * 1025], ALL, False),
    ("max_tokens", 0, ALL, False), ("max_tokens", -1, ALL, False), ("max_tokens", "5", ALL, False),
    ("max_tokens", 2 ** 31, ALL, False),
    ("model", "", ALL, False), ("model", " ", ALL, False), ("model", 5, ALL, False),
    ("repetition_penalty", 0.005, OPENAI, True), ("repetition_penalty", 0, OPENAI, False),
    ("repetition_penalty", 10.5, OPENAI, False),
    ("cache_salt", "s", OPENAI, True), ("cache_salt", "", OPENAI, False), ("cache_salt", 5, OPENAI, False),
    ("cache_salt", "s" * 1025, OPENAI, False),
    ("min_p", 0.1, OPENAI, True), ("min_p", 2, OPENAI, False),
    ("presence_penalty", 1, OPENAI, True), ("presence_penalty", 3, OPENAI, False),
    ("frequency_penalty", -3, OPENAI, False),
    ("seed", -1, OPENAI, True), ("seed", 2 ** 64 - 1, OPENAI, True), ("seed", 1.5, OPENAI, False),
    ("seed", 2 ** 64, OPENAI, False),
    ("logit_bias", {"5": 1}, OPENAI, True), ("logit_bias", {"a": 1}, OPENAI, False),
    ("n", 2, CHOICES, True), ("n", 0, CHOICES, False), ("n", 21, CHOICES, False),
    ("stream_options", {"include_usage": True}, CHOICES + ("/v1/responses",), False),
]
# Where the APIs disagree, each keeps its own bound.
PER_API = [
    ("temperature", 1.5, {"/v1/completions": True, "/v1/chat/completions": True, "/v1/responses": True,
                          "/v1/messages": False}),
]


def cases():
    for field, value, routes, ok in TABLE:
        for route in routes:
            yield pytest.param(route, field, value, ok, id=f"{route}-{field}={value!r}"[:80])
    for field, value, verdicts in PER_API:
        for route, ok in verdicts.items():
            yield pytest.param(route, field, value, ok, id=f"{route}-{field}={value!r}")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from tests.conftest import Harness
    harness = Harness(tmp_path_factory.mktemp("models"))
    harness.engine("fake", reply="ok", max_context=64)
    return harness.client()


@pytest.mark.parametrize("route, field, value, ok", list(cases()))
def test_one_value_one_verdict_on_every_route(client, route, field, value, ok):
    name = RENAMED.get((route, field), field)
    r = client.post_json(route, {**BODIES[route], name: value}, expect_errors=True)
    if ok:
        assert r.status_int == 200, r.text
        return
    assert r.status_int == 400, r.text
    if route == "/v1/messages":        # Anthropic's envelope has no param: the message names the field
        assert r.json["error"]["type"] == "invalid_request_error" and name in r.json["error"]["message"], r.text
    else:
        assert r.json["error"]["param"] == name, r.text

"""Speculative decoding through the app on the tiny stories260K model (skipped when absent): the
request switch, usage details and /metrics counters; the text is the text without it."""
import os
from pathlib import Path

import pytest

MODEL = Path(os.environ.get("TURBOSPARK_TEST_MODELS", "/work/shared/models")) / "stories260K.gguf"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not present")
PROMPT = "Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom"


def app_client(mode):
    import webtest
    from turbospark_wsgi.http.app import create_app
    from turbospark_wsgi.config import Config
    config = Config(models_dir=str(MODEL.parent), model="stories260K", device="cpu", load_default=False,
                    keepalive=0.5, speculative=mode)
    return webtest.TestApp(create_app(config))


@pytest.fixture(scope="module")
def client():
    return app_client("on")


def complete(client, status=200, **body):
    return client.post_json("/v1/completions", {"model": "stories260K", "prompt": PROMPT, "max_tokens": 48,
                                                "temperature": 0, **body}, status=status).json


def test_usage_reports_proposed_and_kept_tokens_and_the_text_is_unchanged(client):
    on = complete(client)
    off = complete(client, speculative=False)
    plain = complete(app_client("off"))
    assert on["choices"][0]["text"] == off["choices"][0]["text"] == plain["choices"][0]["text"]
    details = on["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
    assert details["accepted_prediction_tokens"] < on["usage"]["completion_tokens"]
    assert "completion_tokens_details" not in off["usage"] and "completion_tokens_details" not in plain["usage"]


def test_chat_usage_carries_the_details_too(client):
    body = client.post_json("/v1/chat/completions", {"model": "stories260K", "max_tokens": 40, "temperature": 0,
                                                     "messages": [{"role": "user", "content": PROMPT}]}).json
    assert body["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] >= 0
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


@pytest.mark.parametrize("value", ["no", 0, [True]])
def test_a_switch_that_is_not_a_boolean_is_refused(client, value):
    body = complete(client, status=400, speculative=value)
    assert body["error"]["param"] == "speculative"


def test_metrics_count_proposed_and_accepted_tokens(client):
    def counts():
        text = client.get("/metrics").text
        return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith(f"turbospark_speculative_{name}_tokens_total"))
                for name in ("proposed", "accepted")}
    before = counts()
    usage = complete(client)["usage"]["completion_tokens_details"]
    after = counts()
    assert after["accepted"] - before["accepted"] == usage["accepted_prediction_tokens"]
    assert after["proposed"] - before["proposed"] == \
        usage["accepted_prediction_tokens"] + usage["rejected_prediction_tokens"]

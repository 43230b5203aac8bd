"""Chat and Messages routes on real engines: stories260K (tiny) and the default SmolLM2 (when present)."""
import os
from pathlib import Path

import pytest

from turbospark_wsgi.http.app import create_app
from turbospark_wsgi.config import Config

STORIES = Path("/work/shared/models/stories260K.gguf")
MODELS = Path(os.environ.get("TURBOSPARK_MODELS") or "~/.cache/turbospark/models").expanduser()
SMOLLM = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = MODELS / "gemma-3-270m-q4_k_m.gguf"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def app_for(path, tmp_path_factory):
    if not path.is_file():
        pytest.skip(f"{path} absent")
    webtest = pytest.importorskip("webtest")
    models = tmp_path_factory.mktemp("models")
    (models / path.name).symlink_to(path)
    config = Config(models_dir=str(models), model=path.stem, load_default=False, device="cpu")
    return webtest.TestApp(create_app(config))


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    return app_for(SMOLLM, tmp_path_factory)


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    return app_for(STORIES, tmp_path_factory)


def test_stories_chat_runs_and_counts(stories):
    body = stories.post_json("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                                      "temperature": 0}).json
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 8 and body["usage"]["prompt_tokens"] > 0


def test_truncate_prompt_tokens_keeps_the_rendered_prompts_last_tokens(stories):
    long = [{"role": "user", "content": "word " * 300}]
    body = {"messages": long, "max_tokens": 4, "temperature": 0}
    cut = stories.post_json("/v1/chat/completions", dict(body, truncate_prompt_tokens=50)).json
    assert cut["usage"]["prompt_tokens"] == 50
    err = stories.post_json("/v1/chat/completions", dict(body, truncate_prompt_tokens=0), status=400).json["error"]
    assert err["param"] == "truncate_prompt_tokens"


@pytest.mark.slow
def test_smollm_prompt_tokens_equal_the_engine_template(smollm):
    from turbospark_wsgi.engine import load_engine
    engine = load_engine(str(SMOLLM), device="cpu")
    body = smollm.post_json("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}).json
    assert body["usage"]["prompt_tokens"] == len(engine.apply_chat_template(MESSAGES))


@pytest.mark.slow
def test_smollm_greedy_stream_equals_body(smollm):
    req = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    body = smollm.post_json("/v1/chat/completions", req).json
    resp = smollm.post_json("/v1/chat/completions", {**req, "stream": True, "stream_options": {"include_usage": True}})
    import json
    chunks = [json.loads(line[6:]) for line in resp.text.split("\n") if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == body["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == body["usage"]


@pytest.mark.slow
def test_smollm_count_tokens_equals_input_tokens(smollm):
    req = {"max_tokens": 4, "system": "You are terse.", "messages": [{"role": "user", "content": "Say hi."}],
           "temperature": 0}
    counted = smollm.post_json("/v1/messages/count_tokens", req).json["input_tokens"]
    assert counted == smollm.post_json("/v1/messages", req).json["usage"]["input_tokens"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return app_for(GEMMA3, tmp_path_factory)


@pytest.mark.slow
def test_gemma3_chat_and_stream(gemma3):
    """Gemma 3 270M (no system role: its template folds the system text into the user turn) answers
    and streams the same text; the prompt is the engine's rendering of the conversation."""
    import json
    from turbospark_wsgi.engine import load_engine
    engine = load_engine(str(GEMMA3), device="cpu", max_batch=1)
    req = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    body = gemma3.post_json("/v1/chat/completions", req).json
    assert body["usage"]["prompt_tokens"] == len(engine.apply_chat_template(MESSAGES))
    assert body["choices"][0]["message"]["content"]
    resp = gemma3.post_json("/v1/chat/completions", {**req, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in resp.text.split("\n") if line.startswith("data: {")]
    assert len(chunks) > 3
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == body["choices"][0]["message"]["content"]
    streamed = chunks[-1]["usage"]        # the second run reuses the first one's prompt: only the cache differs
    assert {k: v for k, v in streamed.items() if k != "prompt_tokens_details"} == \
        {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    assert streamed["prompt_tokens_details"]["cached_tokens"] > 0

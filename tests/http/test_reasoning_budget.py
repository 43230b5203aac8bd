"""A reasoning budget on a real engine: a tiny random-weight model whose template opens the think
block in the generation prompt (DeepSeek-R1's later revision), so it thinks until stopped. OpenAI's
`reasoning_effort` (chat) and `reasoning.effort` (Responses) take the server's budgets
(TURBOSPARK_REASONING_BUDGETS), vLLM's `thinking_token_budget` and Anthropic's
`thinking.budget_tokens` name one, a model's default applies when none is named, and `none` /
`disabled` close the block at once. The reasoning never runs past its budget, the server writes the
closing tag itself and the model answers after it; the tokens listed in logprobs show where the
block closed, against `usage.completion_tokens_details.reasoning_tokens`."""
import json

import pytest

from tests.http.test_qwen_chat import R1_OPEN, write_qwen3_gguf
from turbospark_wsgi.config import Config
from turbospark_wsgi.http.app import create_app

USER = [{"role": "user", "content": "Think, then answer."}]
SAMPLED = {"temperature": 1.0, "seed": 11, "ignore_eos": True, "speculative": False}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    webtest = pytest.importorskip("webtest")
    pytest.importorskip("gguf")
    models = tmp_path_factory.mktemp("r1-models")
    write_qwen3_gguf(models / "tiny-r1.gguf", template=R1_OPEN)
    config = Config(models_dir=str(models), model="tiny-r1", load_default=False, device="cpu",
                    reasoning_budgets="minimal=2,low=5,medium=9", reasoning_budget="tiny-r1=4,*=7")
    app = webtest.TestApp(create_app(config))
    [close] = app.post_json("/tokenize", {"prompt": "</think>", "add_special_tokens": False}).json["tokens"]
    # NOTE(bias): the model never writes the closing tag itself, so where it closes is the budget's doing
    SAMPLED["logit_bias"] = {str(close): -100}
    return app


def chat(app, stream=False, status=200, **extra):
    body = {"messages": USER, "max_tokens": 24, "logprobs": True, "stream": stream, **SAMPLED, **extra}
    return app.post_json("/v1/chat/completions", body, status=status)


def thought(resp):
    """(tokens before the closing tag, reasoning text, answer text, usage) of a chat reply. (A random
    model's thoughts may be blank, which the reply leaves out: the tokens tell where they end.)"""
    if resp.content_type == "text/event-stream":
        chunks = [json.loads(line[6:]) for line in resp.text.split("\n") if line.startswith("data: {")]
        tokens, reasoning, content, usage = [], "", "", None
        for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
                tokens += [t["token"] for t in ((choice.get("logprobs") or {}).get("content") or [])]
    else:
        choice = resp.json["choices"][0]
        tokens = [t["token"] for t in choice["logprobs"]["content"]]
        reasoning, content = choice["message"].get("reasoning_content") or "", choice["message"]["content"] or ""
        usage = resp.json["usage"]
    assert "</think>" in tokens, tokens
    return tokens.index("</think>"), reasoning, content, usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, budget", [({"reasoning_effort": "low"}, 5), ({"reasoning_effort": "minimal"}, 2),
                                           ({"thinking_token_budget": 3}, 3), ({}, 4)])
def test_the_budget_closes_the_block_and_the_model_answers(app, stream, field, budget):
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    closed_at, reasoning, content, usage = thought(chat(app, stream, **field, **extra))
    assert closed_at == budget                          # the model never closes it by itself (logit_bias)
    assert content.strip()                              # it answered after the tag
    assert usage["completion_tokens_details"]["reasoning_tokens"] == budget
    assert usage["completion_tokens"] == 24


def test_none_and_zero_close_the_block_at_once(app):
    for field in ({"reasoning_effort": "none"}, {"thinking_token_budget": 0}):
        closed_at, reasoning, content, usage = thought(chat(app, **field))
        assert closed_at == 0 and not reasoning and content.strip()
        assert "reasoning_tokens" not in usage.get("completion_tokens_details", {})


def test_a_budget_bigger_than_the_reply_only_counts(app):
    resp = chat(app, thinking_token_budget=10 ** 9)
    choice = resp.json["choices"][0]
    assert "</think>" not in [t["token"] for t in choice["logprobs"]["content"]]
    assert choice["finish_reason"] == "length"
    assert resp.json["usage"]["completion_tokens_details"]["reasoning_tokens"] == 24


def test_responses_effort_and_messages_budget(app):
    body = {"input": "Think, then answer.", "max_output_tokens": 24, "reasoning": {"effort": "medium"}, **SAMPLED}
    resp = app.post_json("/v1/responses", body).json
    assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == 9
    assert resp["output"][-1]["type"] == "message" and resp["output"][-1]["content"][0]["text"].strip()
    # Messages has no logit_bias (nor usage of reasoning tokens): the budget's effect is read from the
    # tokens the same request gets on chat, where the engine runs the same constraint
    for thinking, budget in (({"type": "enabled", "budget_tokens": 6}, 6), ({"type": "disabled"}, 0)):
        body = {"max_tokens": 24, "messages": USER, "thinking": thinking, **SAMPLED}
        msg = app.post_json("/v1/messages", body).json
        assert msg["usage"]["output_tokens"] == 24 and msg["stop_reason"] == "max_tokens"
        assert thought(chat(app, thinking_token_budget=budget))[0] == budget


@pytest.mark.parametrize("field, param", [
    ({"reasoning_effort": "ultra"}, "reasoning_effort"), ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"thinking_token_budget": 2 ** 31}, "thinking_token_budget"),
    ({"thinking_token_budget": "5"}, "thinking_token_budget"),
    ({"thinking_token_budget": True}, "thinking_token_budget"),
])
def test_hostile_values_are_a_400_naming_the_field_and_the_next_request_is_served(app, field, param):
    resp = chat(app, status=400, **field)
    assert resp.json["error"]["param"] == param and resp.json["error"]["type"] == "invalid_request_error"
    assert thought(chat(app, reasoning_effort="low"))[0] == 5
    resp = app.post_json("/v1/responses", {"input": "x", "reasoning": {"effort": "ultra"}}, status=400)
    assert resp.json["error"]["param"] == "reasoning.effort"

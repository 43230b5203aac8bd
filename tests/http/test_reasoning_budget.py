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

from tests.http.test_qwen_chat import QWEN3, R1_OPEN, write_qwen3_gguf
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


# ---- a Qwen3-style template (the reply opens the block) and a budget before a schema ---------------

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 whose real template leaves the think block to the reply; the tag's logit is raised
    so this random model opens it (as a trained one chooses to), and the closing tag's lowered."""
    webtest = pytest.importorskip("webtest")
    models = tmp_path_factory.mktemp("qwen3-models")
    write_qwen3_gguf(models / "tiny-qwen3.gguf", template=QWEN3)
    app = webtest.TestApp(create_app(Config(models_dir=str(models), model="tiny-qwen3", load_default=False,
                                            device="cpu")))
    ids = {tag: app.post_json("/tokenize", {"prompt": tag, "add_special_tokens": False}).json["tokens"]
           for tag in ("<think>", "</think>")}
    assert all(len(v) == 1 for v in ids.values())
    app.bias = {str(ids["<think>"][0]): 100, str(ids["</think>"][0]): -100}
    return app


@pytest.mark.parametrize("stream", [False, True])
def test_a_qwen3_style_reply_opens_the_block_and_the_budget_closes_it(qwen3, stream):
    body = {"messages": USER, "max_tokens": 24, "logprobs": True, "stream": stream, "thinking_token_budget": 5,
            **dict(SAMPLED, logit_bias=qwen3.bias), "stream_options": {"include_usage": True}}
    if not stream:
        del body["stream_options"]
    resp = qwen3.post_json("/v1/chat/completions", body)
    closed_at, reasoning, content, usage = thought(resp)
    assert closed_at == 1 + 5                           # its own open tag, then five tokens of thought
    assert content.strip() and "<think>" not in content     # the answer, and the tag never again
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 5


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_with_a_budget_the_reply_reasons_first_and_then_answers_in_the_schema(app, qwen3, stream):
    jsonschema = pytest.importorskip("jsonschema")
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    # DeepSeek-R1-style: the template opened the block
    closed_at, reasoning, content, usage = thought(chat(app, stream, thinking_token_budget=4,
                                                        response_format=FORMAT, max_tokens=40, **extra))
    assert closed_at == 4 and usage["completion_tokens_details"]["reasoning_tokens"] == 4
    jsonschema.validate(json.loads(content), SCHEMA)
    # Qwen3-style: the reply opens it
    body = {"messages": USER, "max_tokens": 40, "logprobs": True, "stream": stream, "thinking_token_budget": 3,
            "response_format": FORMAT, **dict(SAMPLED, logit_bias=qwen3.bias), **extra}
    closed_at, reasoning, content, usage = thought(qwen3.post_json("/v1/chat/completions", body))
    assert closed_at == 1 + 3
    jsonschema.validate(json.loads(content), SCHEMA)


def test_without_a_budget_the_schema_governs_the_whole_reply_as_before(qwen3):
    jsonschema = pytest.importorskip("jsonschema")
    body = {"messages": USER, "max_tokens": 40, "response_format": FORMAT, **dict(SAMPLED, logit_bias=qwen3.bias)}
    reply = qwen3.post_json("/v1/chat/completions", body).json["choices"][0]["message"]
    assert not reply.get("reasoning_content")
    jsonschema.validate(json.loads(reply["content"]), SCHEMA)


@pytest.mark.parametrize("budget", [0, 3, 6])
def test_messages_thinking_is_what_chat_gets_with_the_same_budget(app, budget):
    """Anthropic's `thinking.budget_tokens` runs the same constraint as chat's budget: the same seeded
    request gives the same thinking block, the same text and the same token count on both routes."""
    sampled = {k: v for k, v in SAMPLED.items() if k != "logit_bias"}      # Messages has no logit_bias
    thinking = {"type": "enabled", "budget_tokens": budget} if budget else {"type": "disabled"}
    msg = app.post_json("/v1/messages", {"max_tokens": 24, "messages": USER, "thinking": thinking, **sampled}).json
    live = app.post_json("/v1/chat/completions", {"max_tokens": 24, "messages": USER, "thinking_token_budget": budget,
                                                  **sampled}).json
    blocks = {b["type"]: b for b in msg["content"]}
    message = live["choices"][0]["message"]
    assert blocks.get("thinking", {}).get("thinking", "") == (message.get("reasoning_content") or "")
    assert blocks.get("text", {}).get("text", "") == (message["content"] or "")
    assert msg["usage"]["output_tokens"] == live["usage"]["completion_tokens"]

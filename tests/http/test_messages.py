"""POST /v1/messages and /v1/messages/count_tokens against create_app with the fake engine."""
import json
from types import SimpleNamespace

import pytest

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
USER = [{"role": "user", "content": "hi"}]
HEADERS = {"x-api-key": "k", "anthropic-version": "2023-06-01"}


def set_reply(harness, reply):
    engine = harness.engine("fake", reply=reply, max_context=512)
    engine.template = SimpleNamespace(source="{% if tools %}<tool_call>{% endif %}")
    return engine


def events(resp):
    out, name = [], None
    for line in resp.text.split("\n"):
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == name
            out.append(data)
    return out


def post(harness, body, **kw):
    return harness.client().post_json("/v1/messages", body, headers=HEADERS, **kw)


def test_body_shape(harness):
    set_reply(harness, "Hello")
    body = post(harness, {"model": "fake", "max_tokens": 20, "messages": USER}).json
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": "Hello"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    assert body["usage"]["output_tokens"] == 5 and body["usage"]["input_tokens"] > 0


def test_stop_reasons(harness):
    set_reply(harness, "Hello world")
    body = post(harness, {"max_tokens": 3, "messages": USER}).json
    assert body["stop_reason"] == "max_tokens"
    body = post(harness, {"max_tokens": 30, "messages": USER, "stop_sequences": ["wor"]}).json
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "wor")


def test_tool_use_and_thinking_blocks(harness):
    set_reply(harness, "<think>need data</think>Checking." + CALL)
    body = post(harness, {"max_tokens": 200, "messages": USER, "tools": TOOLS}).json
    thinking, text, tool = body["content"]
    assert thinking == {"type": "thinking", "thinking": "need data", "signature": ""}
    assert text == {"type": "text", "text": "Checking."}
    assert tool["type"] == "tool_use" and tool["id"].startswith("toolu_")
    assert (tool["name"], tool["input"]) == ("get_weather", {"city": "Paris"})
    assert body["stop_reason"] == "tool_use"


def test_stream_event_order(harness):
    set_reply(harness, "<think>hm</think>Hi." + CALL)
    evs = events(post(harness, {"max_tokens": 200, "messages": USER, "tools": TOOLS, "stream": True}))
    kinds = [e["type"] for e in evs]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in evs if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert [e["index"] for e in evs if e["type"] == "content_block_stop"] == [0, 1, 2]
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "hm"
    assert "".join(d.get("text", "") for d in deltas) == "Hi."
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"city": "Paris"}
    assert sum(1 for d in deltas if d["type"] == "input_json_delta") > 2     # streamed in pieces
    assert evs[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert evs[0]["message"]["usage"]["input_tokens"] == evs[-2]["usage"]["input_tokens"]


def test_count_tokens_equals_input_tokens(harness):
    set_reply(harness, "ok")
    body = {"model": "fake", "max_tokens": 5, "system": "be nice", "messages": USER, "tools": TOOLS}
    counted = harness.client().post_json("/v1/messages/count_tokens", body, headers=HEADERS).json
    real = post(harness, body).json
    assert counted == {"input_tokens": real["usage"]["input_tokens"]}


def test_tool_result_history(harness):
    engine = set_reply(harness, "Sunny.")
    post(harness, {"max_tokens": 50, "tools": TOOLS, "messages": USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]})
    assert "<tool>sunny" in engine.decode(engine.runs[-1].ids)


@pytest.mark.parametrize("body,param_hint", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
])
def test_errors_use_the_anthropic_envelope(harness, body, param_hint):
    set_reply(harness, "x")
    resp = post(harness, body, status=400)
    assert resp.json["type"] == "error" and resp.json["error"]["type"] == "invalid_request_error"
    assert param_hint in resp.json["error"]["message"]


def test_mid_stream_failure_is_an_anthropic_error_event(harness):
    engine = set_reply(harness, "abcdef")
    engine.fail_at = 2
    text = post(harness, {"max_tokens": 20, "messages": USER, "stream": True}).text
    error = [line for line in text.split("\n") if line.startswith("data: ") and '"error"' in line]
    assert "event: error" in text and json.loads(error[-1][6:])["error"]["type"] == "api_error"


def test_thinking_budget_reaches_the_run_as_a_constraint(harness):
    engine = set_reply(harness, "<think>hm</think>Hi.")
    seen = []
    def thinking_budget(budget, ids, then=None):    # budget None: the serving side's counter of reasoning tokens
        return seen.append((budget, list(ids))) or "budget-constraint" if budget is not None else None
    engine.thinking_budget = thinking_budget
    post(harness, {"max_tokens": 200, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 64}})
    assert seen == [(64, engine.runs[-1].ids)] and engine.runs[-1].constraint == "budget-constraint"
    post(harness, {"max_tokens": 200, "messages": USER})
    assert len(seen) == 1 and engine.runs[-1].constraint is None

"""POST /v1/chat/completions against create_app with the fake engine (tests/conftest.py)."""
import json
from types import SimpleNamespace

import pytest

HERMES_TEMPLATE = "{% if tools %}<tool_call>{% endif %}{{ messages }}"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "hi"}]


def set_reply(harness, reply, template=HERMES_TEMPLATE):
    engine = harness.engine("fake", reply=reply, max_context=512)
    engine.template = SimpleNamespace(source=template)
    return engine


def sse_chunks(resp):
    lines = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_plain_reply_body_shape(harness):
    set_reply(harness, "Hello there")
    body = harness.client().post_json("/v1/chat/completions", {"model": "fake", "messages": USER}).json
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["system_fingerprint"].startswith("fp_") and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "stop",
                                "message": {"role": "assistant", "content": "Hello there", "refusal": None}}]
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] == len("Hello there")


def test_prompt_tokens_equal_the_rendered_template(harness):
    engine = set_reply(harness, "ok")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]}]
    body = harness.client().post_json("/v1/chat/completions", {"messages": messages}).json
    expected = engine.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])
    assert body["usage"]["prompt_tokens"] == len(expected)


def test_max_completion_tokens_gives_length(harness):
    set_reply(harness, "Hello there")
    body = harness.client().post_json("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 3}).json
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["message"]["content"] == "Hel"


def test_reasoning_is_split_and_can_stay_inline(harness):
    set_reply(harness, "<think>\nweighing\n</think>\n\nYes.")
    client = harness.client()
    msg = client.post_json("/v1/chat/completions", {"messages": USER}).json["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"], msg["reasoning"]) == ("Yes.", "weighing", "weighing")
    msg = client.post_json("/v1/chat/completions", {"messages": USER, "reasoning_format": "none"}).json
    assert msg["choices"][0]["message"]["content"] == "<think>\nweighing\n</think>\n\nYes."


def test_tool_call_body(harness):
    set_reply(harness, "Let me look.\n" + CALL)
    body = harness.client().post_json("/v1/chat/completions", {"messages": USER, "tools": TOOLS}).json
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_tool_calls_not_parsed_without_tools_or_with_choice_none(harness):
    set_reply(harness, CALL)
    client = harness.client()
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        msg = client.post_json("/v1/chat/completions", {"messages": USER, **extra}).json["choices"][0]["message"]
        assert msg["content"] == CALL and "tool_calls" not in msg


def test_stream_chunks_with_usage(harness):
    set_reply(harness, "<think>hm</think>Hi!")
    resp = harness.client().post_json("/v1/chat/completions", {
        "messages": USER, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.content_type == "text/event-stream"
    chunks = sse_chunks(resp)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len("<think>hm</think>Hi!")
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert "".join(d.get("content", "") for d in deltas) == "Hi!"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "hm"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)


def test_stream_without_include_usage_has_no_usage_key(harness):
    set_reply(harness, "Hi")
    chunks = sse_chunks(harness.client().post_json("/v1/chat/completions", {"messages": USER, "stream": True}))
    assert all("usage" not in c for c in chunks)


def test_stream_tool_call_deltas(harness):
    set_reply(harness, "Sure." + CALL + CALL.replace("Paris", "Oslo"))
    chunks = sse_chunks(harness.client().post_json("/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    heads = [tc for tc in calls if "id" in tc]
    assert [h["index"] for h in heads] == [0, 1]
    assert all(h["function"]["name"] == "get_weather" and h["function"]["arguments"] == "" for h in heads)
    args = {i: "".join(tc["function"].get("arguments", "") for tc in calls if tc["index"] == i) for i in (0, 1)}
    assert args == {0: '{"city": "Paris"}', 1: '{"city": "Oslo"}'}
    # arguments stream in pieces as the model writes them, not as one delta after the call closes
    assert all(sum(1 for tc in calls if tc["index"] == i and tc not in heads) > 2 for i in (0, 1))
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls if tc not in heads)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Sure."


def test_parallel_tool_calls_false_keeps_the_first(harness):
    set_reply(harness, CALL + CALL.replace("Paris", "Oslo"))
    body = harness.client().post_json("/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "parallel_tool_calls": False}).json
    assert len(body["choices"][0]["message"]["tool_calls"]) == 1


def test_named_tool_choice_forces_the_call_start(harness):
    engine = set_reply(harness, '{"city": "Rome"}}\n</tool_call>')
    body = harness.client().post_json("/v1/chat/completions", {
        "messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}).json
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    prompt = engine.decode(engine.runs[-1].ids)
    assert prompt.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')


def test_template_without_tools_gets_a_fallback_system_turn(harness):
    engine = set_reply(harness, "ok", template="{{ messages }}")
    harness.client().post_json("/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    prompt = engine.decode(engine.runs[-1].ids)
    assert "<tools>" in prompt and "get_weather" in prompt and prompt.index("<system>") < prompt.index("<user>")


def test_history_with_tool_turns_renders(harness):
    set_reply(harness, "It is sunny.")
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = harness.client().post_json("/v1/chat/completions", {"messages": messages, "tools": TOOLS}).json
    assert body["choices"][0]["message"]["content"] == "It is sunny."


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": USER, "response_format": {"type": "bogus"}}, "response_format"),
    ({"messages": USER, "n": 21}, "n"),
])
def test_validation_errors_use_the_openai_envelope(harness, body, param):
    set_reply(harness, "x")
    resp = harness.client().post_json("/v1/chat/completions", body, status=400)
    err = resp.json["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert set(resp.json) == {"error"} and set(err) == {"message", "type", "param", "code"}


def test_context_overflow_is_a_400(harness):
    set_reply(harness, "x")
    harness.engine("fake").max_context = 16
    resp = harness.client().post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 40}]},
                                      status=400)
    assert resp.json["error"]["code"] == "context_length_exceeded"


def test_mid_stream_failure_is_an_error_event(harness):
    engine = set_reply(harness, "abcdef")
    engine.fail_at = 2
    resp = harness.client().post_json("/v1/chat/completions", {"messages": USER, "stream": True})
    assert "event: error" in resp.text and "[DONE]" not in resp.text and "internal detail" not in resp.text

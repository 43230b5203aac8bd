import pytest

from turbospark_wsgi.errors import InvalidRequest
from turbospark_wsgi.http.schemas.chat import parse_chat

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


def refused(body):
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body)
    return info.value


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"messages": USER, "tools": {"a": 1}}, "tools"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": USER, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": USER, "n": 21}, "n"),
    ({"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": "5"}, "max_completion_tokens"),
    ({"messages": USER, "temperature": 3}, "temperature"),
    ({"messages": USER, "stop": [1]}, "stop"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "logprobs": "yes"}, "logprobs"),
    ({"messages": USER, "reasoning_format": "weird"}, "reasoning_format"),
    ({"messages": USER, "seed": 1.5}, "seed"),
])
def test_malformed_bodies_name_their_param(body, param):
    err = refused(body)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert err.message


def test_content_parts_and_roles_are_normalized():
    req = parse_chat({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning": "thought",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ], "max_completion_tokens": 7, "max_tokens": 3, "stop": "END", "seed": 4, "unknown_field": 1})
    assert req.chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "reasoning_content": "thought",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"},
    ]
    assert req.max_tokens == 7 and req.sampling.stop == ("END",) and req.sampling.seed == 4


def test_defaults_and_options():
    req = parse_chat({"messages": USER})
    assert req.max_tokens is None and req.chat.tools is None and req.chat.tool_choice == "none"
    assert req.chat.reasoning and not req.stream and not req.include_usage
    req = parse_chat({"messages": USER, "stream": True, "stream_options": {"include_usage": True},
                      "reasoning_format": "none", "response_format": {"type": "text"},
                      "chat_template_kwargs": {"enable_thinking": False}, "n": 1})
    assert req.include_usage and not req.chat.reasoning and req.chat.template_kwargs == {"enable_thinking": False}


def test_tool_choice_forms():
    assert parse_chat({"messages": USER, "tools": [TOOL]}).chat.tool_choice == "auto"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_chat({"messages": USER, "tools": [TOOL], "tool_choice": named}).chat.tool_choice == "get_weather"
    chat = parse_chat({"messages": USER, "tools": [TOOL], "tool_choice": "none"}).chat
    assert chat.tools is None and chat.tool_choice == "none"


def test_reasoning_content_accepted_back_under_both_names():
    for key in ("reasoning_content", "reasoning"):
        chat = parse_chat({"messages": [{"role": "assistant", "content": "x", key: "why"}]}).chat
        assert chat.messages[0]["reasoning_content"] == "why"

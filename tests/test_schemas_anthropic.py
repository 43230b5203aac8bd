import pytest

from turbospark_wsgi.errors import InvalidRequest
from turbospark_wsgi.http.schemas.anthropic import parse_messages_request

USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_weather", "description": "w", "input_schema": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("body,param", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 5}, "messages"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"name": "f f", "input_schema": {}}]}, "tools.0.name"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"max_tokens": 5, "messages": USER, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice.name"),
    ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 5}}, "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": USER, "system": [{"type": "image"}]}, "system.0"),
])
def test_malformed_bodies(body, param):
    with pytest.raises(InvalidRequest) as info:
        parse_messages_request(body)
    assert (info.value.status, info.value.anthropic_type, info.value.param) == (400, "invalid_request_error", param)


def test_conversation_maps_to_template_messages():
    req = parse_messages_request({
        "max_tokens": 4096, "system": [{"type": "text", "text": "sys"}], "stop_sequences": ["END"],
        "top_k": 5, "tools": [TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use tool", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"c": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "5C"}]},
                {"type": "text", "text": "thanks"}]},
        ]})
    assert req.chat.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "reasoning_content": "use tool", "content": "Checking.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"c": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5C"},
        {"role": "user", "content": "thanks"},
    ]
    assert req.max_tokens == 4096 and req.sampling.stop == ("END",) and req.sampling.top_k == 5
    assert req.chat.tool_choice == "required" and req.chat.parallel_tool_calls is False
    assert req.chat.tools[0]["function"]["parameters"] == TOOL["input_schema"]
    assert req.chat.template_kwargs == {"enable_thinking": True} and req.chat.thinking_budget == 2048


def test_count_only_needs_no_max_tokens():
    assert parse_messages_request({"messages": USER}, count_only=True).chat.messages == [{"role": "user", "content": "hi"}]

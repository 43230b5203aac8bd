"""How a chat request's tools and reasoning meet a model's template: family, fallback, forced prefix."""
import json
from dataclasses import dataclass

from ..parsers import detect_family

_FALLBACK_SYSTEM = (
    "You may call one or more functions to assist with the user query. The available functions are "
    "listed in <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a JSON "
    "object inside <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(slots=True)
class OutputPlan:
    """What the prompt gets and how the output is parsed for one chat request."""

    messages: list
    tools: list | None                    # passed to the template (None when the template can't take them)
    tool_family: str | None               # parser family; None: no tool calls parsed
    in_reasoning: bool                    # the generation prompt already opened <think>
    assistant_prefix: str = ""            # generated-text prefix forcing a tool call ('' when not forced)


def prompt_opens_reasoning(source):
    """Whether the template's generation prompt ends inside an open <think> (DeepSeek-R1 style)."""
    tail = source[source.rfind("add_generation_prompt"):] if "add_generation_prompt" in source else ""
    return "<think>" in tail and "</think>" not in tail


def plan_output(source, messages, tools, tool_choice, reasoning=True):
    """An OutputPlan for a template source and the parsed request's messages, tools and tool_choice."""
    source = source or ""
    in_reasoning = reasoning and prompt_opens_reasoning(source)
    if not tools:
        return OutputPlan(messages, None, None, in_reasoning)
    family = detect_family(source)
    if "tools" not in source:
        # NOTE(tools): a template that never renders `tools` gets them in a Hermes-style system turn,
        # and the tool turns of the history written as Hermes text, instead of losing them silently.
        messages, tools, family = _fallback_messages(messages, tools), None, "hermes"
    return OutputPlan(messages, tools, family, in_reasoning, forced_prefix(family, tool_choice))


def forced_prefix(family, tool_choice):
    """The start of a tool call written for the model when tool_choice is 'required' or a name."""
    if tool_choice in ("auto", "none"):
        return ""
    named = tool_choice != "required"
    name = json.dumps(tool_choice)
    if family == "llama3_json":
        return f'{{"name": {name}, "parameters": ' if named else '{"name": '
    if family == "mistral":
        return f'[TOOL_CALLS][{{"name": {name}, "arguments": ' if named else "[TOOL_CALLS]"
    return f'<tool_call>\n{{"name": {name}, "arguments": ' if named else "<tool_call>\n"


def _fallback_messages(messages, tools):
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = _FALLBACK_SYSTEM.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = out[0]["content"] + "\n\n" + system
    else:
        out.insert(0, {"role": "system", "content": system})
    return [_hermes_turn(m) for m in out]


def _hermes_turn(msg):
    if msg["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
    if msg["role"] == "assistant" and msg.get("tool_calls"):
        calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                        ensure_ascii=False) + "\n</tool_call>"
                          for c in msg["tool_calls"])
        text = (msg["content"] + "\n" if msg["content"] else "") + calls
        return {k: v for k, v in {**msg, "content": text}.items() if k != "tool_calls"}
    return msg

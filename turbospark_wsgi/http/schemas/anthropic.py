"""POST /v1/messages (Anthropic Messages API): the request body checked and turned into a GenerationRequest."""
import json

from ...serving.chat_plan import ChatPart
from ...serving.service import GenerationRequest
from . import checks, common
from .chat_messages import function_spec
from .checks import fail
from .document import encodable_value


def parse_messages_request(doc, count_only=False):
    """The JSON body -> GenerationRequest with a ChatPart; `count_only` (count_tokens) needs no max_tokens."""
    checks.typed(doc, dict, "body", "a JSON object")
    max_tokens = None if count_only else common.max_tokens(doc)
    if max_tokens is None and not count_only:
        fail("max_tokens", "max_tokens: Field required")
    messages = _system(doc.get("system")) + _messages(checks.require(doc, "messages"))
    tools = _tools(doc.get("tools"))
    choice, parallel = _tool_choice(doc.get("tool_choice"), tools)
    sampling = common.sampling(doc, common.ANTHROPIC)
    model, stream = common.model_name(doc), checks.boolean(doc, "stream")
    chat = ChatPart(messages, tools=tools if choice != "none" else None, tool_choice=choice,
                    parallel_tool_calls=parallel, **_thinking(doc.get("thinking"), max_tokens))
    return GenerationRequest(model=model, chat=chat, max_tokens=max_tokens, sampling=sampling, stream=stream,
                             prompt_param="messages")


def _system(system):
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _text_blocks(value, param):
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        fail(param, f"{param}: Input should be a valid string or a list of text blocks")
    texts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            fail(f"{param}.{i}", f"{param}.{i}: only text blocks are supported here")
        texts.append(block["text"])
    return "\n".join(texts)


def _messages(value):
    if not isinstance(value, list) or not value:
        fail("messages", "messages: at least one message is required")
    out = []
    for i, msg in enumerate(value):
        param = f"messages.{i}"
        checks.typed(msg, dict, param, "an object")
        role = msg.get("role")
        if role not in ("user", "assistant"):
            fail(f"{param}.role", f"{param}.role: Input should be 'user' or 'assistant'")
        content = msg.get("content")
        if content is None:
            fail(f"{param}.content", f"{param}.content: Field required")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            fail(f"{param}.content", f"{param}.content: Input should be a valid string or a list of blocks")
        out.extend(_user(blocks, param) if role == "user" else [_assistant(blocks, param)])
    return out


def _block(block, param, kinds):
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document"):
        fail(f"{param}.type", f"{param}: {kind} input is not supported: this server serves text-only models")
    if kind not in kinds:
        fail(f"{param}.type", f"{param}.type: expected one of {', '.join(kinds)}")
    return kind


def _user(blocks, param):
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = _block(block, f"{param}.content.{j}", ("text", "tool_result"))
        if kind == "text":
            texts.append(checks.typed(block.get("text"), str, f"{param}.content.{j}.text", "a string"))
            continue
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            fail(f"{param}.content.{j}.tool_use_id", f"{param}.content.{j}.tool_use_id: Field required")
        content = block.get("content", "")
        text = _text_blocks(content, f"{param}.content.{j}.content") if content else ""
        results.append({"role": "tool", "tool_call_id": call_id, "content": text})
    # NOTE(anthropic): tool results come first: they answer the previous assistant turn's calls.
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _assistant(blocks, param):
    out, texts, calls = {"role": "assistant"}, [], []
    for j, block in enumerate(blocks):
        p = f"{param}.content.{j}"
        kind = _block(block, p, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            texts.append(checks.typed(block.get("text"), str, f"{p}.text", "a string"))
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            out["reasoning_content"] = block["thinking"]
        elif kind == "tool_use":
            calls.append(_history_call(block, p))
    out["content"] = "".join(texts)
    if calls:
        out["tool_calls"] = calls
    return out


def _history_call(block, param):
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        fail(param, f"{param}: tool_use blocks need 'id' and 'name'")
    args = block.get("input", {})
    checks.typed(args, dict, f"{param}.input", "an object")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": args}}


def _tools(value):
    if value is None:
        return None
    if not isinstance(value, list):
        fail("tools", "tools: Input should be a valid list")
    tools = []
    for i, tool in enumerate(value):
        checks.typed(tool, dict, f"tools.{i}", "an object")
        if tool.get("type") not in (None, "custom"):
            fail(f"tools.{i}.type", f"tools.{i}.type: server tool '{tool.get('type')}' is not supported")
        if "input_schema" not in tool:
            fail(f"tools.{i}.input_schema", f"tools.{i}.input_schema: Field required")
        tools.append({"type": "function", "function": function_spec(tool, f"tools.{i}", "input_schema")})
    return tools or None


_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _tool_choice(value, tools):
    if value is None:
        return ("auto" if tools else "none"), True
    checks.typed(value, dict, "tool_choice", "an object")
    kind = value.get("type")
    parallel = not checks.boolean(value, "disable_parallel_tool_use")
    if kind == "tool":
        name = value.get("name")
        if name not in [t["function"]["name"] for t in tools or ()]:
            fail("tool_choice.name", f"tool_choice.name: '{name}' is not among tools")
        return name, parallel
    if not isinstance(kind, str) or kind not in _CHOICES:       # an object or array is unhashable
        fail("tool_choice.type", "tool_choice.type: expected 'auto', 'any', 'tool' or 'none'")
    if kind == "any" and not tools:
        fail("tool_choice", "tool_choice 'any' requires tools")
    return _CHOICES[kind], parallel


def _thinking(value, max_tokens):
    """ChatPart fields for `thinking`: the template's enable_thinking and the budget."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "enabled":
        budget = checks.integer(value, "budget_tokens", 1, None)
        if budget is None:
            fail("thinking.budget_tokens", "thinking.budget_tokens: Field required")
        if max_tokens and budget >= max_tokens:
            fail("thinking.budget_tokens", "`max_tokens` must be greater than `thinking.budget_tokens`")
        return {"template_kwargs": {"enable_thinking": True}, "thinking_budget": budget}
    if kind == "disabled":
        # NOTE(disabled): a template that opens the think tag anyway gets it closed at once
        return {"template_kwargs": {"enable_thinking": False}, "thinking_budget": 0}
    if kind == "adaptive":
        return {"template_kwargs": {"enable_thinking": True}}
    fail("thinking.type", "thinking.type: expected 'enabled' or 'disabled'")


def tool_input(arguments):
    """A ToolCall's JSON arguments as the `input` object of a tool_use block; arguments cut short
    (max_tokens) give an empty object."""
    try:
        value = json.loads(arguments or "{}")
        value = encodable_value(value)        # NOTE(output): the model may write a "\ud800" escape
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {"value": value}

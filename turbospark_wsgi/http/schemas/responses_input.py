"""POST /v1/responses `input`: a string or a list of items (messages, function calls and their
outputs, reasoning) turned into the message dicts chat templates take, as chat_messages does for
/v1/chat/completions. Every refusal names its JSON path, e.g. "input[2].content[0].text".
"""
from .anthropic import tool_input
from .chat_messages import history_arguments, joined_text
from .checks import fail, typed

ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "text": "text"}
_MEDIA_PARTS = {"input_image": "Image", "input_file": "File", "input_audio": "Audio"}
_ITEM_TYPES = "'message', 'function_call', 'function_call_output' or 'reasoning'"


def parse_input(value):
    """`input` -> template message dicts (roles user, assistant, system, tool)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        fail("input", "'input' must be a string or a non-empty array of input items.")
    messages, reasoning = [], None
    for i, item in enumerate(value):
        param = f"input[{i}]"
        typed(item, dict, param, "an object")
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = _reasoning_text(item, param)
            continue
        if kind == "message":
            msg = _message(item, param)
        elif kind == "function_call":
            msg = _call(item, param, messages)
        elif kind == "function_call_output":
            msg = _call_output(item, param)
        elif kind == "item_reference":
            fail(f"{param}.type", f"'{param}': item references are not supported; send the item itself.")
        else:
            fail(f"{param}.type", f"'{param}.type' must be {_ITEM_TYPES}: built-in tool items are not supported.")
        if msg is not None:
            # NOTE(reasoning): a reasoning item belongs to the assistant turn right after it.
            if msg["role"] == "assistant" and reasoning:
                msg["reasoning_content"] = reasoning
            messages.append(msg)
        reasoning = None
    return messages


def _message(item, param):
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        fail(f"{param}.role", f"'{param}.role' must be one of {', '.join(ROLES)}.")
    content = item.get("content")
    if content is None:
        fail(f"{param}.content", f"Missing required parameter: '{param}.content'.")
    return {"role": "system" if role == "developer" else role, "content": text_parts(content, f"{param}.content")}


def text_parts(content, param):
    """A string, or an array of text parts (input_text, output_text, refusal) joined by newlines."""
    return joined_text(content, param, _TEXT_PARTS, _MEDIA_PARTS, "input_text")


def _call(item, param, messages):
    """A function_call item: joins the assistant turn just before it, or starts one; None when joined."""
    call_id, name = _string(item, "call_id", param), _string(item, "name", param)
    args = item.get("arguments", "{}")
    typed(args, str, f"{param}.arguments", "a string of JSON")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": history_arguments(args, f"{param}.arguments")}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return None
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _call_output(item, param):
    call_id = _string(item, "call_id", param)
    output = item.get("output")
    if output is None:
        fail(f"{param}.output", f"Missing required parameter: '{param}.output'.")
    return {"role": "tool", "tool_call_id": call_id, "content": text_parts(output, f"{param}.output")}


def _reasoning_text(item, param):
    """The text of a reasoning item: its reasoning_text content, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            fail(f"{param}.{key}", f"'{param}.{key}' must be an array of text parts.")
        texts = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                fail(f"{param}.{key}[{j}]", f"'{param}.{key}[{j}]' must be an object with a 'text' string.")
            texts.append(part["text"])
        if texts:
            return "\n".join(texts)
    return None


def _string(item, key, param):
    value = item.get(key)
    if not isinstance(value, str) or not value:
        fail(f"{param}.{key}", f"'{param}.{key}' must be a non-empty string.")
    return value


def with_tool_names(messages):
    """Tool results get the name of the call they answer (templates print it), across turns."""
    names = {}
    for msg in messages:
        for call in msg.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
        if msg["role"] == "tool" and "name" not in msg and msg["tool_call_id"] in names:
            msg["name"] = names[msg["tool_call_id"]]
    return messages


def assistant_turn(output):
    """The template message for a response's own output items (to continue it later)."""
    msg = {"role": "assistant", "content": ""}
    texts, reasoning, calls = [], [], []
    for item in output:
        if item["type"] == "message":
            texts += [part["text"] for part in item["content"]]
        elif item["type"] == "reasoning":
            reasoning += [part["text"] for part in item["content"]]
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": tool_input(item["arguments"])}})
    msg["content"] = "".join(texts)
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg

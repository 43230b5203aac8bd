"""OpenAI chat `messages` and `tools` checked and turned into the dicts chat templates expect."""
import json
import re

from .checks import fail, typed
from .document import check_document
from .json_schema import check_schema

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_UNSUPPORTED_PARTS = {"image_url": "Image", "input_audio": "Audio", "file": "File", "video_url": "Video"}
_CHAT_TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def parse_messages(value):
    """`messages` -> list of template dicts: role, content (str), tool_calls, tool_call_id, ..."""
    if not isinstance(value, list) or not value:
        fail("messages", "'messages' must be a non-empty array.")
    names = {}   # tool_call_id -> function name, for tool messages that omit it
    return [_message(m, f"messages[{i}]", names) for i, m in enumerate(value)]


def _message(msg, param, names):
    typed(msg, dict, param, "an object")
    role = msg.get("role")
    if role is None:
        fail(f"{param}.role", f"Missing required parameter: '{param}.role'.")
    if role not in ROLES:
        fail(f"{param}.role", f"Invalid value for '{param}.role': {role!r}. Supported: {', '.join(ROLES)}.")
    out = {"role": "system" if role == "developer" else role}
    content = text_content(msg.get("content"), f"{param}.content")
    if content is None and not (role == "assistant" and msg.get("tool_calls")):
        fail(f"{param}.content", f"'{param}.content' is required for role '{role}'.")
    out["content"] = content if content is not None else ""
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if role == "assistant":
        _assistant_extras(msg, param, out, names)
    elif role == "tool":
        _tool_extras(msg, param, out, names)
    return out


def text_content(content, param):
    """A string, or an array of text parts joined by newlines; other part types are refused."""
    if content is None:
        return None
    return joined_text(content, param, _CHAT_TEXT_PARTS, _UNSUPPORTED_PARTS, "text")


def joined_text(content, param, text_parts, media_parts, example):
    """A string, or an array of content parts joined by newlines. `text_parts` maps a part type to
    the key holding its text; `media_parts` maps the types refused as unsupported input to their
    name; any other part is refused as not text (`example`: the text part type to suggest)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        fail(param, f"'{param}' must be a string or an array of content parts.")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None      # a non-string type is no known part
        if kind in media_parts:
            fail(f"{param}[{j}].type",
                 f"{media_parts[kind]} input is not supported: this server serves text-only models.")
        key = text_parts.get(kind)
        if key is None or not isinstance(part.get(key), str):
            fail(f"{param}[{j}]",
                 f"'{param}[{j}]' must be a text part: {{\"type\": \"{example}\", \"text\": \"...\"}}.")
        texts.append(part[key])
    return "\n".join(texts)


def _assistant_extras(msg, param, out, names):
    # NOTE(reasoning): both field names are accepted back; templates read `reasoning_content`.
    for key in ("reasoning_content", "reasoning"):
        if isinstance(msg.get(key), str) and msg[key]:
            out["reasoning_content"] = msg[key]
            break
    calls = msg.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list):
        fail(f"{param}.tool_calls", f"'{param}.tool_calls' must be an array.")
    out["tool_calls"] = [_history_call(c, f"{param}.tool_calls[{k}]", names) for k, c in enumerate(calls)]


def _history_call(call, param, names):
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        fail(f"{param}.function", f"'{param}.function' must be an object with a 'name'.")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        args = history_arguments(args, f"{param}.function.arguments")
    call_id = call.get("id") if isinstance(call.get("id"), str) else ""
    names[call_id] = fn["name"]
    # NOTE(templates): arguments go to templates as an object (they `tojson` it), as transformers does.
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def history_arguments(text, param):
    """A past call's arguments given as JSON text, decoded and held to the body's own checks
    (nesting depth, lone surrogates), since templates render them."""
    try:
        args = json.loads(text or "{}")
    except ValueError:
        fail(param, f"'{param}' must be a JSON string.")
    except RecursionError:
        fail(param, f"'{param}' is nested too deeply.")
    return check_document(args, param)


def _tool_extras(msg, param, out, names):
    call_id = msg.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        fail(f"{param}.tool_call_id", f"'{param}.tool_call_id' is required for role 'tool'.")
    out["tool_call_id"] = call_id
    if "name" not in out and call_id in names:
        out["name"] = names[call_id]


def parse_tools(value):
    """`tools` -> list of {"type": "function", "function": {name, description, parameters}}."""
    if value is None:
        return None
    if not isinstance(value, list):
        fail("tools", "'tools' must be an array.")
    return [_tool(t, f"tools[{i}]") for i, t in enumerate(value)] or None


def _tool(tool, param):
    if not isinstance(tool, dict) or tool.get("type") != "function":
        fail(f"{param}.type", f"'{param}.type' must be 'function'.")
    fn = typed(tool.get("function"), dict, f"{param}.function", "an object")
    return {"type": "function", "function": function_spec(fn, f"{param}.function")}


def function_spec(fn, param, params_key="parameters"):
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        fail(f"{param}.name", f"'{param}.name' must be 1-64 characters of a-z, A-Z, 0-9, '_', '.' or '-'.")
    spec = {"name": name}
    if fn.get("description") is not None:
        spec["description"] = typed(fn["description"], str, f"{param}.description", "a string")
    schema = fn.get(params_key)
    if schema is not None:
        typed(schema, dict, f"{param}.{params_key}", "a JSON Schema object")
        if schema.get("type", "object") != "object":
            fail(f"{param}.{params_key}", f"'{param}.{params_key}' must describe an object (type 'object').")
        check_schema(schema, f"{param}.{params_key}")
        spec["parameters"] = schema
    return spec


def parse_tool_choice(value, tools):
    """'none' | 'auto' | 'required' | a function name (named choice)."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        choice = value
    elif isinstance(value, dict) and isinstance((value.get("function") or {}).get("name"), str):
        choice = value["function"]["name"]
    else:
        fail("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}.")
    declared = [t["function"]["name"] for t in tools or ()]
    if choice not in ("none", "auto") and not declared:
        fail("tool_choice", "'tool_choice' requires 'tools'.")
    if choice not in ("none", "auto", "required") and choice not in declared:
        fail("tool_choice", f"'tool_choice' names '{choice}', which is not among 'tools'.")
    return choice

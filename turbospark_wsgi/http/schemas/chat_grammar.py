"""Structured output as grammar specs (llguidance's JSON grammar format): `response_format`
json_object / json_schema, and forced tool calls (their arguments follow the tool's schema).

The specs are plain dicts; the service compiles them against the model's tokenizer.
"""
import json

from .checks import fail
from .json_schema import check_schema

# NOTE(whitespace): one fixed style (", " and ": ", no newlines) keeps a small model from wandering
# into endless whitespace, which flexible JSON whitespace allows.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def response_format_grammar(value):
    """`response_format` -> a grammar spec, or None for text / absent."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"})
    if kind != "json_schema":
        fail("response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'.")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        fail("response_format.json_schema", "'response_format.json_schema' must be an object with a 'name'.")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        fail("response_format.json_schema.schema", "'response_format.json_schema.schema' must be a JSON Schema object.")
    check_schema(schema, "response_format.json_schema.schema")
    return json_grammar(schema)


def json_grammar(schema):
    return {"grammars": [{"json_schema": _styled(schema)}]}


def _styled(schema):
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def tool_call_grammar(family, tool_choice, tools):
    """The rest of a forced call after its prefix (see tool_prompt.forced_prefix); None unless forced."""
    if tool_choice in ("auto", "none") or not tools:
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if tool_choice != "required":
        schemas = {tool_choice: schemas[tool_choice]}
    rules, alternatives = [], []
    for k, (name, schema) in enumerate(schemas.items()):
        rules.append(f"args{k}: %json {json.dumps(_styled(schema))}")
        alternatives.append(_call_rule(family, tool_choice == "required", name, f"args{k}"))
    lark = "start: " + " | ".join(alternatives) + "\n" + "\n".join(rules) + "\n"
    return {"grammars": [{"lark_grammar": lark}]}


def _call_rule(family, required, name, args):
    q = json.dumps
    if family == "llama3_json":
        head, tail = (q(q(name) + ", \"parameters\": ") if required else None), q("}")
    elif family == "mistral":
        head = q("[{\"name\": " + q(name) + ", \"arguments\": ") if required else None
        tail = q("}]")
    else:
        head = q("{\"name\": " + q(name) + ", \"arguments\": ") if required else None
        tail = q("}\n</tool_call>")
    return " ".join(p for p in (head, args, tail) if p)

"""Structured output as grammar specs (llguidance's JSON grammar format): `response_format`
json_object / json_schema. A forced tool call's grammar depends on the model's template, so the
service plans it (serving/chat_plan.py), in the same JSON style.

The specs are plain dicts; the service compiles them against the model's tokenizer.
"""
from ...serving.chat_plan import styled
from .checks import fail
from .json_schema import check_schema


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
    return {"grammars": [{"json_schema": styled(schema)}]}

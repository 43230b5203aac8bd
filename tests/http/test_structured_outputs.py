"""Structured outputs by constrained decoding: response_format json_schema / json_object and forced
tool calls always parse and validate (checked with `jsonschema`), on the default SmolLM2 model when
present, else on a tiny random Llama."""
import importlib.util
import json
import os
from pathlib import Path

import pytest

from turbospark_wsgi.http.app import create_app
from turbospark_wsgi.config import Config

jsonschema = pytest.importorskip("jsonschema")
webtest = pytest.importorskip("webtest")

_spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).parents[1] / "engine" / "conftest.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

MODELS = Path(os.environ.get("TURBOSPARK_MODELS") or "~/.cache/turbospark/models").expanduser()
SMOLLM = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"

NESTED = {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
    "user": {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}}
ENUMS = {"type": "object", "additionalProperties": False, "required": ["color", "size", "count"], "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 9}}}
ARRAYS = {"type": "object", "additionalProperties": False, "required": ["items", "tags"], "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "ok"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}}}},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 8}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    if SMOLLM.is_file():
        (root / SMOLLM.name).symlink_to(SMOLLM)
        name = SMOLLM.stem
    else:
        cfg = tiny.hf_config()
        tiny.write_hf_dir(root / "tiny", cfg, tiny.random_state(cfg, 0))
        name = "tiny"
    return webtest.TestApp(create_app(Config(models_dir=str(root), model=name, device="cpu", load_default=False)))


def ask(app, content, **body):
    r = app.post_json("/v1/chat/completions", dict(messages=[{"role": "user", "content": content}], **body))
    assert "x-anyllm-degradation" not in r.headers
    return r.json


@pytest.mark.slow
@pytest.mark.parametrize("schema", [NESTED, ENUMS, ARRAYS], ids=["nested", "enums", "arrays"])
def test_twenty_sampled_responses_validate(app, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    body = ask(app, "Reply with JSON.", response_format=fmt, temperature=0.8, seed=100, n=20, max_tokens=120)
    assert len(body["choices"]) == 20
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_is_an_object(app):
    body = ask(app, "A JSON object please.", response_format={"type": "json_object"}, temperature=0.8, seed=3,
               max_tokens=60, n=2)
    for choice in body["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_streamed_json_schema_output_validates(app):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ENUMS}}
    frames = app.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON"}],
                                                    "response_format": fmt, "stream": True, "seed": 9,
                                                    "max_tokens": 100}).body.decode()
    chunks = [json.loads(f[6:]) for f in frames.split("\n\n") if f.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    jsonschema.validate(json.loads(text), ENUMS)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_against_the_tool_schema(app, choice):
    body = ask(app, "What is the weather in Paris?", tools=TOOLS, tool_choice=choice, temperature=0.8,
               seed=5, n=4, max_tokens=120)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in body["choices"]:
        assert c["finish_reason"] == "tool_calls", c
        for call in c["message"]["tool_calls"]:
            if isinstance(choice, dict):
                assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_validates(app, choice):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = app.post_json("/v1/messages", {"max_tokens": 120, "messages": [{"role": "user", "content": "Paris weather?"}],
                                       "tools": tools, "tool_choice": choice, "temperature": 0.8})
    blocks = [b for b in r.json["content"] if b["type"] == "tool_use"]
    assert r.json["stop_reason"] == "tool_use" and blocks
    for block in blocks:
        jsonschema.validate(block["input"], {t["name"]: t["input_schema"] for t in tools}[block["name"]])


def test_a_schema_the_grammar_engine_cannot_compile_is_400(app):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}
    r = app.post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                               "response_format": fmt}, status=400)
    assert r.json["error"]["param"] == "response_format.json_schema.schema" and "missing" in r.json["error"]["message"]

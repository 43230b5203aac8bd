"""Hostile input on a real engine: lone surrogates, deep nesting, junk grammars and self-referring
tool schemas get a 400 in the route's envelope naming the field, with no traceback in the log, and
the app answers a normal request afterwards. Runs on stories260K or the default SmolLM2 when
present, else on a tiny random Llama."""
import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest

from turbospark_wsgi.http.app import create_app
from turbospark_wsgi.config import Config

webtest = pytest.importorskip("webtest")

_spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).parents[1] / "engine" / "conftest.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

STORIES = Path("/work/shared/models/stories260K.gguf")
MODELS = Path(os.environ.get("TURBOSPARK_MODELS") or "~/.cache/turbospark/models").expanduser()
SMOLLM = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"

S = "\\ud800"                      # a lone surrogate as a JSON escape (raw text, not a Python escape)
USER = '[{"role": "user", "content": "hi"}]'
CALL = ('{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
        '"function": {"name": "f", "arguments": %s}}]}')
TOOL_MSG = '{"role": "tool", "tool_call_id": "c1", "content": "ok"}'


def build_app(root):
    """A webtest app on the smallest real model at hand."""
    for path in (STORIES, SMOLLM):
        if path.is_file():
            (root / path.name).symlink_to(path)
            name = path.stem
            break
    else:
        cfg = tiny.hf_config()
        tiny.write_hf_dir(root / "tiny", cfg, tiny.random_state(cfg, 0))
        name = "tiny"
    return webtest.TestApp(create_app(Config(models_dir=str(root), model=name, device="cpu", load_default=False)))


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    return build_app(tmp_path_factory.mktemp("models"))


def chat_with_args(args_json):
    return '{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, %s, %s]}' % (CALL % args_json, TOOL_MSG)


def deep(n):
    return "[" * n + "]" * n


SURROGATES = [
    ("/v1/completions", '{"prompt": "a%sb", "max_tokens": 2}' % S, "prompt"),
    ("/v1/completions", '{"prompt": ["%s"], "max_tokens": 2}' % S, "prompt[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 2}' % S,
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}' % S,
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": %s, "max_tokens": 2, "tools": [{"type": "function", "function": '
     '{"name": "f", "description": "%s"}}]}' % (USER, S), "tools[0].function.description"),
    ("/v1/chat/completions", '{"messages": %s, "model": "%s"}' % (USER, S), "model"),
    ("/v1/chat/completions", '{"messages": %s, "%s": 1}' % (USER, S), "\\ud800"),
    ("/v1/chat/completions", chat_with_args(json.dumps('{"a": "%s"}' % S)),
     "messages[1].tool_calls[0].function.arguments.a"),
    ("/v1/messages", '{"messages": %s, "max_tokens": 2, "system": "%s"}' % (USER, S), "system"),
    ("/v1/messages", '{"messages": %s, "max_tokens": 2, "model": "%s"}' % (USER, S), "model"),
    ("/v1/messages/count_tokens", '{"messages": [{"role": "user", "content": "%s"}]}' % S, "messages[0].content"),
    ("/tokenize", '{"content": "%s"}' % S, "content"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "%sx"}]}' % S, "messages[0].content"),
    ("/detokenize", '{"tokens": [1], "model": "%s"}' % S, "model"),
]

ARGS = '{"a": %s}' % deep(200)
NESTING = [        # params ending in * name the first too-deep container: that path, then "[0]"s
    ("/v1/chat/completions", chat_with_args(ARGS), "messages[1].tool_calls[0].function.arguments.a[0]*"),
    ("/v1/chat/completions", chat_with_args(json.dumps(ARGS)), "messages[1].tool_calls[0].function.arguments.a[0]*"),
    ("/v1/chat/completions", chat_with_args(json.dumps('{"a": %s}' % deep(1000))),
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/messages", '{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
     '"content": [{"type": "tool_use", "id": "c1", "name": "f", "input": %s}]}]}' % ARGS,
     "messages[1].content[0].input.a*"),
    ("/v1/completions", '{"prompt": "hi", "stop": %s}' % deep(80), "stop[0]*"),
]


def rf(schema):
    return json.dumps({"messages": json.loads(USER), "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})


RECURSIVE_DEFS = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/definitions/x"}},
                  "definitions": {"x": {"$ref": "#/definitions/x"}}}
REQUIRES_ITSELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}   # found by the fuzzer
CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}}
MANY_PATTERNS = {"type": "object", "properties": {
    f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i % 50},{i % 50 + 20}}}x"} for i in range(10000)}}
GRAMMARS = [(rf({"type": "object", "x-guidance": junk}), "response_format.json_schema.schema")
            for junk in ("junk", None, [1, 2], 3)]
GRAMMARS += [(rf({"type": "object", "x-guidance": junk}), "response_format")       # the compiler's refusals
             for junk in ({"whitespace_pattern": "((("}, {"lenient": "x"}, {"item_separator": 5})]
GRAMMARS += [
    (rf({"$ref": "#"}), "response_format.json_schema.schema"),
    (rf(RECURSIVE_DEFS), "response_format.json_schema.schema"),
    (rf(CYCLE), "response_format.json_schema.schema"),
    (rf(REQUIRES_ITSELF), "response_format.json_schema.schema"),
    (rf({"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}),
     "response_format.json_schema.schema"),
    (rf({"type": "nope"}), "response_format"),
    (rf({"type": "integer", "minimum": -1e308, "maximum": 1e308}), "response_format"),
    (rf(MANY_PATTERNS), "response_format"),
]


def forced_tool(schema):
    return json.dumps({"messages": json.loads(USER), "max_tokens": 2, "tool_choice": "required",
                       "tools": [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
                                 {"type": "function", "function": {"name": "f", "parameters": schema}}]})


def anthropic_tool(schema, path="/v1/messages"):
    return path, json.dumps({"messages": json.loads(USER), "max_tokens": 2, "tool_choice": {"type": "any"},
                             "tools": [{"name": "f", "input_schema": schema}]})


TOOL_SCHEMAS = [{"$ref": "#"}, RECURSIVE_DEFS, CYCLE, REQUIRES_ITSELF,
                {"type": "object", "properties": {"a": {"$ref": "#/nope/x"}}},
                {"type": "object", "x-guidance": 3}, {"type": "object", "x-guidance": None}]
TOOLS = [("/v1/chat/completions", forced_tool(s), "tools[1].function.parameters") for s in TOOL_SCHEMAS]
TOOLS += [(*anthropic_tool(s), "tools.0.input_schema") for s in TOOL_SCHEMAS]
TOOLS += [(*anthropic_tool({"$ref": "#"}, "/v1/messages/count_tokens"), "tools.0.input_schema"),
          ("/v1/chat/completions", forced_tool({"type": "object", "properties": {"a": {"$ref": "http://x.test/s"}}}),
           "tools")]

SHAPES = [          # found by tests/http/test_fuzz.py
    ("/v1/messages", json.dumps({"messages": json.loads(USER), "max_tokens": 2, "tool_choice": {"type": {}}}), None),
    ("/v1/messages", json.dumps({"messages": json.loads(USER), "max_tokens": 2, "tool_choice": {"type": [1]}}), None),
]

ALL = SHAPES + ([(p, b, param) for p, b, param in SURROGATES] + [(p, b, param) for p, b, param in NESTING]
       + [("/v1/chat/completions", b, param) for b, param in GRAMMARS] + TOOLS)


def assert_refused(app, caplog, path, raw, param):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        r = app.post(path, raw.encode(), content_type="application/json", expect_errors=True)
    assert r.status_int == 400, (r.status_int, r.body[:300])
    body = json.loads(r.body)
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    else:
        error = body["error"]
        assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)
        if param.endswith("*"):
            assert error["param"].startswith(param[:-1]) and set(error["param"][len(param) - 1:]) <= set("[0]"), error
        else:
            assert error["param"] == param, error
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("path, raw, param", ALL, ids=[f"{i}:{c[0]}:{c[2]}" for i, c in enumerate(ALL)])
def test_hostile_input_is_a_400_naming_the_field(app, caplog, path, raw, param):
    assert_refused(app, caplog, path, raw, param)


def test_the_app_still_answers_afterwards(app):
    for path, raw, _ in SURROGATES[:3] + TOOLS[:2]:
        app.post(path, raw.encode(), content_type="application/json", expect_errors=True)
    body = app.post_json("/v1/chat/completions", {"messages": json.loads(USER), "max_tokens": 2}).json
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_guarded_recursive_tool_schema_runs(app):
    """Recursion through a property (a linked list) is a fine schema: it compiles and generates."""
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}, "v": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"head": {"$ref": "#/$defs/node"}}, "$defs": {"node": node}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    r = app.post_json("/v1/chat/completions", {"messages": json.loads(USER), "max_tokens": 4,
                                                "tool_choice": "required", "tools": tools})
    assert r.json["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_surrogate_pairs_are_fine(app):
    raw = '{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}], "max_tokens": 2}'
    assert app.post("/v1/chat/completions", raw.encode(), content_type="application/json").status_int == 200


def test_nesting_up_to_the_limit_is_accepted(app, caplog):
    """The body is level 1, arguments level 7: 57 arrays under them reach level 64, the limit."""
    r = app.post("/v1/chat/completions", chat_with_args('{"a": %s}' % deep(57)).encode(),
                 content_type="application/json")
    assert r.status_int == 200
    assert_refused(app, caplog, "/v1/chat/completions", chat_with_args('{"a": %s}' % deep(58)),
                   "messages[1].tool_calls[0].function.arguments.a" + "[0]" * 57)


CRASH = """
import json, sys
sys.path.insert(0, {tests!r})
from test_hostile_input import build_app
from pathlib import Path
import tempfile
app = build_app(Path(tempfile.mkdtemp()))
n = 3000
chain = {{"$ref": "#/$defs/d0", "$defs": {{f"d{{i}}": {{"type": "object", "properties": {{"x": {{"$ref": f"#/$defs/d{{i + 1}}"}}}}}}
                                       for i in range(n)}}}}
chain["$defs"][f"d{{n}}"] = {{"type": "string"}}
r = app.post_json({path!r}, {{"messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2,
                             "response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": chain}}}}}},
                  expect_errors=True)
print(r.status_int, r.json["error"]["param"])
"""


def test_a_long_ref_chain_is_refused_without_crashing_the_process():
    """A $ref chain 3,000 schemas long overflows the grammar compiler's native stack (the whole
    process dies): it is refused before compiling. Run in a child process, so a crash is a failure."""
    import subprocess
    import sys
    code = CRASH.format(tests=str(Path(__file__).parent), path="/v1/chat/completions")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["400", "response_format.json_schema.schema"], done.stdout

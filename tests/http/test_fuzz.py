"""Property-based fuzzing of the POST routes on a real engine (stories260K or the default SmolLM2
when present, else a tiny random Llama), deterministic (derandomized, no example database):

(a) bodies generated from the OpenAPI request schemas (`from_schema` below: the subset of JSON
    Schema that openapi_spec.py uses; hypothesis-jsonschema no longer runs on current hypothesis), then mutated with
    extreme numbers, lone surrogates, deep nesting, wrong types, huge strings, special-token and
    template text, junk grammars and self-referring tool schemas;
(b) raw bytes: arbitrary binary, and valid bodies cut short, spliced and escaped;
(c) JSON Schemas built from hostile parts (extreme bounds, bad patterns and formats, self-references,
    combinators, hundreds of optional properties) as response_format or a forced tool's parameters.

Every answer is below 500, every error is in the route family's envelope with a string message,
no stream carries a server error, nothing is logged at ERROR, and a normal request still works.
"""
import copy
import importlib.util
import json
import logging
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from turbospark_wsgi.http.schemas.openapi_spec import spec  # noqa: E402

_spec = importlib.util.spec_from_file_location("hostile_input", Path(__file__).with_name("test_hostile_input.py"))
hostile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostile)

ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
          "/v1/messages": "MessagesRequest", "/v1/messages/count_tokens": "CountTokensRequest",
          "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=800,
                suppress_health_check=list(HealthCheck))
SMALL = {"max_tokens": 3, "max_completion_tokens": 3, "n": 2, "best_of": 2, "top_logprobs": 2, "logprobs": 2}


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    records = Records()
    logging.getLogger().addHandler(records)
    client = hostile.build_app(tmp_path_factory.mktemp("models"))
    client.records = records
    yield client
    logging.getLogger().removeHandler(records)


def inline(schema, components):
    """The schema with its "#/components/schemas/X" refs replaced by X (they hold no cycles)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return inline(components[schema["$ref"].rsplit("/", 1)[1]], components)
        return {k: inline(v, components) for k, v in schema.items()}
    if isinstance(schema, list):
        return [inline(v, components) for v in schema]
    return schema


TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["hi", "Once upon a time", "user", "text", "get_weather"]))


def from_schema(schema):
    """Values that follow `schema` (type, enum, const, oneOf, properties/required, items, bounds)."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema["oneOf"]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "object":
        return _object(schema)
    if kind == "array":
        items = from_schema(schema.get("items", {}))
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 3))
    lo, hi = schema.get("minimum"), schema.get("maximum")
    return {"string": TEXT, "boolean": st.booleans(), "null": st.none(),
            "integer": st.integers(lo if lo is not None else -2 ** 40, hi if hi is not None else 2 ** 40),
            "number": st.floats(lo if lo is not None else -1e6, hi if hi is not None else 1e6, allow_nan=False),
            }.get(kind, st.one_of(st.none(), st.booleans(), st.integers(), TEXT))


def _object(schema):
    props, required = schema.get("properties", {}), set(schema.get("required", ()))
    extra = schema.get("additionalProperties")
    fixed = st.fixed_dictionaries({k: from_schema(props[k]) for k in sorted(required) if k in props},
                                  optional={k: from_schema(v) for k, v in props.items() if k not in required})
    if not isinstance(extra, dict):
        return fixed
    return st.tuples(fixed, st.dictionaries(st.text(max_size=6), from_schema(extra), max_size=3)).map(
        lambda parts: {**parts[1], **parts[0]})


COMPONENTS = spec()["components"]["schemas"]
BODIES = {path: from_schema(inline(COMPONENTS[name], COMPONENTS)) for path, name in ROUTES.items()}


def nested(depth, leaf=None):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<tool_call>", "</tool_call>", "<think>",
           "</think>", "{{ raise_exception('x') }}", "{% for x in range(10**9) %}", "\x00", "\u2028", "\U0001F600"]
HOSTILE_SCALARS = st.sampled_from([
    0, -1, 1, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30, 1e308, -1e308, 5e-324, 0.5, -0.0, True, False, None,
    "", "\ud800", "a\udfffb", "\udc00\ud800", "x" * 70000, " " * 5000, *SPECIAL, "".join(SPECIAL) * 50])
SCHEMAS = st.sampled_from([
    {"$ref": "#"}, {"allOf": [{"$ref": "#"}]}, {"type": "object", "x-guidance": "junk"},
    {"type": "object", "x-guidance": {"whitespace_pattern": "((("}}, {"type": "string", "pattern": "(" * 300},
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}, {"type": "nope"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "integer", "minimum": 1e308}, {"type": "object", "properties": {"a": nested(60, {})}},
    {"enum": []}, {"type": "array", "minItems": 10 ** 9}, {"type": "object", "required": ["\ud800"]}])
HOSTILE = st.one_of(
    HOSTILE_SCALARS,
    st.builds(nested, st.integers(60, 300)),
    st.lists(HOSTILE_SCALARS, max_size=4),
    st.dictionaries(st.sampled_from(["", "\ud800", "type", "$ref", "x-guidance", "0"]), HOSTILE_SCALARS, max_size=3),
    st.lists(st.integers(-2 ** 40, 2 ** 40), min_size=1000, max_size=3000),
    st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, SCHEMAS),
    st.builds(lambda s: [{"type": "function", "function": {"name": "f", "parameters": s}}], SCHEMAS),
    st.builds(lambda s: [{"name": "f", "input_schema": s}], SCHEMAS))
FIELDS = st.sampled_from(["model", "prompt", "messages", "content", "system", "tools", "tool_choice", "response_format",
                          "max_tokens", "temperature", "top_p", "top_k", "stop", "stop_sequences", "logit_bias",
                          "seed", "n", "stream", "tokens", "thinking", "chat_template_kwargs", "repetition_penalty",
                          "\ud800", "logprobs", "echo", "stream_options"])


def slots(doc, out=None):
    """(container, key) for every value inside `doc`."""
    out = [] if out is None else out
    for key, value in (doc.items() if isinstance(doc, dict) else enumerate(doc)):
        out.append((doc, key))
        if isinstance(value, (dict, list)):
            slots(value, out)
    return out


def hostile_text(text):
    """A string field's text turned hostile: a lone surrogate or special-token text inside, or huge."""
    return st.one_of(st.sampled_from(["\ud800", "\udfff", "\udc00\ud800", *SPECIAL]).map(lambda bad: text + bad),
                     st.sampled_from(SPECIAL).map(lambda tag: tag + text + tag),
                     st.just(text[:40] * 2000 or "x" * 70000))


EXTREME = st.sampled_from([0, -1, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30, 1e308, -1e308, 5e-324, -0.0])


@st.composite
def mutation(draw, doc):
    """Changes one place in `doc`: a string made hostile, a number made extreme, a value replaced by
    a hostile one of any type, or a hostile field added."""
    places = slots(doc)
    if not places or not draw(st.integers(0, 4)):
        target = draw(st.sampled_from([doc] + [c[k] for c, k in places if isinstance(c[k], dict)]))
        target[draw(FIELDS)] = copy.deepcopy(draw(HOSTILE))
        return
    container, key = draw(st.sampled_from(places))
    value = container[key]
    if isinstance(value, str) and draw(st.booleans()):
        container[key] = draw(hostile_text(value))
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and draw(st.booleans()):
        container[key] = draw(EXTREME)
    else:
        container[key] = copy.deepcopy(draw(HOSTILE))


USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}}}}
HISTORY = USER + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
    "name": "f", "arguments": '{"a": "x"}'}}]}, {"role": "tool", "tool_call_id": "c", "content": "ok"}]
SEEDS = {   # valid bodies, so that a mutation often lands past the basic checks
    "/v1/completions": [{"prompt": "hi", "max_tokens": 2}, {"prompt": ["hi"], "max_tokens": 2, "stop": ["x"],
                                                             "logit_bias": {"1": 1}, "stream": True}],
    "/v1/chat/completions": [{"messages": USER, "max_tokens": 2},
                             {"messages": HISTORY, "max_tokens": 2, "tools": [TOOL], "tool_choice": "required"},
                             {"messages": USER, "max_tokens": 2, "stream": True, "response_format": {
                                 "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}],
    "/v1/messages": [{"messages": USER, "max_tokens": 2, "system": "s"},
                     {"messages": USER, "max_tokens": 2, "system": [{"type": "text", "text": "s"}], "stream": True,
                      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}}],
    "/v1/messages/count_tokens": [{"messages": USER, "system": "s", "tools": [{"name": "f", "input_schema": {}}]}],
    "/tokenize": [{"content": "hi"}, {"messages": HISTORY, "tools": [TOOL]}],
    "/detokenize": [{"tokens": [1, 2, 3]}],
}


@st.composite
def mutated(draw, path):
    base = st.one_of(st.sampled_from(SEEDS[path]), BODIES[path])
    doc = copy.deepcopy(draw(base))                 # NOTE(hypothesis): drawn values may be shared
    if "model" in doc and draw(st.integers(0, 3)):
        del doc["model"]                            # a random model name stops every case at 404
    for key, cap in SMALL.items():         # NOTE(budget): valid sizes kept small so each case is quick
        if isinstance(doc.get(key), int) and not isinstance(doc[key], bool) and 0 < doc[key]:
            doc[key] = min(doc[key], cap)
    for _ in range(draw(st.integers(0, 3))):
        draw(mutation(doc))
    return doc


def check(app, path, raw):
    app.records.records.clear()
    r = app.post(path, raw, content_type="application/json", expect_errors=True)
    assert r.status_int < 500, (r.status_int, r.body[:300], path, raw[:3000])
    if r.status_int >= 400:
        body = json.loads(r.body)
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
            assert isinstance(body["error"]["message"], str)
        else:
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
            assert isinstance(body["error"]["message"], str)
    elif r.content_type == "text/event-stream":
        assert "server_error" not in r.text and "api_error" not in r.text, (r.text[-300:], path, raw[:3000])
    assert not app.records.records, ([rec.getMessage() for rec in app.records.records], path, raw[:3000])
    return r.status_int


def still_answers(app):
    body = app.post_json("/v1/chat/completions", {"messages": USER, "max_tokens": 2}).json
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_schema_bodies_with_hostile_values(app):
    """(a): 800 cases over the six routes."""
    statuses = []

    @FUZZ
    @given(st.sampled_from(sorted(ROUTES)).flatmap(lambda p: st.tuples(st.just(p), mutated(p))))
    def run(case):
        path, doc = case
        statuses.append(check(app, path, json.dumps(doc).encode()))

    run()
    print(f"schema fuzz: {len(statuses)} cases, {sum(s < 400 for s in statuses)} accepted")
    assert len(statuses) >= 400 and any(s < 400 for s in statuses)
    still_answers(app)


VALID = [b'{"prompt": "hi", "max_tokens": 2}', b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
         b'{"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "system": "s"}', b'{"content": "hi"}',
         b'{"tokens": [1, 2, 3]}']
SPLICES = st.sampled_from([b"\\ud800", b"\\udfff\\ud800", b"[" * 2000, b"{" * 70, b"\x00", b"\xff\xfe", b"NaN",
                           b"1e999", b"9" * 5000, b'"', b"\\", b",", b"}", b'"\\u', b"\xed\xa0\x80", b"\xc0\xaf", b"\t\r\n "])

ESCAPES = st.sampled_from([b"\\ud800", b"\\udfff", b"\\udc00\\ud800", b"\\ud83d\\ude00", b"\\u0000", b"\\\\",
                           b'\\"', b"\\x41", b"\\u12", b"\\ud800\\u0041", b"\t", b"\xe2\x80\xa8"])


@st.composite
def raw_bodies(draw):
    base = draw(st.sampled_from(VALID))
    kind = draw(st.sampled_from(["binary", "cut", "splice", "escape"]))
    if kind == "binary":
        return draw(st.binary(min_size=1, max_size=300))
    if kind == "cut":
        return base[:draw(st.integers(1, len(base) - 1))]
    if kind == "escape" and b'"hi"' in base:
        return base.replace(b'"hi"', b'"h' + draw(ESCAPES) + b'i"')
    at = draw(st.integers(0, len(base)))
    return base[:at] + draw(SPLICES) + base[at:]


def test_raw_byte_bodies(app):
    """(b): 800 cases over the six routes."""
    statuses = []

    @FUZZ
    @given(st.sampled_from(sorted(ROUTES)), raw_bodies())
    def run(path, raw):
        statuses.append(check(app, path, raw))

    run()
    print(f"raw fuzz: {len(statuses)} cases, {sum(s < 400 for s in statuses)} accepted")
    assert len(statuses) >= 400
    still_answers(app)


# ---- (c) generated JSON Schemas as grammars ---------------------------------------------------------

NAMES = st.text(alphabet='abz_é"\\ \n', max_size=5)
LEAVES = st.one_of(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null")] + [{}]),
    st.builds(lambda a, b: {"type": "integer", "minimum": a, "maximum": b}, EXTREME, EXTREME),
    st.builds(lambda a, b: {"type": "number", "exclusiveMinimum": a, "maximum": b}, EXTREME, EXTREME),
    st.builds(lambda a, b: {"type": "string", "minLength": a, "maxLength": b}, st.integers(0, 300), st.integers(0, 300)),
    st.builds(lambda p: {"type": "string", "pattern": p},
              st.sampled_from(["^a+$", "[0-9]{3}", "(a|b)*c", "^$", "a{1000}", "(?=a)", "\\p{L}+", "[z-a]", "("])),
    st.builds(lambda f: {"type": "string", "format": f}, st.sampled_from(["date-time", "email", "uuid", "uri", "bogus"])),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(st.text(max_size=4), st.integers(), st.none()), max_size=5)),
    # NOTE(rows): hundreds of optional properties compile, then fail a few tokens in (llguidance's row limit)
    st.builds(lambda n: {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}},
              st.integers(600, 800)),
)


def schema_nodes(children):
    return st.one_of(
        st.builds(lambda props, req, extra: {"type": "object", "properties": props, "additionalProperties": extra,
                                             "required": sorted(props) if req else []},
                  st.dictionaries(NAMES, children, max_size=4), st.booleans(), st.one_of(st.booleans(), children)),
        st.builds(lambda item, a, b: {"type": "array", "items": item, "minItems": a, "maxItems": b},
                  children, st.integers(0, 4), st.integers(0, 4)),
        st.builds(lambda key, xs: {key: xs}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda x, t: dict(x, type=t), children, st.sampled_from([["string", "null"], "object", "array"])),
        st.builds(lambda x: {"$defs": {"d": x}, "$ref": "#/$defs/d"}, children),
        st.builds(lambda x: {"type": "object", "properties": {"next": {"$ref": "#"}, "v": x}}, children),
        st.builds(lambda x: {"not": x}, children),
    )


JSON_SCHEMAS = st.recursive(LEAVES, schema_nodes, max_leaves=10)


def test_generated_schemas_as_grammars(app):
    """(c): 80 schemas, each a response_format or a forced tool's parameters, whole or streamed."""
    statuses = []

    @settings(FUZZ, max_examples=80)
    @given(JSON_SCHEMAS, st.sampled_from(["response_format", "tool"]), st.booleans())
    def run(schema, where, stream):
        body = {"messages": USER, "max_tokens": 12, "stream": stream, "temperature": 1.0, "seed": 1}
        if where == "tool":
            body.update(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                        tool_choice="required")
        else:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        statuses.append(check(app, "/v1/chat/completions", json.dumps(body).encode()))

    run()
    print(f"schema-grammar fuzz: {len(statuses)} cases, {sum(s < 400 for s in statuses)} accepted")
    assert any(s < 400 for s in statuses)
    still_answers(app)

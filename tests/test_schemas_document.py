"""The whole-body checks (lone surrogates, nesting depth), the JSON Schema checks ($ref cycles,
x-guidance) and error messages that always encode."""
import json

import pytest

from turbospark_wsgi.errors import InvalidRequest, ModelNotFound
from turbospark_wsgi.http.schemas.anthropic import tool_input
from turbospark_wsgi.http.schemas.document import MAX_DEPTH, check_body_text, check_document
from turbospark_wsgi.http.schemas.json_schema import check_schema


def refused(fn, *args):
    with pytest.raises(InvalidRequest) as info:
        fn(*args)
    return info.value


def body(text):
    return check_body_text(text, json.loads(text))


@pytest.mark.parametrize("text, param", [
    ('{"prompt": "\\ud800"}', "prompt"),
    ('{"messages": [{"role": "user", "content": "ok"}, {"content": ["a", "b\\udfff"]}]}', "messages[1].content[1]"),
    ('{"a": {"\\udc00k": 1}}', "a.\\udc00k"),
    ('{"\\ud800": 1}', "\\ud800"),
])
def test_a_lone_surrogate_is_refused_with_its_path(text, param):
    err = refused(body, text)
    assert err.param == param and "surrogate" in err.message
    err.message.encode("utf-8")


def test_surrogate_pairs_and_plain_text_pass():
    doc = body('{"a": "smile \\ud83d\\ude00", "b": ["\\u00e9", "\\\\ud800 is text"]}')
    assert doc["a"] == "smile \U0001F600" and doc["b"][1] == "\\ud800 is text"


def test_depth_is_counted_from_the_body():
    ok = {"a": json.loads("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))}
    assert check_document(ok) is ok
    err = refused(check_document, {"a": json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)})
    assert err.param == "a" + "[0]" * (MAX_DEPTH - 1) and str(MAX_DEPTH) in err.message


def test_a_prefix_names_a_nested_document():
    err = refused(check_document, {"x": "\ud800"}, "messages[0].tool_calls[0].function.arguments")
    assert err.param == "messages[0].tool_calls[0].function.arguments.x"


def test_the_walk_does_not_recurse():
    doc = {"a": None}
    for _ in range(5000):
        doc = {"a": doc}
    assert refused(check_document, doc).param.startswith("a.a.a")


LIST = {"type": "object", "properties": {"next": {"$ref": "#"}, "value": {"type": "integer"}}}


@pytest.mark.parametrize("schema", [
    LIST,
    {"type": "object", "properties": {"head": {"$ref": "#/$defs/node"}},
     "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}},
    {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    {"type": "array", "items": {"$ref": "#"}},
    {"type": "array", "minItems": 1, "prefixItems": [{"type": "string"}], "items": {"$ref": "#"}},
    {"type": "object", "required": ["a"], "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
    {"$ref": "#/definitions/a~1b", "definitions": {"a/b": {"type": "string"}}},
    {"$ref": "#/definitions/a%20b", "definitions": {"a b": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"$ref": "http://elsewhere.test/x"}}},   # the compiler's to refuse
])
def test_schemas_that_can_be_generated_pass(schema):
    check_schema(schema, "p")


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"allOf": [{"$ref": "#"}]},
    {"anyOf": [{"$ref": "#"}]},
    {"oneOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/x"}},
     "definitions": {"x": {"$ref": "#/definitions/x"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}},
    {"type": "array", "items": [{"type": "string"}, {"$ref": "#/items/1"}]},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    {"type": "array", "minItems": 2, "prefixItems": [{"type": "string"}], "items": {"$ref": "#"}},
    {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "required": ["next"], "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"allOf": [{"$ref": "#/$defs/n"}]}]}}}}},
])
def test_a_schema_that_requires_itself_with_no_way_to_end_is_refused(schema):
    err = refused(check_schema, schema, "tools[0].function.parameters")
    assert err.param == "tools[0].function.parameters" and "$ref" in err.message


@pytest.mark.parametrize("schema", [
    {"$ref": "#/definitions/missing"},
    {"$ref": "#/properties/a/0"},
    {"x-guidance": "loose"},
    {"x-guidance": None},
])
def test_missing_refs_and_junk_options_are_refused(schema):
    param = "response_format.json_schema.schema"
    assert refused(check_schema, schema, param).param == param


def test_error_messages_that_quote_client_text_always_encode():
    err = ModelNotFound("The model '\ud800' does not exist", param="\udfff")
    assert err.message == "The model '\\ud800' does not exist" and err.param == "\\udfff"
    err.message.encode("utf-8")


def test_tool_input_survives_what_a_model_can_write():
    assert tool_input('{"a": "\\ud800"}') == {"a": "?"}
    assert tool_input('{"a": ' + "[" * 5000 + "]" * 5000 + "}") == {}
    assert tool_input('{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}


def ref_chain(n):
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def test_schema_depth_through_refs_is_bounded():
    check_schema(ref_chain(40), "p")
    check_schema({"type": "object", "properties": {"next": {"$ref": "#"}}}, "p")      # recursion is not depth
    err = refused(check_schema, ref_chain(3000), "p")
    assert err.param == "p" and "limit" in err.message


def merged_patterns(n, form):
    defs = {"d0": {"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-z]*x"}}}}
    for i in range(1, n + 1):
        prev, pattern = {"$ref": f"#/$defs/d{i - 1}"}, f"[a-z]*{i}.*"
        defs[f"d{i}"] = {"sibling": {**prev, "pattern": pattern}, "allof": {"allOf": [prev, {"pattern": pattern}]},
                         "props": {"allOf": [prev, {"properties": {"a": {"pattern": pattern}}}]}}[form]
    return {"$ref": f"#/$defs/d{n}", "$defs": defs}


@pytest.mark.parametrize("form", ["sibling", "allof", "props"])
def test_patterns_meeting_under_allof_are_bounded(form):
    """Found while fuzzing: 24 patterns intersected this way keep the grammar compiler busy for minutes."""
    check_schema(merged_patterns(3, form), "p")
    assert "limit" in refused(check_schema, merged_patterns(24, form), "p").message


def test_annotation_siblings_and_many_separate_patterns_are_fine():
    props = {f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i}}}"} for i in range(40)}
    check_schema({"type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/x"}], "description": "d"}},
                  "$defs": {"x": {"type": "object", "properties": props}}}, "p")


@pytest.mark.parametrize("schema, where", [
    ({"type": "integer", "minimum": -1e308, "maximum": -1e308}, "'#'"),
    ({"type": "integer", "exclusiveMaximum": -2 ** 63 + 1}, "'#'"),
    ({"type": "integer", "maximum": -10 ** 400}, "'#'"),
    ({"allOf": [{"type": "integer"}, {"maximum": -2 ** 63}]}, "'#/allOf/1'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"maximum": -1e300}}}, "'#/$defs/n'"),
])
def test_an_upper_bound_at_the_64_bit_floor_is_refused(schema, where):
    err = refused(check_schema, schema, "p")
    assert err.param == "p" and "must be above -9223372036854775808" in err.message and where in err.message


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": -1e308, "maximum": -9e18},
    {"type": "integer", "maximum": 1e308},
    {"type": "number", "minimum": -1e308},
    {"type": "object", "properties": {"maximum": {"type": "integer"}}},
    {"enum": [{"maximum": -1e308}]},
])
def test_other_extreme_bounds_pass(schema):
    check_schema(schema, "p")

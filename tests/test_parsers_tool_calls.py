import itertools
import json

import pytest

from turbospark_wsgi.parsers import OutputParser, ToolCall, collect, detect_family, parse_output
from turbospark_wsgi.parsers.tool_calls import calls_from_json

HERMES_TWO = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
CASES = [
    # (family, text, content, [(name, arguments-as-dict)])
    ("hermes", HERMES_TWO, "I will check.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
    ("hermes", "Use <tool_call>{not json}</tool_call> as a tag.", "Use <tool_call>{not json}</tool_call> as a tag.", []),
    ("hermes", 'x <tool_call>{"name": "f", "arguments": {}}', "x", [("f", {})]),          # unclosed at end
    ("hermes", "x <tool_call>{\"name\": ", "x <tool_call>{\"name\": ", []),
    ("hermes", "a <tool_ca b", "a <tool_ca b", []),
    ("llama3_json", '{"name": "f", "parameters": {"q": "x"}}', "", [("f", {"q": "x"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"n": 2}}',
     "", [("f", {}), ("g", {"n": 2})]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "Plain text {not a call}", "Plain text {not a call}", []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, 2]}}, {"name": "g", "arguments": {}}]',
     "", [("f", {"a": [1, 2]}), ("g", {})]),
    ("mistral", 'Sure. [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]abc123456[ARGS]{}',
     "Sure.", [("f", {"a": 1}), ("g", {})]),
    ("mistral", "[1] is a citation", "[1] is a citation", []),
]


def run_stream(family, text, cuts):
    parser = OutputParser(reasoning=False, tool_family=family)
    bounds = [0, *cuts, len(text)]
    events = []
    for a, b in zip(bounds, bounds[1:]):
        events += parser.feed(text[a:b])
    return events + parser.flush()


def summary(parsed):
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_whole_text(family, text, content, calls):
    assert summary(parse_output(text, reasoning=False, tool_family=family)) == (content, calls)


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_every_two_cut_split(family, text, content, calls):
    for cuts in itertools.combinations(range(1, len(text)), 2):
        events = run_stream(family, text, cuts)
        assert summary(collect(events)) == (content, calls), cuts
        if calls:  # content never shows a fragment of the call markup
            for e in events:
                if not isinstance(e, ToolCall):
                    assert "<tool" not in e[1] and "[TOOL" not in e[1] and "{" not in e[1], (cuts, e)


def test_char_by_char_stream_releases_text_before_the_call():
    text = 'Hello there <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser = OutputParser(reasoning=False, tool_family="hermes")
    seen = []
    for ch in text:
        seen.append(parser.feed(ch))
    released = "".join(e[1] for batch in seen for e in batch if not isinstance(e, ToolCall))
    assert released == "Hello there"
    calls = [e for batch in seen for e in batch if isinstance(e, ToolCall)]
    assert [c.name for c in calls] == ["f"] and parser.flush() == []


def test_tool_call_inside_reasoning_is_not_a_call():
    text = '<think>maybe <tool_call>{"name": "f", "arguments": {}}</tool_call></think>Answer'
    parsed = parse_output(text, tool_family="hermes")
    assert parsed.tool_calls == [] and parsed.content == "Answer"
    assert "<tool_call>" in parsed.reasoning


def test_reasoning_then_call_split_everywhere():
    text = '<think>need weather</think>\n<tool_call>{"name": "w", "arguments": {"c": "Oslo"}}</tool_call>'
    for cuts in itertools.combinations(range(1, len(text)), 2):
        events = []
        parser = OutputParser(tool_family="hermes")
        bounds = [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            events += parser.feed(text[a:b])
        parsed = collect(events + parser.flush())
        assert (parsed.reasoning, parsed.content) == ("need weather", ""), cuts
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("w", '{"c": "Oslo"}')]


def test_call_ids_are_unique_and_openai_shaped():
    parsed = parse_output(HERMES_TWO, tool_family="hermes")
    ids = [c.id for c in parsed.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_calls_from_json_needs_arguments_outside_tags():
    assert calls_from_json('{"name": "Bob"}') is None
    assert calls_from_json('{"name": "f"}', lenient=True)[0].arguments == "{}"
    assert calls_from_json('{"name": "f", "arguments": "not json"}') is None
    assert calls_from_json('{"name": "", "arguments": {}}') is None


@pytest.mark.parametrize("template,family", [
    ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]", "mistral"),
    ("<|start_header_id|>ipython<|end_header_id|>{% if tools %}{% endif %}", "llama3_json"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("<|im_start|>{{ m.content }}<|im_end|>", "hermes"),
    (None, "hermes"),
])
def test_detect_family(template, family):
    assert detect_family(template) == family

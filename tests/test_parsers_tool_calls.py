import itertools
import json

import pytest

from turbospark_wsgi.http.parsers import CallArgs, OutputParser, ToolCall, collect, parse_output
from turbospark_wsgi.http.parsers.tool_calls import _encodable, calls_from_json
from turbospark_wsgi.serving.chat_plan import detect_family

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
        if calls:  # content never shows a fragment of the call markup, nor arguments any tag
            for e in events:
                if isinstance(e, CallArgs):
                    assert "<tool" not in e.text and "[TOOL" not in e.text and "[ARGS" not in e.text, (cuts, e)
                elif not isinstance(e, ToolCall):
                    assert "<tool" not in e[1] and "[TOOL" not in e[1] and "{" not in e[1], (cuts, e)


def test_char_by_char_stream_releases_text_before_the_call():
    text = 'Hello there <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser = OutputParser(reasoning=False, tool_family="hermes")
    seen = []
    for ch in text:
        seen.append(parser.feed(ch))
    released = "".join(e[1] for batch in seen for e in batch if isinstance(e, tuple))
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


def feed_chars(family, text):
    parser = OutputParser(reasoning=False, tool_family=family)
    return [parser.feed(ch) for ch in text], parser.flush()


@pytest.mark.parametrize("family,text,args", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>',
     '{"city": "Paris", "days": [1, 2]}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "note": "a \\"}\\" b"}}',
     '{"city": "Paris", "note": "a \\"}\\" b"}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', '{"city": "Paris"}'),
])
def test_arguments_stream_in_pieces_as_generated(family, text, args):
    batches, tail = feed_chars(family, text)
    events = [e for batch in batches for e in batch] + tail
    head = next(i for i, e in enumerate(events) if isinstance(e, ToolCall))
    assert events[head].name == "get_weather" and events[head].arguments == ""
    pieces = [e.text for e in events if isinstance(e, CallArgs)]
    assert len(pieces) > 5 and "".join(pieces) == args
    # each piece leaves as soon as its character arrived: the call is open before its arguments end
    first_piece = next(i for i, b in enumerate(batches) if any(isinstance(e, CallArgs) for e in b))
    assert first_piece < len(text) - len(args) // 2
    assert collect(events).tool_calls[0].arguments == args


def test_call_is_committed_before_its_end_tag_arrives():
    parser = OutputParser(reasoning=False, tool_family="hermes")
    events = parser.feed('Checking. <tool_call>{"name": "f", "arguments": {"q": "wea')
    assert events[0] == ("content", "Checking.")
    assert isinstance(events[1], ToolCall) and events[1].name == "f"
    assert "".join(e.text for e in events[2:]) == '{"q": "wea'


@pytest.mark.parametrize("text,args,content", [
    ('<tool_call>{"name": "f", "arguments": {"a": [1, ', '{"a": [1, ', ""),                  # max_tokens
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call> then', '{"a": ', "then"),    # stray tag
])
def test_arguments_cut_short_end_the_call_as_generated(text, args, content):
    for cut in range(1, len(text)):
        parsed = collect(run_stream("hermes", text, [cut]))
        assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", args)], cut
        assert parsed.content == content, cut


def test_second_call_is_dropped_whole_when_not_parallel():
    from turbospark_wsgi.http.schemas.chat_render import ChatReply, _ChunkWriter
    writer = _ChunkWriter(ChatReply(model="m", parallel_tool_calls=False))
    events = run_stream("hermes", HERMES_TWO, [40, 90])
    deltas = [d for e in events for d in writer.deltas(e)]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert {c["index"] for c in calls} == {0}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'


@pytest.mark.parametrize("call", [
    '{"name": "\\ud800", "arguments": {}}',
    '{"name": "get", "arguments": {"city": "\\udc00"}}',
    '{"name": "get", "arguments": "{\\"a\\": ' + '[' * 3000 + ']' * 3000 + '}"}',
    '{"name": "get", "arguments": {"a": ' + '[' * 3000 + ']' * 3000 + '}}',
])
@pytest.mark.parametrize("streamed", [False, True])
def test_model_written_calls_that_could_not_be_encoded_stay_text(call, streamed):
    """A model may write a lone surrogate as a JSON escape, or nest without end: never a call
    whose reply cannot be encoded, never an exception."""
    text = f"<tool_call>\n{call}\n</tool_call>"
    if streamed:
        parser = OutputParser(tool_family="hermes", reasoning=False)
        result = collect([e for ch in text for e in parser.feed(ch)] + parser.flush())
    else:
        result = parse_output(text, tool_family="hermes", reasoning=False)
    assert all(_encodable(c.name) and _encodable(c.arguments) for c in result.tool_calls)

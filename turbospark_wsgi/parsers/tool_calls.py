"""Tool calls parsed out of generated text, per model family, incrementally.

Families: "hermes" (Hermes/Qwen `<tool_call>{json}</tool_call>`), "llama3_json" (Llama-3 JSON
`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`), "mistral" (`[TOOL_CALLS]`
followed by a JSON array, or `name[ARGS]{json}`). A parser's `feed(text)` and `flush()` return a list
of events: `("content", text)` or a `ToolCall`. A call is released only once it parses; text that
only looks like a call is released as content, unchanged.
"""
import json
import secrets
import string
from dataclasses import dataclass, field

from .holdback import hold_len, split_at_tag

CONTENT = "content"
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id():
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str                      # JSON text, as OpenAI's `function.arguments`
    id: str = field(default_factory=new_call_id)


def _to_call(obj, lenient=False):
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if not lenient and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def decode_json_values(text, separators=" \t\r\n;,"):
    """Every JSON value in `text`, separated by whitespace, `;` or `,`; None unless all of it parses."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.extend(value if isinstance(value, list) else [value])


def calls_from_json(text, lenient=False):
    """ToolCalls from JSON objects `{"name", "arguments"|"parameters"}`; None unless all are calls.

    `lenient` accepts a call without arguments (inside explicit call tags).
    """
    values = decode_json_values(text)
    calls = [_to_call(v, lenient) for v in values or ()]
    return calls if calls and all(calls) else None


class _Parser:
    """Shared content handling: holds back partial triggers and whitespace next to a call."""

    triggers = ()

    def __init__(self):
        self._buf = ""
        self._in_call = False
        self._strip_lead = False
        self._started = False       # any content released yet
        self._ws = ""               # whitespace withheld before an open call

    def feed(self, text):
        self._buf += text
        out = []
        while self._step(out):
            pass
        return out

    def _release(self, out, text):
        if self._strip_lead:
            text = text.lstrip()
        if text:
            self._strip_lead = False
            self._started = True
            out.append((CONTENT, text))

    def _content_step(self, out):
        before, tag, after = split_at_tag(self._buf, self.triggers)
        if tag is None:
            cut = len(self._buf) - hold_len(self._buf, self.triggers)
            self._release(out, self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        kept = before.rstrip()
        self._release(out, kept)
        self._ws = before[len(kept):]   # restored if the call does not parse
        self._in_call, self._tag, self._buf = True, tag, after
        return True


class TagParser(_Parser):
    """Hermes/Qwen: each call is `<tool_call>{json}</tool_call>`; content may surround calls."""

    def __init__(self, start="<tool_call>", end="</tool_call>"):
        super().__init__()
        self._start, self._end = start, end
        self.triggers = (start,)

    def _step(self, out):
        if not self._in_call:
            return self._content_step(out)
        # NOTE(tool_calls): a new start tag before the end tag closes the open call (seen in Qwen output).
        body, tag, after = split_at_tag(self._buf, (self._end, self._start))
        if tag is None:
            return False
        self._strip_lead = self._close(out, body, tag if tag == self._end else "")
        self._in_call, self._ws, self._buf = tag == self._start, "", after
        return True

    def _close(self, out, body, end):
        calls = calls_from_json(body, lenient=True)
        if calls:
            out.extend(calls)
        else:
            self._release(out, self._ws + self._start + body + end)
        return bool(calls)

    def flush(self):
        out = []
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._close(out, rest, "")
        else:
            self._release(out, rest)
        return out


class TailParser(_Parser):
    """Llama-3 JSON and Mistral: from a trigger (or a bare JSON start) to the end of output is calls."""

    bare_starts = ""

    def _step(self, out):
        if self._in_call:
            return False
        head = self._buf.lstrip()
        if not self._started and head[:1] and head[0] in self.bare_starts:
            self._in_call, self._tag, self._ws, self._buf = True, "", "", head
            return False
        return self._content_step(out)

    def flush(self):
        out = []
        rest, self._buf = self._buf, ""
        if not self._in_call:
            self._release(out, rest)
            return out
        calls = self.parse(rest)
        if calls:
            out.extend(calls)
        else:
            self._release(out, self._ws + self._tag + rest)
        return out


class Llama3JsonParser(TailParser):
    triggers = ("<|python_tag|>",)
    bare_starts = "{"

    def parse(self, text):
        return calls_from_json(text.replace("<|python_tag|>", " "))


class MistralParser(TailParser):
    triggers = ("[TOOL_CALLS]",)
    bare_starts = "["

    def parse(self, text):
        calls = []
        for segment in text.split("[TOOL_CALLS]"):
            if not segment.strip():
                continue
            found = self._parse_segment(segment)
            if not found:
                return None
            calls.extend(found)
        return calls or None

    def _parse_segment(self, segment):
        if "[ARGS]" not in segment:
            return calls_from_json(segment)
        name, _, args = segment.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        values = decode_json_values(args, " \t\r\n")
        if not name or not values or len(values) != 1:
            return None
        call = _to_call({"name": name, "arguments": values[0]})
        return [call] if call else None


FAMILIES = {"hermes": TagParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser}


def detect_family(template_text):
    """The tool-call family a chat template speaks; Hermes when the template says nothing."""
    text = template_text or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "tools" in text):
        return "llama3_json"
    return "hermes"


def make_parser(family):
    return FAMILIES[family]()

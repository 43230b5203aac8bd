"""Tool calls parsed out of generated text, per model family, incrementally.

Families: "hermes" (Hermes/Qwen `<tool_call>{json}</tool_call>`), "llama3_json" (Llama-3 JSON
`{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`), "mistral" (`[TOOL_CALLS]`
followed by a JSON array, or `name[ARGS]{json}`). A parser's `feed(text)` and `flush()` return a list
of events: `("content", text)`, a `ToolCall`, or `CallArgs` (more arguments text of the last call).

A call in the common shape, `{"name": "...", "arguments": {` (or `name[ARGS]{` for Mistral), is
committed as soon as that head has arrived: its `ToolCall` comes with empty arguments and the
arguments object then streams as `CallArgs` pieces, as generated, up to its closing brace. Like
OpenAI's, such arguments are the model's own text and may be cut short (max_tokens, a stray tag).
Any other shape is released only once the whole call parses; text that only looks like a call is
released as content, unchanged.
"""
import json
import re
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


@dataclass(slots=True)
class CallArgs:
    text: str                           # the next piece of the last ToolCall's arguments


# The head of a call whose arguments can stream: the name first, then an arguments object.
_OBJECT_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)+")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_BARE = frozenset(" \t\r\n,:-+.0123456789eEtruefalsn")   # JSON outside strings, besides {}[]"


def _head_name(match, quoted):
    if match is None or not quoted:
        return match and match.group(1)
    try:
        name = json.loads(match.group(1))
    except ValueError:
        return None
    return name if _encodable(name) else None


class _ArgsScanner:
    """Follows a JSON object's text as it arrives, to tell where the object ends."""

    def __init__(self):
        self.depth, self.in_string, self.escape, self.done = 0, False, False, False

    def take(self, text):
        """How much of `text` belongs to the object. Sets `done` at its closing brace, or at a
        character no JSON holds outside a string (a tag cutting the arguments short)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
            elif ch not in _BARE:
                self.done = True
                return i
        return len(text)


def _to_call(obj, lenient=False):
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if not lenient and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    try:
        if isinstance(args, str):
            json.loads(args)
        elif isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        else:
            return None
    except (ValueError, RecursionError):
        return None
    # NOTE(hostile-output): the model's text may spell a lone surrogate as a JSON escape; such a
    # call could not be encoded in the reply, so its text stays content
    return ToolCall(obj["name"], args) if _encodable(obj["name"]) and _encodable(args) else None


def _encodable(text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
        except (ValueError, RecursionError):
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
    name_head = None                # a second committable head besides _OBJECT_HEAD (Mistral's)
    separators = ""                 # regex of markup allowed between calls, besides , ; [ ] and spaces

    def __init__(self):
        self._buf = ""
        self._in_call = False
        self._strip_lead = False
        self._started = False       # any content released yet
        self._ws = ""               # whitespace withheld before an open call
        self._args = None           # an _ArgsScanner while a committed call's arguments stream
        self._owes_brace = False    # the committed call's object still has its closing brace to come
        self._committed = 0         # calls committed since the markup opened
        self._sep = re.compile("(?:" + (f"{self.separators}|" if self.separators else "") + r"\s|[;,\[\]])*")

    def _streaming(self):
        return self._args is not None or self._owes_brace

    def _commit(self, out, limit=None):
        """Commits the call whose head starts the buffer (after separators), if it has arrived."""
        text = self._buf if limit is None else self._buf[:limit]
        start = self._sep.match(text).end()
        for head in (_OBJECT_HEAD, self.name_head):
            match = head.match(text, start) if head else None
            name = _head_name(match, head is _OBJECT_HEAD)
            if name:
                out.append(ToolCall(name, ""))
                self._args, self._owes_brace = _ArgsScanner(), head is _OBJECT_HEAD
                self._buf = self._buf[match.end():]
                self._committed += 1
                return True
        return False

    def _stream_step(self, out):
        """A committed call: its arguments as they arrive, then its object's closing brace."""
        if self._args is not None:
            n = self._args.take(self._buf)
            if n:
                out.append(CallArgs(self._buf[:n]))
                self._buf = self._buf[n:]
            if not self._args.done:
                return False
            self._args = None
            return True
        rest = self._buf.lstrip()
        if not rest:
            return False
        self._buf, self._owes_brace = rest[1:] if rest[0] == "}" else rest, False
        return True

    def _leftover(self, out, text, calls, markup):
        """Call markup text that was not streamed: its calls, else dropped if it is only separators
        after streamed calls, else released as content (with the markup when nothing was a call)."""
        if calls:
            out.extend(calls)
        elif not (self._committed and self._sep.fullmatch(text)):
            self._release(out, text if self._committed else markup)
        return bool(calls) or bool(self._committed)

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
        if self._streaming():
            return self._stream_step(out)
        # NOTE(tool_calls): a new start tag before the end tag closes the open call (seen in Qwen output).
        body, tag, after = split_at_tag(self._buf, (self._end, self._start))
        if self._commit(out, None if tag is None else len(body)):
            return True
        if tag is None:
            return False
        self._strip_lead = self._close(out, body, tag if tag == self._end else "")
        self._in_call, self._ws, self._buf, self._committed = tag == self._start, "", after, 0
        return True

    def _close(self, out, body, end):
        calls = None if self._committed and self._sep.fullmatch(body) else calls_from_json(body, lenient=True)
        return self._leftover(out, body, calls, self._ws + self._start + body + end)

    def flush(self):
        out = []
        rest, self._buf = self._buf, ""
        if not self._in_call:
            self._release(out, rest)
        elif not self._streaming():
            self._close(out, rest, "")
        return out


class TailParser(_Parser):
    """Llama-3 JSON and Mistral: from a trigger (or a bare JSON start) to the end of output is calls."""

    bare_starts = ""

    def _step(self, out):
        if self._in_call:
            return self._stream_step(out) if self._streaming() else self._commit(out)
        head = self._buf.lstrip()
        if not self._started and head[:1] and head[0] in self.bare_starts:
            self._in_call, self._tag, self._ws, self._buf = True, "", "", head
            return True
        return self._content_step(out)

    def flush(self):
        out = []
        rest, self._buf = self._buf, ""
        if not self._in_call:
            self._release(out, rest)
        elif not self._streaming():
            calls = None if self._committed and self._sep.fullmatch(rest) else self.parse(rest)
            self._leftover(out, rest, calls, self._ws + self._tag + rest)
        return out


class Llama3JsonParser(TailParser):
    triggers = ("<|python_tag|>",)
    separators = re.escape("<|python_tag|>")
    bare_starts = "{"

    def parse(self, text):
        return calls_from_json(text.replace("<|python_tag|>", " "))


class MistralParser(TailParser):
    triggers = ("[TOOL_CALLS]",)
    separators = re.escape("[TOOL_CALLS]")
    name_head = re.compile(r"([A-Za-z_][\w.-]*)(?:\[CALL_ID\]\w+)?\[ARGS\](?=\{)")
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


def make_parser(family):
    return FAMILIES[family]()

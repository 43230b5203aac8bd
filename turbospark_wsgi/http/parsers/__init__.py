"""Pure text processing of generated output: reasoning split and tool-call parsing, streamable."""
from dataclasses import dataclass, field

from .reasoning import CONTENT, REASONING, ReasoningSplitter
from .tool_calls import CallArgs, ToolCall, make_parser

__all__ = ["OutputParser", "ParsedOutput", "parse_output", "plan_parser", "ToolCall", "CallArgs", "CONTENT",
           "REASONING"]


class OutputParser:
    """Text deltas in; `(REASONING, text)`, `(CONTENT, text)`, `ToolCall` and `CallArgs` events out.

    `reasoning=False` leaves think tags inline in the content. `tool_family=None` parses no tool calls.
    Tool calls are looked for in content only, never inside reasoning.
    """

    def __init__(self, reasoning=True, in_reasoning=False, tool_family=None):
        self._splitter = ReasoningSplitter(in_reasoning=in_reasoning) if reasoning else None
        self._tools = make_parser(tool_family) if tool_family else None

    def feed(self, text):
        pieces = self._splitter.feed(text) if self._splitter else [(CONTENT, text)]
        return self._route(pieces, flush=False)

    def flush(self):
        pieces = self._splitter.flush() if self._splitter else []
        return self._route(pieces, flush=True)

    def _route(self, pieces, flush):
        if self._tools is None:
            return [p for p in pieces if p[1]]
        out = []
        for kind, text in pieces:
            out.extend(self._tools.feed(text) if kind == CONTENT else [(kind, text)])
        if flush:
            out.extend(self._tools.flush())
        return out


def plan_parser(plan):
    """A fresh OutputParser for one choice of a chat reply, as the service planned it (an OutputPlan
    of serving/chat_plan.py), already past the tool-call opening the server wrote for the model."""
    parser = OutputParser(reasoning=plan.reasoning, in_reasoning=plan.in_reasoning, tool_family=plan.tool_family)
    parser.feed(plan.assistant_prefix)     # NOTE(tools): the prefix is output the model did not have to write
    return parser


@dataclass(slots=True)
class ParsedOutput:
    content: str = ""
    reasoning: str | None = None
    tool_calls: list = field(default_factory=list)


def collect(events, parsed=None):
    """Fold parser events into a ParsedOutput (the non-streaming view)."""
    parsed = parsed or ParsedOutput()
    for event in events:
        if isinstance(event, ToolCall):
            parsed.tool_calls.append(ToolCall(event.name, event.arguments, event.id))
        elif isinstance(event, CallArgs):
            parsed.tool_calls[-1].arguments += event.text
        elif event[0] == REASONING:
            parsed.reasoning = (parsed.reasoning or "") + event[1]
        else:
            parsed.content += event[1]
    return parsed


def parse_output(text, **options):
    """The whole generated text at once; the same result as streaming it through OutputParser."""
    parser = OutputParser(**options)
    return collect(parser.feed(text) + parser.flush())

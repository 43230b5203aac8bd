"""POST /v1/messages out: the message body and the stream events, Anthropic's exact shapes."""
import uuid
from dataclasses import dataclass, field

from ...serving.generation import Finished, KeepAlive, TextDelta
from .. import sse
from ..parsers import CONTENT, REASONING, CallArgs, ToolCall
from .anthropic import tool_input
from .common import anthropic_error_body


@dataclass(slots=True)
class MessageReply:
    model: str
    parallel_tool_calls: bool = True
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])


def tool_use_id(call):
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(finished, has_calls):
    """(stop_reason, stop_sequence) for the service's Finished event."""
    if finished.reason == "length":
        return "max_tokens", None
    if finished.reason == "content_filter":
        return "refusal", None          # NOTE(guardrails): an output rule blocked the rest of the reply
    if has_calls:
        return "tool_use", None
    if finished.stop_string:
        return "stop_sequence", finished.stop_string
    return "end_turn", None


def _tool_block(call):
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": tool_input(call.arguments)}


def message_body(reply, parsed, finished):
    """The non-streaming body for a ParsedOutput and the service's Finished event."""
    calls = parsed.tool_calls if reply.parallel_tool_calls else parsed.tool_calls[:1]
    content = []
    if parsed.reasoning is not None:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not (content or calls):
        content.append({"type": "text", "text": parsed.content})
    content += [_tool_block(c) for c in calls]
    reason, sequence = stop_reason(finished, bool(calls))
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": finished.usage.prompt_tokens, "output_tokens": finished.usage.completion_tokens}}


class _Blocks:
    """Opens and closes content blocks as the kind of output changes; yields (event name, data)."""

    def __init__(self, reply):
        self.reply = reply
        self.index, self.open_kind, self.calls = -1, None, 0
        self.dropping = False       # a call past the first when parallel_tool_calls is false

    def start(self, kind, block):
        yield from self.stop()
        self.index, self.open_kind = self.index + 1, kind
        yield "content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block}
        if self.index == 0:
            yield "ping", {"type": "ping"}

    def stop(self):
        if self.open_kind is not None:
            self.open_kind = None
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}

    def delta(self, delta):
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def events(self, event):
        if isinstance(event, ToolCall):
            yield from self._tool(event)
            return
        if isinstance(event, CallArgs):
            if not self.dropping and event.text:
                yield self.delta({"type": "input_json_delta", "partial_json": event.text})
            return
        kind, text = event
        if kind == REASONING:
            if self.open_kind != REASONING:
                yield from self.start(REASONING, {"type": "thinking", "thinking": "", "signature": ""})
            yield self.delta({"type": "thinking_delta", "thinking": text})
        elif kind == CONTENT:
            if self.open_kind != CONTENT:
                yield from self.start(CONTENT, {"type": "text", "text": ""})
            yield self.delta({"type": "text_delta", "text": text})

    def _tool(self, call):
        """A tool_use block that stays open while the call's arguments stream in."""
        self.dropping = bool(self.calls) and not self.reply.parallel_tool_calls
        if self.dropping:
            return
        self.calls += 1
        yield from self.start("tool_use", {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}})
        yield from self.events(CallArgs(call.arguments))


def message_events(reply, make_parser, events, input_tokens):
    """(event name, data) pairs for service events, read by the parser `make_parser()` gives;
    (None, None) stands for a keep-alive comment. A cancelled run ends without message_delta /
    message_stop.
    """
    blocks, parser = _Blocks(reply), make_parser()
    yield "message_start", {"type": "message_start", "message": {
        "id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}}
    for event in events:
        if isinstance(event, KeepAlive):
            yield None, None
        elif isinstance(event, TextDelta):
            for parsed in parser.feed(event.text):
                yield from blocks.events(parsed)
        elif isinstance(event, Finished):
            yield from _finish(blocks, parser, event)


def _finish(blocks, parser, finished):
    for parsed in parser.flush():
        yield from blocks.events(parsed)
    if blocks.index < 0:   # NOTE(anthropic): an empty answer is still one (empty) text block
        yield from blocks.start(CONTENT, {"type": "text", "text": ""})
    yield from blocks.stop()
    reason, sequence = stop_reason(finished, blocks.calls > 0)
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                            "usage": {"input_tokens": finished.usage.prompt_tokens,
                                      "output_tokens": finished.usage.completion_tokens}}
    yield "message_stop", {"type": "message_stop"}


def message_stream(reply, make_parser, events, input_tokens):
    """SSE frames: named events, with keep-alive comments while waiting."""
    for name, data in message_events(reply, make_parser, events, input_tokens):
        yield sse.KEEPALIVE if name is None else sse.named_event(name, data)


def error_event(exc):
    """A mid-stream failure as `event: error` with Anthropic's envelope."""
    return sse.named_event("error", anthropic_error_body(exc))

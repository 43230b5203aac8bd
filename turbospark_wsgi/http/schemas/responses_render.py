"""POST /v1/responses out: Response objects and the typed stream events (`response.created` ...
`response.completed`, each with its `sequence_number`), OpenAI's exact shapes.

Both are built from the same OutputParser events by one OutputItems, so a streamed response ends
as the same Response the non-streamed call returns.
"""
import secrets
import time
from dataclasses import dataclass, field

from ...serving.generation import Finished, KeepAlive, TextDelta
from .. import sse
from ..parsers import CONTENT, REASONING, CallArgs, ToolCall

_PREFIX = {"message": "msg_", "reasoning": "rs_", "function_call": "fc_"}


def new_id(prefix):
    return prefix + secrets.token_hex(24)


@dataclass(slots=True)
class ResponseReply:
    """Per-response constants: the id, the model name and the request fields every Response repeats."""

    model: str
    echo: dict
    id: str = field(default_factory=lambda: new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status, output=(), usage=None, error=None, incomplete=None):
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error, "incomplete_details": incomplete, "model": self.model,
                "output": list(output), "usage": usage, **self.echo}

    def final(self, finished, items):
        """The finished Response: 'incomplete' when a token budget (or the time limit) cut it, or a
        guardrail blocked the rest of it."""
        cut = _INCOMPLETE.get(finished.reason)
        body = self.response("incomplete" if cut else "completed", [item.wire() for item in items],
                             usage_dict(finished.usage), incomplete={"reason": cut} if cut else None)
        body["completed_at"] = None if cut else int(time.time())
        return body


def usage_dict(usage):
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


# the service's finish reasons that leave a response incomplete -> incomplete_details.reason
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(slots=True)
class _Item:
    kind: str                             # "message" | "reasoning" | "function_call"
    id: str
    text: str = ""                        # the message or reasoning text, or a call's arguments
    name: str = ""
    call_id: str = ""
    status: str = "in_progress"

    def wire(self, announced=False):
        """The item as the API shows it; `announced`: as `output_item.added` shows it (nothing written yet)."""
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "status": self.status, "call_id": self.call_id,
                    "name": self.name, "arguments": "" if announced else self.text}
        parts = [] if announced else [self.part()]
        if self.kind == "message":
            return {"id": self.id, "type": "message", "role": "assistant", "status": self.status, "content": parts}
        return {"id": self.id, "type": "reasoning", "status": self.status, "summary": [], "content": parts}

    def part(self):
        if self.kind == "message":
            return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": self.text}


class OutputItems:
    """OutputParser events in; output items, and the stream events that announce, fill and close
    them, out: (type, fields) pairs without a sequence number. The item being written is the last."""

    def __init__(self, parallel_tool_calls=True):
        self.items = []
        self._open = None
        self._space = ""            # whitespace not yet in a message: dropped when no text follows
        self._parallel = parallel_tool_calls
        self._dropping = False      # a call past the first when parallel_tool_calls is false

    def feed(self, parsed):
        if isinstance(parsed, ToolCall):
            return self._call(parsed)
        if isinstance(parsed, CallArgs):
            writing = self._open is not None and self._open.kind == "function_call"
            return self._delta(parsed.text) if writing and not self._dropping and parsed.text else []
        kind, text = parsed
        if kind == REASONING:
            return self._text("reasoning", text)
        return self._text("message", text) if kind == CONTENT else []

    def finish(self, reason):
        """Closes the open item; an answer with no output at all is one empty message."""
        status = "incomplete" if reason in _INCOMPLETE else "completed"
        events = self._close(status)
        if not self.items:
            events += self._start("message") + (self._delta(self._space) if self._space else []) + self._close(status)
        return events

    def _text(self, kind, text):
        if self._open is not None and self._open.kind == kind:
            return self._delta(text)
        if kind == "message" and not (self._space + text).strip():
            self._space += text     # NOTE(items): whitespace between items makes no message of its own
            return []
        text, self._space = (self._space + text if kind == "message" else text), ""
        return self._close("completed") + self._start(kind) + self._delta(text)

    def _call(self, call):
        self._dropping = not self._parallel and any(i.kind == "function_call" for i in self.items)
        if self._dropping:
            return []
        self._space = ""
        events = self._close("completed") + self._start("function_call", call)
        return events + (self._delta(call.arguments) if call.arguments else [])

    def _start(self, kind, call=None):
        item = _Item(kind, new_id(_PREFIX[kind]), name=call.name if call else "", call_id=call.id if call else "")
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events = [("response.output_item.added", {"output_index": index, "item": item.wire(announced=True)})]
        if kind != "function_call":
            events.append(("response.content_part.added", self._where(content_index=0, part=item.part())))
        return events

    def _delta(self, text):
        item = self._open
        item.text += text
        if item.kind == "function_call":
            return [("response.function_call_arguments.delta", self._where(delta=text))]
        if item.kind == "message":
            return [("response.output_text.delta", self._where(content_index=0, delta=text, logprobs=[]))]
        return [("response.reasoning_text.delta", self._where(content_index=0, delta=text))]

    def _close(self, status):
        item = self._open
        if item is None:
            return []
        self._open, item.status = None, status
        if item.kind == "function_call":
            events = [("response.function_call_arguments.done",
                       self._where(item, arguments=item.text, name=item.name))]
        else:
            done = self._where(item, content_index=0, text=item.text)
            if item.kind == "message":
                done["logprobs"] = []
            events = [(f"response.{'output' if item.kind == 'message' else 'reasoning'}_text.done", done),
                      ("response.content_part.done", self._where(item, content_index=0, part=item.part()))]
        return events + [("response.output_item.done", {"output_index": len(self.items) - 1, "item": item.wire()})]

    def _where(self, item=None, **fields):
        item = item or self._open
        return {"item_id": item.id, "output_index": len(self.items) - 1, **fields}


def response_body(reply, make_parser, events, parallel_tool_calls=True):
    """Drains service events, read by the parser `make_parser()` gives, into the finished Response;
    None when the run was cancelled."""
    items, parser = OutputItems(parallel_tool_calls), make_parser()
    for event in events:
        if isinstance(event, TextDelta):
            for parsed in parser.feed(event.text):
                items.feed(parsed)
        elif isinstance(event, Finished):
            for parsed in parser.flush():
                items.feed(parsed)
            items.finish(event.reason)
            return reply.final(event, items.items)
    return None


class ResponseStream:
    """The SSE frames of one streamed response, numbered in order; `error_frame` ends it after any
    of them with an `error` event and `response.failed`. `on_done(body)` sees the finished Response
    before `response.completed` (or `response.incomplete`) goes out. The text is read by the parser
    `make_parser()` gives."""

    def __init__(self, reply, make_parser, parallel_tool_calls=True, on_done=None):
        self._reply, self._parser = reply, make_parser()
        self._items = OutputItems(parallel_tool_calls)
        self._on_done = on_done
        self._seq = 0

    def frames(self, events):
        """Frames for service events; keep-alive comments while waiting. A cancelled run just ends."""
        start = self._reply.response("in_progress")
        yield self._frame("response.created", {"response": start})
        yield self._frame("response.in_progress", {"response": start})
        for event in events:
            if isinstance(event, KeepAlive):
                yield sse.KEEPALIVE
            elif isinstance(event, TextDelta):
                yield from self._frames(self._parser.feed(event.text))
            elif isinstance(event, Finished):
                yield from self._frames(self._parser.flush())
                yield from (self._frame(*e) for e in self._items.finish(event.reason))
                body = self._reply.final(event, self._items.items)
                if self._on_done is not None:
                    self._on_done(body)
                kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
                yield self._frame(kind, {"response": body})

    def error_frame(self, exc):
        """An ApiError in mid-stream: `error`, then `response.failed` with the output so far."""
        error = {"code": "server_error" if exc.status >= 500 else "invalid_prompt", "message": exc.message,
                 "param": exc.param, "type": exc.type}
        failed = self._reply.response("failed", [item.wire() for item in self._items.items], error=error)
        return (self._frame("error", {"code": exc.code or exc.type, "message": exc.message, "param": exc.param})
                + self._frame("response.failed", {"response": failed}))

    def _frames(self, parsed_events):
        for parsed in parsed_events:
            for kind, fields in self._items.feed(parsed):
                yield self._frame(kind, fields)

    def _frame(self, kind, fields):
        event = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return sse.named_event(kind, event)

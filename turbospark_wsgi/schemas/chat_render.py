"""POST /v1/chat/completions out: the response body and the stream chunks, OpenAI's exact shapes."""
import hashlib
import time
import uuid
from dataclasses import dataclass, field

from ..parsers import CONTENT, REASONING, ToolCall, collect
from .. import sse
from ..service import Finished, KeepAlive, TextDelta


def _fingerprint(model):
    return "fp_" + hashlib.sha1(model.encode("utf-8")).hexdigest()[:10]


@dataclass(slots=True)
class ChatReply:
    """Per-response constants shared by the body and every chunk."""

    model: str
    include_usage: bool = False
    parallel_tool_calls: bool = True
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, obj):
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": _fingerprint(self.model)}


def usage_dict(usage):
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reason(reason, has_calls):
    # NOTE(openai): the engine's "stop" becomes "tool_calls" when the model called a tool.
    return "tool_calls" if has_calls and reason == "stop" else reason


def _call_dict(call, index=None):
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def chat_body(reply, parsed, finished):
    """The non-streaming body for a ParsedOutput and the service's Finished event."""
    calls = parsed.tool_calls if reply.parallel_tool_calls else parsed.tool_calls[:1]
    message = {"role": "assistant", "content": parsed.content if parsed.content or not calls else None,
               "refusal": None}
    if parsed.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = parsed.reasoning
    if calls:
        message["tool_calls"] = [_call_dict(c) for c in calls]
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": finish_reason(finished.reason, bool(calls))}
    return {**reply.envelope("chat.completion"), "choices": [choice], "usage": usage_dict(finished.usage)}


def drain(parser, events):
    """Runs service events through an OutputParser: (ParsedOutput, Finished or None if cancelled)."""
    parsed, finished = None, None
    for event in events:
        if isinstance(event, TextDelta):
            parsed = collect(parser.feed(event.text), parsed)
        elif isinstance(event, Finished):
            finished = event
    return collect(parser.flush(), parsed), finished


class _ChunkWriter:
    def __init__(self, reply):
        self.reply = reply
        self.calls = 0

    def chunk(self, delta, reason=None):
        body = {**self.reply.envelope("chat.completion.chunk"),
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if self.reply.include_usage:
            body["usage"] = None
        return body

    def deltas(self, event):
        if isinstance(event, ToolCall):
            if self.calls and not self.reply.parallel_tool_calls:
                return []
            index, self.calls = self.calls, self.calls + 1
            head = {"index": index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": event.arguments}}]}]
        kind, text = event
        if kind == REASONING:
            return [{"reasoning_content": text, "reasoning": text}]
        return [{"content": text}] if kind == CONTENT else []


def chat_chunks(reply, parser, events):
    """Stream chunks (dicts) for service events; None stands for a keep-alive comment.

    The first chunk carries the role; a cancelled run ends without a finish chunk.
    """
    writer = _ChunkWriter(reply)
    yield writer.chunk({"role": "assistant", "content": "", "refusal": None})
    for event in events:
        if isinstance(event, KeepAlive):
            yield None
        elif isinstance(event, TextDelta):
            for parsed in parser.feed(event.text):
                yield from (writer.chunk(d) for d in writer.deltas(parsed))
        elif isinstance(event, Finished):
            for parsed in parser.flush():
                yield from (writer.chunk(d) for d in writer.deltas(parsed))
            yield writer.chunk({}, finish_reason(event.reason, writer.calls > 0))
            if reply.include_usage:
                yield {**reply.envelope("chat.completion.chunk"), "choices": [], "usage": usage_dict(event.usage)}


def chat_stream(reply, parser, events):
    """SSE frames: the chunks, keep-alive comments, then `[DONE]` after a finish (not after a cancel)."""
    finished = False
    for chunk in chat_chunks(reply, parser, events):
        if chunk is None:
            yield sse.KEEPALIVE
            continue
        finished = finished or bool(chunk["choices"] and chunk["choices"][0]["finish_reason"])
        yield sse.data_event(chunk)
    if finished:
        yield sse.DONE

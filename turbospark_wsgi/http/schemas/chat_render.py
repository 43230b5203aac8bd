"""POST /v1/chat/completions out: the response body and the stream chunks, OpenAI's exact shapes."""
import hashlib
import time
import uuid
from dataclasses import dataclass, field

from ...serving.generation import Finished, KeepAlive, TextDelta
from .. import sse
from ..parsers import CONTENT, REASONING, CallArgs, ToolCall, collect
from .openai import filter_results, prompt_filter_results, usage_body


def _fingerprint(model):
    return "fp_" + hashlib.sha1(model.encode("utf-8")).hexdigest()[:10]


@dataclass(slots=True)
class ChatReply:
    """Per-response constants shared by the body and every chunk."""

    model: str
    include_usage: bool = False
    parallel_tool_calls: bool = True
    prompt_filters: list | None = None    # (rule id, action) of the input guardrails that redacted
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, obj):
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": _fingerprint(self.model)}


def usage_dict(usage):
    """Completions' usage body plus the prompt tokens the prefix cache served."""
    return {**usage_body(usage), "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reason(reason, has_calls):
    # NOTE(openai): the engine's "stop" becomes "tool_calls" when the model called a tool.
    return "tool_calls" if has_calls and reason == "stop" else reason


def _call_dict(call, index=None):
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def logprobs_dict(entries):
    """[TokenLogprob] -> a choice's `logprobs` object (None when logprobs were not asked for)."""
    if entries is None:
        return None
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top]}
                        for e in entries], "refusal": None}


def chat_body(reply, parsed, finished, choices=None):
    """The non-streaming body for a ParsedOutput and the service's Finished event; with n > 1,
    `choices` is [(parsed, Finished, logprob entries)] by index and `finished` the last one."""
    choices = choices if choices is not None else [(parsed, finished, None)]
    body = {**reply.envelope("chat.completion"),
            "choices": [_choice(reply, i, *c) for i, c in enumerate(choices)], "usage": usage_dict(finished.usage)}
    if reply.prompt_filters:
        body["prompt_filter_results"] = prompt_filter_results(reply.prompt_filters)
    return body


def _choice(reply, index, parsed, finished, logprobs):
    calls = parsed.tool_calls if reply.parallel_tool_calls else parsed.tool_calls[:1]
    message = {"role": "assistant", "content": parsed.content if parsed.content or not calls else None,
               "refusal": None}
    if parsed.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = parsed.reasoning
    if calls:
        message["tool_calls"] = [_call_dict(c) for c in calls]
    choice = {"index": index, "message": message, "logprobs": logprobs_dict(logprobs),
              "finish_reason": finish_reason(finished.reason, bool(calls))}
    if finished.guardrails:
        choice["content_filter_results"] = filter_results(finished.guardrails)
    return choice


def drain_choices(make_parser, events):
    """Service events of n choices -> ([(ParsedOutput, Finished, logprobs)], last Finished or None)."""
    parsers, parsed, logprobs, done, last = {}, {}, {}, {}, None
    for event in events:
        i = getattr(event, "index", 0)
        if isinstance(event, TextDelta):
            parser = parsers.setdefault(i, make_parser())
            parsed[i] = collect(parser.feed(event.text), parsed.get(i))
            if event.logprobs is not None:
                logprobs.setdefault(i, []).extend(event.logprobs)
        elif isinstance(event, Finished):
            parser = parsers.setdefault(i, make_parser())
            parsed[i], done[i] = collect(parser.flush(), parsed.get(i)), event
            last = event if event.last else last
    if last is None:
        return [], None
    return [(parsed[i], done[i], logprobs.get(i)) for i in sorted(done)], last


class _ChunkWriter:
    """Chunks of one choice: its index, its tool-call count and the logprobs not yet sent."""

    def __init__(self, reply, index=0):
        self.reply = reply
        self.index = index
        self.calls = 0
        self.dropping = False       # a call past the first when parallel_tool_calls is false
        self.logprobs = None

    def chunk(self, delta, reason=None):
        logprobs, self.logprobs = self.logprobs, None
        body = {**self.reply.envelope("chat.completion.chunk"),
                "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs_dict(logprobs),
                             "finish_reason": reason}]}
        if self.reply.include_usage:
            body["usage"] = None
        return body

    def hold(self, entries):
        if entries is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(entries)

    def deltas(self, event):
        if isinstance(event, ToolCall):
            self.dropping = bool(self.calls) and not self.reply.parallel_tool_calls
            if self.dropping:
                return []
            self.calls += 1
            head = {"index": self.calls - 1, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            return [{"tool_calls": [head]}] + self.deltas(CallArgs(event.arguments))
        if isinstance(event, CallArgs):
            if self.dropping or not event.text:
                return []
            return [{"tool_calls": [{"index": self.calls - 1, "function": {"arguments": event.text}}]}]
        kind, text = event
        if kind == REASONING:
            return [{"reasoning_content": text, "reasoning": text}]
        return [{"content": text}] if kind == CONTENT else []


def chat_chunks(reply, make_parser, events, n=1):
    """Stream chunks (dicts) for service events; None stands for a keep-alive comment.

    Each choice's first chunk carries the role; logprobs ride on the next chunk of their choice;
    a cancelled run ends without a finish chunk. `make_parser()` gives each choice its parser.
    """
    writers, parsers = {}, {}
    for i in range(n):
        writers[i], parsers[i] = _ChunkWriter(reply, i), make_parser()
        first = writers[i].chunk({"role": "assistant", "content": "", "refusal": None})
        if i == 0 and reply.prompt_filters:
            first["prompt_filter_results"] = prompt_filter_results(reply.prompt_filters)
        yield first
    for event in events:
        if isinstance(event, KeepAlive):
            yield None
            continue
        writer, parser = writers[event.index], parsers[event.index]
        if isinstance(event, TextDelta):
            writer.hold(event.logprobs)
            for parsed in parser.feed(event.text):
                yield from (writer.chunk(d) for d in writer.deltas(parsed))
        elif isinstance(event, Finished):
            for parsed in parser.flush():
                yield from (writer.chunk(d) for d in writer.deltas(parsed))
            last = writer.chunk({}, finish_reason(event.reason, writer.calls > 0))
            if event.guardrails:
                last["choices"][0]["content_filter_results"] = filter_results(event.guardrails)
            yield last
            if reply.include_usage and event.last:
                yield {**reply.envelope("chat.completion.chunk"), "choices": [], "usage": usage_dict(event.usage)}


def chat_stream(reply, make_parser, events, n=1):
    """SSE frames: the chunks, keep-alive comments, then `[DONE]` after the last choice's finish
    (not after a cancel)."""
    finished = 0
    for chunk in chat_chunks(reply, make_parser, events, n):
        if chunk is None:
            yield sse.KEEPALIVE
            continue
        finished += bool(chunk["choices"] and chunk["choices"][0]["finish_reason"])
        yield sse.data_event(chunk)
    if finished >= n:
        yield sse.DONE

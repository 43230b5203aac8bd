"""The seam between HTTP and the engine: eager admission, then lazy generation as service events.

    events = service.run(GenerationRequest(...), CancelToken())   # ApiError here: nothing sent yet
    for event in events:       # KeepAlive | TextDelta | Finished; ends without Finished if cancelled
        ...
    events.close()             # idempotent: cancels, stops the engine, releases the queue slot
"""
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from . import compute
from .engine import Finish, FinishReason, Prefill, SamplingParams, Token
from .errors import ApiError, ContextLengthExceeded, EngineError, InvalidRequest
from .queue import LockQueue
from .registry import Registry

log = logging.getLogger("turbospark.service")


@dataclass(slots=True)
class GenerationRequest:
    """One generation, as the schemas hand it to the service (one of prompt / prompt_ids / messages)."""

    model: str | None = None                # None: the default model
    prompt: str | None = None               # raw text (completions)
    prompt_ids: list | None = None          # token ids given by the client
    messages: list | None = None            # chat messages (the model's template applies)
    tools: list | None = None
    template_kwargs: dict = field(default_factory=dict)
    add_bos: bool = True                    # raw text only; templates bring their own BOS
    max_tokens: int | None = 16             # None: up to the end of the context
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    include_usage: bool = False             # stream_options.include_usage
    echo: bool = False                      # placeholders until echo/logprobs are honoured
    logprobs: int | None = None
    request_id: str = ""
    prompt_param: str = "prompt"            # the request field blamed when the prompt is too long
    assistant_prefix: str = ""              # chat only: text the reply starts with (a forced tool call)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self):
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class KeepAlive:
    phase: str                              # "queued" | "running"


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class Finished:
    reason: str                             # FinishReason.STOP | LENGTH
    usage: Usage
    stop_string: str | None = None


class Service:
    """Admits requests, queues them FIFO and drives the engine on the compute thread."""

    def __init__(self, config, registry=None, queue=None):
        self.config = config
        self.registry = registry if registry is not None else Registry(config)
        self.queue = queue if queue is not None else LockQueue(config.max_waiting, config.queue_timeout)
        self._loading_pid = None
        self._load_error = None

    def run(self, req, cancel):
        """Admits `req` now (model, tokens, context, queue: ApiError on refusal) and returns a
        lazy `Generation` iterator that waits its turn and then generates."""
        engine = self.registry.resolve(req.model)
        ids = self._prompt_ids(engine, req)
        params = dataclasses.replace(req.params, max_new_tokens=self._budget(engine, req, len(ids)))
        self._check_logit_bias(engine, params)
        ticket = self.queue.enqueue(cancel)
        return Generation(engine, ids, params, req, cancel, ticket, self.config.keepalive)

    @property
    def default_model(self):
        return self.registry.default_name

    def count_tokens(self, req):
        """Prompt tokens `req` would use (template applied), without queueing or generating."""
        return len(self._prompt_ids(self.registry.resolve(req.model), req))

    def chat_template(self, model):
        """The chat template source of `model` (resolving it), for the chat output parsers."""
        engine = self.registry.resolve(model)
        template = getattr(engine, "template", None)
        return getattr(template, "source", "") or ""

    def models(self):
        return self.registry.list()

    def health(self):
        """{"status": "ok" | "loading" | "error", "model", "backend", "queue": {...}}."""
        engine = self.registry.loaded()
        status = "ok" if engine is not None else ("error" if self._load_error else "loading")
        body = {"status": status, "model": self.registry.default_name,
                "queue": {"waiting": self.queue.depth, "running": self.queue.running,
                          "max_waiting": self.queue.max_waiting}}
        if engine is not None:
            body["backend"] = getattr(engine, "backend", None)
            body["backend_reason"] = getattr(engine, "backend_reason", None)
            body["max_context"] = self._context(engine)
        elif self._load_error:
            body["error"] = self._load_error
        return body

    def start_loading(self):
        """Loads the default model on a background thread, once per process (call it post-fork)."""
        if self._loading_pid == os.getpid():
            return
        self._loading_pid = os.getpid()
        threading.Thread(target=self._load_default, name="turbospark-load", daemon=True).start()

    def _load_default(self):
        try:
            self.registry.resolve(None)
            self._load_error = None
        except ApiError as e:
            self._load_error = e.message
            log.error("default model not loaded: %s", e.message)
        except Exception:
            self._load_error = "the default model could not be loaded (see the server log)"
            log.exception("loading the default model failed")

    def _prompt_ids(self, engine, req):
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            vocab = engine.config.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        elif req.messages is not None:
            try:
                ids = engine.apply_chat_template(req.messages, tools=req.tools, **req.template_kwargs)
            except ValueError as e:
                raise InvalidRequest(str(e), param="messages") from e
            if req.assistant_prefix:
                ids = ids + engine.encode(req.assistant_prefix, add_bos=False)
        else:
            ids = engine.encode(req.prompt or "", add_bos=req.add_bos)
        if not ids:
            raise InvalidRequest("the prompt is empty", param=req.prompt_param)
        return ids

    def _context(self, engine):
        cap = self.config.max_context
        return min(engine.max_context, cap) if cap else engine.max_context

    def _budget(self, engine, req, n_prompt):
        ctx = self._context(engine)
        if n_prompt + 1 > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens, but the prompt has {n_prompt} "
                f"tokens, which leaves no room for a completion. Please shorten the prompt.",
                param=req.prompt_param)
        if req.max_tokens is None:
            return ctx - n_prompt
        if n_prompt + req.max_tokens > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the prompt, {req.max_tokens} for "
                f"the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens")
        return req.max_tokens

    def _check_logit_bias(self, engine, params):
        vocab = engine.config.vocab_size
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                 param="logit_bias")


def collect(events):
    """Drains a Generation: (text, Finished), or (text, None) when it was cancelled."""
    parts, finished = [], None
    for event in events:
        if isinstance(event, TextDelta):
            parts.append(event.text)
        elif isinstance(event, Finished):
            finished = event
    return "".join(parts), finished


class Generation:
    """The lazy half of `Service.run`: an iterator of service events with an idempotent `close()`.

    Attributes for logs and metrics: model_id, usage, finish_reason, enqueued_at, started_at,
    first_token_at, finished_at (time.monotonic values or None).
    """

    def __init__(self, engine, ids, params, req, cancel, ticket, keepalive):
        self.model_id = engine.name
        self.request_id = req.request_id
        self.prompt_tokens = len(ids)
        self.usage = None
        self.finish_reason = None
        self.enqueued_at, self.started_at = time.monotonic(), None
        self.first_token_at = self.finished_at = None
        self._engine, self._ids, self._params = engine, ids, params
        self._cancel, self._ticket, self._keepalive = cancel, ticket, keepalive
        self._steps = self._pending = None
        self._completion_tokens = 0
        self._quiet_since = time.monotonic()      # last time the consumer got an event
        self._cleaned = False
        self._gen = self._events()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._gen)

    def close(self):
        try:
            self._gen.close()       # runs the generator's `finally` if it had started
        finally:
            self._cleanup()         # ... and this covers a generator that never started

    def _events(self):
        try:
            if not (yield from self._wait_turn()):
                return
            self.started_at = time.monotonic()
            self._steps = yield from self._await(compute.submit(
                self._engine.generate, self._ids, self._params, should_stop=self._cancel.is_set))
            while True:
                event = yield from self._await(compute.submit(next, self._steps, None))
                if event is None:
                    return
                for out in self._translate(event):
                    self._quiet_since = time.monotonic()
                    yield out
                if isinstance(event, Finish):
                    return
                if time.monotonic() - self._quiet_since >= self._keepalive:
                    # NOTE(keepalive): many quick prefill chunks (or held-back tokens) are silent too.
                    self._quiet_since = time.monotonic()
                    yield KeepAlive("running")
        except ApiError:
            raise
        except Exception as e:
            log.exception("generation failed [request %s]", self.request_id)
            raise EngineError(f"The server had an error while generating (request id {self.request_id})") from e
        finally:
            self._cleanup()

    def _wait_turn(self):
        while not self._ticket.wait(self._keepalive):
            if self._ticket.left:
                return False
            self._quiet_since = time.monotonic()
            yield KeepAlive("queued")
        return not self._cancel.cancelled

    def _await(self, fut):
        self._pending = fut
        while True:
            try:
                result = fut.result(timeout=self._keepalive)
            except TimeoutError:
                if fut.done():
                    raise
                self._quiet_since = time.monotonic()
                yield KeepAlive("running")
                continue
            self._pending = None
            return result

    def _translate(self, event):
        if isinstance(event, Token):
            self._completion_tokens += 1
            if event.text:
                self.first_token_at = self.first_token_at or time.monotonic()
                yield TextDelta(event.text)
        elif isinstance(event, Finish):
            self.finish_reason = event.reason
            if event.reason == FinishReason.CANCELLED:
                return
            if event.text:
                yield TextDelta(event.text)
            self.usage = Usage(event.prompt_tokens or len(self._ids),
                               event.completion_tokens or self._completion_tokens, event.cached_tokens)
            yield Finished(event.reason, self.usage, event.stop_string)
        elif not isinstance(event, Prefill):
            raise TypeError(f"unexpected engine event {event!r}")

    def _cleanup(self):
        if self._cleaned:
            return
        self._cleaned = True
        self._cancel.cancel("closed")       # a step still running stops at its next check
        try:
            if self._pending is not None:
                self._pending.exception()   # wait for the step in flight; its result no longer matters
            if self._steps is not None:
                compute.run(self._steps.close)
        except Exception:
            log.exception("closing the engine generator failed [request %s]", self.request_id)
        finally:
            self._ticket.release()
            self.finished_at = time.monotonic()

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

from . import compute, metrics
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
    echo: bool = False                      # completions: each choice starts with the prompt text
    logprobs: int | None = None             # None: no logprobs; N: the chosen token's plus the top N
    n: int = 1                              # choices returned
    best_of: int | None = None              # choices generated (the n with the best cumulative logprob win)
    grammar: dict | None = None             # llguidance grammar spec the output must follow
    grammar_param: str = "response_format"  # the request field blamed when the grammar cannot compile
    request_id: str = ""
    prompt_param: str = "prompt"            # the request field blamed when the prompt is too long
    assistant_prefix: str = ""              # chat only: text the reply starts with (a forced tool call)
    thinking_budget: int | None = None      # reasoning tokens before the think tag is closed (no grammar)


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
class TokenLogprob:
    token: str                              # the token's text (special tokens by name, bad UTF-8 escaped)
    bytes: bytes
    logprob: float | None                   # None: the first prompt token (nothing before it)
    top: list = field(default_factory=list)  # [(token, bytes, logprob)], best first
    text_len: int = 0                       # characters it adds to the decoded text (0 for special tokens)


@dataclass(slots=True)
class TextDelta:
    text: str
    logprobs: list | None = None            # [TokenLogprob] of the tokens behind this text, when asked
    index: int = 0                          # the choice (n > 1)


@dataclass(slots=True)
class Finished:
    reason: str                             # FinishReason.STOP | LENGTH
    usage: Usage                            # of the run so far: the last choice's is the total
    stop_string: str | None = None
    index: int = 0
    last: bool = True                       # the last choice's Finished ends the run


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str = ""
    logprobs: list | None = None
    finished: Finished | None = None


class Service:
    """Admits requests, queues them FIFO and drives the engine on the compute thread."""

    def __init__(self, config, registry=None, queue=None):
        self.config = config
        self.registry = registry if registry is not None else Registry(config)
        self.queue = queue if queue is not None else LockQueue(config.max_waiting, config.queue_timeout,
                                                                        slots=config.max_batch)
        self._loading_pid = None
        self._load_error = None

    def run(self, req, cancel):
        """Admits `req` now (model, tokens, context, queue: ApiError on refusal) and returns a
        lazy `Generation` iterator that waits its turn and then generates."""
        self._check_max_tokens(req)             # NOTE(order): no model needed, so before resolving one
        lease = self.registry.acquire(req.model)
        try:
            gen = self._admit(lease.engine, req, cancel)
        except BaseException:
            lease.release()
            raise
        gen.limit_time(self.config.max_generation_seconds)
        gen.on_close(lease.release)             # NOTE(lease): a model in use is never unloaded
        gen.on_close(lambda: metrics.observe_queue(self.queue))
        metrics.observe_queue(self.queue)
        return gen

    def _admit(self, engine, req, cancel):
        ids = self._prompt_ids(engine, req)
        params = dataclasses.replace(req.params, max_new_tokens=self._budget(engine, req, len(ids)),
                                     logprobs=_logprobs_wanted(req))
        self._check_logit_bias(engine, params)
        grammar = self._grammar(engine, req)
        ticket = self.queue.enqueue(cancel)
        return Generation(engine, ids, params, req, cancel, ticket, self.config.keepalive, grammar)

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
            _check_ids(engine, ids, req.prompt_param)
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
        cap = self.config.max_prompt_tokens
        if cap and n_prompt > cap:
            raise InvalidRequest(f"The prompt has {n_prompt} tokens; this server accepts at most {cap} "
                                 f"(TURBOSPARK_MAX_PROMPT_TOKENS)", param=req.prompt_param, code="prompt_too_long")
        if req.max_tokens is None:
            return min(ctx - n_prompt, self.config.max_tokens_cap or ctx)
        if req.max_tokens == 0:             # echo only: score the prompt, generate nothing
            return 0
        if n_prompt + req.max_tokens > ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the prompt, {req.max_tokens} for "
                f"the completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens")
        return req.max_tokens

    def _grammar(self, engine, req):
        if req.grammar is None:
            return None
        if not hasattr(engine, "compile_grammar"):
            raise InvalidRequest("this model cannot constrain its output", param=req.grammar_param)
        try:
            # NOTE(grammar): compiled on the compute thread: the first one builds the tokenizer tables.
            return compute.run(engine.compile_grammar, req.grammar)
        except ValueError as e:
            raise InvalidRequest(f"'{req.grammar_param}' cannot be enforced: {e}", param=req.grammar_param) from e

    def tokenize(self, req):
        """(token ids, max context) for a GenerationRequest's prompt, as `run` would build them."""
        engine = self.registry.resolve(req.model)
        if req.prompt == "" and not req.add_bos:
            return [], self._context(engine)
        return self._prompt_ids(engine, req), self._context(engine)

    def detokenize(self, model, ids):
        """The text of token ids (special tokens kept), checked against the vocabulary."""
        engine = self.registry.resolve(model)
        _check_ids(engine, ids, "tokens")
        return engine.decode(list(ids), skip_special=False)

    def _check_max_tokens(self, req):
        cap = self.config.max_tokens_cap
        if cap and req.max_tokens is not None and req.max_tokens > cap:
            raise InvalidRequest(f"max_tokens is {req.max_tokens}; this server allows at most {cap} "
                                 f"(TURBOSPARK_MAX_TOKENS_CAP)", param="max_tokens", code="max_tokens_too_large")

    def _check_logit_bias(self, engine, params):
        vocab = engine.config.vocab_size
        bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                 param="logit_bias")


def _check_ids(engine, ids, param):
    vocab = engine.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)


def _logprobs_wanted(req):
    if req.logprobs is not None:
        return req.logprobs
    return 0 if (req.best_of or 0) > req.n else None      # best_of ranks by cumulative logprob


def collect_choices(events):
    """Drains a Generation: ([ChoiceResult] by index, the last Finished), or (..., None) if cancelled."""
    choices, finished = {}, None
    for event in events:
        if isinstance(event, TextDelta):
            choice = choices.setdefault(event.index, ChoiceResult(event.index))
            choice.text += event.text
            if event.logprobs is not None:
                choice.logprobs = choice.logprobs if choice.logprobs is not None else []
                choice.logprobs.extend(event.logprobs)
        elif isinstance(event, Finished):
            choices.setdefault(event.index, ChoiceResult(event.index)).finished = event
            finished = event if event.last else finished
    return [choices[i] for i in sorted(choices)], finished


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

    Choices (n, best_of) run one after another inside the one queue slot; the engine's prefix
    cache makes the repeated prompt nearly free. Events carry their choice's `index`.

    Attributes for logs and metrics: model_id, usage, finish_reason, enqueued_at, started_at,
    first_token_at, finished_at (time.monotonic values or None).
    """

    def __init__(self, engine, ids, params, req, cancel, ticket, keepalive, grammar=None):
        self.model_id = engine.name
        self.request_id = req.request_id
        self.prompt_tokens = len(ids)
        self.usage = None
        self.finish_reason = None
        self.enqueued_at, self.started_at = time.monotonic(), None
        self.first_token_at = self.finished_at = None
        self._engine, self._ids, self._params, self._grammar = engine, ids, params, grammar
        self._thinking_budget = req.thinking_budget
        self._n, self._runs = req.n, max(req.n, req.best_of or 1)
        self._echo_text = None if not req.echo else (req.prompt if req.prompt is not None else None)
        self._echo, self._report = req.echo, req.logprobs is not None
        self._cancel, self._ticket, self._keepalive = cancel, ticket, keepalive
        self._steps = self._pending = None
        self._completion_tokens = 0
        self._lp_pending = []                     # TokenLogprobs whose text is still held back
        self._quiet_since = time.monotonic()      # last time the consumer got an event
        self._cleaned = False
        self.time_limited = False                 # ended by the wall-clock limit (finish reason length)
        self._time_limit, self._on_close = 0.0, []
        self._gen = self._events()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._gen)

    def on_close(self, fn):
        """Calls `fn()` once when the generation is closed (after its queue slot is released)."""
        self._on_close.append(fn)

    def limit_time(self, seconds):
        """Ends generation with finish reason length once `seconds` (0: no limit) have passed since it started."""
        self._time_limit = seconds

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
            echo = (yield from self._prompt_echo()) if self._echo else None
            if self._runs == self._n:
                for i in range(self._n):
                    if not (yield from self._choice(i, echo, last=i == self._n - 1)):
                        return
            else:
                yield from self._best_of(echo)
        except ApiError:
            raise
        except Exception as e:
            log.exception("generation failed [request %s]", self.request_id)
            raise EngineError(f"The server had an error while generating (request id {self.request_id})") from e
        finally:
            self._cleanup()

    def _best_of(self, echo):
        # NOTE(best_of): every run is buffered, then the n with the best cumulative logprob are
        # sent, renumbered; usage counts all runs (they were all generated).
        runs = []
        for i in range(self._runs):
            events = []
            for event in self._choice(i, echo, last=False):
                if isinstance(event, KeepAlive):
                    yield event
                else:
                    events.append(event)
            if not events or not isinstance(events[-1], Finished):
                return          # cancelled
            runs.append(events)
        skip = 1 if echo is not None else 0         # the echoed prompt is the same in every run
        best = sorted(range(len(runs)), key=lambda r: -_cumulative_logprob(runs[r], skip))[:self._n]
        for index, r in enumerate(best):
            for event in runs[r]:
                if isinstance(event, TextDelta):
                    yield TextDelta(event.text, event.logprobs if self._report else None, index)
                else:
                    yield Finished(event.reason, self.usage, event.stop_string, index, index == self._n - 1)

    def _prompt_echo(self):
        """The echoed prompt: its text and, with logprobs, its tokens' logprobs (the first is None)."""
        text = self._echo_text if self._echo_text is not None else self._engine.decode(self._ids)
        if self._params.logprobs is None:
            return TextDelta(text)
        scored = yield from self._await(compute.submit(self._engine.score, self._ids, self._params.logprobs))
        return TextDelta(text, [self._entry(t, lp, top) for t, (lp, top) in zip(self._ids, scored)])

    def _constraint(self):
        if self._grammar is not None:       # NOTE(thinking): a grammar governs the whole reply
            return self._grammar.start()
        if self._thinking_budget and hasattr(self._engine, "thinking_budget"):
            return self._engine.thinking_budget(self._thinking_budget, self._ids)
        return None

    def _choice(self, i, echo, last):
        """One choice's events; returns False when the run was cancelled."""
        params = self._params
        params = dataclasses.replace(
            params, seed=None if params.seed is None else (params.seed + i) % 2 ** 64,
            constraint=self._constraint())
        if echo is not None:
            yield TextDelta(echo.text, echo.logprobs if self._report else None, i)
        if params.max_new_tokens == 0:
            self._account(0, 0)
            yield Finished(FinishReason.LENGTH, self.usage, None, i, last)
            return True
        self._completion_tokens, self._lp_pending = 0, []
        self._steps = yield from self._await(compute.submit(
            self._engine.generate, self._ids, params, should_stop=self._cancel.is_set))
        while True:
            event = yield from self._await(compute.submit(next, self._steps, None))
            if event is None:
                return False
            for out in self._translate(event, i, last):
                self._quiet_since = time.monotonic()
                yield out
            if isinstance(event, Finish):
                return event.reason != FinishReason.CANCELLED
            if self._out_of_time():
                yield self._end_for_time(i, last)
                return True
            if time.monotonic() - self._quiet_since >= self._keepalive:
                # NOTE(keepalive): many quick prefill chunks (or held-back tokens) are silent too.
                self._quiet_since = time.monotonic()
                yield KeepAlive("running")

    def _out_of_time(self):
        return bool(self._time_limit) and time.monotonic() - self.started_at >= self._time_limit

    def _end_for_time(self, i, last):
        # NOTE(time-limit): text the engine still holds back (a possible stop string) is dropped.
        steps, self._steps = self._steps, None
        compute.run(steps.close)
        self.time_limited, self.finish_reason = True, FinishReason.LENGTH
        self._account(self._completion_tokens, 0)
        return Finished(FinishReason.LENGTH, self.usage, None, i, last)

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
                if fut.done():      # NOTE(race): finished just as the wait timed out
                    result = fut.result()
                    self._pending = None
                    return result
                self._quiet_since = time.monotonic()
                yield KeepAlive("running")
                continue
            self._pending = None
            return result

    def _translate(self, event, i, last):
        if isinstance(event, Token):
            self._completion_tokens += 1
            if event.logprob is not None:
                self._lp_pending.append(self._entry(event.id, event.logprob, event.top_logprobs))
            if event.text:
                self.first_token_at = self.first_token_at or time.monotonic()
                yield TextDelta(event.text, self._take_logprobs(), i)
        elif isinstance(event, Finish):
            self.finish_reason = event.reason
            if event.reason == FinishReason.CANCELLED:
                return
            if event.text or self._lp_pending or (self._report and not self._completion_tokens):
                yield TextDelta(event.text, self._take_logprobs(), i)   # logprobs: [] when nothing came
            self._account(event.completion_tokens or self._completion_tokens, event.cached_tokens)
            yield Finished(event.reason, self.usage, event.stop_string, i, last)
        elif not isinstance(event, Prefill):
            raise TypeError(f"unexpected engine event {event!r}")

    def _take_logprobs(self):
        if self._params.logprobs is None:
            return None
        out, self._lp_pending = self._lp_pending, []
        return out

    def _account(self, completion_tokens, cached_tokens):
        if self.usage is None:
            self.usage = Usage(len(self._ids), completion_tokens, cached_tokens)
        else:
            self.usage = Usage(self.usage.prompt_tokens, self.usage.completion_tokens + completion_tokens,
                               self.usage.cached_tokens)

    def _entry(self, token_id, logprob, top):
        tokenizer = self._engine.tokenizer
        text, data = _token_text(tokenizer, token_id)
        width = 0 if tokenizer.is_special(token_id) else sum(1 for b in data if b & 0xC0 != 0x80)
        return TokenLogprob(text, data, logprob, [(*_token_text(tokenizer, t), lp) for t, lp in top or ()], width)

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
            for fn in self._on_close:
                fn()


def _token_text(tokenizer, token_id):
    """(text, bytes) of one token for logprobs: special tokens by name, invalid UTF-8 as \\x escapes."""
    data = tokenizer.token_bytes(token_id)
    if tokenizer.is_special(token_id) or not data:
        return tokenizer.id_to_piece(token_id) or "", data
    return data.decode("utf-8", "backslashreplace"), data


def _cumulative_logprob(events, skip):
    deltas = [e for e in events if isinstance(e, TextDelta)][skip:]
    return sum(t.logprob for d in deltas for t in d.logprobs or () if t.logprob is not None)

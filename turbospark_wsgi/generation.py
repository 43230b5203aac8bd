"""The lazy half of the service: a Generation runs an admitted request's choices on the engine
and yields service events (KeepAlive | TextDelta | Finished), which `collect*` fold for bodies.

service.py admits a request (template, tokens, context and queue checks) and hands it here; the
HTTP side only ever sees these events.
"""
import dataclasses
import logging
import time
from dataclasses import dataclass, field

from . import compute
from .engine import ConstraintError, Finish, FinishReason, Paused, Prefill, Scores, Token
from .errors import ApiError, EngineError, InvalidRequest

log = logging.getLogger("turbospark.service")


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
class Waiting:
    """Poll mode only (the runs of a PromptBatch): the generation cannot go on before its queue
    `ticket` is granted or the compute `future` is done; `block(timeout)` waits for either."""
    ticket: object = None
    future: object = None

    def block(self, timeout):
        if self.future is None:
            self.ticket.wait(timeout)       # Overloaded when the queue's wait timeout passes
            return
        try:
            self.future.exception(timeout=timeout)
        except Exception:       # noqa: BLE001 - TimeoutError, or (gevent) the step's own error,
            pass                # which the run raises itself when it next looks


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

    def __init__(self, engine, ids, params, req, cancel, ticket, keepalive, grammar=None, poll=False, plan=None):
        self.model_id = engine.name
        self.plan = plan                          # a chat request's OutputPlan (its `parser()` reads the text)
        self.request_id = req.request_id
        self._client = req.client
        self.prompt_tokens = len(ids)
        self.usage = None
        self.finish_reason = None
        self.enqueued_at, self.started_at = time.monotonic(), None
        self.first_token_at = self.finished_at = None
        self._engine, self._ids, self._params, self._grammar = engine, ids, params, grammar
        self._thinking_budget = req.chat.thinking_budget if req.chat is not None else None
        self._n, self._runs = req.n, max(req.n, req.best_of or 1)
        self._echo_text = None if not req.echo else (req.prompt if req.prompt is not None else None)
        self._echo, self._report = req.echo, req.logprobs is not None
        self._cancel, self._ticket, self._keepalive = cancel, ticket, keepalive
        self._poll = poll                         # yield Waiting instead of blocking (PromptBatch)
        self._end_listed = req.chat is None       # completions list the end token's logprob
        self._steps = self._pending = None
        self._completion_tokens = 0
        self._unaccounted = 0                     # tokens of the choice in flight, not yet in usage
        self._on_token = []
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

    def on_token(self, fn):
        """Calls `fn()` on the consuming thread each time the engine produces a token."""
        self._on_token.append(fn)

    @property
    def produced_tokens(self):
        """Completion tokens generated so far, every choice and run counted (a cancelled one's too)."""
        return (self.usage.completion_tokens if self.usage else 0) + self._unaccounted

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
            if self._echo and echo is None:
                return          # cancelled while scoring the prompt
            if self._runs == self._n:
                for i in range(self._n):
                    if not (yield from self._choice(i, echo, last=i == self._n - 1)):
                        return
            else:
                yield from self._best_of(echo)
        except ApiError:
            raise
        except ConstraintError as e:
            # NOTE(grammar): the client's schema failed after it compiled (a parser limit reached a
            # few tokens in): its 400, logged without a traceback.
            param = getattr(self.plan, "grammar_param", None) or "response_format"
            log.warning("grammar failed [request %s]: %s", self.request_id, e)
            raise InvalidRequest(f"'{param}' cannot be enforced: {e}", param=param) from None
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
        """The echoed prompt: its text and, with logprobs, its tokens' logprobs (the first is None);
        None when cancelled. NOTE(score): scoring runs chunk by chunk among the other runs' steps,
        like a prefill, so it neither stalls them nor outlives its client by more than a chunk."""
        text = self._echo_text if self._echo_text is not None else self._engine.decode(self._ids)
        if self._params.logprobs is None:
            return TextDelta(text)
        scored = []
        self._steps = yield from self._await(compute.submit(
            self._engine.score, self._ids, self._params.logprobs, should_stop=self._cancel.is_set,
            client=self._client))
        while True:
            event = yield from self._await(compute.submit(next, self._steps, None))
            if event is None or isinstance(event, Finish) and event.reason == FinishReason.CANCELLED:
                return None
            if isinstance(event, Finish):
                break
            scored += event.entries if isinstance(event, Scores) else []
            yield from self._keep_alive()
        steps, self._steps = self._steps, None
        compute.run(steps.close)
        return TextDelta(text, [self._entry(t, lp, top) for t, (lp, top) in zip(self._ids, scored)])

    def _constraint(self):
        if self._grammar is not None:       # NOTE(thinking): a grammar governs the whole reply
            return self._grammar.start()
        if self._thinking_budget:
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
            self._engine.generate, self._ids, params, should_stop=self._cancel.is_set, client=self._client))
        while True:
            event = yield from self._await(compute.submit(next, self._steps, None))
            if event is None:
                return False
            if isinstance(event, Finish):
                # NOTE(slot): closed on the compute thread now, so the next choice (n, best_of) finds
                # its engine slot free; left to the garbage collector it would close on this thread.
                self._close_steps()
            for out in self._translate(event, i, last):
                self._quiet_since = time.monotonic()
                yield out
            if isinstance(event, Finish):
                return event.reason != FinishReason.CANCELLED
            if self._out_of_time():
                yield self._end_for_time(i, last)
                return True
            yield from self._keep_alive()

    def _keep_alive(self):
        if time.monotonic() - self._quiet_since >= self._keepalive:
            # NOTE(keepalive): many quick prefill chunks (or held-back tokens) are silent too.
            self._quiet_since = time.monotonic()
            yield KeepAlive("running")

    def _out_of_time(self):
        return bool(self._time_limit) and time.monotonic() - self.started_at >= self._time_limit

    def _end_for_time(self, i, last):
        # NOTE(time-limit): text the engine still holds back (a possible stop string) is dropped.
        self._close_steps()
        self.time_limited, self.finish_reason = True, FinishReason.LENGTH
        self._account(self._completion_tokens, 0)
        return Finished(FinishReason.LENGTH, self.usage, None, i, last)

    def _close_steps(self):
        steps, self._steps = self._steps, None
        compute.run(steps.close)

    def _wait_turn(self):
        while not self._ticket.wait(0 if self._poll else self._keepalive):
            if self._ticket.left:
                return False
            if self._poll:
                yield Waiting(ticket=self._ticket)
                continue
            self._quiet_since = time.monotonic()
            yield KeepAlive("queued")
        return not self._cancel.cancelled

    def _await(self, fut):
        self._pending = fut
        while self._poll and not fut.done():
            yield Waiting(future=fut)
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
            self._unaccounted += 1
            for fn in self._on_token:
                fn()
            if event.logprob is not None:
                self._lp_pending.append(self._entry(event.id, event.logprob, event.top_logprobs))
            if event.text:
                self.first_token_at = self.first_token_at or time.monotonic()
                yield TextDelta(event.text, self._take_logprobs(), i)
        elif isinstance(event, Finish):
            self.finish_reason = event.reason
            if event.reason == FinishReason.CANCELLED:
                return
            completion = self._completion_count(event)
            if event.text or self._lp_pending or (self._report and not completion):
                yield TextDelta(event.text, self._take_logprobs(), i)   # logprobs: [] when nothing came
            self._account(completion, event.cached_tokens)
            yield Finished(event.reason, self.usage, event.stop_string, i, last)
        elif not isinstance(event, (Prefill, Paused)):
            raise TypeError(f"unexpected engine event {event!r}")

    def _completion_count(self, finish):
        """Tokens this choice generated. NOTE(eos): with logprobs the engine also sends the end
        token that stopped the run (one Token more than it counts). Completions list and count it,
        as OpenAI's legacy API lists `<|endoftext|>`, so echo's tokens are prompt + generated
        (lm-eval slices on that); the chat routes list no end token."""
        ended = self._completion_tokens == finish.completion_tokens + 1 and self._lp_pending
        if ended and not self._end_listed:
            self._lp_pending.pop()
            return finish.completion_tokens
        return max(finish.completion_tokens, self._completion_tokens)

    def _take_logprobs(self):
        if self._params.logprobs is None:
            return None
        out, self._lp_pending = self._lp_pending, []
        return out

    def _account(self, completion_tokens, cached_tokens):
        self._unaccounted = 0
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


class PromptBatch:
    """The runs of a prompt list side by side, as one iterator of service events with `close()`.

    Each prompt's Generation (in poll mode) holds its own queue place and runs as its own sequence
    of the engine's batch; they are advanced in turn, so their steps are shared, never one
    prompt after another. Choice j of prompt p is index p * n + j (as OpenAI numbers them); the
    last Finished carries the usage of all prompts. Same attributes as a Generation.
    """

    def __init__(self, gens, n, cancel, keepalive):
        self._gens, self._n, self._cancel, self._keepalive = gens, n, cancel, keepalive
        self.model_id, self.request_id = gens[0].model_id, gens[0].request_id
        self.plan = None                  # completions only: no chat output plan
        self.prompt_tokens = sum(g.prompt_tokens for g in gens)
        self.enqueued_at = min(g.enqueued_at for g in gens)
        self._usages = {}                 # prompt index -> its run's final Usage
        self._on_close, self._cleaned = [], False
        self._gen = self._events()

    # ---- what logs and metrics read, folded over the runs

    @property
    def usage(self):
        done = list(self._usages.values())
        if not done:
            return None
        return Usage(sum(u.prompt_tokens for u in done), sum(u.completion_tokens for u in done),
                     sum(u.cached_tokens for u in done))

    @property
    def finish_reason(self):
        return next((g.finish_reason for g in self._gens if g.finish_reason is not None), None)

    @property
    def time_limited(self):
        return any(g.time_limited for g in self._gens)

    @property
    def started_at(self):
        return _earliest(g.started_at for g in self._gens)

    @property
    def first_token_at(self):
        return _earliest(g.first_token_at for g in self._gens)

    @property
    def finished_at(self):
        ends = [g.finished_at for g in self._gens]
        return None if None in ends else max(ends)

    # ---- the Generation interface

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._gen)

    def on_close(self, fn):
        self._on_close.append(fn)

    def limit_time(self, seconds):
        for gen in self._gens:
            gen.limit_time(seconds)

    def on_token(self, fn):
        for gen in self._gens:
            gen.on_token(fn)

    @property
    def produced_tokens(self):
        return sum(g.produced_tokens for g in self._gens)

    def close(self):
        try:
            self._gen.close()
        finally:
            self._cleanup()

    def _events(self):
        try:
            yield from self._interleave()
        finally:
            self._cleanup()

    def _interleave(self):
        live, quiet = dict(enumerate(self._gens)), time.monotonic()
        while live:
            waits, moved = [], False
            for p, gen in list(live.items()):
                event = next(gen, None)
                if event is None:
                    return          # cancelled: the client is gone, nothing more is sent
                if isinstance(event, Waiting):
                    waits.append(event)
                elif not isinstance(event, KeepAlive):
                    moved, quiet = True, time.monotonic()
                    if isinstance(event, Finished) and event.last:
                        del live[p]
                        self._usages[p] = event.usage
                        gen.close()         # NOTE(slot): its queue place goes to the next waiter now
                    yield self._renumber(event, p, last=not live)
            if waits and not moved:
                # NOTE(wait): nothing moved this round: wait for a step of ours (the compute thread
                # runs them in order), else for our first queue place, then look again.
                wait = next((w for w in waits if w.future is not None), waits[0])
                wait.block(max(self._keepalive - (time.monotonic() - quiet), 0.001))
            if time.monotonic() - quiet >= self._keepalive:
                quiet = time.monotonic()
                yield KeepAlive("running" if self.started_at is not None else "queued")

    def _renumber(self, event, p, last):
        index = p * self._n + event.index
        if isinstance(event, TextDelta):
            return TextDelta(event.text, event.logprobs, index)
        usage = self.usage if last else event.usage
        return Finished(event.reason, usage, event.stop_string, index, last)

    def _cleanup(self):
        if self._cleaned:
            return
        self._cleaned = True
        self._cancel.cancel("closed")
        try:
            for gen in self._gens:
                gen.close()
        finally:
            for fn in self._on_close:
                fn()


def _earliest(times):
    found = [t for t in times if t is not None]
    return min(found) if found else None

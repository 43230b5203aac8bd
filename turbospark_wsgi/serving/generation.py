"""The lazy half of the service: a Generation runs an admitted request's choices on the engine
and yields service events (KeepAlive | TextDelta | Finished), which `collect_choices` folds for bodies.

service.py admits a request (template, tokens, context and queue checks) and hands it here; the
HTTP side only ever sees these events.
"""
import logging
import time
from dataclasses import dataclass, field

from ..engine import ConstraintError, Finish, FinishReason, Paused, Prefill, Scores, Token
from ..errors import ApiError, EngineError, InvalidRequest
from .steps import EngineSteps

log = logging.getLogger("turbospark.service")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    proposed_tokens: int = 0                # speculative decoding: tokens proposed, then checked
    accepted_tokens: int = 0                # ... and kept
    reasoning_tokens: int = 0               # of completion_tokens, those inside think tags

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
    reason: str                             # FinishReason.STOP | LENGTH, or "content_filter" (guarded.py)
    usage: Usage                            # of the run so far: the last choice's is the total
    stop_string: str | None = None
    index: int = 0
    last: bool = True                       # the last choice's Finished ends the run
    guardrails: tuple = ()                  # (rule id, action) of the output rules that acted on this choice


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


class Tally:
    """Usage of one generation's runs: the prompt once, the completion tokens of every run (best_of's
    unreturned runs too); `pending` counts the Tokens of the run in flight (runs go one after
    another) until its end is accounted."""

    def __init__(self, prompt_tokens):
        self.prompt_tokens, self.pending = prompt_tokens, 0
        self.usage = None           # a new Usage per account, so a sent Finished keeps its own

    def count(self):
        self.pending += 1

    def account(self, completion_tokens, cached_tokens, proposed=0, accepted=0, reasoning=0):
        self.pending = 0
        if self.usage is None:
            self.usage = Usage(self.prompt_tokens, completion_tokens, cached_tokens, proposed, accepted, reasoning)
        else:
            u = self.usage
            self.usage = Usage(self.prompt_tokens, u.completion_tokens + completion_tokens, u.cached_tokens,
                               u.proposed_tokens + proposed, u.accepted_tokens + accepted,
                               u.reasoning_tokens + reasoning)

    @property
    def produced(self):
        return (self.usage.completion_tokens if self.usage else 0) + self.pending


class RunTranslator:
    """One engine run (one choice) -> service events: Tokens become TextDeltas (with their logprob
    entries when `want_logprobs`), the Finish a last TextDelta and a Finished; Prefill and Paused
    say nothing. Counts the run's tokens into `tally`, and with `thought` (a counting ThinkingBudget)
    those inside think tags."""

    def __init__(self, tokenizer, tally, index, last, want_logprobs, report, end_listed, thought=None):
        self._tokenizer, self._tally, self._index, self._last = tokenizer, tally, index, last
        self._want, self._report, self._end_listed = want_logprobs, report, end_listed
        self._thought = thought
        self._held = []                 # TokenLogprobs whose text is still held back
        self.finish_reason = None

    def translate(self, event):
        """The service events for one engine event (a list, often empty)."""
        if isinstance(event, Token):
            self._tally.count()
            if self._thought is not None:
                self._thought.advance(event.id)
            if event.logprob is not None:
                self._held.append(logprob_entry(self._tokenizer, event.id, event.logprob, event.top_logprobs))
            return [TextDelta(event.text, self._take(), self._index)] if event.text else []
        if isinstance(event, Finish):
            return self._finish(event)
        if not isinstance(event, (Prefill, Paused)):
            raise TypeError(f"unexpected engine event {event!r}")
        return []

    def cut(self, reason=FinishReason.LENGTH):
        """The Finished of a run ended early (the time limit): text still held back is dropped."""
        self.finish_reason = reason
        self._tally.account(self._tally.pending, 0)
        return Finished(reason, self._tally.usage, None, self._index, self._last)

    def _finish(self, event):
        self.finish_reason = event.reason
        if event.reason == FinishReason.CANCELLED:
            return []
        completion = self._completion_count(event)
        out = []
        if event.text or self._held or (self._report and not completion):
            out.append(TextDelta(event.text, self._take(), self._index))    # logprobs: [] when nothing came
        self._tally.account(completion, event.cached_tokens, event.proposed_tokens, event.accepted_tokens,
                            min(self._thought.thought, completion) if self._thought is not None else 0)
        return out + [Finished(event.reason, self._tally.usage, event.stop_string, self._index, self._last)]

    def _completion_count(self, finish):
        """Tokens this choice generated. NOTE(eos): with logprobs the engine also sends the end
        token that stopped the run (one Token more than it counts). Completions list and count it,
        as OpenAI's legacy API lists `<|endoftext|>`, so echo's tokens are prompt + generated
        (lm-eval slices on that); the chat routes list no end token."""
        seen = self._tally.pending      # this run's Tokens
        ended = seen == finish.completion_tokens + 1 and self._held
        if ended and not self._end_listed:
            self._held.pop()
            return finish.completion_tokens
        return max(finish.completion_tokens, seen)

    def _take(self):
        if not self._want:
            return None
        out, self._held = self._held, []
        return out


class Choices:
    """The choices policy: n runs, or best_of runs of which the n most likely are sent (renumbered);
    with echo, each choice starts with the prompt's TextDelta."""

    def __init__(self, n, best_of, report):
        self.n, self.runs, self._report = n, max(n, best_of or 1), report

    def events(self, run, echo, tally):
        """Events of every choice. `run(i, last)` yields one run's events and returns False when it
        was cancelled; `echo` is the prompt's TextDelta or None; `tally` gives best_of's total usage."""
        if self.runs == self.n:
            for i in range(self.n):
                yield from self._echo(echo, i)
                if not (yield from run(i, i == self.n - 1)):
                    return
            return
        yield from self._best_of(run, echo, tally)

    def _echo(self, echo, i):
        if echo is not None:
            yield TextDelta(echo.text, echo.logprobs if self._report else None, i)

    def _best_of(self, run, echo, tally):
        # NOTE(best_of): every run is buffered, then the n with the best cumulative logprob are
        # sent, renumbered; usage counts all runs (they were all generated).
        runs = []
        for i in range(self.runs):
            events = []
            for event in run(i, False):
                if isinstance(event, KeepAlive):
                    yield event
                else:
                    events.append(event)
            if not events or not isinstance(events[-1], Finished):
                return          # cancelled
            runs.append(events)
        best = sorted(range(len(runs)), key=lambda r: -_cumulative_logprob(runs[r]))[:self.n]
        for index, r in enumerate(best):
            yield from self._echo(echo, index)
            for event in runs[r]:
                if isinstance(event, TextDelta):
                    yield TextDelta(event.text, event.logprobs if self._report else None, index)
                else:
                    yield Finished(event.reason, tally.usage, event.stop_string, index, index == self.n - 1)


class Pacer:
    """How a Generation waits: for its queue turn, then for each compute step, with a KeepAlive
    whenever the consumer has heard nothing for `keepalive` seconds; in poll mode (the runs of a
    PromptBatch) it yields Waiting instead of blocking."""

    def __init__(self, ticket, keepalive, poll=False):
        self._ticket, self._keepalive, self._poll = ticket, keepalive, poll
        self.pending = None                     # the compute future awaited now
        self._quiet_since = time.monotonic()    # last time the consumer got an event

    def heard(self):
        self._quiet_since = time.monotonic()

    def wait_turn(self, cancel):
        """Waits for the queue turn; returns False when the waiter left or was cancelled."""
        while not self._ticket.wait(0 if self._poll else self._keepalive):
            if self._ticket.left:
                return False
            if self._poll:
                yield Waiting(ticket=self._ticket)
                continue
            self.heard()
            yield KeepAlive("queued")
        return not cancel.cancelled

    def result(self, fut):
        """The result of a compute future, waited for with keep-alives."""
        self.pending = fut
        while self._poll and not fut.done():
            yield Waiting(future=fut)
        while True:
            try:
                result = fut.result(timeout=self._keepalive)
            except TimeoutError:
                if fut.done():      # NOTE(race): finished just as the wait timed out
                    result = fut.result()
                    self.pending = None
                    return result
                self.heard()
                yield KeepAlive("running")
                continue
            self.pending = None
            return result

    def keep_alive(self):
        if time.monotonic() - self._quiet_since >= self._keepalive:
            # NOTE(keepalive): many quick prefill chunks (or held-back tokens) are silent too.
            self.heard()
            yield KeepAlive("running")


class Generation:
    """The lazy half of `Service.run`: an iterator of service events with an idempotent `close()`.
    This class drives the runs on the compute thread, ends them at the time limit and cleans up
    once; a `Pacer` does the waiting (queue turn, compute steps, keep-alives), `Choices` decides the
    runs (n, best_of, echo) and a `RunTranslator` turns each run's engine events into service
    events. Choices run one after another inside the one queue slot; the engine's prefix
    cache makes the repeated prompt nearly free.

    Attributes for logs and metrics: model_id, usage, finish_reason, enqueued_at, started_at,
    first_token_at, finished_at (time.monotonic values or None).
    """

    def __init__(self, engine, ids, params, req, cancel, ticket, keepalive, grammar=None, poll=False, plan=None,
                 time_limit=0.0, on_close=()):
        self.model_id, self.request_id = engine.name, req.request_id
        self._req = req                           # what it asks: echo, logprobs, its chat part, its client
        self.plan = plan                          # a chat request's OutputPlan: how the HTTP side reads the text
        self.prompt_tokens = len(ids)
        self.finish_reason = None
        self.enqueued_at, self.started_at = time.monotonic(), None
        self.first_token_at = self.finished_at = None
        self.time_limited = False                 # ended by the wall-clock limit (finish reason length)
        self._engine, self._ids, self._params, self._grammar = engine, ids, params, grammar
        self._choices = Choices(req.n, req.best_of, req.logprobs is not None)
        self._cancel, self._ticket, self._time_limit = cancel, ticket, time_limit
        self._pace = Pacer(ticket, keepalive, poll)
        self._tally = Tally(len(ids))
        self._steps = EngineSteps(self._pace, req.background)
        self._on_token, self._on_close, self._cleaned = [], list(on_close), False
        self._gen = self._events()

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._gen)

    @property
    def usage(self):
        return self._tally.usage

    @property
    def produced_tokens(self):
        """Completion tokens generated so far, every choice and run counted (a cancelled one's too)."""
        return self._tally.produced

    def on_close(self, fn):
        """Calls `fn()` once when the generation is closed (after its queue slot is released)."""
        self._on_close.append(fn)

    def on_token(self, fn):
        """Calls `fn()` on the consuming thread each time the engine produces a token."""
        self._on_token.append(fn)

    def close(self):
        try:
            self._gen.close()       # runs the generator's `finally` if it had started
        finally:
            self._cleanup()         # ... and this covers a generator that never started

    def _events(self):
        try:
            if not (yield from self._pace.wait_turn(self._cancel)):
                return
            self.started_at = time.monotonic()
            echo = (yield from self._prompt_echo()) if self._req.echo else None
            if self._req.echo and echo is None:
                return          # cancelled while scoring the prompt
            yield from self._choices.events(self._run, echo, self._tally)
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

    def _prompt_echo(self):
        """The echoed prompt: its text and, with logprobs, its tokens' logprobs (the first is None);
        None when cancelled. NOTE(score): scoring runs chunk by chunk among the other runs' steps,
        like a prefill, so it neither stalls them nor outlives its client by more than a chunk."""
        text = self._req.prompt if self._req.prompt is not None else self._engine.decode(self._ids)
        if self._params.logprobs is None:
            return TextDelta(text)
        scored = []
        yield from self._steps.start(
            self._engine.score, self._ids, self._params.logprobs, should_stop=self._cancel.is_set,
            client=self._req.client, cache_salt=self._req.cache_salt, background=self._req.background)
        while True:
            event = yield from self._steps.next()
            if event is None or isinstance(event, Finish) and event.reason == FinishReason.CANCELLED:
                return None
            if isinstance(event, Finish):
                break
            scored += event.entries if isinstance(event, Scores) else []
            yield from self._pace.keep_alive()
        self._steps.close()
        tokenizer = self._engine.tokenizer
        return TextDelta(text, [logprob_entry(tokenizer, t, lp, top) for t, (lp, top) in zip(self._ids, scored)])

    def _constraint(self):
        grammar = self._grammar.start() if self._grammar is not None else None
        budget = self._req.chat.thinking_budget if self._req.chat is not None else None
        if budget is None:
            return grammar      # NOTE(thinking): without a budget a grammar governs the whole reply
        # NOTE(thinking): with one, the reply may reason first (within the budget), then the grammar
        return self._engine.thinking_budget(budget, self._ids, then=grammar)

    def _run(self, i, last):
        """One choice's events, paced; returns False when the run was cancelled. The request's
        params serve every choice; the run's constraint and its index (its seed) go beside them."""
        params, constraint = self._params, self._constraint()
        # NOTE(reasoning): counted on this thread from the tokens' ids, whatever constrains the run
        thought = self._engine.thinking_budget(None, self._ids) if self._req.chat is not None else None
        run = RunTranslator(self._engine.tokenizer, self._tally, i, last, params.logprobs is not None,
                            self._req.logprobs is not None, self._req.chat is None, thought)
        if params.max_new_tokens == 0:      # echo only: the prompt was scored, nothing is generated
            yield run.cut()
            return True
        yield from self._steps.start(
            self._engine.generate, self._ids, params, should_stop=self._cancel.is_set, client=self._req.client,
            cache_salt=self._req.cache_salt, background=self._req.background, constraint=constraint, choice=i)
        while True:
            event = yield from self._steps.next()
            if event is None:
                return False
            if isinstance(event, Finish):
                # NOTE(slot): closed on the compute thread now, so the next choice (n, best_of) finds
                # its engine slot free; left to the garbage collector it would close on this thread.
                self._steps.close()
            yield from self._send(run, event)
            if isinstance(event, Finish):
                return event.reason != FinishReason.CANCELLED
            if self._out_of_time():
                # NOTE(time-limit): text the engine still holds back (a possible stop string) is dropped.
                self._steps.close()
                self.time_limited = True
                yield run.cut()
                self.finish_reason = run.finish_reason
                return True
            yield from self._pace.keep_alive()

    def _send(self, run, event):
        outs = run.translate(event)
        if isinstance(event, Token):
            for fn in self._on_token:
                fn()
            if outs:
                self.first_token_at = self.first_token_at or time.monotonic()
        self.finish_reason = run.finish_reason or self.finish_reason
        for out in outs:
            self._pace.heard()
            yield out

    def _out_of_time(self):
        return bool(self._time_limit) and time.monotonic() - self.started_at >= self._time_limit

    def _cleanup(self):
        if self._cleaned:
            return
        self._cleaned = True
        self._cancel.cancel("closed")       # a step still running stops at its next check
        try:
            if self._pace.pending is not None:
                self._pace.pending.exception()  # wait for the step in flight; its result no longer matters
            self._steps.close()
        except Exception:
            log.exception("closing the engine generator failed [request %s]", self.request_id)
        finally:
            self._ticket.release()
            self.finished_at = time.monotonic()
            for fn in self._on_close:
                fn()


def logprob_entry(tokenizer, token_id, logprob, top):
    """A TokenLogprob for a token and its top alternatives [(id, logprob)], as the tokenizer shows them."""
    text, data, width = tokenizer.token_text(token_id)
    return TokenLogprob(text, data, logprob, [(*tokenizer.token_text(t)[:2], lp) for t, lp in top or ()], width)


def _cumulative_logprob(events):
    return sum(t.logprob for e in events if isinstance(e, TextDelta) for t in e.logprobs or () if t.logprob is not None)


class PromptBatch:
    """The runs of a prompt list side by side, as one iterator of service events with `close()`.

    Each prompt's Generation (in poll mode) holds its own queue place and runs as its own sequence
    of the engine's batch; they are advanced in turn, so their steps are shared, never one
    prompt after another. Choice j of prompt p is index p * n + j (as OpenAI numbers them); the
    last Finished carries the usage of all prompts. Same attributes as a Generation.
    """

    def __init__(self, gens, n, cancel, keepalive, on_close=()):
        self._gens, self._n, self._cancel, self._keepalive = gens, n, cancel, keepalive
        self.model_id, self.request_id = gens[0].model_id, gens[0].request_id
        self.plan = None                  # completions only: no chat output plan
        self.prompt_tokens = sum(g.prompt_tokens for g in gens)
        self.enqueued_at = min(g.enqueued_at for g in gens)
        self._usages = {}                 # prompt index -> its run's final Usage
        self._on_close, self._cleaned = list(on_close), False
        self._gen = self._events()

    # ---- what logs and metrics read, folded over the runs

    @property
    def usage(self):
        done = list(self._usages.values())
        if not done:
            return None
        return Usage(*(sum(getattr(u, f) for u in done) for f in Usage.__slots__))

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

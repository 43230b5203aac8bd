"""Sequences and the scheduler: chunked prefill, then decode steps batched across sequences; each
sequence runs in a prefix-cache slot (prefix_cache.Slot), and only the scheduler changes a slot.

Every call runs on one thread (the compute thread). `Scheduler.poll(seq)` returns the events that
sequence has waiting; when it has none, it runs one step for the sequences in the batch: one
prefill chunk for the oldest one still prefilling (of the client decoding the fewest rows), and one
batched decode step for all the others.
So requests that arrive while others decode join the running batch at the next step. The batch is
up to `max_batch` sequences, shared fairly between clients; the others wait paused (`_batch`).
"""
import numpy as np

from .events import Finish, FinishReason, Paused, Prefill, Scores, Token
from .model import SMALL_WINDOW
from .prefix_cache import Slot
from .sampling import Sampler, SamplingParams, log_softmax, top_n
from .stops import StopMatcher

_PREFILL, _DECODE, _DONE = "prefill", "decode", "done"


class Sequence:
    """One run: prompt, sampler, detokenizer, stop strings and a slot. Events wait in `events`."""

    def __init__(self, slot, tokenizer, prompt, params, should_stop, chunk, max_context):
        self.slot, self.prompt, self.params = slot, prompt, params
        self.should_stop = should_stop or (lambda: False)
        self.chunk, self.max_context = chunk, max_context
        self.cached = slot.reusable(prompt)
        slot.keep(self.cached)
        self.sampler = Sampler(params, prompt)
        self.decoder = tokenizer.incremental_decoder()
        self.stops = StopMatcher(params.stop)
        self.end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.stop_ids))
        self.state, self.pending, self.completion = _PREFILL, None, 0
        self.events = [Prefill(self.cached, len(prompt))]
        self.error = None
        self.client = ""        # whose run: the batch is shared fairly between clients

    @property
    def finished(self):
        return self.state == _DONE

    def prefill_chunk(self, model):
        piece, row_exact = self.slot.pieces(self.prompt, self.chunk)
        last = len(self.slot.ids) + len(piece) == len(self.prompt)
        logits = self.slot.prefill(model, piece, "last" if last else "none", row_exact)
        self.events.append(Prefill(len(self.slot.ids), len(self.prompt)))
        if last:
            self.state = _DECODE
            self.accept(logits)

    def accept(self, logits):
        """Samples from this step's logits: a Token, or the end of the run."""
        if not np.isfinite(logits.max()):       # NaN or +inf anywhere (max propagates NaN)
            raise FloatingPointError("the model's logits for this sequence are not finite")
        token, logprob, top = self.sampler(logits)
        if token in self.end_ids:
            if self.params.logprobs is not None:
                # NOTE(eos): with logprobs the end token is listed too (no text): every sampled token is
                self.events.append(Token(token, "", logprob, top))
            return self._end(FinishReason.STOP)
        self.completion += 1
        text, matched = self.stops.feed(self.decoder.push(token))
        self.events.append(Token(token, text, logprob, top))
        if matched is not None:
            return self._finish(FinishReason.STOP, stop_string=matched)
        if self.completion >= self.params.max_new_tokens or self.slot.cache.length >= self.max_context:
            return self._end(FinishReason.LENGTH)
        self.pending = token

    def cancel(self):
        self._finish(FinishReason.CANCELLED)

    def fail(self, error):
        """Ends this sequence with `error` (raised to its reader by Scheduler.poll). Its cache may
        hold a half-run step: the caller forgets it."""
        self.error, self.state, self.pending = error, _DONE, None

    def _end(self, reason):
        # held-back text goes out at the end, unless the flushed bytes complete a stop string
        text, matched = self.stops.feed(self.decoder.flush())
        if matched is None:
            return self._finish(reason, text + self.stops.flush())
        return self._finish(FinishReason.STOP, text, matched)

    def _finish(self, reason, text="", stop_string=None):
        self.state, self.pending = _DONE, None
        self.events.append(Finish(reason, text, stop_string, len(self.prompt), self.completion, self.cached))


class Scoring(Sequence):
    """A prompt scored, not continued: each chunk's rows give the log-probability of the next
    prompt token (with the `top` best), sent as a Scores event; it runs its chunks among the
    other sequences' steps, like any prefill, and ends after the last one."""

    def __init__(self, slot, tokenizer, prompt, top, should_stop, chunk, max_context):
        super().__init__(slot, tokenizer, prompt, SamplingParams(max_new_tokens=0), should_stop, chunk, max_context)
        slot.forget()               # NOTE(score): every position's logits are needed: nothing is reused
        self.cached, self.top = 0, top
        self.events = [Prefill(0, len(prompt)), Scores([(None, [])])]

    def prefill_chunk(self, model):
        start = len(self.slot.ids)
        piece, row_exact = self.slot.pieces(self.prompt, self.chunk)
        lp = log_softmax(self.slot.prefill(model, piece, "all", row_exact))             # [T, V]
        nxt = self.prompt[start + 1:start + len(piece) + 1]
        self.events += [Prefill(len(self.slot.ids), len(self.prompt)),
                        Scores([(float(row[t]), top_n(row, self.top)) for row, t in zip(lp, nxt)])]
        if len(self.slot.ids) == len(self.prompt):
            self._finish(FinishReason.LENGTH)


class Scheduler:
    """Up to `max_batch` sequences run each step and up to `max_paused` more wait beside them,
    each in its own slot; slots keep their K/V afterwards so a new prompt goes to the free slot
    holding its longest reusable prefix."""

    def __init__(self, model, tokenizer, *, max_batch, max_context, chunk, max_paused=0):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_context, self.chunk = max_batch, max_context, chunk
        self.max_slots = max_batch + max_paused
        self.slots, self.active = [], []
        self.steps = 0              # steps run so far
        self._clock = 0             # acquisition counter, for least-recently-used slot reuse

    def add(self, prompt, params, should_stop=None, client="", salt=""):
        return self._start(Sequence, prompt, params, should_stop, client, salt)

    def add_scoring(self, prompt, top, should_stop=None, client="", salt=""):
        return self._start(Scoring, prompt, top, should_stop, client, salt)

    def _start(self, kind, prompt, options, should_stop, client, salt):
        slot = self.acquire(prompt, salt)
        seq = kind(slot, self.tokenizer, prompt, options, should_stop, self.chunk, self.max_context)
        seq.client = client
        self.active.append(seq)
        return seq

    def acquire(self, prompt, salt=""):
        """A free slot: the one holding the longest prefix of `prompt` reusable under `salt`; without
        any, a new slot while fewer than max_batch exist, else the least recently used (so a warm
        prefix survives unrelated requests as long as it can); with none free, a new one up to
        max_batch + max_paused (see `release`).

        NOTE(related): a slot counts as related only when the prompt reuses at least as many of its
        ids as it would throw away. Chats all start with the same few template tokens; without
        this, a new conversation would take over the slot of another one (reusing those few
        tokens, dropping the rest) and that conversation's next turn would find nothing."""
        free = [s for s in self.slots if not s.busy]

        def related(slot):
            n = slot.reusable(prompt, salt)
            return n if n >= len(slot.ids) - n else 0

        best = max(free, key=lambda s: (related(s), -s.used), default=None)
        if best is None or related(best) == 0:
            if len(self.slots) < (self.max_batch if free else self.max_slots):
                every_row = self.model.decode_exact
                granule = 1 if every_row or (self.chunk > SMALL_WINDOW and self.model.rows_exact) else self.chunk
                best = Slot(self.model.new_cache(self.max_context), granule, every_row)
                self.slots.append(best)
            elif best is not None:
                best = min(free, key=lambda s: s.used)
        if best is None:
            raise RuntimeError(f"all {self.max_slots} sequence slots are busy")
        self._clock += 1
        best.busy, best.used = True, self._clock
        best.claim(salt)
        return best

    def poll(self, seq):
        """The events `seq` has waiting, running one step first if it has none; after a step that
        left `seq` out (paused, or another prompt's chunk ran), one Paused."""
        if not seq.events and not seq.finished:
            self.step()
            if not seq.events and not seq.finished:
                seq.events.append(Paused())
        if seq.error is not None:
            raise seq.error
        out, seq.events = seq.events, []
        return out

    def step(self):
        self.steps += 1
        for seq in self.active:
            if seq.should_stop():
                seq.cancel()
        batch = self._batch()
        decoding = [s for s in batch if s.pending is not None]
        prefilling = [s for s in batch if s.state == _PREFILL]
        try:
            if prefilling:
                first = self._next_prefill(prefilling, decoding)
                _isolated(first, first.prefill_chunk, self.model)
            if decoding:
                self._decode(decoding)
        except Exception as e:
            self._fail(e)
            raise
        finally:
            self.active = [s for s in self.active if not s.finished]

    def _batch(self):
        """The sequences that run this step: all, while they fit in `max_batch`; else each client's
        fair share of the rows, dealt round-robin (one row per client per round, clients in the
        order of their oldest sequence), each client's sequences in the order they came.

        NOTE(fair-share): the others are paused: they keep their slot, its K/V and their pending
        token, and go on when rows free up, so their output is what it would have been (batching
        never changes a row, see model.decode_batch). A client with one sequence among another
        client's many runs at the next step instead of after one of theirs ends; the queue gives
        it the slot (LockQueue's spare places)."""
        live = [s for s in self.active if not s.finished]
        if len(live) <= self.max_batch:
            return live
        lanes = {}
        for seq in live:
            lanes.setdefault(seq.client, []).append(seq)
        chosen, depth = set(), 0
        while len(chosen) < self.max_batch:
            for lane in lanes.values():
                if depth < len(lane) and len(chosen) < self.max_batch:
                    chosen.add(id(lane[depth]))
            depth += 1
        return [s for s in live if id(s) in chosen]

    @staticmethod
    def _next_prefill(prefilling, decoding):
        """The sequence whose prompt chunk runs this step: the oldest of the client decoding the
        fewest rows. NOTE(fair-share): so a newcomer's short prompt does not wait behind every
        chunk of a long prompt of a client that already runs; one client alone goes in order."""
        rows = {}
        for seq in decoding:
            rows[seq.client] = rows.get(seq.client, 0) + 1
        return min(prefilling, key=lambda s: rows.get(s.client, 0))

    def release(self, seq):
        """Ends `seq` (if still running) and frees its slot; idempotent. NOTE(memory): slots beyond
        max_batch (taken while clients shared the batch) are dropped once free, least recently used
        first, so a server that is not shared keeps max_batch caches, as without pausing."""
        if not seq.finished:
            seq.cancel()
        if seq in self.active:
            self.active.remove(seq)
        seq.slot.busy = False
        free = sorted((s for s in self.slots if not s.busy), key=lambda s: s.used)
        for slot in free[:max(0, len(self.slots) - self.max_batch)]:
            self.slots.remove(slot)

    def _decode(self, seqs):
        tokens = [s.pending for s in seqs]
        logits = self.model.decode_batch(tokens, [s.slot.cache for s in seqs])   # [B, vocab]
        for seq, token, row in zip(seqs, tokens, logits):
            seq.slot.decoded(token)
            _isolated(seq, seq.accept, row)

    def _fail(self, error):
        # NOTE(fault): only the shared batched product gets here; it leaves every cache it
        # touched unknown: forget them all and fail every running sequence with the same error.
        for seq in self.active:
            seq.fail(error)
        for slot in self.slots:     # the failed sequences' slots among them
            slot.forget()


def _isolated(seq, work, *args):
    """Runs one sequence's own part of a step (its prefill chunk, or sampling, constraint,
    detokenizing and stop strings for its row). NOTE(fault): a failure there is that
    sequence's alone: it ends with the error and its neighbours in the batch go on."""
    try:
        work(*args)
    except Exception as e:     # noqa: BLE001 - whatever it was, it ends this sequence only
        seq.fail(e)
        seq.slot.forget()

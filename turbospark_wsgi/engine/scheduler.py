"""Sequences and the scheduler: chunked prefill, then decode steps batched across sequences; each
sequence runs in a prefix-cache slot (prefix_cache.Slot), and only the scheduler changes a slot.

Every call runs on one thread (the compute thread). `Scheduler.poll(seq)` returns the events that
sequence has waiting; when it has none, it runs one step for the sequences in the batch: one
prefill chunk for the oldest one still prefilling (of the client decoding the fewest rows), and one
batched decode step for all the others.
So requests that arrive while others decode join the running batch at the next step (the loop
from a request's thread to this step: serving/steps.py). The batch is
up to `max_batch` sequences, shared fairly between clients; the others wait paused (`_batch`).
A decoding sequence may run proposed tokens as further rows of its step (speculative.py); the
tokens a step keeps beyond the first reach its reader one per poll, as separate steps would.
"""
import numpy as np

from .events import Finish, FinishReason, Paused, Prefill, Scores, Token
from .model import SMALL_WINDOW
from .prefix_cache import Slot, copy_shared_prefix
from .sampling import Sampler, SamplingParams, log_softmax, top_n
from .speculative import Acceptance, PromptLookup, SpeculativeOptions, plan_rows
from .stops import StopMatcher

_PREFILL, _DECODE, _DONE = "prefill", "decode", "done"
# PERF(speculative): proposals fill a step up to this many rows (never past it; a batch of more
# sequences runs none). Float32-activation products switch kernels past kernels_cpu.GEMV_MAX_B rows.
ROW_LIMIT = 64


class Sequence:
    """One run: prompt, sampler, detokenizer, stop strings and a slot. Events wait in `events`.
    `constraint` and `choice` are this run's own (see sampling.Sampler); `params` the request's."""

    def __init__(self, slot, tokenizer, prompt, params, should_stop, chunk, max_context, constraint=None, choice=0):
        self.slot, self.prompt, self.params = slot, prompt, params
        self.should_stop = should_stop or (lambda: False)
        self.chunk, self.max_context = chunk, max_context
        self.cached = slot.reusable(prompt)
        slot.keep(self.cached)
        self.sampler = Sampler(params, prompt, constraint, choice)
        self.decoder = tokenizer.incremental_decoder()
        self.stops = StopMatcher(params.stop)
        self.end_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.stop_ids))
        self.state, self.pending, self.completion = _PREFILL, None, 0
        self.events = [Prefill(self.cached, len(prompt))]
        self.error = None
        self.client = ""        # whose run: the batch is shared fairly between clients
        self.background = False     # a batch line: runs only in the rows and steps live runs leave
        # speculative decoding: events of kept proposals not yet polled, as [(events, completion
        # before them)]; the prompt-lookup index (built at the first proposal); recent acceptance
        self.ahead, self.lookup, self.acceptance = [], None, Acceptance()
        self.draft = None           # draft.Draft's (KV cache, ids) for this sequence
        self.proposed = self.accepted = 0
        self.adapter = None         # the lora.LoraAdapter it runs, or None (the base model)

    @property
    def finished(self):
        return self.state == _DONE

    def prefill_chunk(self, model):
        piece, row_exact = self.slot.pieces(self.prompt, self.chunk)
        last = len(self.slot.ids) + len(piece) == len(self.prompt)
        logits = self.slot.prefill(model, piece, "last" if last else "none", row_exact, self.adapter)
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
        if self.completion >= self.params.max_new_tokens or len(self.slot.ids) >= self.max_context:
            return self._end(FinishReason.LENGTH)
        self.pending = token

    def room(self, limit):
        """How many tokens may be proposed: at most `limit`, none past the token budget or the context."""
        return max(0, min(limit, self.params.max_new_tokens - self.completion - 1,
                          self.max_context - 1 - len(self.slot.ids)))

    def proposal(self, options, limit):
        """Up to `limit` tokens prompt lookup proposes to follow the pending one (see `trim`)."""
        room = self.room(limit)
        if not room:
            return []
        if self.lookup is None:
            self.lookup = PromptLookup(self.slot.ids, options.min_ngram, options.max_ngram)
        for token in self.slot.ids[len(self.lookup.tokens):]:     # the tokens decoded since
            self.lookup.append(token)
        self.lookup.append(self.pending)
        return self.trim(self.lookup.propose(room))

    def trim(self, tokens):
        """A proposal cut before its first end token and where the grammar stops allowing it."""
        end = next((i for i, t in enumerate(tokens) if t in self.end_ids), len(tokens))
        valid = getattr(self.sampler.constraint, "valid_prefix", None)
        return tokens[:end] if valid is None or not end else tokens[:valid(tokens[:end])]

    def verify(self, rows, logits):
        """Samples a step's rows in order: row 0 ran the pending token, row j the j-th proposal,
        which counts only if it is the token row j - 1 drew (see speculative: exact). The first
        row's events go out now, each further kept row's on a later poll. Returns the kept proposals."""
        before, groups = self.events, []
        self.proposed += len(rows) - 1
        for j, (token, row) in enumerate(zip(rows, logits)):
            if j and self.pending != token:
                break
            self.accepted += j > 0
            self.events, completion = [], self.completion
            self.slot.decoded(token)
            self.accept(row)
            groups.append((self.events, completion))
        self.slot.cache.truncate(len(self.slot.ids))     # the K/V of proposals not kept
        self.events, self.ahead = before + groups[0][0], groups[1:]
        return len(groups) - 1

    def cancel(self):
        if self.ahead:      # tokens computed but not yet sent are dropped, as if never computed
            self.ahead, self.completion, self.pending = [], self.ahead[0][1], None
        self._finish(FinishReason.CANCELLED)

    def fail(self, error):
        """Ends this sequence with `error` (raised to its reader by Scheduler.poll). Its cache may
        hold a half-run step: the caller forgets it."""
        self.error, self.state, self.pending, self.ahead = error, _DONE, None, []

    def _end(self, reason):
        # held-back text goes out at the end, unless the flushed bytes complete a stop string
        text, matched = self.stops.feed(self.decoder.flush())
        if matched is None:
            return self._finish(reason, text + self.stops.flush())
        return self._finish(FinishReason.STOP, text, matched)

    def _finish(self, reason, text="", stop_string=None):
        self.state, self.pending = _DONE, None
        self.events.append(Finish(reason, text, stop_string, len(self.prompt), self.completion, self.cached,
                                  self.proposed, self.accepted))


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
        lp = log_softmax(self.slot.prefill(model, piece, "all", row_exact, self.adapter))   # [T, V]
        nxt = self.prompt[start + 1:start + len(piece) + 1]
        self.events += [Prefill(len(self.slot.ids), len(self.prompt)),
                        Scores([(float(row[t]), top_n(row, self.top)) for row, t in zip(lp, nxt)])]
        if len(self.slot.ids) == len(self.prompt):
            self._finish(FinishReason.LENGTH)


class Scheduler:
    """Up to `max_batch` sequences run each step and up to `max_paused` more wait beside them,
    each in its own slot; slots keep their K/V afterwards so a new prompt goes to the free slot
    holding its longest reusable prefix."""

    def __init__(self, model, tokenizer, *, max_batch, max_context, chunk, max_paused=0, speculative=None,
                 draft=None):
        self.model, self.tokenizer = model, tokenizer
        self.speculative = speculative or SpeculativeOptions()
        self.draft = draft          # a draft.Draft proposes instead of prompt lookup
        self.max_batch, self.max_context, self.chunk = max_batch, max_context, chunk
        self.max_slots = max_batch + max_paused
        self.slots, self.active = [], []
        self.steps = 0              # steps run so far
        self._clock = 0             # acquisition counter, for least-recently-used slot reuse

    def add(self, prompt, params, should_stop=None, client="", salt="", background=False, adapter=None,
            constraint=None, choice=0):
        return self._start(Sequence, prompt, params, should_stop, client, salt, background, adapter,
                           constraint=constraint, choice=choice)

    def add_scoring(self, prompt, top, should_stop=None, client="", salt="", background=False, adapter=None):
        return self._start(Scoring, prompt, top, should_stop, client, salt, background, adapter)

    def _start(self, kind, prompt, options, should_stop, client, salt, background=False, adapter=None, **run):
        if adapter is not None:
            # NOTE(lora-salt): K/V computed with one adapter are never another's (or the base's):
            # the adapter's load key joins the salt, so slots are shared only within one adapter
            salt = f"{salt}\x00lora:{adapter.key}"
        slot = self.acquire(prompt, salt, background)
        seq = kind(slot, self.tokenizer, prompt, options, should_stop, self.chunk, self.max_context, **run)
        seq.client, seq.background, seq.adapter = client, background, adapter
        self.active.append(seq)
        return seq

    def acquire(self, prompt, salt="", background=False):
        """A free slot: the one holding the longest prefix of `prompt` reusable under `salt`; without
        any, a new slot while fewer than max_batch exist, else the least recently used (so a warm
        prefix survives unrelated requests as long as it can); with none free, a new one up to
        max_batch + max_paused (see `release`).

        NOTE(related): a slot counts as related only when the prompt reuses at least as many of its
        ids as it would throw away. Chats all start with the same few template tokens; without
        this, a new conversation would take over the slot of another one (reusing those few
        tokens, dropping the rest) and that conversation's next turn would find nothing.
        NOTE(background): a slot a batch line held last goes before any other, so batch lines
        reuse each other's slots and leave live conversations' prefixes where they were."""
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
                best = min(free, key=lambda s: (not s.background, s.used))
        if best is None:
            raise RuntimeError(f"all {self.max_slots} sequence slots are busy")
        self._clock += 1
        best.busy, best.used, best.background = True, self._clock, background
        best.claim(salt)
        copy_shared_prefix(best, self.slots, prompt, salt)
        return best

    def poll(self, seq):
        """The events `seq` has waiting, running one step first if it has none; after a step that
        left `seq` out (paused, or another prompt's chunk ran), one Paused."""
        if not seq.events and seq.ahead:
            # NOTE(speculative): a kept proposal's token goes out as its own step would: after a
            # cancellation check, so a run cancelled inside a verified block ends where plain decoding would
            if seq.should_stop():
                seq.cancel()
            else:
                seq.events = seq.ahead.pop(0)[0]
        elif not seq.events and not seq.finished:
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
        decoding = [s for s in batch if s.pending is not None and not s.ahead]   # ahead: tokens unsent
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
        running = [s for s in self.active if not s.finished]
        live = [s for s in running if not s.background]
        if len(live) < len(running):
            # NOTE(background): batch lines take the rows live runs leave, and no step while a live
            # prompt is prefilling, so a live request's first token waits for no batch line
            if any(s.state == _PREFILL for s in live):
                return _fair_rows(self.max_batch, live)
            rest = [s for s in running if s.background][:max(0, self.max_batch - len(live))]
            return _fair_rows(self.max_batch, live) + rest
        return _fair_rows(self.max_batch, running)

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
        """One decode step: each sequence's pending token, then the proposals it runs (speculative)."""
        rows = [[s.pending] + p for s, p in zip(seqs, self._proposals(seqs))]
        adapters = [s.adapter for s, r in zip(seqs, rows) for _ in r]
        kw = {"adapters": adapters} if any(a is not None for a in adapters) else {}   # NOTE(lora-rows): lora.py
        logits = self.model.decode_batch([t for r in rows for t in r],
                                         [s.slot.cache for s, r in zip(seqs, rows) for _ in r], **kw)   # [rows, vocab]
        at = 0
        for seq, r in zip(seqs, rows):
            _isolated(seq, self._verify, seq, r, logits[at:at + len(r)])
            at += len(r)

    def _proposals(self, seqs):
        """The proposed tokens each sequence runs this step: those that pay (speculative.plan_rows),
        the step's rows kept within ROW_LIMIT. Prompt lookup proposes first and the plan takes a
        prefix; a draft model writes only the planned tokens."""
        opt = self.speculative
        if opt.mode == "off" or not opt.max_tokens:
            return [[] for _ in seqs]
        cost = 0.0 if opt.mode == "on" else opt.row_cost + (self.draft.cost if self.draft else 0.0)
        if self.draft is None:
            found = [_guarded(s, s.proposal, opt, opt.max_tokens) if s.params.speculative else [] for s in seqs]
            take = plan_rows([(s.acceptance.rate, len(p)) for s, p in zip(seqs, found)], len(seqs), cost)
        else:
            rooms = [s.room(opt.max_tokens) if s.params.speculative else 0 for s in seqs]
            take = plan_rows([(s.acceptance.rate, n) for s, n in zip(seqs, rooms)], len(seqs), cost)
            found = [_guarded(s, s.trim, p) for s, p in zip(seqs, self.draft.propose(seqs, take))]
        room = max(0, ROW_LIMIT - len(seqs))
        out = []
        for p, n in zip(found, take):
            out.append(p[:min(n, room)])
            room -= len(out[-1])
        return out

    @staticmethod
    def _verify(seq, rows, logits):
        kept = seq.verify(rows, logits)
        seq.acceptance.step(len(rows) - 1, kept)

    def _fail(self, error):
        # NOTE(fault): only the shared batched product gets here; it leaves every cache it
        # touched unknown: forget them all and fail every running sequence with the same error.
        for seq in self.active:
            seq.fail(error)
        for slot in self.slots:     # the failed sequences' slots among them
            slot.forget()


def _guarded(seq, work, *args):
    """`work(*args)` for one sequence's proposal; a failure there (its grammar's) proposes nothing:
    the step itself then meets it, as without speculation."""
    try:
        return work(*args)
    except Exception:      # noqa: BLE001 - the sequence's own step reports it
        return []


def _isolated(seq, work, *args):
    """Runs one sequence's own part of a step (its prefill chunk, or sampling, constraint,
    detokenizing and stop strings for its row). NOTE(fault): a failure there is that
    sequence's alone: it ends with the error and its neighbours in the batch go on."""
    try:
        work(*args)
    except Exception as e:     # noqa: BLE001 - whatever it was, it ends this sequence only
        seq.fail(e)
        seq.slot.forget()


def _fair_rows(most, live):
    """Up to `most` of `live`: all when they fit, else each client's fair share (Scheduler._batch)."""
    if len(live) <= most:
        return live
    lanes = {}
    for seq in live:
        lanes.setdefault(seq.client, []).append(seq)
    chosen, depth = set(), 0
    while len(chosen) < most:
        for lane in lanes.values():
            if depth < len(lane) and len(chosen) < most:
                chosen.add(id(lane[depth]))
        depth += 1
    return [s for s in live if id(s) in chosen]

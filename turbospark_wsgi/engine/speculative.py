"""Speculative decoding: tokens proposed for a sequence ahead of the model, checked in the sequence's
next decode step (scheduler.Scheduler._decode runs them as further rows of that step).

A proposal is a guess of the tokens that follow the sequence's pending one. Prompt lookup finds
them in the run's own text: the tokens that followed the last occurrence of its latest n tokens in
the prompt and the reply so far (code being edited, text being quoted or rewritten). A draft model
(draft.py) writes them with a smaller model of the same tokenizer.

NOTE(exact): a proposal never decides a token. The step computes the logits of every proposed
position (each row exactly what its own decode step would compute: model.decode_batch), and the
sequence samples them in order as it samples any step; the next row counts only while the token it
drew equals the proposal the row was run on. For a proposal that is one token, not a distribution
(both kinds here), that is the standard rejection rule: a proposal t is kept with probability
p(t), and otherwise the token comes from p with t taken out, renormalised. Drawn with the same coin
as without speculation, the same seed gives the same tokens, greedy or sampled, logprobs,
penalties, grammars and stop strings included.

When proposing pays (`Planner`): a step of R rows costs about t1 (1 + row_cost (R - 1)), and a
proposal's j-th token adds a token with the probability that it and the ones before it are kept,
estimated per sequence from its own recent proposals. Rows are added, most likely first, while
each adds more tokens than its share of the longer step, so an unlikely guess or a busy batch
proposes nothing.
"""
from dataclasses import dataclass

# PERF(speculative): measured cost of one more row of a decode step, as a fraction of a one-row step
# (SmolLM2-135M Q4_1, int8 fused layers, 2 cores: 1 row 14.6 ms, 4 rows 29.3 ms: 0.33 a row;
# kernels_layer: B = 8 rows of 8 sequences 3.0x one row). CuPy: assumed nearly free, not yet measured.
ROW_COST = {"numpy": 0.3, "cupy": 0.05}


@dataclass(frozen=True, slots=True)
class SpeculativeOptions:
    mode: str = "auto"          # auto: rows where they pay (plan_rows); on: every proposal; off: none
    max_tokens: int = 8         # proposed tokens per sequence and step
    row_cost: float = 0.3       # see ROW_COST
    min_ngram: int = 2          # prompt lookup: the shortest run of latest tokens matched
    max_ngram: int = 4          # ... and the longest, tried first


class PromptLookup:
    """Proposals from a sequence's own tokens (prompt, then the reply as it grows).

    `last[n - 1]` maps each n-gram to the index of the token that followed its latest occurrence.
    Once a proposal came from index j, `cursor` follows the source while the reply keeps copying it,
    so a long copy goes on from where it was found rather than jumping to a later repeat of its
    last few tokens."""

    def __init__(self, tokens, min_n=2, max_n=4):
        self.min_n, self.max_n = min_n, max_n
        self.tokens, self.last = [], [{} for _ in range(max_n)]
        self.cursor = None
        for t in tokens:
            self.append(t)

    def append(self, token):
        i = len(self.tokens)
        for n in range(1, min(self.max_n, i) + 1):
            self.last[n - 1][tuple(self.tokens[i - n:i])] = i
        if self.cursor is not None:
            self.cursor = self.cursor + 1 if self.tokens[self.cursor] == token else None
        self.tokens.append(token)

    def propose(self, k):
        """Up to k tokens that may follow the tokens so far."""
        if k <= 0 or len(self.tokens) < self.min_n:
            return []
        if self.cursor is None or self.cursor >= len(self.tokens):
            self.cursor = None
            for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
                j = self.last[n - 1].get(tuple(self.tokens[-n:]))
                if j is not None:
                    self.cursor = j
                    break
        return [] if self.cursor is None else self.tokens[self.cursor:self.cursor + k]


class Acceptance:
    """A sequence's recent rate of kept proposal tokens: kept / tried, both decaying each step, plus
    a prior; after a miss it falls below the cost of a row and recovers over some steps without
    proposals, so a text that does not repeat is probed now and then rather than every step."""

    PRIOR, WEIGHT, DECAY = 0.5, 1.0, 0.95

    def __init__(self):
        self.kept = self.tried = 0.0

    @property
    def rate(self):
        return (self.kept + self.PRIOR * self.WEIGHT) / (self.tried + self.WEIGHT)

    def step(self, proposed, kept):
        """One step: `proposed` tokens were verified (0: none) of which the first `kept` held."""
        self.kept, self.tried = self.kept * self.DECAY, self.tried * self.DECAY
        if proposed:
            self.kept += kept
            self.tried += kept + (kept < proposed)     # the tokens after the first miss were not tested


def plan_rows(candidates, rows, row_cost):
    """How many proposal tokens each sequence runs this step. `candidates`: per sequence (rate,
    available tokens); `rows`: the step's rows without proposals. A token j (1-based) of a sequence
    with rate a is kept with probability a^j; it is added while that beats its share of the longer
    step: a^j > row_cost * expected / (1 + row_cost * (R - 1)), R the rows so far."""
    take = [0] * len(candidates)
    if row_cost <= 0:
        return [n for _, n in candidates]
    expected, total = float(rows), rows
    gains = sorted(((a ** j, s) for s, (a, n) in enumerate(candidates) for j in range(1, n + 1)), reverse=True)
    for gain, s in gains:       # per sequence the gains fall with j, so this adds prefixes
        if gain * (1 + row_cost * (total - 1)) <= row_cost * expected:
            break
        take[s] += 1
        expected += gain
        total += 1
    return take

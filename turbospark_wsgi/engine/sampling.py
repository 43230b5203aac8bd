"""Sampling parameters, logits processors and samplers.

Order per step: logit_bias, repetition penalty (prompt + output), presence/frequency penalties
(output only), then temperature 0 -> argmax, else temperature, top_k, min_p, top_p and a draw from
the run's own RNG. A constraint (structured output) masks disallowed tokens to -inf just before the
choice and is advanced with the chosen token. Log-probabilities are reported from the model's raw logits.

SamplingParams are what a request asks of every run; what differs between a request's runs (its
choices) belongs to each run's Sampler: the constraint, which holds the run's grammar state, and the
choice's index, which moves a seeded run's RNG to seed + index.
"""
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0            # 0 (or below GREEDY_BELOW) = argmax
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0                  # 1 = off
    min_p: float = 0.0                  # 0 = off
    repetition_penalty: float = 1.0     # 1 = off (HF/llama.cpp style, over prompt + output)
    presence_penalty: float = 0.0       # OpenAI style, over output tokens
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)   # token id -> bias added to the logit
    seed: int | None = None             # None: fresh entropy; choice i of a request draws from seed + i
    logprobs: int | None = None         # None: none; N >= 0: chosen token's logprob plus the top N
    stop: tuple = ()                    # stop strings, matched on text
    stop_token_ids: tuple = ()          # extra ids that end the run (besides the model's eos/end-of-turn)
    ignore_eos: bool = False
    speculative: bool = True            # proposals may run ahead (as the engine's setting allows); output is the same


GREEDY_BELOW = 1e-6     # a temperature this small is argmax in all but float noise, and dividing by a
                        # subnormal one (5e-324) overflows the logits to inf, then NaN
FLOAT32_MAX = float(np.finfo(np.float32).max)


def log_softmax(logits):
    # logits: [..., V] float32 -> float64 log-probabilities (float64 so logprobs are exact to 1e-6)
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def top_n(logprobs, n):
    """[(id, logprob)] of the n best entries, best first (ties: lower id first)."""
    if n <= 0:
        return []
    idx = np.argpartition(-logprobs, n - 1)[:n] if n < logprobs.shape[0] else np.arange(logprobs.shape[0])
    idx = idx[np.lexsort((idx, -logprobs[idx]))]
    return [(int(i), float(logprobs[i])) for i in idx]


def choice_seed(seed, choice):
    """The RNG seed of a request's choice `choice` (n, best_of): seed + choice in 64 bits, so the
    choices differ and each is reproducible; None stays fresh entropy."""
    return None if seed is None else (seed + choice) % 2 ** 64


class Sampler:
    """Per-run sampler: owns its RNG, its constraint (engine.constraints.Constraint or ThinkingBudget:
    allowed_mask/advance/is_done, or None) and the token counts the penalties need."""

    def __init__(self, params, prompt_ids=(), constraint=None, choice=0):
        self.params, self.constraint = params, constraint
        self.rng = np.random.default_rng(choice_seed(params.seed, choice))
        self.seen = set(int(t) for t in prompt_ids)       # for the repetition penalty
        self.counts = {}                                  # output token -> count

    def __call__(self, logits):
        """logits: [V] float32 -> (token id, logprob | None, top logprobs | None)."""
        p, constraint = self.params, self.constraint
        x = self._process(logits)
        mask = constraint.allowed_mask() if constraint is not None else None
        if mask is not None:                               # None: every token is allowed this step
            x = np.where(mask, x, -np.inf)
        token = self._choose(x)
        if constraint is not None:
            constraint.advance(token)
        self.seen.add(token)
        self.counts[token] = self.counts.get(token, 0) + 1
        if p.logprobs is None:
            return token, None, None
        lp = log_softmax(logits)
        return token, float(lp[token]), top_n(lp, p.logprobs)

    def _process(self, logits):
        p = self.params
        if not (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            return logits
        x = logits.astype(np.float32, copy=True)
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < x.shape[0]:
                x[tok] += bias
        if p.repetition_penalty != 1.0 and self.seen:
            ids = np.fromiter(self.seen, dtype=np.int64)
            v = x[ids]
            with np.errstate(over="ignore", under="ignore", divide="ignore"):
                x[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = np.fromiter(self.counts.keys(), dtype=np.int64)
            n = np.fromiter(self.counts.values(), dtype=np.float32)
            x[ids] -= p.presence_penalty + p.frequency_penalty * n
        # NOTE(fault): extreme-but-accepted penalties (a repetition penalty of 1e-40 divides a logit
        # into float32 overflow) saturate instead of turning the step's logits into inf and NaN
        return np.clip(x, -FLOAT32_MAX, FLOAT32_MAX, out=x)

    def _choose(self, x):
        p = self.params
        if p.temperature < GREEDY_BELOW:
            return int(np.argmax(x))
        ids, probs = candidates(x, p.temperature, p.top_k, p.top_p, p.min_p)
        return int(ids[draw(probs, self.rng.random())])


DRAW_BLOCK = 256


def draw(probs, coin):
    """The index that coin (uniform in [0, 1)) picks: i with probability probs[i] / probs.sum()."""
    # PERF(cumsum): a running sum goes one element at a time (0.17 ms over 49,152 probabilities), so
    # the coin picks a block of DRAW_BLOCK by the blocks' sums, then an index inside that block
    starts = np.arange(0, len(probs), DRAW_BLOCK)
    cum = np.cumsum(np.add.reduceat(probs, starts))         # [blocks]
    u = coin * cum[-1]                                       # < cum[-1], as coin < 1
    b = int(np.searchsorted(cum, u, side="right"))           # a block of positive mass
    inside = np.cumsum(probs[starts[b]:starts[b] + DRAW_BLOCK])
    # NOTE(rounding): the block's own running sum may end a hair below what is left of u; kept
    # under its end, u lands on an entry of positive probability
    u = min(u - (cum[b - 1] if b else 0.0), np.nextafter(inside[-1], 0.0))
    return int(starts[b]) + int(np.searchsorted(inside, u, side="right"))


def candidates(x, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Surviving token ids and their unnormalised probabilities (the best token's is 1).

    Filters in order: temperature, top_k, tokens of probability 0 (masked or underflowed), min_p
    relative to the best, then top_p: the smallest prefix of the best-first order (ties: lower id
    first) whose mass is >= top_p of the survivors' (their total summed in id order). Best first when
    top_k, top_p or min_p is on; in id order when none is.
    """
    z = x.astype(np.float64) / temperature                 # [V]
    if 0 < top_k < z.shape[0]:
        ids = _best_first(z, _top_k(z, top_k))
        probs = np.exp(z[ids] - z[ids[0]])                 # [K], probs[0] == 1
        kept = int(np.count_nonzero(probs >= min_p if min_p > 0 else probs > 0))   # a prefix: probs fall
        ids, probs = ids[:kept], probs[:kept]
        if top_p < 1.0:
            cut = _prefix_reaching(probs, probs[np.argsort(ids)].sum(), top_p)
            ids, probs = ids[:cut], probs[:cut]
        return ids, probs
    p = np.exp(z - z.max())                                # [V], the best token's is 1
    keep = p >= min_p if min_p > 0 else p > 0              # the best tokens, ties together
    if top_p < 1.0:
        ids = _top_p_prefix(z, p, keep, top_p)
    elif min_p > 0:
        ids = _best_first(z, np.flatnonzero(keep))
    else:                                                  # PERF(sort): nothing is cut: draw in id order
        ids = np.arange(z.shape[0]) if keep.all() else np.flatnonzero(keep)
    return ids, p[ids]


def _top_p_prefix(z, p, keep, top_p):
    """Ids of the shortest best-first prefix of the kept tokens with mass >= top_p of theirs."""
    n = int(np.count_nonzero(keep))
    total = p.sum() if n == z.shape[0] else p[keep].sum()
    # PERF(sort): the prefix is looked for among the k best (with every tie of the k-th, so the set is
    # a prefix of the full order), k growing until their mass reaches top_p: only that set is sorted
    k = TOP_P_FIRST
    while k < n:
        inside = z >= _kth_best(z, k)                       # a survivor's value, as k < n
        if np.sum(p, where=inside) >= top_p * total:        # the cut below decides; this only spares sorts
            ids = _best_first(z, np.flatnonzero(inside))
            cut = _prefix_reaching(p[ids], total, top_p)
            if cut <= len(ids):
                return ids[:cut]
        k *= 4
    ids = _best_first(z, np.flatnonzero(keep))
    return ids[:_prefix_reaching(p[ids], total, top_p)]


TOP_P_FIRST = 64        # the first set top_p's prefix is looked for in; each next one is 4 times larger


def _top_k(z, k):
    """Ids of the k largest z, ties at the k-th value taken lower id first (in no particular order)."""
    t = _kth_best(z, k)
    above = np.flatnonzero(z > t)
    return np.concatenate((above, np.flatnonzero(z == t)[:k - len(above)]))


def _kth_best(z, k):
    return np.partition(z, z.shape[0] - k)[z.shape[0] - k]


def _best_first(z, ids):
    """ids ordered by z descending, ties lower id first."""
    # PERF(sort): an unstable sort, then one of the runs of ties by id: half the time of a stable
    # sort of the floats (32,768 ids: 1.2 against 2.4 ms, load average 3.8)
    ids = ids[np.argsort(-z[ids])]
    v = z[ids]
    tied = v[1:] == v[:-1]
    if tied.any():
        run = np.concatenate(([0], np.cumsum(~tied)))       # [K] index of each run of equal values
        span = int(ids.max()) + 1
        ids = np.sort(run * span + ids) % span
    return ids


def _prefix_reaching(probs, total, top_p):
    """Length of the shortest prefix of probs whose sum over total is >= top_p (len(probs) + 1: none is)."""
    return int(np.searchsorted(np.cumsum(probs) / total, top_p)) + 1

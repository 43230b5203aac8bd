"""What a request's sampling becomes: the fields the schemas checked (`Sampling`, on the
GenerationRequest) and, once admission knows the prompt and so the token budget, the engine's
SamplingParams, built here and nowhere else (vLLM's `to_sampling_params`).

    req = GenerationRequest(..., sampling=Sampling(temperature=0.7, stop=("END",)))    # the schemas
    params = sampling_params(req.sampling, max_new_tokens, logprobs_wanted(req))       # admission

What differs between a request's choices (the seed of choice i, a grammar's state) is each run's
own, passed beside these params to `engine.generate` (see generation.py).
"""
import dataclasses
from dataclasses import dataclass, field

from ..engine import SamplingParams


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling fields as the schemas checked them, by SamplingParams' names and defaults."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)      # token id -> bias
    seed: int | None = None
    stop: tuple = ()
    ignore_eos: bool = False
    speculative: bool = True


def sampling_params(sampling, max_new_tokens, logprobs=None):
    """The engine's SamplingParams: `sampling`'s fields, the budget the prompt leaves, and the top
    logprobs to compute (None: none)."""
    fields = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(Sampling)}
    return SamplingParams(max_new_tokens=max_new_tokens, logprobs=logprobs, **fields)


def logprobs_wanted(req):
    """The top logprobs the engine computes for a GenerationRequest: its own, or 0 where best_of
    ranks its runs by their cumulative logprob without returning any."""
    if req.logprobs is not None:
        return req.logprobs
    return 0 if (req.best_of or 0) > req.n else None

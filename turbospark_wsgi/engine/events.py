"""What Engine.generate yields (each `next()` does at most one prefill chunk or one decode step), and
the engine's refusals of a request's input that the service turns into 4xx."""
from dataclasses import dataclass


class FinishReason:
    STOP = "stop"            # eos / end-of-turn token, or a stop string (then Finish.stop_string is set)
    LENGTH = "length"        # max_new_tokens reached, or the context is full
    CANCELLED = "cancelled"  # should_stop() returned True


@dataclass(slots=True)
class Prefill:
    done: int                # prompt tokens processed so far (includes reused cached prefix)
    total: int


@dataclass(slots=True)
class Token:
    id: int
    text: str                # text released by this step ("" while held back: partial UTF-8 or a possible stop string)
    logprob: float | None = None          # log-softmax of the raw logits at the chosen token
    top_logprobs: list | None = None      # [(token_id, logprob)], best first, len = params.logprobs


@dataclass(slots=True)
class Paused:
    """A step ran without this run: it waits for a row of the batch (its client holds more than
    its share, or another prompt's chunk ran first). Nothing to send; the next step may run it."""


@dataclass(slots=True)
class Finish:
    reason: str
    text: str = ""           # held-back text released at the end (never part of a stop string)
    stop_string: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    proposed_tokens: int = 0     # speculative decoding: tokens proposed and checked by the model
    accepted_tokens: int = 0     # ... and of them, those kept (each one a token that took no step of its own)


@dataclass(slots=True)
class Scores:
    entries: list            # [(logprob, [(token_id, logprob)] top)] for prompt tokens, in order;
                             # the prompt's first token has (None, [])


class ConstraintError(RuntimeError):
    """A sequence's grammar failed while it ran: the grammar's doing (e.g. a parser limit that a
    client's schema reaches only after its first tokens), not the engine's."""


class QueryTooLong(ValueError):
    """Pair `index`'s first text leaves no room for any of the second within a cross-encoder's limit."""

    def __init__(self, index, tokens, limit):
        super().__init__(f"pair {index}: the first text has {tokens} tokens; with the special tokens this "
                         f"model scores at most {limit} tokens per pair")
        self.index, self.tokens, self.limit = index, tokens, limit

"""Prefill in chunks, then decode one token per step; events out, a cancel check between steps."""
from .events import Finish, FinishReason, Prefill, Token
from .sampling import Sampler
from .stops import StopMatcher


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Generation:
    """One run over one sequence; the caller's `next()` does at most one forward pass."""

    def __init__(self, model, cache, tokenizer, prompt_ids, params, *, should_stop=None,
                 prefill_chunk=256, max_context=None, cached_ids=None):
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.prompt = list(prompt_ids)
        self.params = params
        self.should_stop = should_stop or (lambda: False)
        self.chunk = max(1, prefill_chunk)
        self.max_context = max_context or cache.max_seq
        self.ids = cached_ids if cached_ids is not None else []   # tokens whose K/V are in the cache
        self.completion = 0
        self.cached = 0

    def __iter__(self):
        logits = yield from self._prefill()
        if logits is None:
            return
        yield from self._decode(logits)

    def _prefill(self):
        # NOTE(prefix-cache): reuse the K/V of the longest common prefix, but always run at least the
        # last prompt token so there are logits to sample from.
        self.cached = min(common_prefix(self.ids, self.prompt), len(self.prompt) - 1)
        self.cache.truncate(self.cached)
        del self.ids[self.cached:]
        total, logits = len(self.prompt), None
        yield Prefill(self.cached, total)
        for start in range(self.cached, total, self.chunk):
            if self.should_stop():
                yield self._finish(FinishReason.CANCELLED)
                return None
            piece = self.prompt[start:start + self.chunk]
            last = start + len(piece) == total
            logits = self.model.forward(piece, self.cache, logits="last" if last else "none")
            self.ids.extend(piece)
            yield Prefill(start + len(piece), total)
        return logits

    def _decode(self, logits):
        p = self.params
        sample = Sampler(p, self.prompt)
        decoder = self.tokenizer.incremental_decoder()
        stops = StopMatcher(p.stop)
        end_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.tokenizer.stop_ids))
        while True:
            token, logprob, top = sample(logits)
            if token in end_ids:
                yield self._end(FinishReason.STOP, decoder, stops)
                return
            self.completion += 1
            text, matched = stops.feed(decoder.push(token))
            yield Token(token, text, logprob, top)
            if matched is not None:
                yield self._finish(FinishReason.STOP, stop_string=matched)
                return
            if self.completion >= p.max_new_tokens or self.cache.length >= self.max_context:
                yield self._end(FinishReason.LENGTH, decoder, stops)
                return
            if self.should_stop():
                yield self._finish(FinishReason.CANCELLED)
                return
            logits = self.model.forward([token], self.cache, logits="last")
            self.ids.append(token)

    def _end(self, reason, decoder, stops):
        # held-back text goes out at the end, unless the flushed bytes complete a stop string
        text, matched = stops.feed(decoder.flush())
        if matched is None:
            return self._finish(reason, text + stops.flush())
        return self._finish(FinishReason.STOP, text, matched)

    def _finish(self, reason, text="", stop_string=None):
        return Finish(reason, text, stop_string, len(self.prompt), self.completion, self.cached)

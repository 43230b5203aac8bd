"""The prefill/decode loop, driven by a scripted model and a one-character-per-token tokenizer."""
import numpy as np
import pytest

from turbospark_wsgi.engine.events import Finish, Prefill, Token
from turbospark_wsgi.engine.generate import Generation
from turbospark_wsgi.engine.sampling import SamplingParams

ALPHABET = "abcdefghijklmnopqrstuvwxyz <>|/"
EOS = len(ALPHABET)
V = EOS + 1


class Cache:
    def __init__(self, max_seq):
        self.max_seq, self.length = max_seq, 0
        self.tokens = []

    def truncate(self, n):
        self.length = n
        del self.tokens[n:]


class ScriptedModel:
    """Next token = script[position]; logits favour it strongly. Records every forward call."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def forward(self, tokens, cache, logits="last"):
        self.calls.append(list(tokens))
        cache.tokens.extend(tokens)
        cache.length += len(tokens)
        if logits == "none":
            return None
        out = np.zeros(V, dtype=np.float32)
        out[self.script[cache.length - 1] if cache.length - 1 < len(self.script) else EOS] = 10.0
        return out


class CharTokenizer:
    stop_ids = frozenset({EOS})

    def incremental_decoder(self):
        class D:
            def push(self, t):
                return ALPHABET[t] if t < len(ALPHABET) else ""

            def flush(self):
                return ""
        return D()


def ids(text):
    return [ALPHABET.index(c) for c in text]


def run(model, prompt, params, cache=None, cached_ids=None, **kw):
    cache = cache or Cache(64)
    g = Generation(model, cache, CharTokenizer(), prompt, params, cached_ids=cached_ids, **kw)
    return list(g)


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, (Token, Finish)))


def script_for(prompt, continuation):
    # script[i] = the token predicted after position i
    return [0] * (len(prompt) - 1) + ids(continuation)


def test_greedy_run_stops_on_eos_with_counts():
    prompt = ids("hi ")
    events = run(ScriptedModel(script_for(prompt, "abc")), prompt, SamplingParams(temperature=0, max_new_tokens=10))
    fin = events[-1]
    assert text_of(events) == "abc"
    assert (fin.reason, fin.prompt_tokens, fin.completion_tokens) == ("stop", 3, 3)


def test_length_limit():
    prompt = ids("hi ")
    events = run(ScriptedModel(script_for(prompt, "abcdef")), prompt, SamplingParams(temperature=0, max_new_tokens=2))
    assert text_of(events) == "ab" and events[-1].reason == "length"


def test_prefill_runs_in_chunks_and_reports_progress():
    prompt = ids("abcdefghij")
    model = ScriptedModel(script_for(prompt, "x"))
    events = run(model, prompt, SamplingParams(temperature=0, max_new_tokens=1), prefill_chunk=4)
    assert [e.done for e in events if isinstance(e, Prefill)] == [0, 4, 8, 10]
    assert [len(c) for c in model.calls] == [4, 4, 2]


def test_stop_string_across_tokens_is_never_emitted():
    prompt = ids("q ")
    events = run(ScriptedModel(script_for(prompt, "ab<|end|>zz")), prompt,
                 SamplingParams(temperature=0, max_new_tokens=20, stop=("<|end|>",)))
    streamed = [e.text for e in events if isinstance(e, Token)]
    assert "".join(streamed) + events[-1].text == "ab"
    assert all("<" not in t for t in streamed)
    assert events[-1].reason == "stop" and events[-1].stop_string == "<|end|>"


def test_cancel_between_prefill_chunks_and_decode_steps():
    prompt = ids("abcdefghij")
    flag = {"n": 0}

    def should_stop():
        flag["n"] += 1
        return flag["n"] > 1

    model = ScriptedModel(script_for(prompt, "xyz"))
    events = run(model, prompt, SamplingParams(temperature=0, max_new_tokens=5), should_stop=should_stop, prefill_chunk=4)
    assert events[-1].reason == "cancelled" and len(model.calls) == 1


def test_prefix_reuse_skips_cached_tokens_and_gives_the_same_output():
    cache, cached = Cache(64), []
    first = ids("the cat ")
    model = ScriptedModel(script_for(first, "sat") + [0] * 20)
    a = run(model, first, SamplingParams(temperature=0, max_new_tokens=3), cache=cache, cached_ids=cached)
    second = first + ids("sat on")
    model.script = script_for(second, "mat")
    model.calls.clear()
    b = run(model, second, SamplingParams(temperature=0, max_new_tokens=3), cache=cache, cached_ids=cached)
    assert text_of(a) == "sat" and text_of(b) == "mat"
    assert b[-1].cached_tokens == len(first) + 2          # the prompt plus the two forwarded outputs
    assert model.calls[0] == ids("t on")
    assert cache.tokens[:len(second)] == second


def test_identical_prompt_still_recomputes_the_last_token():
    cache, cached = Cache(64), []
    prompt = ids("abc")
    model = ScriptedModel(script_for(prompt, "x"))
    run(model, prompt, SamplingParams(temperature=0, max_new_tokens=1), cache=cache, cached_ids=cached)
    model.calls.clear()
    events = run(model, prompt, SamplingParams(temperature=0, max_new_tokens=1), cache=cache, cached_ids=cached)
    assert model.calls[0] == [prompt[-1]] and events[-1].cached_tokens == 2


def test_context_full_ends_with_length():
    prompt = ids("abcd")
    events = run(ScriptedModel(script_for(prompt, "x" * 20)), prompt, SamplingParams(temperature=0, max_new_tokens=50),
                 cache=Cache(8), max_context=8)
    assert events[-1].reason == "length" and events[-1].completion_tokens == 5


def test_ignore_eos_and_stop_token_ids():
    prompt = ids("ab")
    script = script_for(prompt, "c") + [EOS] + ids("de")
    events = run(ScriptedModel(script), prompt, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    assert [e.id for e in events if isinstance(e, Token)][1] == EOS
    events = run(ScriptedModel(script_for(prompt, "cde")), prompt,
                 SamplingParams(temperature=0, max_new_tokens=5, stop_token_ids=(ALPHABET.index("d"),)))
    assert text_of(events) == "c" and events[-1].reason == "stop"


def test_logprobs_are_reported_per_token():
    prompt = ids("ab")
    events = run(ScriptedModel(script_for(prompt, "cd")), prompt, SamplingParams(temperature=0, max_new_tokens=2, logprobs=2))
    tok = [e for e in events if isinstance(e, Token)][0]
    assert tok.logprob == pytest.approx(10.0 - np.log(np.exp(10.0) + V - 1), abs=1e-6)
    assert tok.top_logprobs[0][0] == tok.id and len(tok.top_logprobs) == 2

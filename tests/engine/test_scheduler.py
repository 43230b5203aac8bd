"""The scheduler's prefill/decode loop, driven by a scripted model and a one-character-per-token tokenizer."""
import numpy as np
import pytest

from turbospark_wsgi.engine.events import Finish, Prefill, Token
from turbospark_wsgi.engine.prefix_cache import Slot
from turbospark_wsgi.engine.scheduler import Scheduler
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

    def copy_prefix(self, other, n):
        self.tokens, self.length = list(other.tokens[:n]), n

    def reset(self):
        self.truncate(0)


class ScriptedModel:
    """Next token = script[position]; logits favour it strongly. Records every forward call."""

    rows_exact = False          # prefixes are reused in whole aligned chunks
    decode_exact = False        # and never a reply

    def __init__(self, script):
        self.script = script
        self.calls = []
        self.batches = []

    def new_cache(self, max_seq):
        return Cache(max_seq)

    def forward(self, tokens, cache, logits="last", row_exact=False):
        self.calls.append(list(tokens))
        cache.tokens.extend(tokens)
        cache.length += len(tokens)
        return None if logits == "none" else self._logits(cache)

    def decode_batch(self, tokens, caches):
        self.batches.append(len(tokens))
        for t, cache in zip(tokens, caches):
            self.calls.append([t])
            cache.tokens.append(t)
            cache.length += 1
        return np.stack([self._logits(c) for c in caches])

    def _logits(self, cache):
        script = self.script(cache) if callable(self.script) else self.script
        out = np.zeros(V, dtype=np.float32)
        out[script[cache.length - 1] if cache.length - 1 < len(script) else EOS] = 10.0
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


def scheduler(model, max_batch=1, max_context=64, chunk=4):
    return Scheduler(model, CharTokenizer(), max_batch=max_batch, max_context=max_context, chunk=chunk)


def drain(sched, seq):
    events = []
    while not events or not isinstance(events[-1], Finish):
        events += sched.poll(seq)
    sched.release(seq)
    return events


def run(model, prompt, params, sched=None, should_stop=None, **kw):
    sched = sched or scheduler(model, **kw)
    return drain(sched, sched.add(prompt, params, should_stop))


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
    events = run(model, prompt, SamplingParams(temperature=0, max_new_tokens=1), chunk=4)
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
    events = run(model, prompt, SamplingParams(temperature=0, max_new_tokens=5), should_stop=should_stop, chunk=4)
    assert events[-1].reason == "cancelled" and len(model.calls) == 1


def test_prefix_reuse_takes_whole_aligned_chunks_and_gives_the_same_output():
    first = ids("the cat sat ")                 # 12 tokens: 3 whole chunks of 4
    second = first + ids("on the")
    model = ScriptedModel(lambda cache: script_for(cache.tokens, "x"))
    sched = scheduler(model, chunk=4)
    a = run(model, first, SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    model.calls.clear()
    b = run(model, second, SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    assert text_of(a) == "x" and text_of(b) == "x"
    assert b[-1].cached_tokens == 12               # whole chunks of the first prompt, not its output
    assert model.calls[0] == second[12:16]


def test_prefix_reuse_never_covers_the_last_prompt_token():
    prompt = ids("abcdefgh")                     # 2 whole chunks of 4
    model = ScriptedModel(script_for(prompt, "x"))
    sched = scheduler(model, chunk=4)
    run(model, prompt, SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    model.calls.clear()
    events = run(model, prompt, SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    assert model.calls[0] == prompt[4:] and events[-1].cached_tokens == 4


def test_partial_chunks_and_decoded_tokens_are_not_reused():
    prompt = ids("abcdef")                       # one whole chunk + a partial one
    model = ScriptedModel(script_for(prompt, "xyz"))
    sched = scheduler(model, chunk=4)
    run(model, prompt, SamplingParams(temperature=0, max_new_tokens=3), sched=sched)
    events = run(model, prompt + ids("xy"), SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    assert events[-1].cached_tokens == 4


def test_concurrent_sequences_share_decode_steps_and_match_solo_runs():
    prompts = [ids("ab"), ids("hello wor"), ids("zz")]

    def script(cache):
        return [(t * 7 + 3) % EOS for t in cache.tokens] + [0] * 40

    solo = [text_of(run(ScriptedModel(script), p, SamplingParams(temperature=0, max_new_tokens=6))) for p in prompts]
    model = ScriptedModel(script)
    sched = scheduler(model, max_batch=3)
    seqs = [sched.add(p, SamplingParams(temperature=0, max_new_tokens=6)) for p in prompts]
    outs = [[] for _ in seqs]
    while any(not o or not isinstance(o[-1], Finish) for o in outs):
        for seq, out in zip(seqs, outs):
            if not out or not isinstance(out[-1], Finish):
                out += sched.poll(seq)
    assert [text_of(o) for o in outs] == solo
    assert max(model.batches) == 3


def test_cancelling_one_sequence_leaves_the_others_untouched():
    def script(cache):
        return [(t * 5 + 1) % EOS for t in cache.tokens] + [0] * 40

    solo = text_of(run(ScriptedModel(script), ids("abc"), SamplingParams(temperature=0, max_new_tokens=8)))
    model = ScriptedModel(script)
    sched = scheduler(model, max_batch=2)
    stop = {"b": False}
    keep = sched.add(ids("abc"), SamplingParams(temperature=0, max_new_tokens=8))
    doomed = sched.add(ids("xyz"), SamplingParams(temperature=0, max_new_tokens=8), lambda: stop["b"])
    out = sched.poll(keep) + sched.poll(keep)
    stop["b"] = True
    gone = sched.poll(doomed)
    while not isinstance(gone[-1], Finish):
        gone += sched.poll(doomed)
    while not isinstance(out[-1], Finish):
        out += sched.poll(keep)
    assert gone[-1].reason == "cancelled" and text_of(out) == solo


def test_no_free_slot_is_an_error():
    sched = scheduler(ScriptedModel([0] * 10), max_batch=1)
    sched.add(ids("ab"), SamplingParams())
    with pytest.raises(RuntimeError):
        sched.add(ids("cd"), SamplingParams())


def test_a_failing_step_fails_every_running_sequence_and_forgets_caches(monkeypatch):
    class Broken(ScriptedModel):
        def decode_batch(self, tokens, caches):
            raise FloatingPointError("boom")

    model = Broken([0] * 10 + ids("abc"))
    sched = scheduler(model, max_batch=2)
    a = sched.add(ids("ab"), SamplingParams(temperature=0, max_new_tokens=5))
    b = sched.add(ids("cd"), SamplingParams(temperature=0, max_new_tokens=5))
    forgotten, real = [], Slot.forget
    monkeypatch.setattr(Slot, "forget", lambda slot: (forgotten.append(slot), real(slot)))
    for seq in (a, b):
        with pytest.raises(FloatingPointError):
            while True:
                sched.poll(seq)
    assert all(s.ids == [] for s in sched.slots)
    assert sorted(map(id, forgotten)) == sorted(map(id, sched.slots))      # each once


def test_context_full_ends_with_length():
    prompt = ids("abcd")
    events = run(ScriptedModel(script_for(prompt, "x" * 20)), prompt, SamplingParams(temperature=0, max_new_tokens=50),
                 max_context=8)
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


def test_unrelated_prompts_do_not_evict_a_warm_prefix_while_other_slots_exist():
    warm = ids("the cat sat on the mat ")         # 23 tokens: 5 whole chunks of 4
    model = ScriptedModel(lambda cache: script_for(cache.tokens, "x"))
    sched = scheduler(model, max_batch=3, chunk=4)
    run(model, warm, SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    for other in ("zzzz yyyy", "qqqq rrrr", "kkkk llll"):      # fills the other slots, then LRU
        run(model, ids(other), SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    events = run(model, warm + ids("ab"), SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    assert events[-1].cached_tokens == 0            # 3 slots, 4 distinct prompts: the oldest went
    sched = scheduler(model, max_batch=3, chunk=4)
    run(model, warm, SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    run(model, ids("zzzz yyyy"), SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    run(model, ids("qqqq rrrr"), SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    events = run(model, warm + ids("ab"), SamplingParams(temperature=0, max_new_tokens=1), sched=sched)
    assert events[-1].cached_tokens == 20


def salted(model, sched, prompt, salt):
    return drain(sched, sched.add(prompt, SamplingParams(temperature=0, max_new_tokens=1), salt=salt))


def test_a_salt_reuses_only_its_own_prefixes_and_the_output_is_the_same():
    prompt = ids("the cat sat on it")
    model = ScriptedModel(lambda cache: script_for(cache.tokens, "x"))
    sched = scheduler(model, max_batch=2, chunk=4)
    a = salted(model, sched, prompt, "alice")
    b = salted(model, sched, prompt, "bob")                 # the same prompt, another salt: a miss
    assert b[-1].cached_tokens == 0 and text_of(a) == text_of(b) == "x"
    assert salted(model, sched, prompt, "alice")[-1].cached_tokens == 16
    assert salted(model, sched, prompt, "bob")[-1].cached_tokens == 16
    assert salted(model, sched, prompt, "")[-1].cached_tokens == 0     # unsalted runs share among themselves


def test_a_slot_taken_by_another_salt_starts_empty():
    prompt = ids("the cat sat on it")
    model = ScriptedModel(lambda cache: script_for(cache.tokens, "x"))
    sched = scheduler(model, max_batch=1, chunk=4)          # one slot: bob's run must take alice's
    salted(model, sched, prompt, "alice")
    model.calls.clear()
    assert salted(model, sched, prompt, "bob")[-1].cached_tokens == 0
    assert model.calls[0] == prompt[:4]                     # the whole prompt ran again
    assert salted(model, sched, prompt, "alice")[-1].cached_tokens == 0   # alice's ids went with it


def test_a_new_conversation_sharing_only_a_template_start_keeps_off_another_ones_slot():
    start = ids("<sys>")                                   # what every chat template puts first
    a, b = start + ids("the cat sat on the mat"), start + ids("zzzz yyyy qqqq rrrr ss")
    model = ScriptedModel(lambda cache: script_for(cache.tokens, "x"))
    sched = scheduler(model, max_batch=2, chunk=4)
    salted(model, sched, a, "")
    # a new slot, not a's, holding a copy of the start they share (NOTE(copied-prefix))
    assert salted(model, sched, b, "")[-1].cached_tokens == 4
    assert salted(model, sched, a + ids("x more"), "")[-1].cached_tokens == 24   # a's turn finds its own
    sched = scheduler(model, max_batch=1, chunk=4)          # no room for another slot: b takes the only one
    salted(model, sched, a, "")
    assert salted(model, sched, b, "")[-1].cached_tokens == 4

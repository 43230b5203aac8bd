"""Scoring a prompt (echo + logprobs) runs chunk by chunk among the other runs' steps: it never
holds the engine for a whole long prompt, and a cancel stops it within one chunk."""
import numpy as np
import pytest

from turbospark_wsgi.engine import Finish, FinishReason, Prefill, SamplingParams, Scores, Token, load_engine
from turbospark_wsgi.engine.sampling import log_softmax

CHUNK = 8


@pytest.fixture
def engine(stories_gguf):
    return load_engine(stories_gguf, device="cpu", max_batch=4, prefill_chunk=CHUNK)


def long_prompt(engine, n=120):
    ids = engine.encode("Once upon a time there was a little dog who liked to run in the park. " * 8, add_bos=True)
    return ids[:n]


def scored(events):
    out = []
    for e in events:
        out += e.entries if isinstance(e, Scores) else []
    return out


def test_scores_match_the_whole_prompt_forward_pass(engine):
    prompt = long_prompt(engine)
    got = scored(engine.score(prompt, top=3))
    want = log_softmax(engine.model.forward(prompt, engine.model.new_cache(256), logits="all"))
    assert len(got) == len(prompt) and got[0] == (None, [])
    for (lp, top), row, nxt in zip(got[1:], want, prompt[1:]):
        assert abs(lp - row[nxt]) < 1e-4 and len(top) == 3
        assert [t for t, _ in top] == list(np.argsort(-row, kind="stable")[:3])


def test_a_long_score_shares_steps_with_a_running_stream(engine):
    prompt = long_prompt(engine)
    stream = engine.generate(engine.encode("Tom", add_bos=True), SamplingParams(temperature=0, max_new_tokens=64,
                                                                               ignore_eos=True))
    while not isinstance(next(stream), Token):      # the stream is decoding
        pass
    score = engine.score(prompt, top=1)
    tokens_while_scoring, done = 0, False
    while not done:
        for event in (next(score),):
            done = isinstance(event, Finish)
        tokens_while_scoring += isinstance(next(stream), Token)
    chunks = -(-len(prompt) // CHUNK)
    assert tokens_while_scoring >= chunks - 1       # one decode step beside every scoring chunk
    stream.close()
    score.close()


def test_a_cancelled_score_stops_within_one_chunk(engine, monkeypatch):
    prompt = long_prompt(engine)
    cancelled = {"flag": False}
    score = engine.score(prompt, top=0, should_stop=lambda: cancelled["flag"])
    while not (isinstance(e := next(score), Prefill) and e.done >= 2 * CHUNK):
        pass
    runs = []
    real = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: runs.append(1) or real(*a, **k))
    cancelled["flag"] = True
    events = list(score)
    assert isinstance(events[-1], Finish) and events[-1].reason == FinishReason.CANCELLED
    assert len(runs) <= 1
    assert not any(s.busy for s in engine.scheduler.slots)

import math

import numpy as np
import pytest

from turbospark_wsgi.engine.sampling import Sampler, SamplingParams, candidates, log_softmax, top_n


def logits_of(*values):
    return np.array(values, dtype=np.float32)


def draw(params, logits, n=400, prompt=()):
    return [Sampler(SamplingParams(**params, seed=s), prompt)(logits)[0] for s in range(n)]


def test_temperature_zero_is_argmax():
    x = logits_of(0.1, 3.0, 2.9, -1)
    assert Sampler(SamplingParams(temperature=0))(x)[0] == 1


def test_top_k_keeps_only_the_k_best():
    x = logits_of(1.0, 3.0, 2.0, 0.5, 2.5)
    assert set(draw({"temperature": 5.0, "top_k": 2}, x)) == {1, 4}


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    x = np.log(p).astype(np.float32)
    ids, _ = candidates(x, 1.0, top_p=0.75)
    assert list(ids) == [0, 1]
    ids, _ = candidates(x, 1.0, top_p=0.8)     # 0.5 + 0.3 reaches 0.8 exactly (float rounding aside)
    assert list(ids)[:2] == [0, 1] and len(ids) <= 3
    assert set(draw({"temperature": 1.0, "top_p": 0.75}, x)) == {0, 1}


def test_min_p_is_relative_to_the_best_token():
    x = np.log(np.array([0.6, 0.3, 0.07, 0.03])).astype(np.float32)
    ids, _ = candidates(x, 1.0, min_p=0.1)     # keeps p >= 0.06
    assert list(ids) == [0, 1, 2]


def test_sampling_frequencies_follow_the_distribution():
    p = np.array([0.7, 0.2, 0.1])
    got = np.bincount(draw({"temperature": 1.0}, np.log(p).astype(np.float32), n=3000), minlength=3) / 3000
    assert np.allclose(got, p, atol=0.04)


def test_same_seed_same_tokens_and_different_seeds_differ():
    rng = np.random.default_rng(0)
    steps = [rng.normal(size=50).astype(np.float32) for _ in range(30)]

    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=seed))
        return [s(x)[0] for x in steps]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_logit_bias_can_force_and_ban():
    x = logits_of(5.0, 1.0, 0.0)
    assert Sampler(SamplingParams(temperature=0, logit_bias={2: 100.0}))(x)[0] == 2
    assert Sampler(SamplingParams(temperature=0, logit_bias={0: -100.0}))(x)[0] == 1


def test_repetition_penalty_covers_prompt_tokens():
    x = logits_of(2.0, 1.9, -1.0)
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.2), prompt_ids=[0])(x)[0] == 1
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.0), prompt_ids=[0])(x)[0] == 0


def test_negative_logits_are_multiplied_by_the_repetition_penalty():
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_ids=[0])
    out = s._process(logits_of(-1.0, -1.5))
    assert out[0] == pytest.approx(-2.0)


def test_presence_and_frequency_penalties_count_output_tokens():
    s = Sampler(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25))
    x = logits_of(3.0, 2.0)
    assert s(x)[0] == 0
    assert s._process(x)[0] == pytest.approx(3.0 - 0.5 - 0.25)
    s(x)
    assert s._process(x)[0] == pytest.approx(3.0 - 0.5 - 0.5)
    assert s._process(x)[1] == pytest.approx(2.0)


def test_logprobs_are_log_softmax_of_raw_logits_and_sorted():
    x = np.random.default_rng(1).normal(size=100).astype(np.float32)
    token, lp, top = Sampler(SamplingParams(temperature=0, logprobs=5, logit_bias={3: 50.0}))(x)
    ref = x.astype(np.float64) - math.log(np.exp(x.astype(np.float64)).sum())
    assert token == 3
    assert lp == pytest.approx(ref[3], abs=1e-9)
    assert [t for t, _ in top] == list(np.argsort(-ref)[:5])
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_log_softmax_sums_to_one_and_top_n_handles_small_vocab():
    lp = log_softmax(logits_of(1, 2, 3))
    assert np.exp(lp).sum() == pytest.approx(1.0)
    assert [t for t, _ in top_n(lp, 10)] == [2, 1, 0]
    assert top_n(lp, 0) == []

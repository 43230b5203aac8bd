"""One sequence's failure is its own: extreme sampling values run safely, and a sequence whose
sampling, constraint or logits fail ends alone while its neighbours in the batch finish untouched."""
import numpy as np
import pytest

from turbospark_wsgi.engine import Finish, SamplingParams, Token, load_engine
from turbospark_wsgi.engine.sampling import Sampler

from test_batching import prompts_for, run_alone

EXTREMES = [dict(temperature=5e-324), dict(temperature=1e-300, top_p=0.5), dict(repetition_penalty=1e-40),
            dict(repetition_penalty=1e-300), dict(repetition_penalty=5e-324), dict(repetition_penalty=1e300),
            dict(temperature=2.0, repetition_penalty=1e-40, presence_penalty=2, frequency_penalty=-2),
            dict(temperature=5e-324, logit_bias={3: 100.0, 4: -100.0}, repetition_penalty=1e-300)]


@pytest.mark.parametrize("extreme", EXTREMES)
def test_extreme_sampling_values_pick_a_real_token(extreme):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(300) * 8).astype(np.float32)
    sampler = Sampler(SamplingParams(seed=1, logprobs=2, **extreme), prompt_ids=range(0, 300, 3))
    for _ in range(5):
        token, logprob, top = sampler(logits)
        assert 0 <= token < 300 and np.isfinite(logprob) and all(np.isfinite(lp) for _, lp in top)


def test_a_temperature_below_the_floor_is_argmax():
    logits = np.array([0.5, 3.0, 2.9999, -1.0], dtype=np.float32)
    for t in (5e-324, 1e-300, 1e-9):
        assert Sampler(SamplingParams(temperature=t, seed=3))(logits)[0] == 1


class Poison:
    """A constraint that fails after `after` tokens, as a grammar engine error would."""

    def __init__(self, after):
        self.left = after

    def allowed_mask(self):
        if self.left == 0:
            raise RuntimeError("grammar engine failed")
        return None

    def advance(self, token):
        self.left -= 1

    def is_done(self):
        return False


def run_batch(engine, prompts, params_list, constraints=None):
    """Round-robin over concurrent runs; {index: tokens} for the finished, {index: error} for the failed."""
    constraints = constraints or [None] * len(prompts)
    gens = [engine.generate(p, params, constraint=c) for p, params, c in zip(prompts, params_list, constraints)]
    outs, errors, live = [[] for _ in gens], {}, set(range(len(gens)))
    while live:
        for i in sorted(live):
            try:
                event = next(gens[i])
            except Exception as e:      # noqa: BLE001 - the poisoned run's own error
                errors[i] = e
                live.discard(i)
                continue
            if isinstance(event, Token):
                outs[i].append(event.id)
            elif isinstance(event, Finish):
                live.discard(i)
    for gen in gens:
        gen.close()
    return outs, errors


@pytest.fixture
def engine(stories_gguf):
    return load_engine(stories_gguf, device="cpu", max_batch=4, prefill_chunk=8)


def greedy(n=24, **kw):
    return SamplingParams(temperature=0, max_new_tokens=n, **kw)


@pytest.mark.parametrize("poisoned_at", [0, 1, 3])
def test_a_failing_sequence_ends_alone_and_its_neighbours_equal_their_solo_runs(engine, poisoned_at):
    prompts = prompts_for(engine)
    solo = [run_alone(engine, p, greedy()) for p in prompts]
    constraints = [None] * len(prompts)
    constraints[poisoned_at] = Poison(after=5)
    outs, errors = run_batch(engine, prompts, [greedy() for _ in prompts], constraints)
    assert list(errors) == [poisoned_at] and "grammar engine failed" in str(errors[poisoned_at])
    for i, (got, want) in enumerate(zip(outs, solo)):
        if i != poisoned_at:
            assert got == want, i
    assert not any(s.busy for s in engine.scheduler.slots)     # every slot is free again
    assert run_alone(engine, prompts[poisoned_at], greedy()) == solo[poisoned_at]   # and reusable


def test_non_finite_logits_end_only_their_own_sequence(engine, monkeypatch):
    prompts = prompts_for(engine)
    solo = [run_alone(engine, p, greedy()) for p in prompts]
    real = engine.model.decode_batch
    calls = {"n": 0}

    def nan_in_row_two(tokens, caches):
        logits = real(tokens, caches)
        calls["n"] += 1
        if calls["n"] == 6 and len(tokens) == 4:
            logits[2, 7] = np.nan
        return logits

    monkeypatch.setattr(engine.model, "decode_batch", nan_in_row_two)
    outs, errors = run_batch(engine, prompts, [greedy() for _ in prompts])
    assert list(errors) == [2] and isinstance(errors[2], FloatingPointError)
    assert [o for i, o in enumerate(outs) if i != 2] == [s for i, s in enumerate(solo) if i != 2]


def test_extreme_values_beside_greedy_streams_leave_them_untouched(engine):
    prompts = prompts_for(engine)
    solo = [run_alone(engine, p, greedy()) for p in prompts[:3]]
    params = [greedy() for _ in range(3)] + [SamplingParams(max_new_tokens=24, seed=5, **EXTREMES[0])]
    for extreme in EXTREMES:
        params[3] = SamplingParams(max_new_tokens=24, seed=5, **extreme)
        outs, errors = run_batch(engine, prompts, params)
        assert errors == {} and outs[:3] == solo, extreme

"""The sampler's surviving set against a plain full sort of the vocabulary (same ids, same probabilities),
and its draws against those probabilities."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from turbospark_wsgi.engine.sampling import Sampler, SamplingParams, candidates, draw  # noqa: E402

EXACT = settings(derandomize=True, database=None, deadline=None, max_examples=600,
                 suppress_health_check=list(HealthCheck))
FLOAT32_MAX = float(np.finfo(np.float32).max)


def reference(x, temperature, top_k, top_p, min_p):
    """The definition: sort everything best first (ties: lower id first), then cut."""
    z = x.astype(np.float64) / temperature
    ids = np.argsort(-z, kind="stable")
    if 0 < top_k < len(ids):
        ids = ids[:top_k]
    probs = np.exp(z[ids] - z[ids[0]])
    ids, probs = ids[probs > 0], probs[probs > 0]
    if min_p > 0:
        ids, probs = ids[probs >= min_p], probs[probs >= min_p]
    if top_p < 1.0:
        cum = np.cumsum(probs) / probs[np.argsort(ids)].sum()      # the survivors' total, summed in id order
        cut = int(np.searchsorted(cum, top_p)) + 1
        ids, probs = ids[:cut], probs[:cut]
    return ids, probs


def assert_same_as_reference(x, temperature, top_k=0, top_p=1.0, min_p=0.0):
    ids, probs = candidates(x, temperature, top_k, top_p, min_p)
    want_ids, want_probs = reference(x, temperature, top_k, top_p, min_p)
    if 0 < top_k < len(x) or top_p < 1.0 or min_p > 0:
        assert ids.tolist() == want_ids.tolist()                   # best first, the reference's order
        assert probs.tolist() == want_probs.tolist()
    else:
        order = np.argsort(want_ids)                               # nothing cut: in id order
        assert ids.tolist() == want_ids[order].tolist()
        assert probs.tolist() == want_probs[order].tolist()


@st.composite
def logits(pick):
    """Random logits with ties (values drawn from a few levels), masked (-inf) entries and extreme scales."""
    n = pick(st.integers(1, 700))
    rng = np.random.default_rng(pick(st.integers(0, 2**32 - 1)))
    scale = pick(st.sampled_from([0.01, 1.0, 8.0, 1e3, FLOAT32_MAX]))
    x = rng.standard_normal(n) * min(scale, 1e30)
    levels = pick(st.integers(0, 6))                               # 0: continuous values
    if levels:
        x = rng.integers(0, levels, n) * (scale / levels)
    x = np.clip(x, -FLOAT32_MAX, FLOAT32_MAX).astype(np.float32)
    masked = rng.random(n) < pick(st.sampled_from([0.0, 0.0, 0.3, 0.95]))
    masked[rng.integers(n)] = False                                # at least one token stays allowed
    return np.where(masked, -np.inf, x).astype(np.float32)


@EXACT
@given(logits(), st.one_of(st.sampled_from([1e-6, 0.7, 1.0, 1e6]), st.floats(1e-6, 1e6)),
       st.one_of(st.just(0), st.integers(-1, 800)),
       st.one_of(st.just(1.0), st.sampled_from([0.0, 0.5, 0.9, 0.95]), st.floats(0.0, 1.0)),
       st.one_of(st.just(0.0), st.sampled_from([0.05, 1.0]), st.floats(0.0, 1.0)))
def test_candidates_match_a_full_sort(x, temperature, top_k, top_p, min_p):
    assert_same_as_reference(x, temperature, top_k, top_p, min_p)


@pytest.mark.parametrize("top_p", [0.01, 0.5, 0.9, 0.95, 0.999999])
@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
def test_top_p_on_a_real_vocabulary_size(top_p, spread):
    # the prefix at every size the sampler grows through (64 .. 32768 and past it), with runs of ties
    rng = np.random.default_rng(int(spread * 10))
    x = np.round(rng.standard_normal(49152) * spread, 2).astype(np.float32)
    for temperature in (0.5, 1.0, 2.0):
        assert_same_as_reference(x, temperature, top_p=top_p)
        assert_same_as_reference(x, temperature, top_p=top_p, min_p=1e-4)
        assert_same_as_reference(x, temperature, top_k=40, top_p=top_p)


def test_top_k_ties_at_the_cut_keep_the_lower_ids():
    x = np.array([1.0, 3.0, 2.0, 2.0, 0.0, 2.0, 3.0], dtype=np.float32)
    ids, _ = candidates(x, 1.0, top_k=4)
    assert ids.tolist() == [1, 6, 2, 3]


def chi_square(counts, expected):
    """Pearson's statistic of observed counts against expected probabilities (bins with p > 0)."""
    n, expected = counts.sum(), np.asarray(expected, dtype=np.float64)
    assert counts[expected == 0].sum() == 0                      # nothing drawn outside the kept set
    e = n * expected[expected > 0]
    return float(((counts[expected > 0] - e) ** 2 / e).sum()), int((expected > 0).sum()) - 1


def generous_limit(df):
    return df + 8 * np.sqrt(2 * df)         # about 8 standard deviations of the chi-square: p < 1e-6


SMALL = np.log(np.array([0.02, 0.3, 1.0, 0.1, 0.2, 0.08, 0.2, 0.06, 0.04])).astype(np.float32)
SMALL[2] = -np.inf                          # a masked token


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=1.0, top_k=4),
                                    dict(temperature=1.0, top_p=0.75), dict(temperature=1.0, min_p=0.25),
                                    dict(temperature=0.5, top_p=0.9), dict(temperature=2.0, top_k=6, min_p=0.3)])
def test_draw_frequencies_match_the_kept_probabilities(params):
    sampler = Sampler(SamplingParams(seed=1234, **params))
    counts = np.bincount([sampler(SMALL)[0] for _ in range(20000)], minlength=len(SMALL))
    ids, probs = reference(SMALL, params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0),
                           params.get("min_p", 0.0))
    expected = np.zeros(len(SMALL))
    expected[ids] = probs / probs.sum()
    stat, df = chi_square(counts, expected)
    assert stat < generous_limit(df), (stat, df, counts)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.95)])
def test_draw_frequencies_on_a_real_vocabulary_size(params):
    # tokens grouped into 10 bins by id, so the id-order draw over 49,152 tokens is checked as a whole
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(49152) * 3.0).astype(np.float32)
    x[rng.random(49152) < 0.2] = -np.inf
    sampler = Sampler(SamplingParams(seed=99, **params))
    bins = np.arange(49152) * 10 // 49152
    counts = np.bincount(bins[[sampler(x)[0] for _ in range(2500)]], minlength=10)
    ids, probs = reference(x, params["temperature"], 0, params.get("top_p", 1.0), 0.0)
    expected = np.bincount(bins[ids], weights=probs, minlength=10) / probs.sum()
    stat, df = chi_square(counts, expected)
    assert stat < generous_limit(df), (stat, df, counts)


def test_draw_lands_only_on_positive_probabilities():
    probs = np.zeros(1000)
    probs[[3, 255, 256, 511, 999]] = [1.0, 2.0, 0.5, 1e-300, 3.0]      # at block edges, one tiny
    coins = [0.0, 1e-17, 0.5, 1 - 2**-53, *np.random.default_rng(0).random(3000)]
    picked = [draw(probs, c) for c in coins]
    assert set(picked) <= {3, 255, 256, 511, 999} and {3, 255, 256, 999} <= set(picked)
    assert draw(probs, 0.0) == 3 and draw(probs, 1 - 2**-53) == 999
    assert [draw(np.array([0.0, 2.0, 0.0]), c) for c in (0.0, 0.7, 1 - 2**-53)] == [1, 1, 1]

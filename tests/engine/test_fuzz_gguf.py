"""The structured GGUF fuzzer (tools/fuzz_gguf.py), a bounded run: hypothesis drives its field
mutations of two seeds (stories260K, an SPM vocabulary; the tiny test llama, a byte-level BPE one
with a chat template) through the whole load and a use of what loaded. Every case loads or fails
with a ValueError / OSError, within 5 s, allocating at most a small multiple of the file's size.
The long run (`python3 tools/fuzz_gguf.py --minutes N`) runs the same cases in child processes."""
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st   # noqa: E402

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import fuzz_gguf  # noqa: E402

MAX_EXTRA = 32 << 20        # bytes a case may allocate beyond 8x its file


def cases(layout):
    change = st.tuples(st.integers(0, len(layout.fields) - 1), st.integers(0, 1 << 20),
                       st.integers(0, fuzz_gguf.N_CHOICES - 1), st.integers(0, (1 << 64) - 1))
    tail = st.one_of(st.none(), st.tuples(st.just("cut"), st.integers(0, len(layout.seed) - 1)),
                     st.tuples(st.just("append"), st.sampled_from([1, 31, 4096])))
    return st.tuples(st.lists(change, min_size=1, max_size=3), tail)


def check(layout, case, workdir):
    blob, what = fuzz_gguf.apply(layout, *case)
    tracemalloc.start()
    started = time.monotonic()
    try:
        outcome = fuzz_gguf.run_case(blob, workdir)
        seconds, peak = time.monotonic() - started, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < fuzz_gguf.HANG_S, (what, outcome, seconds)
    assert peak < 8 * len(blob) + MAX_EXTRA, (what, outcome, peak)
    return outcome


# NOTE(fixtures): the seeds' layouts are read-only, so one per test serves every example
FUZZ = settings(max_examples=500, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def stories():
    if not fuzz_gguf.SEED.is_file():
        pytest.skip(f"{fuzz_gguf.SEED} absent")
    return fuzz_gguf.Layout(fuzz_gguf.SEED)


@pytest.fixture
def tiny_bpe(tiny_gguf):
    return fuzz_gguf.Layout(tiny_gguf(qtype="Q8_0").path)


def test_the_seeds_load_unchanged(stories, tiny_bpe, tmp_path):
    for layout in (stories, tiny_bpe):
        assert fuzz_gguf.run_case(layout.seed, tmp_path) == "loaded"
        assert len(layout.fields) > 100       # header, key/values, token arrays and tensor table


@FUZZ
@given(data=st.data())
def test_mutations_of_an_spm_model_load_or_fail_cleanly(stories, data):
    with tempfile.TemporaryDirectory() as work:
        check(stories, data.draw(cases(stories)), work)


@FUZZ
@given(data=st.data())
def test_mutations_of_a_bpe_model_with_a_template_load_or_fail_cleanly(tiny_bpe, data):
    with tempfile.TemporaryDirectory() as work:
        check(tiny_bpe, data.draw(cases(tiny_bpe)), work)


def test_a_finding_is_reported_not_swallowed(stories, tmp_path, monkeypatch):
    # the harness's own check: an exception other than ValueError / OSError escapes run_case
    from turbospark_wsgi.engine import engine

    def broken(*args, **kwargs):
        raise IndexError("a bug")

    monkeypatch.setattr(engine, "load_engine", broken)
    with pytest.raises(IndexError):
        fuzz_gguf.run_case(stories.seed, tmp_path)

"""The Hugging Face directory fuzzer (tools/fuzz_hf.py), a bounded run: hypothesis drives its node
mutations of the tiny test llama's config.json, tokenizer.json, tokenizer_config.json,
generation_config.json and safetensors header through the whole load and a use of what loaded.
Every case loads or fails with a ValueError / OSError, within 5 s, allocating at most a small
multiple of the directory's size."""
import json
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st   # noqa: E402

from turbospark_wsgi.engine import model_json  # noqa: E402
from turbospark_wsgi.engine.tokenizer import Tokenizer  # noqa: E402

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import fuzz_gguf  # noqa: E402
import fuzz_hf  # noqa: E402

MAX_EXTRA = 48 << 20        # bytes a case may allocate beyond 8x its files (the hostile values' own text)


@pytest.fixture
def seed(tiny_hf_dir):
    return fuzz_hf.Seed(tiny_hf_dir().path)


def directory_bytes(path):
    return sum(f.stat().st_size for f in Path(path).iterdir())


def test_the_seed_loads_unchanged(seed, tmp_path):
    assert fuzz_hf.run_case(seed, [], tmp_path / "case")[1] == "loaded"
    assert {name for name, _ in seed.nodes} == {*fuzz_hf.JSON_FILES, fuzz_hf.WEIGHTS}
    assert len(seed.nodes) > 100


FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.data())
def test_mutations_of_a_model_directory_load_or_fail_cleanly(seed, data):
    change = st.tuples(st.integers(0, len(seed.nodes) - 1), st.integers(0, fuzz_hf.N_CHOICES - 1),
                       st.sampled_from([0, 1, 7, 100, 1 << 40]))
    changes = data.draw(st.lists(change, min_size=1, max_size=3))
    with tempfile.TemporaryDirectory() as work:
        case = Path(work) / "case"
        tracemalloc.start()
        started = time.monotonic()
        try:
            what, outcome = fuzz_hf.run_case(seed, changes, case)
            seconds, peak = time.monotonic() - started, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert seconds < fuzz_gguf.HANG_S, (what, outcome, seconds)
        assert peak < 8 * directory_bytes(case) + MAX_EXTRA, (what, outcome, peak)


# ---- what the fuzzer found, each once -------------------------------------------------------------

def _edit(directory, name, change):
    path = Path(directory) / name
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


def test_a_huge_token_id_is_refused_before_tokenizers_builds_tables_for_it(tiny_hf_dir):
    directory = tiny_hf_dir().path
    _edit(directory, "tokenizer.json", lambda t: t["model"]["vocab"].update({"h": 2 ** 31}))
    started = time.monotonic()
    with pytest.raises(ValueError, match="token id 2147483648"):
        Tokenizer.from_hf_dir(directory)
    assert time.monotonic() - started < 2.0       # `tokenizers` alone took ~30 s on it


def test_json_nested_past_the_parsers_depth_is_a_value_error(tiny_hf_dir, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="nests too deeply"):
        model_json.loads(deep, "config.json")
    directory = tiny_hf_dir().path
    (Path(directory) / "tokenizer_config.json").write_text('{"x": ' + deep + "}")
    with pytest.raises(ValueError, match="tokenizer_config.json nests too deeply"):
        Tokenizer.from_hf_dir(directory)


def test_a_chat_template_that_is_not_text_turns_chat_off_not_the_model(tiny_hf_dir):
    from turbospark_wsgi.engine.engine import load_engine
    directory = tiny_hf_dir().path
    _edit(directory, "tokenizer_config.json", lambda c: c.update(chat_template=[7, {"name": "default", "template": 3}]))
    engine = load_engine(directory, device="cpu", max_batch=1, max_paused=0, speculative="off")
    assert engine.template.problem == "the chat template is int, not text"
    assert engine.encode("hi", False)


def test_a_tokenizer_json_over_its_size_limit_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(model_json, "MAX_TOKENIZER_BYTES", 100)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": {"a": 0}}, "pad": "x" * 200}))
    with pytest.raises(ValueError, match="over the 100"):
        model_json.tokenizer_from_file(str(path))


@pytest.mark.parametrize("key", ["num_hidden_layers", "hidden_size", "vocab_size"])
def test_a_size_past_any_model_is_refused_before_anything_is_built_per_layer(tiny_hf_dir, key):
    from turbospark_wsgi.engine.loader import load_model
    directory = tiny_hf_dir().path
    _edit(directory, "config.json", lambda c: c.update({key: 2 ** 31}))    # once a 16 GiB list per layer
    with pytest.raises(ValueError, match=f"config.json '{key}' must be an integer from 1 to"):
        load_model(directory)

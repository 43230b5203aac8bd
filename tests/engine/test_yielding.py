"""The compute thread's gate between layers: called once per layer, and it changes no number."""
import pytest

from turbospark_wsgi.engine import SamplingParams, Token, load_engine, yielding


@pytest.fixture
def counting_gate():
    calls = []
    previous = yielding.install(lambda: calls.append(1))
    try:
        yield calls
    finally:
        yielding.install(previous)


def greedy(engine, prompt, n=6):
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [e.id for e in engine.generate(prompt, params) if isinstance(e, Token)]


def test_the_gate_is_asked_once_per_layer_of_every_forward_pass(tiny_gguf, counting_gate, monkeypatch):
    engine = load_engine(tiny_gguf(qtype="Q8_0").path, device="cpu", max_batch=2, prefill_chunk=4)
    model = engine.model
    counting_gate.clear()                              # the load's own first pass (loader._first_pass)
    passes = []
    for name in ("forward", "decode_batch"):
        real = getattr(model, name)
        monkeypatch.setattr(model, name, lambda *a, _real=real, **k: passes.append(1) or _real(*a, **k))
    prompt = engine.encode("hello world", add_bos=True)
    out = greedy(engine, prompt, n=5)
    assert len(out) == 5 and len(passes) >= 5          # a prefill, then a decode step per later token
    assert len(counting_gate) == len(model.w.layers) * len(passes)


def test_a_gate_that_waits_changes_no_token(tiny_gguf):
    engine = load_engine(tiny_gguf(qtype="Q8_0").path, device="cpu", max_batch=2, prefill_chunk=4)
    prompt = engine.encode("the cat sat on", add_bos=True)
    plain = greedy(engine, prompt, n=8)
    previous = yielding.install(lambda: None)
    try:
        gated = greedy(engine, prompt, n=8)
    finally:
        yielding.install(previous)
    assert gated == plain

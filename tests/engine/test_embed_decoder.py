"""Embeddings from decoder models: hidden states pooled, normalised, and run beside generations
without touching them."""
import numpy as np
import pytest

from turbospark_wsgi.engine import Finish, SamplingParams, Token, engine as E, load_engine
from turbospark_wsgi.engine.kernels import cpu as kernels_cpu


@pytest.fixture(params=["stories", "tiny_q8"])
def engine(request, tiny_gguf):
    if request.param == "stories":
        return load_engine(request.getfixturevalue("stories_gguf"), device="cpu", max_batch=4, prefill_chunk=8)
    return load_engine(tiny_gguf(qtype="Q8_0").path, device="cpu", max_batch=4, prefill_chunk=8)


def texts_ids(engine):
    return engine.encode_batch(["Once upon a time", "The little dog ran", "Tom", "One day, Lily went to the park"])


def test_mean_of_final_normed_hidden_states_at_unit_length(engine):
    seqs = texts_ids(engine)
    got = engine.embed(seqs)
    assert got.shape == (4, engine.config.dim) and got.dtype == np.float32 and engine.pooling == "mean"
    for row, ids in zip(got, seqs):
        with kernels_cpu.activations_as("float32"):
            hidden = engine.model.forward(ids, engine.model.new_cache(), logits="hidden")
        assert hidden.shape == (len(ids), engine.config.dim)
        want = hidden.mean(axis=0)
        np.testing.assert_allclose(row, want / np.linalg.norm(want), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    alone = np.stack([engine.embed([s])[0] for s in seqs])
    np.testing.assert_allclose(got, alone, atol=1e-6)


def test_a_long_input_runs_in_pieces_like_one_call(engine, monkeypatch):
    ids = (texts_ids(engine)[3] * 6)[:40]
    whole = engine.embed([ids])
    monkeypatch.setattr(E, "EMBED_PIECE", 16)
    assert np.abs(engine.embed([ids]) - whole).max() < 1e-5


def test_embedding_between_decode_steps_leaves_generations_alone(engine):
    prompts = [engine.encode(t, add_bos=True) for t in ("Once upon a time", "The little dog")]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    solo = [[e.id for e in engine.generate(p, params) if isinstance(e, Token)] for p in prompts]
    gens = [engine.generate(p, params) for p in prompts]
    outs, live, step = [[], []], {0, 1}, 0
    while live:
        for i in sorted(live):
            event = next(gens[i])
            if isinstance(event, Token):
                outs[i].append(event.id)
            elif isinstance(event, Finish):
                live.discard(i)
        step += 1
        if step in (3, 9):          # mid-generation, as the compute thread would run an embedding request
            engine.embed(texts_ids(engine) + [prompts[0] * 3])
    assert outs == solo


@pytest.mark.parametrize("meta, mode", [({}, "mean"), ({"llama.pooling_type": 1}, "mean"),
                                        ({"llama.pooling_type": 2}, "cls"), ({"llama.pooling_type": 3}, "last"),
                                        ({"llama.pooling_type": 0}, "mean"), ({"qwen2.pooling_type": 3}, "mean")])
def test_pooling_follows_the_ggufs_own_key(meta, mode):
    class Loaded:
        kind = "gguf"
        metadata = dict(meta, **{"general.architecture": "llama"})
    assert E._pooling(Loaded) == mode


def test_last_token_pooling(engine):
    engine.pooling = "last"
    ids = texts_ids(engine)[0]
    with kernels_cpu.activations_as("float32"):
        hidden = engine.model.forward(ids, engine.model.new_cache(), logits="hidden")
    np.testing.assert_allclose(engine.embed([ids])[0], hidden[-1] / np.linalg.norm(hidden[-1]), atol=1e-5)


def test_embeddings_use_the_float32_kernels_whatever_generation_uses(engine, monkeypatch):
    """int8 activations are generation's speed/precision trade; an embedding is compared by cosine
    and ranking, so it runs the float32 kernels (the transformers-equal path) and is the same either way."""
    seqs = texts_ids(engine)
    monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "float32")
    exact = engine.embed(seqs)
    monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "int8")
    assert np.array_equal(engine.embed(seqs), exact)
    assert kernels_cpu.ACTIVATIONS == "int8", "embedding left generation's setting changed"

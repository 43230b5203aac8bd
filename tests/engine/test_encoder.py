"""The BERT encoder against sentence-transformers (test extra, CPU, float32) on the pulled
all-minilm-l6-v2; skipped when the model (`turbospark pull all-minilm-l6-v2`) or the reference is absent."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from turbospark_wsgi.engine import EngineOptions
from turbospark_wsgi.engine import encoder as E

MODEL_DIR = Path(os.path.expanduser(os.environ.get("TURBOSPARK_MODELS", "~/.cache/turbospark/models"))) / "all-minilm-l6-v2"

SENTENCES = [
    "", " ", ".", "a", "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "東京は日本の首都です。", "Привет, как у тебя дела сегодня?", "مرحبا بالعالم، كيف حالك؟",
    "Ελληνικά γράμματα και αριθμοί 12345", "🙂🙃 emoji only 🚀",
    "def f(x): return x ** 2  # code, not prose",
    "UPPER CASE and lower case and MiXeD cAsE",
    "word " * 120,
    " ".join(f"token{i} and some filler text" for i in range(25)),   # long, under the 256-token limit
    "Numbers: 3.14159, 2.71828, 1.41421; dates 2024-01-01.",
    "A much longer sentence that talks about retrieval augmented generation, vector databases, "
    "and the way embeddings place similar meanings close together in a high-dimensional space.",
]


def _cos(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def pair():
    if not (MODEL_DIR / "modules.json").is_file():
        pytest.skip(f"{MODEL_DIR} absent (turbospark pull all-minilm-l6-v2)")
    st = pytest.importorskip("sentence_transformers")
    return E.load_encoder(str(MODEL_DIR)), st.SentenceTransformer(str(MODEL_DIR), device="cpu")


def test_parity_with_sentence_transformers(pair):
    enc, ref = pair
    ids = enc.encode_batch(SENTENCES)
    assert max(len(i) for i in ids) > 150 and all(len(i) <= enc.max_tokens for i in ids)
    ours = enc.embed(ids)
    theirs = ref.encode(SENTENCES, convert_to_numpy=True, batch_size=32)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (20, 384)
    cos = _cos(ours, theirs)
    assert cos.min() >= 0.9999, list(zip(SENTENCES, cos))
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)   # modules.json: Normalize


def test_one_at_a_time_equals_batched(pair):
    enc, _ = pair
    ids = enc.encode_batch(SENTENCES[:8])
    batched = enc.embed(ids)
    single = np.stack([enc.embed([s])[0] for s in ids])
    assert _cos(batched, single).min() >= 0.99999     # padding never leaks into a shorter sequence


def test_retrieval_ranking_matches(pair):
    enc, ref = pair
    docs = ["The cat sits on the mat.", "Stock markets fell sharply on Monday.",
            "Python is a programming language.", "Paris is the capital of France.",
            "The recipe needs flour, eggs and sugar.", "Football match ended in a draw."]
    queries = ["Which city is France's capital?", "How do I bake a cake?", "What language should I code in?",
               "Where is the kitten?", "What happened to shares?", "Who won the game?"]
    ours_q, ours_d = enc.embed(enc.encode_batch(queries)), enc.embed(enc.encode_batch(docs))
    ref_q, ref_d = ref.encode(queries), ref.encode(docs)
    ours_rank = np.argsort(-(ours_q @ ours_d.T), axis=1)
    assert (ours_rank == np.argsort(-(ref_q @ ref_d.T), axis=1)).all()
    assert list(ours_rank[:, 0]) == [3, 4, 2, 0, 1, 5]


@pytest.mark.parametrize("cfg, mode", [({"pooling_mode_mean_tokens": True}, "mean"),
                                       ({"pooling_mode_cls_token": True}, "cls"),
                                       ({"pooling_mode_lasttoken": True}, "lasttoken")])
def test_pooling_follows_the_directory(tmp_path, cfg, mode):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    modules = [{"type": "sentence_transformers.models.Transformer", "path": ""},
               {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert E._pooling(str(tmp_path)) == (mode, False)
    modules.append({"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert E._pooling(str(tmp_path)) == (mode, True)


def test_unsupported_pooling_is_refused(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    (tmp_path / "modules.json").write_text(json.dumps([{"type": "x.Pooling", "path": "p"}]))
    with pytest.raises(E.EncoderError, match="unsupported pooling"):
        E._pooling(str(tmp_path))


def test_products_run_on_the_encoders_threads_whatever_a_decoder_capped_blas_at(monkeypatch):
    if not (MODEL_DIR / "modules.json").is_file():
        pytest.skip(f"{MODEL_DIR} absent (turbospark pull all-minilm-l6-v2)")
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    enc, seen, linear = E.load_encoder(str(MODEL_DIR), EngineOptions(encoder_threads=2)), [], E._linear
    monkeypatch.setattr(E, "_linear", lambda *a: (seen.append(blas()), linear(*a))[1])
    with threadpool_limits(1, user_api="blas"):              # as a quantized decoder leaves it
        enc.embed(enc.encode_batch(["a", "b c"]))
        assert blas() == [1] * len(blas())                   # and as it stays for the decoder
    assert len(seen) == 4 * enc.n_layers and all(n == [2] * len(n) for n in seen)

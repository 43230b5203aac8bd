"""The cross-encoder (engine/cross_encoder.py) against transformers' AutoModelForSequenceClassification
and sentence-transformers' CrossEncoder (torch, float32, CPU) on tiny random BERT and XLM-RoBERTa
rerankers written on the fly (tests/cross_encoders.py)."""
import json
import shutil

import numpy as np
import pytest
from cross_encoders import build_cross_encoder

from turbospark_wsgi.engine import QueryTooLong, protocol
from turbospark_wsgi.engine.cross_encoder import CrossEncoder, load_cross_encoder
from turbospark_wsgi.engine.encoder import EncoderError
from turbospark_wsgi.serving.registry import model_capabilities, model_kind

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAIRS = [("what is the capital of france", "paris is the capital city of france"),
         ("what is the capital of france", "the cat sits on the mat"),
         ("what is the capital of france", ""),
         ("how to bake a cake", "flour eggs and sugar " * 30),        # over the 64 positions: its tail is cut
         ("Python CODE?", "stock market fell, shares won"),
         ("a", "東京 ünïcödé émoji 🙂 unknown words"),
         ("who won the football match", "the game ended in a draw")]


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def model_dir(request, tmp_path_factory):
    return build_cross_encoder(tmp_path_factory.mktemp(request.param) / "ce", request.param)


def reference_logits(path, pairs, max_length):
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    batch = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, truncation="only_second",
                max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits[:, 0].numpy(), batch


def test_scores_match_transformers_and_sentence_transformers(model_dir):
    ce = load_cross_encoder(str(model_dir))
    pairs, cut = ce.encode_pairs(PAIRS)
    ours = ce.score(pairs)
    logits, batch = reference_logits(model_dir, PAIRS, ce.max_tokens)
    for i, (ids, segments) in enumerate(pairs):
        mask = batch["attention_mask"][i].bool()
        assert ids == batch["input_ids"][i][mask].tolist()               # the tokenizer's pair template
        if segments is not None:
            assert segments == batch["token_type_ids"][i][mask].tolist()
    assert cut == [False, False, False, True, False, False, False] and len(pairs[3][0]) == ce.max_tokens == 64
    assert ours.dtype == np.float32 and ce.activation_name == "Sigmoid"
    want = 1 / (1 + np.exp(-logits.astype(np.float64)))
    assert np.abs(ours - want).max() < 1e-4, np.abs(ours - want).max()
    st = pytest.importorskip("sentence_transformers")
    theirs = st.CrossEncoder(str(model_dir), device="cpu").predict(PAIRS, batch_size=3)
    assert np.abs(ours - theirs).max() < 1e-4, np.abs(ours - theirs).max()
    assert len(set(np.round(ours, 5))) == len(PAIRS)                    # the pairs do score apart


def test_batched_equals_one_at_a_time(model_dir):
    ce = load_cross_encoder(str(model_dir))
    pairs, _ = ce.encode_pairs(PAIRS)
    single = np.array([ce.score([p])[0] for p in pairs])
    np.testing.assert_allclose(ce.score(pairs), single, atol=1e-6)     # padding never leaks into a shorter pair


def test_a_query_that_leaves_no_room_is_refused(model_dir):
    ce = load_cross_encoder(str(model_dir))
    with pytest.raises(QueryTooLong) as e:
        ce.encode_pairs([("short", "doc"), ("cat " * 70, "doc")])
    assert e.value.index == 1 and e.value.tokens == 70 and e.value.limit == 64


def test_the_activation_config_json_names_is_applied(tmp_path):
    path = build_cross_encoder(tmp_path / "ce", config={"sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}})
    ce = load_cross_encoder(str(path))
    logits, _ = reference_logits(path, PAIRS, ce.max_tokens)
    assert ce.activation_name == "Identity"
    assert np.abs(ce.score(ce.encode_pairs(PAIRS)[0]) - logits).max() < 1e-4
    st = pytest.importorskip("sentence_transformers")
    np.testing.assert_allclose(st.CrossEncoder(str(path), device="cpu").predict(PAIRS), logits, atol=1e-4)


def test_a_directory_sentence_transformers_saved_is_a_reranker(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    plain = build_cross_encoder(tmp_path / "plain")
    st.CrossEncoder(str(plain), device="cpu").save_pretrained(str(tmp_path / "saved"))
    saved = tmp_path / "saved"
    assert (saved / "modules.json").is_file()                            # as an embedding model has
    assert model_kind(str(saved)) == model_kind(str(plain)) == "rerank"
    assert model_capabilities("rerank") == ("rerank",)
    ce = load_cross_encoder(str(saved))
    np.testing.assert_allclose(ce.score(ce.encode_pairs(PAIRS)[0]),
                               st.CrossEncoder(str(saved), device="cpu").predict(PAIRS), atol=1e-4)


def test_several_labels_are_refused_naming_their_count(tmp_path):
    path = build_cross_encoder(tmp_path / "ce", num_labels=3)
    assert model_kind(str(path)) == "rerank"
    with pytest.raises(EncoderError, match="3 labels; reranking needs one"):
        load_cross_encoder(str(path))


@pytest.mark.parametrize("edit, words", [
    ({"model_type": "distilbert"}, "unsupported encoder model_type 'distilbert'"),
    ({"architectures": ["ElectraForSequenceClassification"]}, "unsupported reranker architecture"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Softmax"}}, "unsupported activation_fn"),
])
def test_unsupported_directories_are_refused_naming_why(tmp_path, edit, words):
    path = build_cross_encoder(tmp_path / "ce")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, **edit)))
    with pytest.raises(EncoderError, match=words):
        load_cross_encoder(str(path))


def test_a_missing_head_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file
    path = build_cross_encoder(tmp_path / "ce")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["classifier.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(EncoderError, match="no tensor 'classifier.weight'"):
        load_cross_encoder(str(path))


def test_the_cross_encoder_implements_the_rerank_engine_protocol(tmp_path):
    from test_protocol import missing
    ce = load_cross_encoder(str(build_cross_encoder(tmp_path / "ce")))
    assert isinstance(ce, CrossEncoder) and missing(ce, protocol.RerankEngine) == []
    assert ce.kind == "rerank" and ce.capabilities == ("rerank",) and ce.nbytes > 0
    shutil.rmtree(tmp_path / "ce")

"""POST /v1/embeddings on the real all-minilm-l6-v2 (skipped when it is not pulled), and the kind
checks between embedding and generation models (stories260K, skipped when absent)."""
import base64
import os
import struct
from pathlib import Path

import numpy as np
import pytest

MODELS = Path(os.path.expanduser(os.environ.get("TURBOSPARK_MODELS", "~/.cache/turbospark/models")))
EMBED_DIR = MODELS / "all-minilm-l6-v2"
STORIES = Path(os.environ.get("TURBOSPARK_TEST_MODELS", "/work/shared/models")) / "stories260K.gguf"
pytestmark = pytest.mark.skipif(not (EMBED_DIR / "modules.json").is_file(),
                                reason=f"{EMBED_DIR} absent (turbospark pull all-minilm-l6-v2)")
M = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / M).symlink_to(EMBED_DIR)
    if STORIES.is_file():
        (root / "stories260K.gguf").symlink_to(STORIES)
    return root


@pytest.fixture(scope="module")
def client(root):
    import webtest
    from turbospark_wsgi.http.app import create_app
    from turbospark_wsgi.config import Config
    config = Config(models_dir=str(root), model=M, device="cpu", load_default=False, max_embedding_inputs=64)
    return webtest.TestApp(create_app(config))


@pytest.fixture(scope="module")
def direct():
    from turbospark_wsgi.engine.encoder import load_encoder
    return load_encoder(str(EMBED_DIR))


def embed(client, status=200, **body):
    return client.post_json("/v1/embeddings", {"model": M, **body}, status=status).json


def vectors(doc):
    assert [d["index"] for d in doc["data"]] == list(range(len(doc["data"])))
    assert all(d["object"] == "embedding" for d in doc["data"])
    return np.array([d["embedding"] for d in doc["data"]], dtype=np.float32)


def test_one_string(client, direct):
    doc = embed(client, input="The quick brown fox")
    assert doc["object"] == "list" and doc["model"] == M
    got = vectors(doc)
    assert got.shape == (1, 384)
    np.testing.assert_allclose(got[0], direct.embed([direct.encode("The quick brown fox")])[0], atol=1e-6)
    n = len(direct.encode("The quick brown fox"))
    assert doc["usage"] == {"prompt_tokens": n, "total_tokens": n}


def test_a_list_is_batched_in_order_like_one_at_a_time(client, direct):
    texts = ["short", "a somewhat longer sentence about embeddings " * 5, "東京", "مرحبا"]
    got = vectors(embed(client, input=texts))
    want = np.stack([direct.embed([direct.encode(t)])[0] for t in texts])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_base64_is_little_endian_float32(client):
    floats = vectors(embed(client, input=["one", "two"]))
    b64 = embed(client, input=["one", "two"], encoding_format="base64")["data"]
    for i, d in enumerate(b64):
        raw = base64.b64decode(d["embedding"])
        assert np.allclose(struct.unpack(f"<{len(raw) // 4}f", raw), floats[i], atol=1e-7)


def test_token_ids_and_lists_of_them(client, direct):
    ids = direct.encode("hello world")
    one = vectors(embed(client, input=ids))
    many = vectors(embed(client, input=[ids, direct.encode("bye")]))
    text = vectors(embed(client, input="hello world"))
    np.testing.assert_allclose(one[0], text[0], atol=1e-6)
    np.testing.assert_allclose(many[0], text[0], atol=1e-6)
    assert embed(client, input=ids)["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["a", ""]}, "input", "input[1]"),
    ({"input": 5}, "input", "integer"),
    ({"input": None}, "input", "null"),
    ({"input": {"text": "a"}}, "input", "object"),
    ({"input": ["a", 1]}, "input", "input[1]"),
    ({"input": [True, False]}, "input", "input[0]"),
    ({"input": [{}, {}]}, "input", "input[0]"),
    ({"input": [[1, [2]]]}, "input", "input[0]"),
    ({"input": [[]]}, "input", "no token ids"),
    ({"input": [[-1]]}, "input", "non-negative"),
    ({"input": [101, 99999999]}, "input", "outside the vocabulary"),
    ({"input": [[101], [30522]]}, "input", "input[1]: token id 30522 is outside"),
    ({"input": ["ok", "word " * 300]}, "input", "input[1] has 302 tokens; this model embeds at most 256"),
    ({"input": ["x"] * 10000}, "input", "TURBOSPARK_MAX_EMBEDDING_INPUTS"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "float, base64"),
    ({"input": "a", "dimensions": 128}, "dimensions", "Matryoshka"),
    ({"input": "a", "dimensions": "128"}, "dimensions", "integer"),
    ({"input": "a", "dimensions": 0}, "dimensions", ""),
    ({"input": "a", "model": ""}, "model", "empty"),
    ({"input": "a", "model": "nope"}, "model", "does not exist"),
])
def test_bad_input_is_a_400_naming_the_field(client, body, param, words):
    status = 404 if body.get("model") == "nope" else 400
    err = client.post_json("/v1/embeddings", {"model": M, **body}, status=status).json["error"]
    assert err["param"] == param and words in err["message"], err
    assert vectors(embed(client, input="still fine")).shape == (1, 384)     # and the next request is served


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_the_special_ones(client, direct):
    text = " ".join(f"w{i}" for i in range(400))
    ids = direct.encode(text)
    assert len(ids) > 256 and direct.special_span == (1, 1)
    kept = ids[:1] + ids[-(256 - 1):]                         # [CLS] + the end of the text + [SEP]
    for value in (-1, 256):
        doc = embed(client, input=["short", text], truncate_prompt_tokens=value)
        assert doc["usage"]["prompt_tokens"] == len(direct.encode("short")) + 256
        np.testing.assert_allclose(vectors(doc)[1], direct.embed([kept])[0], atol=1e-5)
    ten = vectors(embed(client, input=text, truncate_prompt_tokens=10))[0]
    np.testing.assert_allclose(ten, direct.embed([ids[:1] + ids[-9:]])[0], atol=1e-5)
    by_ids = embed(client, input=[ids], truncate_prompt_tokens=10)           # client ids: the plain last 10
    np.testing.assert_allclose(vectors(by_ids)[0], direct.embed([ids[-10:]])[0], atol=1e-5)
    short = embed(client, input="short", truncate_prompt_tokens=100)
    np.testing.assert_allclose(vectors(short)[0], vectors(embed(client, input="short"))[0], atol=1e-6)


@pytest.mark.parametrize("value, words", [(0, "-1 (the model's limit) or at least 1"), (-2, ">= -1"),
                                          (257, "is 257; this model's input limit is 256"), (1.5, "integer")])
def test_truncate_prompt_tokens_refusals(client, value, words):
    err = client.post_json("/v1/embeddings", {"model": M, "input": "a", "truncate_prompt_tokens": value},
                           status=400).json["error"]
    assert err["param"] == "truncate_prompt_tokens" and words in err["message"], err


def test_nested_too_deep_is_a_400(client):
    deep = "x"
    for _ in range(200):
        deep = [deep]
    r = client.post_json("/v1/embeddings", {"model": M, "input": deep}, status=400)
    assert r.json["error"]["type"] == "invalid_request_error"


def test_health_with_the_embedding_model_as_the_default(client):
    embed(client, input="load it")
    body = client.get("/health").json
    assert body["status"] == "ok" and body["max_context"] == 256


def test_models_say_which_embed(client):
    kinds = {m["id"]: (m["kind"], m["capabilities"]) for m in client.get("/v1/models").json["data"]}
    assert kinds[M] == ("embedding", ["embedding"])
    if STORIES.is_file():
        assert kinds["stories260K"] == ("generation", ["generation", "embedding"])


def test_chat_to_the_embedding_model_is_a_400_naming_its_kind(client):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"})):
        err = client.post_json(path, {"model": M, **body}, status=400).json["error"]
        assert err["param"] == "model" and "embedding model" in err["message"], (path, err)


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} absent")
def test_a_generation_model_embeds_in_its_own_dimensions(client):
    doc = client.post_json("/v1/embeddings", {"model": "stories260K", "input": ["hi", "there"]}).json
    assert doc["model"] == "stories260K" and [len(d["embedding"]) for d in doc["data"]] == [64, 64]


def test_matryoshka_dimensions_truncate_and_renormalise(direct, monkeypatch):
    full = direct.embed([direct.encode("a test")])[0]
    cut = direct.embed([direct.encode("a test")], dimensions=64)[0]
    assert cut.shape == (64,) and abs(np.linalg.norm(cut) - 1) < 1e-5
    np.testing.assert_allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


def test_hostile_bodies_are_4xx_in_the_openai_envelope(client):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 40, 2 ** 40), st.floats(allow_nan=False),
                        st.text(max_size=20))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=5), inner, max_size=3), max_leaves=12)
    fields = st.fixed_dictionaries({}, optional={"input": values, "dimensions": values, "encoding_format": values,
                                                 "model": st.sampled_from([M, "", None, 3]), "user": values})

    @settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(fields)
    def run(body):
        r = client.post_json("/v1/embeddings", body, status="*")
        assert r.status_int in (200, 400, 404), (r.status_int, body, r.text[:300])
        if r.status_int != 200:
            assert set(r.json["error"]) == {"message", "type", "param", "code"}, r.json

    run()


def test_embeddings_take_a_place_in_the_generation_queue(root):
    import webtest
    from turbospark_wsgi.http.app import create_app
    from turbospark_wsgi.config import Config
    from turbospark_wsgi.serving.service import Service
    config = Config(models_dir=str(root), model=M, device="cpu", load_default=False, max_batch=1, max_waiting=1,
                    queue_timeout=0.3)
    service = Service(config)
    client = webtest.TestApp(create_app(config, service=service))
    embed(client, input="warm")
    held = service.queue.enqueue()          # a running generation holds the only slot
    assert held.wait(1)
    try:
        err = client.post_json("/v1/embeddings", {"model": M, "input": "waits"}, status=503).json["error"]
        assert err["type"] and err["message"], err
    finally:
        held.release()
    assert vectors(embed(client, input="now it runs")).shape == (1, 384)

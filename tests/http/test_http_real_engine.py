"""/v1/completions with the real engine on the tiny stories260K model (skipped when absent)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

MODEL = Path(os.environ.get("TURBOSPARK_TEST_MODELS", "/work/shared/models")) / "stories260K.gguf"
pytestmark = pytest.mark.skipif(not MODEL.is_file(), reason=f"{MODEL} not present")
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client():
    import webtest
    from turbospark_wsgi.http.app import create_app
    from turbospark_wsgi.config import Config
    config = Config(models_dir=str(MODEL.parent), model="stories260K", device="cpu", load_default=False,
                    keepalive=0.5)
    return webtest.TestApp(create_app(config))


@pytest.fixture(scope="module")
def direct():
    """A second, independent engine instance driven without the server."""
    from turbospark_wsgi.engine import load_engine
    return load_engine(str(MODEL), device="cpu")


def complete(client, **body):
    return client.post_json("/v1/completions", {"model": "stories260K", "prompt": PROMPT, **body})


def streamed_text(body):
    chunks = [json.loads(f[6:]) for f in body.decode().split("\n\n") if f.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


def test_greedy_output_is_stable_and_matches_the_engine_alone(client, direct):
    from turbospark_wsgi.engine import SamplingParams, Token
    first = complete(client, max_tokens=24, temperature=0).json
    second = complete(client, max_tokens=24, temperature=0).json
    ids = direct.encode(PROMPT, add_bos=direct.add_bos)
    events = list(direct.generate(ids, SamplingParams(max_new_tokens=24, temperature=0)))
    alone = "".join(e.text for e in events if isinstance(e, Token)) + events[-1].text
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == alone and alone.strip()


def test_streaming_text_equals_non_streaming_text(client):
    plain = complete(client, max_tokens=30, temperature=0).json
    text, chunks = streamed_text(complete(client, max_tokens=30, temperature=0, stream=True,
                                          stream_options={"include_usage": True}).body)
    assert text == plain["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == plain["usage"]


def test_usage_counts(client, direct):
    body = complete(client, max_tokens=7, temperature=0).json
    n_prompt = len(direct.encode(PROMPT, add_bos=direct.add_bos))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 7, "total_tokens": n_prompt + 7}
    assert body["choices"][0]["finish_reason"] == "length"


def test_token_id_prompt_equals_text_prompt(client, direct):
    ids = direct.encode(PROMPT, add_bos=direct.add_bos)
    by_text = complete(client, max_tokens=10, temperature=0).json["choices"][0]["text"]
    by_ids = client.post_json("/v1/completions", {"model": "stories260K", "prompt": ids, "max_tokens": 10,
                                                  "temperature": 0}).json["choices"][0]["text"]
    assert by_ids == by_text


def test_seeded_sampling_repeats(client):
    a = complete(client, max_tokens=20, temperature=1.0, seed=7).json["choices"][0]["text"]
    b = complete(client, max_tokens=20, temperature=1.0, seed=7).json["choices"][0]["text"]
    assert a == b


def test_a_stop_string_ends_the_text_before_it(client):
    full = complete(client, max_tokens=30, temperature=0).json["choices"][0]["text"]
    stop = full.split()[3]
    body = complete(client, max_tokens=30, temperature=0, stop=[stop]).json
    assert body["choices"][0]["finish_reason"] == "stop" and full.startswith(body["choices"][0]["text"])
    assert stop not in body["choices"][0]["text"]


def test_context_overflow_uses_the_model_context(client):
    r = client.post_json("/v1/completions", {"model": "stories260K", "prompt": "word " * 600}, status=400)
    assert r.json["error"]["code"] == "context_length_exceeded" and "512" in r.json["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, direct):
    ids = direct.encode("word " * 600, add_bos=direct.add_bos)
    head = ids[:1] if direct.add_bos else []
    kept = head + ids[-(100 - len(head)):]
    body = {"model": "stories260K", "max_tokens": 8, "temperature": 0}
    cut = client.post_json("/v1/completions", dict(body, prompt="word " * 600, truncate_prompt_tokens=100)).json
    want = client.post_json("/v1/completions", dict(body, prompt=kept)).json
    assert cut["usage"]["prompt_tokens"] == 100 and cut["choices"] == want["choices"]
    by_ids = client.post_json("/v1/completions", dict(body, prompt=ids, truncate_prompt_tokens=100)).json
    assert by_ids["usage"]["prompt_tokens"] == 100         # client ids: the plain last 100
    short = client.post_json("/v1/completions", dict(body, prompt=PROMPT, truncate_prompt_tokens=100)).json
    assert short["usage"]["prompt_tokens"] == len(direct.encode(PROMPT, add_bos=direct.add_bos))


@pytest.mark.parametrize("value, words", [(0, "-1 (the model's limit) or at least 1"), (-2, ">= -1"),
                                          (513, "is 513; this model's context length is 512"),
                                          ("5", "integer"), (-1, "but the prompt has 512 tokens")])
def test_truncate_prompt_tokens_refusals(client, value, words):
    r = client.post_json("/v1/completions", {"model": "stories260K", "prompt": "word " * 600,
                                             "truncate_prompt_tokens": value}, status=400)
    assert words in r.json["error"]["message"], r.json


def test_the_generation_model_embeds_too(client, direct):
    texts = ["Once upon a time", "東京", "The little dog ran to the park"]
    doc = client.post_json("/v1/embeddings", {"model": "stories260K", "input": texts}).json
    got = np.array([d["embedding"] for d in doc["data"]], dtype=np.float32)
    seqs = direct.encode_batch(texts)
    assert got.shape == (3, 64) and doc["usage"]["prompt_tokens"] == sum(map(len, seqs))
    np.testing.assert_allclose(got, direct.embed(seqs), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    by_ids = client.post_json("/v1/embeddings", {"model": "stories260K", "input": seqs[2]}).json
    np.testing.assert_allclose(by_ids["data"][0]["embedding"], got[2], atol=1e-6)
    cut = client.post_json("/v1/embeddings", {"model": "stories260K", "input": "word " * 600,
                                              "truncate_prompt_tokens": -1}).json
    assert cut["usage"]["prompt_tokens"] == 512


@pytest.mark.parametrize("body, words", [({"input": "word " * 600}, "input has 1802 tokens; this model embeds at most 512"),
                                         ({"input": [[5, 32000]]}, "token id 32000 is outside the vocabulary"),
                                         ({"input": "a", "dimensions": 8}, "Matryoshka")])
def test_embedding_refusals_on_the_generation_model(client, body, words):
    err = client.post_json("/v1/embeddings", {"model": "stories260K", **body}, status=400).json["error"]
    assert words in err["message"], err


def test_health_and_models_after_load(client):
    complete(client, max_tokens=1)
    health = client.get("/health").json
    assert health["status"] == "ok" and health["backend"] == "numpy" and health["max_context"] == 512
    model = next(m for m in client.get("/v1/models").json["data"] if m["id"] == "stories260K")
    assert model["kind"] == "generation" and model["capabilities"] == ["generation", "embedding"]

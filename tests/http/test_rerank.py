"""POST /v1/rerank (and /rerank, /v2/rerank) and /v1/score on a tiny random cross-encoder in the
models directory (tests/cross_encoders.py), through the whole app: shapes, order, limits and every
hostile value answered 4xx in OpenAI's envelope; stories260K (skipped when absent) as the
generation model that cannot rerank."""
import os
from pathlib import Path

import numpy as np
import pytest
from cross_encoders import build_cross_encoder

pytest.importorskip("transformers")
STORIES = Path(os.environ.get("TURBOSPARK_TEST_MODELS", "/work/shared/models")) / "stories260K.gguf"
M = "tiny-reranker"
QUERY = "what is the capital of france"
DOCS = ["the cat sits on the mat", "paris is the capital city of france", "stock market fell",
        "berlin is the capital of germany", ""]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    build_cross_encoder(root / M)
    if STORIES.is_file():
        (root / "stories260K.gguf").symlink_to(STORIES)
    return root


@pytest.fixture(scope="module")
def client(root):
    import webtest
    from turbospark_wsgi.config import Config
    from turbospark_wsgi.http.app import create_app
    config = Config(models_dir=str(root), model=M, device="cpu", load_default=False, max_body=1 << 20)
    return webtest.TestApp(create_app(config))


@pytest.fixture(scope="module")
def direct(root):
    from turbospark_wsgi.engine.cross_encoder import load_cross_encoder
    return load_cross_encoder(str(root / M))


def want_scores(direct, pairs):
    return direct.score(direct.encode_pairs(pairs)[0])


def rerank(client, path="/v1/rerank", status=200, **body):
    return client.post_json(path, {"model": M, "query": QUERY, "documents": DOCS, **body}, status=status).json


def test_rerank_orders_every_document_best_first(client, direct):
    doc = rerank(client)
    assert set(doc) == {"id", "model", "results", "usage"} and doc["model"] == M and doc["id"].startswith("rerank-")
    results = doc["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    want = want_scores(direct, [(QUERY, d) for d in DOCS])
    np.testing.assert_allclose([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])], want,
                               atol=1e-6)
    assert all(r["document"] == {"text": DOCS[r["index"]]} and r["truncated"] is False for r in results)
    tokens = sum(len(ids) for ids, _ in direct.encode_pairs([(QUERY, d) for d in DOCS])[0])
    assert doc["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_top_n_return_documents_and_text_objects(client):
    full = rerank(client)["results"]
    top = rerank(client, top_n=2, return_documents=False)["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]] and all("document" not in r for r in top)
    assert len(rerank(client, top_n=99)["results"]) == len(DOCS)
    objects = rerank(client, documents=[{"text": d} for d in DOCS])["results"]
    assert [(r["index"], r["relevance_score"]) for r in objects] == [(r["index"], r["relevance_score"]) for r in full]


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_the_aliases_answer_as_v1(client, path):
    assert [r["index"] for r in rerank(client, path)["results"]] == [r["index"] for r in rerank(client)["results"]]


def test_a_long_document_is_cut_and_says_so(client, direct):
    long = "flour eggs and sugar " * 100
    results = rerank(client, documents=["paris", long])["results"]
    cut = {r["index"]: r["truncated"] for r in results}
    assert cut == {0: False, 1: True}
    assert rerank(client, documents=[long])["usage"]["total_tokens"] == direct.max_tokens


def test_score_one_against_many_and_pairwise(client, direct):
    doc = client.post_json("/v1/score", {"model": M, "text_1": QUERY, "text_2": DOCS}).json
    assert doc["object"] == "list" and doc["model"] == M and isinstance(doc["created"], int)
    assert [d["index"] for d in doc["data"]] == list(range(len(DOCS)))
    assert all(d["object"] == "score" for d in doc["data"])
    np.testing.assert_allclose([d["score"] for d in doc["data"]], want_scores(direct, [(QUERY, d) for d in DOCS]),
                               atol=1e-6)
    firsts = ["what is the capital of france", "how to bake a cake", "who won the game"]
    seconds = ["paris", "flour eggs sugar", "the match ended in a draw"]
    pairwise = client.post_json("/v1/score", {"model": M, "text_1": firsts, "text_2": seconds}).json["data"]
    np.testing.assert_allclose([d["score"] for d in pairwise], want_scores(direct, list(zip(firsts, seconds))),
                               atol=1e-6)
    one = client.post_json("/v1/score", {"model": M, "text_1": [QUERY], "text_2": "paris"}).json["data"]
    assert len(one) == 1 and one[0]["truncated"] is False


def test_models_say_it_reranks(client):
    kinds = {m["id"]: (m["kind"], m["capabilities"]) for m in client.get("/v1/models").json["data"]}
    assert kinds[M] == ("rerank", ["rerank"])


def test_other_routes_refuse_the_reranker_naming_its_kind(client):
    for path, body, code in (("/v1/embeddings", {"input": "hi"}, "model_not_embedding"),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                              "model_not_generative"),
                             ("/v1/completions", {"prompt": "hi"}, "model_not_generative")):
        err = client.post_json(path, {"model": M, **body}, status=400).json["error"]
        assert err["code"] == code and err["param"] == "model" and "rerank model" in err["message"], (path, err)


HUGE = "cat " * 200_000         # 800 kB: under the body limit, far over the model's 64 tokens


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/rerank", {"model": "nope"}, 404, "model", "does not exist"),
    ("/v1/rerank", {"model": ""}, 400, "model", "empty"),
    ("/v1/rerank", {"documents": []}, 400, "documents", "empty array"),
    ("/v1/rerank", {"documents": "a"}, 400, "documents", "got string"),
    ("/v1/rerank", {"documents": None}, 400, "documents", "got null"),
    ("/v1/rerank", {"documents": ["a", 3]}, 400, "documents", "documents[1]"),
    ("/v1/rerank", {"documents": [{"txt": "a"}]}, 400, "documents", "documents[0]"),
    ("/v1/rerank", {"documents": ["a"] * 100_000}, 400, "documents", "TURBOSPARK_RERANK_MAX_DOCUMENTS"),
    ("/v1/rerank", {"top_n": 0}, 400, "top_n", ">= 1"),
    ("/v1/rerank", {"top_n": -3}, 400, "top_n", ">= 1"),
    ("/v1/rerank", {"top_n": "2"}, 400, "top_n", "integer"),
    ("/v1/rerank", {"top_n": 1.5}, 400, "top_n", "integer"),
    ("/v1/rerank", {"return_documents": "yes"}, 400, "return_documents", "boolean"),
    ("/v1/rerank", {"query": ""}, 400, "query", "empty"),
    ("/v1/rerank", {"query": None}, 400, "query", "got null"),
    ("/v1/rerank", {"query": ["a"]}, 400, "query", "got array"),
    ("/v1/rerank", {"query": HUGE}, 400, "query", "200000 tokens; this model scores at most 64"),
    ("/v2/rerank", {"query": "cat " * 62}, 400, "query", "leaves no room"),
    ("/v1/score", {"text_1": []}, 400, "text_1", "empty array"),
    ("/v1/score", {"text_2": None}, 400, "text_2", "got null"),
    ("/v1/score", {"text_2": ["a", 1]}, 400, "text_2", "holding integer"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "text_2", "2 texts and 'text_2' 3"),
    ("/v1/score", {"text_1": ["a", "cat " * 70]}, 400, "text_1", "'text_1[1]' has 70 tokens"),
    ("/v1/score", {"text_2": ["a"] * 100_000}, 400, "text_2", "TURBOSPARK_RERANK_MAX_DOCUMENTS"),
])
def test_hostile_values_are_4xx_in_the_envelope_and_the_next_request_is_served(client, path, body, status, param,
                                                                               words):
    base = {"model": M, "query": QUERY, "documents": DOCS} if "rerank" in path else \
        {"model": M, "text_1": ["a", "b"], "text_2": ["c", "d"]}
    err = client.post_json(path, {**base, **body}, status=status).json
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param and words in err["error"]["message"], err
    assert len(rerank(client)["results"]) == len(DOCS)        # and a neighbouring request is served


def test_huge_documents_are_cut_not_refused(client):
    results = rerank(client, documents=[HUGE, "paris"])["results"]
    assert {r["index"]: r["truncated"] for r in results} == {0: True, 1: False}


def test_a_body_over_the_limit_is_413(client):
    err = rerank(client, status=413, documents=["cat " * 300_000])["error"]
    assert err["code"] == "request_too_large"


@pytest.mark.skipif(not STORIES.is_file(), reason=f"{STORIES} absent")
def test_a_generation_model_cannot_rerank(client):
    for path, body in (("/v1/rerank", {"query": "q", "documents": ["d"]}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"})):
        err = client.post_json(path, {"model": "stories260K", **body}, status=400).json["error"]
        assert err["code"] == "model_not_reranker" and err["param"] == "model" and "'stories260K'" in err["message"]
    assert len(rerank(client)["results"]) == len(DOCS)

"""POST /v1/rerank (Cohere's, Jina's and vLLM's shape) and POST /v1/score (vLLM's): the body in, a
ScoreRequest of text pairs out; the scores rendered.

    {"query": str, "documents": [str | {"text": str}, ...], "model"?, "top_n"?, "return_documents"?}
    -> {"id", "model", "usage": {"prompt_tokens", "total_tokens"},
        "results": [{"index", "relevance_score", "truncated", "document"?: {"text"}}, ...]}   best first

    {"text_1": str | [str, ...], "text_2": str | [str, ...], "model"?}     one against N, or N pairs
    -> {"id", "object": "list", "created", "model", "usage": {...},
        "data": [{"index", "object": "score", "score", "truncated"}, ...]}                  pair order
"""
import time
import uuid
from dataclasses import dataclass

from ...errors import InvalidRequest
from ...serving.service import ScoreRequest
from .common import expect_object, model_name, opt_bool, opt_int, type_name

LIMIT_NAME = "TURBOSPARK_RERANK_MAX_DOCUMENTS"


@dataclass(slots=True)
class RerankView:
    """What the rerank reply shows besides the scores."""

    top_n: int                  # results kept, best first (at most the documents' count)
    documents: list | None      # the documents' texts, echoed in each result; None: not echoed


def parse_rerank(doc, max_documents):
    """-> (ScoreRequest of (query, document) pairs, RerankView). `max_documents`: RERANK_MAX_DOCUMENTS."""
    expect_object(doc)
    model = model_name(doc)
    query = doc.get("query")
    if not isinstance(query, str):
        raise InvalidRequest(f"'query' must be a string, got {type_name(query)}", param="query")
    if not query:
        raise InvalidRequest("'query' must not be an empty string", param="query")
    texts = _documents(doc.get("documents"), max_documents)
    top_n = opt_int(doc, "top_n", len(texts), lo=1)
    echo = opt_bool(doc, "return_documents", True)
    request = ScoreRequest(model=model, pairs=[(query, t) for t in texts], first_param="query")
    return request, RerankView(min(top_n, len(texts)), texts if echo else None)


def _documents(value, max_documents):
    """The texts of `documents`: strings or {"text": str} objects (Cohere's and Jina's), at least one."""
    if not isinstance(value, list):
        raise InvalidRequest(f"'documents' must be an array of strings or {{\"text\": ...}} objects, got "
                             f"{type_name(value)}", param="documents")
    if not value:
        raise InvalidRequest("'documents' must not be an empty array", param="documents")
    _check_count("documents", len(value), max_documents)
    texts = []
    for i, d in enumerate(value):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise InvalidRequest(f"documents[{i}] must be a string or an object with a string 'text', got "
                                 f"{type_name(d)}", param="documents")
        texts.append(text)
    return texts


def parse_score(doc, max_pairs):
    """-> ScoreRequest: text_1 one text against each of text_2, or text_1[i] with text_2[i]."""
    expect_object(doc)
    model = model_name(doc)
    first, second = _texts(doc, "text_1", max_pairs), _texts(doc, "text_2", max_pairs)
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise InvalidRequest(f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: give one text_1, or "
                             f"as many as text_2 (scored pairwise)", param="text_2")
    return ScoreRequest(model=model, pairs=list(zip(first, second)), first_param="text_1")


def _texts(doc, name, most):
    value = doc.get(name)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        shown = type_name(value) if not isinstance(value, list) else "an array holding " + next(
            type_name(t) for t in value if not isinstance(t, str))
        raise InvalidRequest(f"'{name}' must be a string or an array of strings, got {shown}", param=name)
    if not value:
        raise InvalidRequest(f"'{name}' must not be an empty array", param=name)
    _check_count(name, len(value), most)
    return list(value)


def _check_count(name, n, most):
    if n > most:
        raise InvalidRequest(f"'{name}' holds {n} items; this server scores at most {most} per request "
                             f"({LIMIT_NAME})", param=name)


def rerank_body(result, view):
    """The reply: the `view.top_n` best documents, highest relevance_score first (ties in input order)."""
    order = sorted(range(len(result.scores)), key=lambda i: -result.scores[i])[:view.top_n]
    results = []
    for i in order:
        item = {"index": i, "relevance_score": result.scores[i], "truncated": result.truncated[i]}
        if view.documents is not None:
            item["document"] = {"text": view.documents[i]}
        results.append(item)
    return {"id": "rerank-" + uuid.uuid4().hex, "model": result.model, "results": results,
            "usage": _usage(result)}


def score_body(result):
    data = [{"index": i, "object": "score", "score": s, "truncated": cut}
            for i, (s, cut) in enumerate(zip(result.scores, result.truncated))]
    return {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
            "model": result.model, "data": data, "usage": _usage(result)}


def _usage(result):
    return {"prompt_tokens": result.tokens, "total_tokens": result.tokens}

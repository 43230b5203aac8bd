"""POST /v1/rerank (also /rerank, llama.cpp's, and /v2/rerank, Cohere's) and POST /v1/score (vLLM's):
relevance scores of text pairs from a cross-encoder model."""
from ..middleware import read_json
from ..schemas import rerank
from . import metered


class Rerank:
    def __init__(self, service, config):
        self._service = service
        self._max_body = config.max_body
        self._max_documents = config.rerank_max_documents

    def on_post(self, req, resp):
        request, view = rerank.parse_rerank(read_json(req, self._max_body), self._max_documents)
        result = metered(self._service, req, self._service.score, request, lambda r: r.tokens)
        resp.media = rerank.rerank_body(result, view)


class Score(Rerank):
    def on_post(self, req, resp):
        request = rerank.parse_score(read_json(req, self._max_body), self._max_documents)
        result = metered(self._service, req, self._service.score, request, lambda r: r.tokens)
        resp.media = rerank.score_body(result)

"""POST /v1/embeddings: sentence embeddings from an embedding model (OpenAI shape)."""
from ..middleware import caller, read_json
from ..schemas import embeddings


class Embeddings:
    def __init__(self, service, config):
        self._service = service
        self._max_body = config.max_body
        self._max_inputs = config.max_embedding_inputs

    def on_post(self, req, resp):
        request, fmt = embeddings.parse_embeddings(read_json(req, self._max_body), self._max_inputs)
        who = caller(req)
        request.background = who.background
        permit = self._service.limits.admit(who.digest, who.address)
        result = permit.call(self._service.embed, request)
        permit.settle(result.prompt_tokens)
        req.context.limits = permit
        resp.media = embeddings.embeddings_body(result, fmt)

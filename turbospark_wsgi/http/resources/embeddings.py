"""POST /v1/embeddings: sentence embeddings from an embedding model (OpenAI shape)."""
from ..middleware import caller, read_json
from ..schemas import embeddings
from . import metered


class Embeddings:
    def __init__(self, service, config):
        self._service = service
        self._max_body = config.max_body
        self._max_inputs = config.max_embedding_inputs

    def on_post(self, req, resp):
        request, fmt = embeddings.parse_embeddings(read_json(req, self._max_body), self._max_inputs)
        request.background = caller(req).background     # a batch line's: below live requests
        result = metered(self._service, req, self._service.embed, request, lambda r: r.prompt_tokens)
        resp.media = embeddings.embeddings_body(result, fmt)

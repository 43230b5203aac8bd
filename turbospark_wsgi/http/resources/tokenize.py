"""POST /tokenize and /detokenize, GET /tokenizer_info: the model's tokenizer, exactly as the
generation routes use it."""
from ..middleware import read_json
from ..schemas import tokenize


class Tokenize:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        # NOTE(tokenize): messages go through the chat route's own planning, so count == its usage.prompt_tokens
        ids, max_len = self._service.tokenize(tokenize.parse_tokenize(read_json(req, self._max_body)))
        resp.media = tokenize.tokenize_body(ids, max_len)


class Detokenize:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        model, ids = tokenize.parse_detokenize(read_json(req, self._max_body))
        resp.media = tokenize.detokenize_body(self._service.detokenize(model, ids))


class TokenizerInfo:
    """vLLM's GET /tokenizer_info, which lm-eval's remote tokenizer backend reads."""

    def __init__(self, service):
        self._service = service

    def on_get(self, req, resp):
        model = tokenize.parse_tokenizer_info(req.params)
        info = self._service.tokenizer_info(model)
        resp.media = tokenize.tokenizer_info_body(info, model or self._service.default_model)

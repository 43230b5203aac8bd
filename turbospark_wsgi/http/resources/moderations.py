"""POST /v1/moderations: the caller's input guardrail rules (TURBOSPARK_GUARDRAILS) run over the
given text, in OpenAI's shape: one category per rule id, `flagged` when any rule matches. Nothing is
blocked, redacted or counted here; it is a question, not a request to the model."""
from ..middleware import caller, read_json
from ..schemas import moderations


class Moderations:
    def __init__(self, service, config):
        self._service = service
        self._max_body = config.max_body
        self._max_inputs = config.max_embedding_inputs

    def on_post(self, req, resp):
        inputs, model = moderations.parse_inputs(read_json(req, self._max_body), self._max_inputs)
        rules = self._service.guardrails.rules_for(caller(req).digest, None)
        resp.media = moderations.moderations_body(inputs, model, rules)

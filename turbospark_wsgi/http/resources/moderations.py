"""POST /v1/moderations: the caller's input guardrail rules (TURBOSPARK_GUARDRAILS) run over the
given text, in OpenAI's shape: one category per rule id, `flagged` when any rule matches. Nothing is
blocked, redacted or counted here; it is a question, not a request to the model."""
import uuid

from ..middleware import caller, read_json
from ..schemas.checks import fail

MODEL = "turbospark-guardrails"


def parse_inputs(doc, max_inputs):
    """`input` -> [[text, ...], ...]: one result per string of a string list; a list of content
    parts (OpenAI's multi-modal input) is one input whose text parts are checked together."""
    if not isinstance(doc, dict):
        fail(None, "The request body must be a JSON object.")
    value = doc.get("input")
    if value is None:
        fail("input", "Missing required parameter: 'input'.")
    model = doc.get("model", MODEL)
    if not isinstance(model, str):
        fail("model", "'model' must be a string.")
    if isinstance(value, str):
        return [[value]], model
    if not isinstance(value, list) or not value:
        fail("input", "'input' must be a string, an array of strings or an array of content parts.")
    if len(value) > max_inputs:
        fail("input", f"'input' has {len(value)} items; at most {max_inputs} are allowed.")
    if all(isinstance(v, str) for v in value):
        return [[v] for v in value], model
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
            fail(f"input[{i}]", f"'input[{i}]' must be a content part of type 'text' or 'image_url'.")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                fail(f"input[{i}].text", f"'input[{i}].text' must be a string.")
            texts.append(part["text"])
    return [texts], model


class Moderations:
    def __init__(self, service, config):
        self._service = service
        self._max_body = config.max_body
        self._max_inputs = config.max_embedding_inputs

    def on_post(self, req, resp):
        inputs, model = parse_inputs(read_json(req, self._max_body), self._max_inputs)
        rules = self._service.guardrails.rules_for(caller(req).digest, None)
        ids = [r.id for r in rules.rules if r.applies("input")] if rules is not None else []
        resp.media = {"id": "modr-" + uuid.uuid4().hex, "model": model,
                      "results": [self._result(texts, rules, ids) for texts in inputs]}

    @staticmethod
    def _result(texts, rules, ids):
        hit = set().union(*(rules.moderate(t) for t in texts)) if rules is not None else set()
        return {"flagged": bool(hit), "categories": {i: i in hit for i in ids},
                "category_scores": {i: float(i in hit) for i in ids},
                "category_applied_input_types": {i: ["text"] if i in hit else [] for i in ids}}

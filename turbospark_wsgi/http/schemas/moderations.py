"""POST /v1/moderations: the body checked (OpenAI's shape: `input` a string, strings, or content
parts) and the result rendered, one category per input guardrail rule of the caller."""
import uuid

from .checks import fail

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


def moderations_body(inputs, model, rules):
    """The response for [[text, ...], ...]: `rules` the caller's RuleSet, or None (no rule applies)."""
    ids = [r.id for r in rules.rules if r.applies("input")] if rules is not None else []
    return {"id": "modr-" + uuid.uuid4().hex, "model": model,
            "results": [_result(texts, rules, ids) for texts in inputs]}


def _result(texts, rules, ids):
    hit = set().union(*(rules.moderate(t) for t in texts)) if rules is not None else set()
    return {"flagged": bool(hit), "categories": {i: i in hit for i in ids},
            "category_scores": {i: float(i in hit) for i in ids},
            "category_applied_input_types": {i: ["text"] if i in hit else [] for i in ids}}

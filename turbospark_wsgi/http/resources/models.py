"""GET /v1/models and /v1/models/{model_id}: installed models and aliases, OpenAI list shape."""
from ...errors import ModelNotFound
from ..schemas import openai


class Models:
    def __init__(self, service):
        self._service = service

    def on_get(self, req, resp):
        infos = self._service.models()
        resp.media = {"object": "list", "data": [_model(i) for i in infos]}


class Model:
    def __init__(self, service):
        self._service = service

    def on_get(self, req, resp, model_id):
        info = next((i for i in self._service.models() if i.id == model_id), None)
        if info is None:
            raise ModelNotFound(f"The model '{model_id}' does not exist or is not installed", param="model")
        resp.media = _model(info)


def _model(info):
    """The OpenAI model object plus `loaded` (whether it is in memory now), `kind` (generation or
    embedding: what the model is), `capabilities` (the routes it serves: a generation model
    embeds too) and, for a loaded generation model, `chat_template` (whether its template passed
    the load's probe: `usable`, and the `reason` where it did not); a LoRA adapter's `parent` is
    its base model's id (vLLM's field)."""
    extra = {"chat_template": info.chat_template} if info.chat_template is not None else {}
    if info.parent:
        extra["parent"] = info.parent
    return dict(openai.model_object(info), loaded=info.loaded, kind=info.kind,
                capabilities=list(info.capabilities), **extra)

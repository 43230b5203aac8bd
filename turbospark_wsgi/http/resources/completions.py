"""POST /v1/completions: raw prompts (one or a list), no chat template, BOS by the model's own rule
(see DEVIATIONS.md)."""
from ...serving.generation import collect_choices
from ..middleware import caller, read_json
from ..schemas import openai
from . import begin, client_gone, finish, stream_response


class Completions:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        self._service.check_room(*caller(req).queue_as)   # NOTE(overload): a full server says so before any work
        # NOTE(order): every check that needs no model runs in parse_completion, before the
        # service resolves (and maybe loads) the model.
        gen, degraded = openai.parse_completion(read_json(req, self._max_body), self._service.config.max_prompts)
        events, watcher = begin(self._service, req, gen)
        if degraded:
            resp.set_header(openai.DEGRADATION_HEADER, ", ".join(degraded))
        meta = openai.response_meta("cmpl-", gen.model or self._service.default_model, gen.include_usage)
        meta.prompt_filters = gen.guardrails
        if gen.stream:
            stream_response(resp, openai.completion_stream(events, meta), events, watcher, openai.error_event)
            return
        choices, finished = finish(events, watcher, collect_choices)
        if finished is None:
            client_gone(resp)
        else:
            resp.media = openai.completion_body(meta, choices, finished)

"""POST /v1/chat/completions: the model's chat template, tools, reasoning split, OpenAI shapes."""
from ..middleware import caller, read_json
from ..schemas import openai
from ..schemas.chat import parse_chat
from ..schemas.chat_render import ChatReply, chat_body, chat_stream, drain_choices
from . import begin, client_gone, finish, reply_parsers, stream_response


class ChatCompletions:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        self._service.check_room(*caller(req).queue_as)   # NOTE(overload): a full server says so before any work
        gen = parse_chat(read_json(req, self._max_body))
        events, watcher = begin(self._service, req, gen)
        # NOTE(model): the name the request used, as every route echoes it (DEVIATIONS.md)
        reply = ChatReply(gen.model or self._service.default_model, gen.include_usage, gen.chat.parallel_tool_calls,
                          gen.guardrails)
        make_parser = reply_parsers(events)
        if gen.stream:
            frames = chat_stream(reply, make_parser, events, gen.n)
            stream_response(resp, frames, events, watcher, openai.error_event)
            return
        choices, finished = finish(events, watcher, lambda e: drain_choices(make_parser, e))
        if finished is None:
            client_gone(resp)
        else:
            resp.media = chat_body(reply, None, finished, choices)

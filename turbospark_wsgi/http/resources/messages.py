"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API."""
from ..middleware import caller, read_json
from ..schemas.anthropic import parse_messages_request
from ..schemas.anthropic_render import MessageReply, error_event, message_body, message_stream
from ..schemas.chat_render import drain_choices
from . import begin, client_gone, finish, reply_parsers, stream_response


class Messages:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        self._service.check_room(*caller(req).queue_as)   # NOTE(overload): a full server says so before any work
        gen = parse_messages_request(read_json(req, self._max_body))
        events, watcher = begin(self._service, req, gen)
        reply = MessageReply(gen.model or self._service.default_model, gen.chat.parallel_tool_calls)
        make_parser = reply_parsers(events)
        if gen.stream:
            frames = message_stream(reply, make_parser, events, events.prompt_tokens)
            stream_response(resp, frames, events, watcher, error_event)
            return
        choices, finished = finish(events, watcher, lambda e: drain_choices(make_parser, e))
        if finished is None:
            client_gone(resp)
        else:
            resp.media = message_body(reply, choices[0][0], finished)


class CountTokens:
    """input_tokens exactly as a real request with the same body would report them."""

    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        gen = parse_messages_request(read_json(req, self._max_body), count_only=True)
        resp.media = {"input_tokens": self._service.count_tokens(gen)}

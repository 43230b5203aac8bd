"""POST /v1/chat/completions: the model's chat template, tools, reasoning split, OpenAI shapes."""
from ..middleware import read_json
from ..parsers import OutputParser
from ..schemas import openai
from ..schemas.chat import generation_request, parse_chat
from ..schemas.chat_render import ChatReply, chat_body, chat_stream, drain, drain_choices
from ..schemas.tool_prompt import plan_output
from . import begin, client_gone, stream_response


def output_parser(request, plan):
    """The OutputParser for a request and its plan, already past the forced tool-call prefix."""
    parser = OutputParser(reasoning=getattr(request, "reasoning", True), in_reasoning=plan.in_reasoning,
                          tool_family=plan.tool_family)
    parser.feed(plan.assistant_prefix)     # NOTE(tools): the prefix is output the model did not have to write
    return parser


def plan_for(service, request):
    """Resolves the model (maybe loading it) and plans prompt and parsing against its template."""
    source = service.chat_template(request.model)
    return plan_output(source, request.messages, request.tools, request.tool_choice,
                       getattr(request, "reasoning", True))


def drain_generation(events, watcher, parser):
    try:
        return drain(parser, events)
    finally:
        events.close()
        watcher.stop()


class ChatCompletions:
    def __init__(self, service, max_body):
        self._service = service
        self._max_body = max_body

    def on_post(self, req, resp):
        self._service.check_room()          # NOTE(overload): a full server says so before any work
        # NOTE(order): parse_chat checks everything that needs no model before one is resolved.
        chat = parse_chat(read_json(req, self._max_body))
        plan = plan_for(self._service, chat)
        events, watcher = begin(self._service, req, generation_request(chat, plan))
        # NOTE(model): the name the request used, as every route echoes it (DEVIATIONS.md)
        reply = ChatReply(chat.model or self._service.default_model, chat.include_usage, chat.parallel_tool_calls)

        def make_parser():
            return output_parser(chat, plan)
        if chat.stream:
            frames = chat_stream(reply, make_parser, events, chat.n)
            stream_response(resp, frames, events, watcher, openai.error_event)
            return
        try:
            choices, finished = drain_choices(make_parser, events)
        finally:
            events.close()
            watcher.stop()
        if finished is None:
            client_gone(resp)
        else:
            resp.media = chat_body(reply, None, finished, choices)

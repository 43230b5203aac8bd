"""HTTP resources, one module per endpoint family, plus the few steps every generation route shares:

    gen = schemas.parse_*(read_json(req, max_body))   # every check that needs no model
    events, watcher = begin(service, req, gen)        # admission errors raise here, before any byte
    stream_response(resp, frames, events, watcher, error_event)   # or:
    body = finish(events, watcher, fold)              # fold(events) -> the body's parts; always closes

Chat-shaped routes read the reply through `reply_parsers(events)`: a fresh parser per choice, built
from the output plan the service made against the model's template.
"""
import functools
import logging

from ...errors import ApiError, EngineError
from ...serving.cancel import CancelToken, DisconnectWatcher
from ...serving.guarded import GuardedEvents, input_fields
from ...serving.guardrails import Blocked
from ..middleware import caller, request_id
from ..parsers import plan_parser
from ..sse import SSEStream

log = logging.getLogger("turbospark.http")

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
SSE_HEADERS = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499     # nginx's code for "client closed request"; nobody reads the body


def begin(service, req, gen, prefix="messages"):
    """Admits `gen` (eagerly: the input guardrails, the client's limits, then the service) and
    starts a disconnect watcher on the client socket. `prefix`: the request field of the messages,
    as input guardrails name it. What the input rules did is in `gen.guardrails`."""
    who = caller(req)
    gen.request_id, gen.client, gen.background = request_id(req), who.client, who.background
    if service.config.cache_per_key:
        gen.cache_salt = who.owner + gen.cache_salt     # NOTE(salt): 32 hex digits first, so never ambiguous
    rules = service.guardrails.rules_for(who.digest, req.path)
    if rules is not None and rules.input:
        # NOTE(order): a blocked prompt is refused before it costs the key a request or a queue place
        try:
            gen.guardrails = rules.check_input(input_fields(gen, prefix))
        except Blocked as e:
            req.context.guardrails = [(e.rule_id, "block")]
            raise
        req.context.guardrails = gen.guardrails
    permit = service.limits.admit(who.digest, who.address, anthropic=req.path.startswith("/v1/messages"))
    cancel = CancelToken()
    events = permit.call(service.run, gen, cancel)
    permit.meter(events)
    if rules is not None and rules.output:
        events = GuardedEvents(events, rules, gen.n * (len(gen.prompts) if gen.prompts else 1))
    req.context.generation, req.context.limits = events, permit
    return events, DisconnectWatcher(req.env, cancel).start()


def reply_parsers(events):
    """The chat-shaped routes' one parser hand-over: `make_parser()` gives a fresh OutputParser for
    a choice of `events` (the service's plan says how the reply reads)."""
    return functools.partial(plan_parser, events.plan)


def finish(events, watcher, fold):
    """Drains a non-streaming generation through `fold(events)`; always closes it and stops the watcher."""
    try:
        return fold(events)
    finally:
        events.close()
        watcher.stop()


def stream_response(resp, frames, events, watcher, error_event):
    """Sends `frames` as SSE; a mid-stream exception becomes `error_event(ApiError)`."""
    rid = events.request_id

    def on_error(exc):
        return error_event(as_api_error(exc, rid))

    def on_close():
        events.close()
        watcher.stop()

    resp.content_type = SSE_CONTENT_TYPE
    resp.set_headers(SSE_HEADERS)
    resp.stream = SSEStream(frames, on_error, on_close)


def client_gone(resp):
    resp.status = CLIENT_CLOSED
    resp.media = None


def as_api_error(exc, rid):
    if isinstance(exc, ApiError):
        return exc
    log.error("stream failed [request %s]", rid, exc_info=exc)
    return EngineError(f"The server had an error while generating (request id {rid})")


def metered(service, req, call, request, tokens):
    """`call(request)` within the caller's limits (admitted first, then charged `tokens(result)`
    tokens): the routes that answer in one piece without generating (embeddings, rerank, score)."""
    who = caller(req)
    permit = service.limits.admit(who.digest, who.address)
    result = permit.call(call, request)
    permit.settle(tokens(result))
    req.context.limits = permit
    return result

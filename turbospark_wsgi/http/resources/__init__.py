"""HTTP resources, one module per endpoint family, plus the few steps every generation route shares:

    gen = schemas.parse_*(read_json(req, max_body))   # every check that needs no model
    events, watcher = begin(service, req, gen)        # admission errors raise here, before any byte
    stream_response(resp, frames, events, watcher, error_event)   # or:
    body = finish(events, watcher, fold)              # fold(events) -> the body's parts; always closes

Chat-shaped routes read the reply through `events.plan.parser()` (the service planned it).
"""
import logging

from ...errors import ApiError, EngineError
from ...serving.cancel import CancelToken, DisconnectWatcher
from ..middleware import caller, request_id
from ..sse import SSEStream

log = logging.getLogger("turbospark.http")

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
SSE_HEADERS = {"Cache-Control": "no-cache, no-transform", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499     # nginx's code for "client closed request"; nobody reads the body


def begin(service, req, gen):
    """Admits `gen` (eagerly: the client's limits, then the service) and starts a disconnect watcher
    on the client socket."""
    who = caller(req)
    gen.request_id, gen.client = request_id(req), who.client
    if service.config.cache_per_key:
        gen.cache_salt = who.owner + gen.cache_salt     # NOTE(salt): 32 hex digits first, so never ambiguous
    permit = service.limits.admit(who.digest, who.address, anthropic=req.path.startswith("/v1/messages"))
    cancel = CancelToken()
    events = permit.call(service.run, gen, cancel)
    permit.meter(events)
    req.context.generation, req.context.limits = events, permit
    return events, DisconnectWatcher(req.env, cancel).start()


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

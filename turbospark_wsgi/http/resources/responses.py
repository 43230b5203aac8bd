"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: the OpenAI Responses API, served
by the chat path (template, tools, reasoning split, grammars) and a response store (response_store.py:
this worker's memory, or Redis shared by every replica), each response visible to its own key only."""
from ...errors import ApiError, InvalidRequest, NotFound
from ..middleware import caller, read_json
from ..schemas.responses import parse_responses
from ..schemas.responses_input import assistant_turn
from ..schemas.responses_render import ResponseReply, ResponseStream, response_body
from . import begin, client_gone, finish, reply_parsers, stream_response

# NOTE(params): the chat path names chat fields in its refusals; a Responses client sent these.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}


def not_found(response_id, param=None):
    return NotFound(f"Response with id '{response_id}' not found.", param=param,
                    code="previous_response_not_found" if param else "not_found")


class Responses:
    def __init__(self, service, store, max_body):
        self._service = service
        self._store = store
        self._max_body = max_body

    def on_post(self, req, resp):
        self._service.check_room(*caller(req).queue_as)   # NOTE(overload): a full server says so before any work
        # NOTE(order): the body and the stored history are checked before any model is resolved.
        request = parse_responses(read_json(req, self._max_body))
        owner = caller(req).owner
        parent = self._previous(request, owner)
        if request.store and parent is None:
            self._store.check()         # NOTE(outage): a store out of reach refuses before any work
        events, watcher = self._admit(req, request.generation(parent.history() if parent else []))
        reply = ResponseReply(request.model or self._service.default_model, request.echo)
        make_parser = reply_parsers(events)
        keep = self._keeper(request, owner, parent)
        if request.stream:
            stream = ResponseStream(reply, make_parser, request.parallel_tool_calls, keep)
            stream_response(resp, stream.frames(events), events, watcher, stream.error_frame)
            return
        body = finish(events, watcher, lambda e: response_body(reply, make_parser, e, request.parallel_tool_calls))
        if body is None:
            client_gone(resp)
            return
        keep(body)
        resp.media = body

    def _admit(self, req, gen):
        """(events, watcher) as chat admits a request; refusals name the Responses fields."""
        try:
            return begin(self._service, req, gen, prefix="input")
        except ApiError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise

    def _previous(self, request, owner):
        if request.previous_response_id is None:
            return None
        entry = self._store.get(owner, request.previous_response_id)
        if entry is None:
            raise not_found(request.previous_response_id, "previous_response_id")
        return entry

    def _keeper(self, request, owner, parent):
        """fn(body) that stores a finished response with its turn (not when `store` is false)."""
        def keep(body):
            if request.store:
                self._store.put(owner, body, request.input_messages + [assistant_turn(body["output"])], parent)
        return keep


class StoredResponse:
    """GET / DELETE /v1/responses/{response_id}: a stored response of the requesting key."""

    def __init__(self, store):
        self._store = store

    def on_get(self, req, resp, response_id):
        if req.get_param("stream", default="false").lower() not in ("false", "0"):
            raise InvalidRequest("Streaming a stored response again is not supported; GET it without "
                                 "'stream'.", param="stream")
        entry = self._store.get(caller(req).owner, response_id)
        if entry is None:
            raise not_found(response_id)
        resp.media = entry.body

    def on_delete(self, req, resp, response_id):
        if not self._store.delete(caller(req).owner, response_id):
            raise not_found(response_id)
        resp.media = {"id": response_id, "object": "response", "deleted": True}

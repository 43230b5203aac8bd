"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: the OpenAI Responses API, served
by the chat path (template, tools, reasoning split, grammars) and a per-worker store of responses."""
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import ApiError, InvalidRequest, NotFound
from ..middleware import caller, read_json
from ..schemas.responses import parse_responses
from ..schemas.responses_input import assistant_turn
from ..schemas.responses_render import ResponseReply, ResponseStream, response_body
from . import begin, client_gone, finish, stream_response

log = logging.getLogger("turbospark.http")

# NOTE(params): the chat path names chat fields in its refusals; a Responses client sent these.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}


@dataclass(slots=True)
class _Turn:
    """One response's messages (its input, then its output), linked to the turns before it."""

    messages: list
    parent: "_Turn | None"
    size: int                   # bytes of JSON of this turn and every turn before it

    def history(self):
        turns, turn = [], self
        while turn is not None:             # NOTE(iterative): conversations may be long
            turns.append(turn.messages)
            turn = turn.parent
        return [m for messages in reversed(turns) for m in messages]


@dataclass(slots=True)
class _Stored:
    body: dict
    turn: _Turn
    expires: float
    size: int


class ResponseStore:
    """Finished responses of this worker, for GET and `previous_response_id`: at most `size` of them
    holding at most `max_bytes` of JSON (a response counts its whole conversation), each for `ttl`
    seconds (0: until pushed out); the oldest go first. Thread-safe."""

    def __init__(self, size, max_bytes, ttl, clock=time.monotonic):
        self._size, self._max_bytes, self._ttl, self._clock = size, max_bytes, ttl, clock
        self._entries = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, body, messages, parent=None):
        """Keeps `body`; `messages` is its turn, after `parent` (the previous response's turn)."""
        own = len(json.dumps(messages)) + (parent.size if parent else 0)
        size = own + len(json.dumps(body))
        if not self._size:
            return
        if size > self._max_bytes:
            log.info("response %s not stored: %d bytes (TURBOSPARK_RESPONSES_STORE_BYTES is %d)",
                     body["id"], size, self._max_bytes)
            return
        expires = self._clock() + self._ttl if self._ttl else float("inf")
        with self._lock:
            self._entries[body["id"]] = _Stored(body, _Turn(messages, parent, own), expires, size)
            self._bytes += size
            self._evict()

    def get(self, response_id):
        """The stored entry (body, turn) or None when unknown, deleted, expired or pushed out."""
        with self._lock:
            self._evict()
            return self._entries.get(response_id)

    def delete(self, response_id):
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.size
            return entry is not None

    def _evict(self):
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now and len(self._entries) <= self._size and self._bytes <= self._max_bytes:
                return
            self._bytes -= self._entries.popitem(last=False)[1].size


def not_found(response_id, param=None):
    return NotFound(f"Response with id '{response_id}' not found.", param=param,
                    code="previous_response_not_found" if param else "not_found")


class Responses:
    def __init__(self, service, store, max_body):
        self._service = service
        self._store = store
        self._max_body = max_body

    def on_post(self, req, resp):
        self._service.check_room(caller(req).client)   # NOTE(overload): a full server says so before any work
        # NOTE(order): the body and the stored history are checked before any model is resolved.
        request = parse_responses(read_json(req, self._max_body))
        parent = self._previous(request)
        events, watcher = self._admit(req, request.generation(parent.history() if parent else []))
        reply = ResponseReply(request.model or self._service.default_model, request.echo)
        parser = events.plan.parser()
        keep = self._keeper(request, parent)
        if request.stream:
            stream = ResponseStream(reply, parser, request.parallel_tool_calls, keep)
            stream_response(resp, stream.frames(events), events, watcher, stream.error_frame)
            return
        body = finish(events, watcher, lambda e: response_body(reply, parser, e, request.parallel_tool_calls))
        if body is None:
            client_gone(resp)
            return
        keep(body)
        resp.media = body

    def _admit(self, req, gen):
        """(events, watcher) as chat admits a request; refusals name the Responses fields."""
        try:
            return begin(self._service, req, gen)
        except ApiError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise

    def _previous(self, request):
        if request.previous_response_id is None:
            return None
        entry = self._store.get(request.previous_response_id)
        if entry is None:
            raise not_found(request.previous_response_id, "previous_response_id")
        return entry.turn

    def _keeper(self, request, parent):
        """fn(body) that stores a finished response with its turn (not when `store` is false)."""
        def keep(body):
            if request.store:
                self._store.put(body, request.input_messages + [assistant_turn(body["output"])], parent)
        return keep


class StoredResponse:
    """GET / DELETE /v1/responses/{response_id}: a stored response of this worker."""

    def __init__(self, store):
        self._store = store

    def on_get(self, req, resp, response_id):
        if req.get_param("stream", default="false").lower() not in ("false", "0"):
            raise InvalidRequest("Streaming a stored response again is not supported; GET it without "
                                 "'stream'.", param="stream")
        entry = self._store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        resp.media = entry.body

    def on_delete(self, req, resp, response_id):
        if not self._store.delete(response_id):
            raise not_found(response_id)
        resp.media = {"id": response_id, "object": "response", "deleted": True}

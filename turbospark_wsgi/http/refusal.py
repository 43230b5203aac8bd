"""A full server's 503, and a body's 413 or 400, answered by the worker from a request's head alone.

When every running slot and every queue place is taken, a generation route refuses a request
before its first step anyway (`Service.check_room`). The worker asks the EarlyRefusal of the app it
serves (`deps_of(app).refusal`, deps.py) as soon as a request's head is in and, when it gets an
answer, writes it on the loop that read the head: no worker thread, no environ, no Falcon. It is
the app's answer byte for byte (status, envelope, Retry-After, request id, replica, CORS headers)
and logs the same access line and metrics.

Anything the app would answer otherwise goes the normal way: another method or route, a missing or
wrong API key (401), a Content-Length over the limit or not a plain number (413, 400), a chunked
body or `Expect` (the server's reader owns those), a header the app would see joined from several.
`refuse()` gives the app's 413 (or 400) for a body the worker's framing (framing.py) already knows
is over the limit (or unreadable), before anything of it is read: no `100 Continue`, no wait.

    early = deps_of(app).refusal                        # the app's own, built by create_app
    answer = early.answer("POST", "/v1/messages", [("x-api-key", "k"), ...], peer=("10.0.0.2", 5123))
    if answer is not None:                              # an Answer: the server is full
        send(answer.status, answer.headers, answer.body); answer.log()
"""
import json
import re
import time
from dataclasses import dataclass

import falcon

from ..errors import InvalidRequest, Overloaded, PayloadTooLarge
from .middleware import ApiKeyAuth, Cors, caller_of, presented_key, request_id_from, write_access

# Headers the app reads before it refuses (a second copy would reach it joined), and those the
# server refuses twice (400): with any of them repeated, the normal path answers.
_ONCE = frozenset(("authorization", "x-api-key", "x-request-id", "origin", "content-length",
                   "transfer-encoding", "expect", "host", "content-type", "x-forwarded-proto",
                   "x-forwarded-ssl", "x-forwarded-protocol"))
_NUMBER = re.compile(r"0|[1-9][0-9]{0,14}")
_BODY_ERRORS = {400: InvalidRequest, 413: PayloadTooLarge}


@dataclass(slots=True)
class Answer:
    status: str
    headers: list               # (name, value) pairs, without the server's own (Date, Connection)
    body: bytes
    request_id: str
    path: str
    started: float

    def log(self):
        """The access line and metrics the app writes for the same response."""
        write_access(self.request_id, "POST", self.path, int(self.status[:3]), self.started, route=self.path)


class EarlyRefusal:
    """An app's early answers: `check_room` raises Overloaded when full, `routes` are the POST routes
    whose first step is that check, `envelope_for(path)` the route's error body builder,
    `body_routes` the POST routes that read a JSON body (and refuse one over the limit). Each app
    has its own (AppDeps), which the worker serving it finds through the app."""

    def __init__(self, check_room, config, routes, envelope_for, body_routes=()):
        self._check_room = check_room
        self._routes = frozenset(routes)
        self._body_routes = frozenset(body_routes) | self._routes
        self._envelope_for = envelope_for
        self._max_body = config.max_body
        self._auth = ApiKeyAuth(config.api_keys)
        self._cors = Cors(config.cors_origins)
        self._replica = config.replica_id
        self._bodies = {}                   # (route, message, code) -> the envelope's bytes

    def answer(self, method, path, headers, peer=None):
        """The app's 503 for this head (`headers`: (name, value) pairs as sent, `peer` the socket's
        peer address as gunicorn has it), or None when the app would answer something else or the
        server has room."""
        caller = self._caller(method, path, headers, peer, self._routes)
        if caller is None:
            return None
        route, seen, who = caller
        if "transfer-encoding" in seen or "expect" in seen:
            return None
        length = seen.get("content-length")
        if length is not None and not (_NUMBER.fullmatch(length) and int(length) <= self._max_body):
            return None
        started = time.monotonic()
        try:        # NOTE(fair-share): the client as the app names it, or a spare place looks free
            self._check_room(who.client)
            return None
        except Overloaded as e:
            return self._answer(route, seen, e, started)

    def refuse(self, method, path, headers, peer, status, message):
        """The app's 413 (or 400) for a body that its head or first bytes already put over the
        limit (or that no reader can frame), in the route's envelope; None where the app would
        answer something else first (another route or method, a missing or wrong API key)."""
        caller = self._caller(method, path, headers, peer, self._body_routes)
        if caller is None:
            return None
        route, seen, _ = caller
        return self._answer(route, seen, _BODY_ERRORS[status](message), time.monotonic())

    def _caller(self, method, path, headers, peer, routes):
        """(route, {header: value}, Caller) for a POST to one of `routes` whose key the app accepts,
        with no header the app would see joined; else None."""
        if method != "POST":
            return None
        route = path[:-1] if path.endswith("/") else path    # NOTE(route): the app strips one too
        if route not in routes:
            return None
        seen = {}
        for name, value in headers:
            name = name.lower()
            if name in _ONCE:
                if name in seen:
                    return None
                seen[name] = value.strip(" \t")
        who = caller_of(presented_key(seen.get("authorization"), seen.get("x-api-key")), remote_addr(peer))
        if not self._auth.accepts(who.digest):
            return None
        return route, seen, who

    def _answer(self, route, seen, refused, started):
        """The app's response to `refused` (an ApiError) on `route`, with the headers it adds."""
        rid = request_id_from(seen.get("x-request-id"))
        key = (route, refused.status, refused.message, refused.code)
        body = self._bodies.get(key)
        if body is None:
            if len(self._bodies) > 256:
                self._bodies.clear()
            body = self._bodies[key] = json.dumps(self._envelope_for(route)(refused), ensure_ascii=False,
                                                  separators=(",", ":")).encode()
        out = [("content-type", "application/json"), ("content-length", str(len(body)))]
        out += [(name.lower(), value) for name, value in refused.headers.items()]
        out.append(("x-request-id", rid))
        if self._replica:
            out.append(("x-turbospark-replica", self._replica))
        out += self._cors.headers_for(seen.get("origin"))
        return Answer(falcon.code_to_http_status(refused.status), out, body, rid, route, started)


def remote_addr(peer):
    """WSGI's REMOTE_ADDR for a peer address as gunicorn sets it: the host of a (host, port) pair,
    a unix socket's path as given, else empty."""
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    if isinstance(peer, bytes):
        return peer.decode("utf-8", "replace")
    return peer if isinstance(peer, str) else ""

"""Request id, API keys, body size limit and the access log; `read_json` for request bodies."""
import hashlib
import hmac
import json
import logging
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from .. import metrics
from ..errors import InvalidRequest, PayloadTooLarge, Unauthorized, UnsupportedMediaType
from ..logsafe import escape
from ..serving.cancel import client_socket
from .schemas.document import check_body_text
from .sse import SSEStream

access_log = logging.getLogger("turbospark.access")

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_JSON_TYPES = ("application/json",)
_READ_BLOCK = 64 * 1024
BATCH_CALLER = "turbospark.batch_caller"    # the environ key of a batch line's Caller (see caller())
TIME_LIMIT_HEADER = "x-turbospark-time-limited"     # the generation hit TURBOSPARK_MAX_GENERATION_SECONDS


class RequestContext:
    """Gives each request an id (a valid `x-request-id` is kept), echoes it with the replica id,
    and logs one line (and records its metrics) when the response, or its stream, is done.
    `body_timeout` (s) is what `read_json` allows a body by default."""

    def __init__(self, replica_id=None, body_timeout=None):
        self._replica = replica_id
        self._body_timeout = body_timeout

    def process_request(self, req, resp):
        req.context.request_id = request_id_from(req.get_header("x-request-id"))
        req.context.started = time.monotonic()
        req.context.generation = None
        req.context.body_timeout = self._body_timeout

    def process_response(self, req, resp, resource, req_succeeded):
        resp.set_header("x-request-id", request_id(req))
        if self._replica:
            resp.set_header("x-turbospark-replica", self._replica)
        gen = getattr(req.context, "generation", None)
        if getattr(gen, "time_limited", False) and not isinstance(resp.stream, SSEStream):
            resp.set_header(TIME_LIMIT_HEADER, "true")
        permit = getattr(req.context, "limits", None)
        if permit is not None and resp.status_code < 400:
            resp.set_headers(permit.headers(anthropic=req.path.startswith("/v1/messages")))
        if isinstance(resp.stream, SSEStream):
            resp.stream.add_close_callback(lambda: log_access(req, resp))
        else:
            log_access(req, resp)


class ApiKeyAuth:
    """`Authorization: Bearer KEY` or `x-api-key: KEY` against the configured keys.

    Open without a key: `open_paths` (/health, /openapi.json, the chat page's files, which hold no
    data) and CORS preflights (OPTIONS), which browsers send without credentials. Keys are never logged.
    """

    def __init__(self, keys, open_paths=("/health", "/openapi.json", "/", "/ui/app.js", "/ui/style.css",
                                       "/ui/favicon.svg")):
        self._digests = [_digest(k) for k in keys]
        self._open = frozenset(open_paths)

    def process_request(self, req, resp):
        if not self._digests or req.path in self._open or req.method == "OPTIONS":
            return
        digest = caller(req).digest
        if digest is None:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                               headers={"WWW-Authenticate": "Bearer"})
        if not key_matches(digest, self._digests):
            raise Unauthorized("Incorrect API key provided", headers={"WWW-Authenticate": "Bearer"})

    def accepts(self, digest):
        """True when a request presenting a key with this sha256 `digest` (None: no key) passes on a
        route that needs one."""
        return not self._digests or digest is not None and key_matches(digest, self._digests)


def key_matches(probe, digests):
    """True if the key whose sha256 digest is `probe` is one of the keys whose digests are `digests`.

    NOTE(timing): fixed-length digests make `compare_digest` independent of the key's length, and
    every key is compared (no early exit), so the time taken says nothing about any key.
    """
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(probe, digest)
    return matched


def _digest(key):
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class Cors:
    """CORS for browser clients: answers preflights and adds the headers to every response,
    streams included (they are headers of the response that carries the stream).

    `origins`: allowed origins, or ("*",) for any. Empty: no CORS headers at all.
    """

    METHODS = "GET, POST, DELETE, OPTIONS"     # DELETE: /v1/responses/{id}
    HEADERS = ("Authorization, x-api-key, anthropic-version, anthropic-beta, content-type, x-request-id, "
               "x-session-affinity")     # the last: conversation affinity behind nginx (deploy/)
    EXPOSE = "x-request-id, x-anyllm-degradation, x-turbospark-replica, Retry-After"

    def __init__(self, origins):
        self._any = "*" in origins
        self._origins = frozenset(o.rstrip("/") for o in origins)

    def process_request(self, req, resp):
        if not self._origins or req.method != "OPTIONS":
            return
        if req.get_header("Access-Control-Request-Method") is None:
            return          # a plain OPTIONS: Falcon answers it with Allow
        resp.status = 204
        resp.set_header("Access-Control-Allow-Methods", self.METHODS)
        resp.set_header("Access-Control-Allow-Headers", self.HEADERS)
        resp.set_header("Access-Control-Max-Age", "600")
        resp.complete = True        # NOTE(cors): skip auth and the responder; process_response still runs

    def process_response(self, req, resp, resource, req_succeeded):
        for name, value in self.headers_for(req.get_header("Origin")):
            if name == "vary":
                resp.append_header(name, value)
            else:
                resp.set_header(name, value)

    def headers_for(self, origin):
        """The CORS headers of a response to a request from `origin` (None: not from a browser)."""
        if not self._origins or origin is None:
            return []
        if self._any:
            return [("access-control-allow-origin", "*"), ("access-control-expose-headers", self.EXPOSE)]
        if origin.rstrip("/") in self._origins:
            return [("access-control-allow-origin", origin), ("vary", "Origin"),
                    ("access-control-expose-headers", self.EXPOSE)]
        return []


class BodyLimit:
    """Refuses a declared Content-Length over the limit (`paths`: another limit for a route) before
    anything is read (413)."""

    def __init__(self, limit, paths=None):
        self._limit, self._paths = limit, dict(paths or {})

    def process_request(self, req, resp):
        length = req.content_length
        limit = self._paths.get(req.path, self._limit)
        if length is not None and length > limit:
            raise too_large(length, limit)


def read_json(req, limit, timeout=None):
    """The request body as decoded JSON, read with a size limit (chunked bodies too).

    415 for a non-JSON Content-Type, 413 over `limit`, 400 for an empty, short, badly framed,
    non-UTF-8 or malformed body, 408 when it is not all in within `timeout` seconds.
    """
    media = (req.content_type or "").split(";")[0].strip().lower()
    if media and media not in _JSON_TYPES and not media.endswith("+json"):
        raise UnsupportedMediaType(f"Content-Type must be application/json, got '{media}'")
    raw = read_body(req, limit, timeout)
    if not raw.strip():
        raise InvalidRequest("The request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"The request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return check_body_text(text, json.loads(text, parse_constant=_refuse_constant))
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"Invalid JSON body: {_short(e)}") from None


class RequestTimeout(InvalidRequest):
    status = 408
    code = "request_timeout"


def read_body(req, limit, timeout=None):
    """The whole body (Content-Length or chunked), within `limit` bytes and `timeout` seconds."""
    length = req.content_length
    if length is not None and length > limit:
        raise too_large(length, limit)
    if length == 0 or length is None and "chunked" not in (req.get_header("Transfer-Encoding") or "").lower():
        return b""
    timeout = timeout or getattr(req.context, "body_timeout", None)
    with ReadDeadline(req.env, timeout) as deadline:
        try:
            raw = _read_blocks(req.stream, limit + 1 if length is None else length)
        except Exception as e:
            # NOTE(framing): the server's reader raises its own types for a bad chunk size, a
            # missing CRLF or an early EOF (gunicorn.http.errors); every one is the client's doing.
            if deadline.expired:
                raise deadline.error() from None
            detail = _short(e) or type(e).__name__
            raise InvalidRequest(f"The request body could not be read: {detail}") from None
        if length is not None and len(raw) < length:
            if deadline.expired:
                raise deadline.error()
            raise InvalidRequest(f"The request body ended after {len(raw)} of its {length} bytes "
                                 "(Content-Length)")
    if length is None and len(raw) > limit:
        raise too_large(len(raw), limit, at_least=True)
    return raw


def _read_blocks(stream, most):
    """Up to `most` bytes from `stream`, until EOF."""
    # NOTE(chunked): Falcon bounds reads by Content-Length and reads a chunked body as empty; the
    # server de-chunks `wsgi.input`, so read it directly, one block past the limit at most.
    parts, size = [], 0
    while size < most:
        block = stream.read(min(_READ_BLOCK, most - size))
        if not block:
            break
        parts.append(block)
        size += len(block)
    return b"".join(parts)


class ReadDeadline:
    """Cuts the read side of the client's socket when a body takes longer than `timeout` seconds.

    A blocked read then ends at once (EOF), however the client trickles its bytes: a per-read
    socket timeout would restart with every byte. Without a socket in the environ (tests, other
    servers) it does nothing.
    """

    def __init__(self, environ, timeout):
        self._sock = client_socket(environ)
        self._timeout = timeout
        self._timer = None
        self.expired = False

    def __enter__(self):
        if self._sock is not None and self._timeout:
            self._timer = threading.Timer(self._timeout, self._cut)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc):
        if self._timer is not None:
            self._timer.cancel()
        return False

    def _cut(self):
        self.expired = True
        try:
            self._sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def error(self):
        return RequestTimeout(f"The request body was not received within {self._timeout:g} seconds")


def too_large(size, limit, at_least=False):
    what = f"at least {size}" if at_least else str(size)
    return PayloadTooLarge(f"The request body is too large ({what} bytes; the limit is {limit})")


def _refuse_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _short(exc):
    text = "nesting too deep" if isinstance(exc, RecursionError) else str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, for auth, limits, fair queueing, stored responses and cached prefixes."""

    digest: bytes | None    # sha256 of the API key it presents (None: none); never the key itself
    address: str            # its peer address (WSGI's REMOTE_ADDR)
    client: str             # its name for fair queueing: a digest of its key (any key, also on an
                            # open server), else its address
    background: bool = False    # a Batch API line run on its key's behalf (http/batch_runner.py)

    @property
    def queue_as(self):
        """(client, background): how its requests take their turn (Service.check_room)."""
        return self.client, self.background

    @property
    def owner(self):
        """Its key as stored responses and the prefix cache name it: the digest's first 128 bits
        in hex, as the limits name a key ("" without a key)."""
        return self.digest.hex()[:32] if self.digest is not None else ""


def caller(req):
    """The request's Caller: its key is read from the headers and hashed once per request."""
    found = getattr(req.context, "caller", None)
    if found is None:
        # NOTE(batch): only the batch runner, calling the app in this process, puts a Caller in the
        # environ; a client's request can set no such key (its headers arrive as HTTP_* keys)
        found = req.env.get(BATCH_CALLER) or caller_of(api_key(req), req.remote_addr)
        req.context.caller = found
    return found


def caller_of(given, remote_addr):
    """The Caller presenting API key `given` (or None) from peer address `remote_addr`."""
    address = remote_addr or ""
    if not given:
        return Caller(None, address, "addr:" + address)
    digest = _digest(given)
    return Caller(digest, address, "key:" + digest.hex()[:16])


def api_key(req):
    """The API key the request presents (`Authorization: Bearer` or `x-api-key`), or None."""
    return presented_key(req.get_header("Authorization"), req.get_header("x-api-key"))


def presented_key(authorization, x_api_key):
    """The API key of a request with these headers: `Authorization: Bearer KEY`, else `x-api-key`."""
    return _bearer(authorization) or x_api_key or None


def _bearer(header):
    if header and header[:7].lower() == "bearer ":
        return header[7:].strip()
    return None


def request_id_from(given):
    """A request's id: the client's `x-request-id` when it is a valid one, else a new id."""
    return given if given and _REQUEST_ID.fullmatch(given) else new_request_id()


def new_request_id():
    return "req-" + secrets.token_hex(12)


def request_id(req):
    return getattr(req.context, "request_id", None) or "-"


def log_access(req, resp):
    ctx = req.context
    gen = getattr(ctx, "generation", None)
    fired = list(getattr(ctx, "guardrails", None) or ()) + list(getattr(gen, "guardrails_fired", None) or ())
    write_access(request_id(req), req.method, req.path, resp.status_code, getattr(ctx, "started", None),
                 gen, req.uri_template, fired)


def write_access(rid, method, path, status, started, gen=None, route=None, guardrails=()):
    """One access line and the request's metrics; `started`: its time.monotonic() (None: now)."""
    elapsed = (time.monotonic() - (started or time.monotonic())) * 1000
    # NOTE(log-injection): the method, path and model come from the client; escaped, they cannot
    # start a line of their own or close the quotes around the request.
    line = f'"{_quoted(method)} {_quoted(path)}"'
    fields = [rid, line, status, f"{elapsed:.1f}ms"]
    if gen is not None:
        usage = gen.usage
        fields += [f"model={_token(gen.model_id)}",
                   f"prompt_tokens={usage.prompt_tokens if usage else '-'}",
                   f"completion_tokens={usage.completion_tokens if usage else '-'}",
                   f"queue_ms={_ms(gen.enqueued_at, gen.started_at)}",
                   f"ttft_ms={_ms(gen.enqueued_at, gen.first_token_at)}",
                   f"finish={gen.finish_reason or '-'}"]
    if guardrails:
        # NOTE(leak): the rules that acted, by id: never the text they matched
        # (before finish=, which ends a generation's line)
        named = "guardrails=" + ",".join(f"{rule}:{action}" for rule, action in dict.fromkeys(guardrails))
        fields.insert(len(fields) - (gen is not None), named)
    access_log.info(" ".join(str(f) for f in fields))
    metrics.record_request(route, method, status, elapsed / 1000, gen)


def _quoted(text):
    return escape(text).replace('"', '\\"')


def _token(text):
    return _quoted(text).replace(" ", "\\x20")


def _ms(start, end):
    return "-" if start is None or end is None else f"{(end - start) * 1000:.1f}"

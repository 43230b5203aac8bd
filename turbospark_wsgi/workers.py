"""gunicorn workers under which a slow client costs a buffer, not a worker thread.

`ThreadWorker` (gthread): a request's head, and a Content-Length body up to TURBOSPARK_MAX_BODY,
are read off the socket as they arrive, between trips back to the poller; a thread runs only once
the request is all there. `GeventWorker`: a connection may idle for the keep-alive time, but once
a request's first byte is in, its head must follow within TURBOSPARK_HEADER_TIMEOUT.

A head not complete within TURBOSPARK_HEADER_TIMEOUT, or a buffered body not complete within
TURBOSPARK_BODY_TIMEOUT, gets a 408 and the connection is closed.
"""
import contextlib
import heapq
import itertools
import json
import re
import select
import selectors
import socket
import time

from gunicorn import util
from gunicorn.http.errors import NoMoreData
from gunicorn.http2 import negotiation
from gunicorn.workers import ggevent, gthread

from .config import Config

_RECV = 256 * 1024
LINGER = 2.0                                # seconds a closed connection's input is drained, as gunicorn does
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_CONTENT_LENGTH = re.compile(rb"\ncontent-length[ \t]*:[ \t]*([0-9]{1,15})[ \t]*(?=\r?\n)", re.IGNORECASE)
_TRANSFER_ENCODING = re.compile(rb"\ntransfer-encoding[ \t]*:", re.IGNORECASE)
_EXPECT = re.compile(rb"\nexpect[ \t]*:", re.IGNORECASE)
_WAIT, _READY, _EXPIRED = "wait", "ready", "expired"
_DEFER = gthread._DEFER                     # a handle() result: park the connection on the poller


class ThreadWorker(gthread.ThreadWorker):
    """gthread that dispatches a request to a thread only when its head and body are buffered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = Config.from_env()
        self.header_timeout = config.header_timeout
        self.body_timeout = config.body_timeout
        self.max_body = config.max_body
        self.max_head = head_limit(self.cfg)
        self.deadlines = []                 # heap (when, seq, deadline, conn): parked requests to time out
        self.closing = []                   # heap (when, seq, socket): lingering closes to end
        self.lingering = set()
        self.seq = itertools.count()

    def handle(self, conn):
        if self.cfg.is_ssl or conn.is_http2 or negotiation.prior_knowledge_allowed(self.cfg, conn.client):
            return super().handle(conn)
        try:
            state = self.fill(conn)
        except OSError:
            return False                    # reset while buffering: nothing to answer
        if state is _WAIT:
            return _DEFER                   # back to the poller until more bytes arrive
        if state is _EXPIRED:
            self.refuse(conn)
            return False
        return super().handle(conn)

    def fill(self, conn):
        """Reads what the socket holds now into `conn.pending`; hands it to the parser when whole."""
        if not hasattr(conn, "pending"):
            conn.pending, conn.deadline = bytearray(), None
            conn.init()
        pending = conn.pending
        pending += take_buffered(conn.parser.unreader)
        eof = read_available(conn.sock, pending)
        state = _READY if eof else self.check(conn)
        if state is not _READY:
            return state
        conn.parser.unreader.unread(bytes(pending))
        conn.pending, conn.deadline = bytearray(), None
        return _READY

    def check(self, conn):
        """Whether `conn.pending` holds a whole request (_READY), needs more (_WAIT) or is late."""
        pending = conn.pending
        if not pending:
            return _WAIT
        head_end = find_head_end(pending)
        if head_end < 0:
            if len(pending) > self.max_head:
                return _READY               # over gunicorn's limits: its parser refuses it
            return _EXPIRED if late(conn, "head", self.header_timeout) else _WAIT
        length = body_length(pending[:head_end])
        if length is None or len(pending) >= head_end + min(length, self.max_body):
            return _READY
        return _EXPIRED if late(conn, "body", self.body_timeout) else _WAIT


    def finish_request(self, conn, fs):
        ok = not fs.cancelled() and fs.exception() is None
        result = fs.result() if ok else False
        if result is False:
            # NOTE(linger): gunicorn drains a closing connection for up to 2 s on the loop's only
            # thread, so a client that keeps sending would stall every other connection. The
            # poller drains it instead.
            self.nr_conns -= 1
            self.linger(conn.sock)
            return
        super().finish_request(conn, fs)
        conn.parked = result is _DEFER and self.alive
        deadline = getattr(conn, "deadline", None)
        if conn.parked and deadline:
            heapq.heappush(self.deadlines, (deadline[1], next(self.seq), deadline, conn))

    def on_pending_socket_readable(self, conn, client):
        conn.parked = False
        super().on_pending_socket_readable(conn, client)

    def murder_pending(self):
        """Also answers 408 to parked requests past their deadline, and ends lingering closes."""
        super().murder_pending()
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, deadline, conn = heapq.heappop(self.deadlines)
            if conn.parked and conn.deadline is deadline:
                self.expire(conn)
        while self.closing and self.closing[0][0] <= now:
            self.unlinger(heapq.heappop(self.closing)[2])

    def expire(self, conn):
        conn.parked = False
        try:
            self.pending_conns.remove(conn)
        except ValueError:
            return                          # already closed, idle past keepalive
        with contextlib.suppress(OSError, KeyError, ValueError):
            self.poller.unregister(conn.sock)
        self.nr_conns -= 1
        self.refuse(conn)
        self.linger(conn.sock)

    def refuse(self, conn):
        stage = conn.deadline[0] if conn.deadline else "head"
        self.log.debug("408 to %s: its request %s was not all in within the timeout", conn.client, stage)
        refuse_timeout(conn.sock, conn.pending)

    def linger(self, sock):
        """Sends FIN, then closes once the client stops sending (EOF) or after LINGER seconds."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self.poller.register(sock, selectors.EVENT_READ, self.drain)
        except (OSError, ValueError, KeyError):
            util.close(sock)
            return
        self.lingering.add(sock)
        heapq.heappush(self.closing, (time.monotonic() + LINGER, next(self.seq), sock))

    def drain(self, sock):
        try:
            if sock.recv(_RECV):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self.unlinger(sock)

    def unlinger(self, sock):
        if sock in self.lingering:
            self.lingering.discard(sock)
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.poller.unregister(sock)
            util.close(sock)


class GeventWorker(ggevent.GeventWorker):
    """gevent whose connections idle for the keep-alive time, then send a head within the limit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = Config.from_env().header_timeout
        self.connections = {}               # greenlet -> [client socket, parser's unreader or None]
        # NOTE(capacity): each connection is a greenlet and a socket buffer, so slow clients
        # cannot use up the pool before their timeouts end them.

    def handle(self, listener, client, addr):
        import gevent

        me = gevent.getcurrent()
        self.connections[me] = [client, None]
        try:
            super().handle(listener, client, addr)
        finally:
            self.connections.pop(me, None)

    def handle_request(self, listener_name, req, sock, addr):
        import gevent

        entry = self.connections.get(gevent.getcurrent())
        if entry is not None:
            entry[1] = req.unreader
        return super().handle_request(listener_name, req, sock, addr)

    @contextlib.contextmanager
    def timeout_ctx(self):
        """Around gunicorn's read of each request head: idle up to keepalive, then the head's limit."""
        import gevent

        client, unreader = self.connections.get(gevent.getcurrent(), (None, None))
        if client is None:
            with gevent.Timeout(self.cfg.keepalive, False):
                yield
            return
        buffered = unreader is not None and unreader.buf.getbuffer().nbytes > 0
        if not buffered and not readable(client, self.cfg.keepalive):
            raise NoMoreData(b"")           # idle past keepalive: gunicorn closes it quietly
        timer = gevent.Timeout(self.header_timeout)
        try:
            with timer:
                yield
        except gevent.Timeout as e:
            if e is not timer:
                raise
            refuse_timeout(client, b"")
            raise NoMoreData(b"") from None


def late(conn, stage, timeout):
    """True once `stage` of the request has taken longer than `timeout` (its clock starts now)."""
    now = time.monotonic()
    if conn.deadline is None or conn.deadline[0] != stage:
        conn.deadline = (stage, now + timeout)
    return now > conn.deadline[1]


def head_limit(cfg):
    """The largest head gunicorn's parser accepts: beyond it, buffering more is pointless."""
    line = cfg.limit_request_line if cfg.limit_request_line > 0 else 1024 * 1024
    fields = cfg.limit_request_fields if cfg.limit_request_fields > 0 else 32768
    field = cfg.limit_request_field_size if cfg.limit_request_field_size > 0 else 8190
    return line + fields * (field + 2) + 8


def take_buffered(unreader):
    """Bytes the parser read ahead (a pipelined request), taken out of it."""
    data = unreader.buf.getvalue()
    unreader.buf.seek(0)
    unreader.buf.truncate()
    return data


def read_available(sock, pending):
    """Appends what `sock` holds now, without waiting; True at EOF."""
    while True:
        try:
            data = sock.recv(_RECV, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        if not data:
            return True
        pending += data
        if len(data) < _RECV:
            return False


def find_head_end(pending):
    """Where the head ends (after its empty line), or -1; one leading empty line is allowed."""
    start = 2 if pending[:2] == b"\r\n" else 0
    match = _HEAD_END.search(pending, start)
    return match.end() if match else -1


def body_length(head):
    """The Content-Length to buffer, or None: chunked, unclear, or awaited by a client that expects
    a `100 Continue` first (gunicorn sends it when the app starts reading)."""
    if _TRANSFER_ENCODING.search(head) or _EXPECT.search(head):
        return None
    lengths = {m.group(1) for m in _CONTENT_LENGTH.finditer(head)}
    return int(lengths.pop()) if len(lengths) == 1 else None


def readable(sock, timeout):
    """True once `sock` has bytes or EOF, False after `timeout` seconds (cooperative under gevent)."""
    return bool(select.select([sock], [], [], timeout)[0])


def refuse_timeout(sock, pending):
    """A 408 in the route family's error envelope, sent only if the socket takes it at once."""
    anthropic = re.match(rb"[A-Z]+ /v1/messages[/?# ]", bytes(pending[:64])) is not None
    message = "The request was not received in time"
    if anthropic:
        body = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": "request_timeout"}}
    data = json.dumps(body).encode()
    head = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data))
    try:
        sock.send(head + data, socket.MSG_DONTWAIT)
    except OSError:
        pass

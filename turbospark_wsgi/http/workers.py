"""gunicorn workers under which a slow client costs a buffer, not a worker thread.

`ThreadWorker` (gthread): a request's head, and its body up to TURBOSPARK_MAX_BODY (Content-Length
or chunked), are read off the socket by the worker's loop as they arrive, framed by h11
(framing.py); a thread runs only once the request is all there (or its framing is for the server's
reader to refuse). `GeventWorker`: a connection may idle for the keep-alive time, but once a
request's first byte is in, its head must follow within TURBOSPARK_HEADER_TIMEOUT.

Under both, what the head (or a chunk's size line) alone decides is answered at once: the app's
413 for a body over the limit (before any `100 Continue`), its 400 for a chunk size over 64 bits;
a request line h11 refuses (HTTP/0.9) goes to gunicorn's parser as soon as it is in.

Under both, a full server's 503 to a generation request (refusal.py) is written as soon as the
request is in: by the loop itself under gthread; under gevent from the bytes the socket holds, before
gunicorn's parser runs (or, for a body that came later, before the environ is built). While the loop
answers such a burst the compute thread gives way (compute.FrontDoor), and each worker grows its
descriptor table before it starts a thread (reserve_descriptors). The early refusal and the door
are the app's (AppDeps): each worker finds them through the app it loaded (`self.wsgi`).

A head not complete within TURBOSPARK_HEADER_TIMEOUT, or a buffered body not complete within
TURBOSPARK_BODY_TIMEOUT, gets a 408 and the connection is closed.
"""
import contextlib
import errno
import fcntl
import heapq
import itertools
import json
import os
import re
import resource
import select
import selectors
import socket
import sys
import time
from concurrent import futures
from functools import partial

from gunicorn import SERVER, util
from gunicorn.http.errors import NoMoreData
from gunicorn.http2 import negotiation
from gunicorn.workers import ggevent, gthread

from ..config import Config
from ..serving import compute, registry
from .deps import deps_of
from .framing import REFUSE, WAIT, WHOLE, Framing

_RECV = 256 * 1024
LOG_DELAY = 0.5                             # seconds an early answer's access line may wait for a burst's end
# PERF(gil): a loop or hub thread that gives up the GIL for a syscall (accept, recv, send) waits up
# to the switch interval to get it back from the compute thread's Python between kernels. 5 ms
# (CPython's default) -> 0.5 ms: bursts of 184 refusals (tools/bench_reject.py, gthread, 6
# interleaved runs at load 7-10 on 2 cores) median 59 -> 38 ms, p99 99 -> 90 ms; 8 streams decode at
# the same rate (13.7 and 13.6 tok/s, 4 runs each). 0.2 ms was no better.
SWITCH_INTERVAL = 0.0005
LINGER = 2.0                                # seconds a closed connection's input is drained, as gunicorn does
SPARE_DESCRIPTORS = 128                     # beyond worker_connections: model files, logs, pipes
_PEEK = 64 * 1024                           # bytes of a request gevent's early path looks at
_WAIT, _READY, _EXPIRED, _CLOSED = "wait", "ready", "expired", "closed"


class _ProcessSetup:
    """What both workers set in their process before gunicorn's own init, while it has one thread:
    the GIL switch interval, a descriptor table grown for their connections, and the heap frozen
    after each model load (registry.freeze_after_load); then, from the app they load, its early
    refusal (`early`) and its front door (`door`)."""

    def init_process(self):
        sys.setswitchinterval(SWITCH_INTERVAL)
        reserve_descriptors(self.worker_connections + SPARE_DESCRIPTORS)
        registry.freeze_after_load()
        super().init_process()

    def load_wsgi(self):
        """Loads the app (gunicorn's), then takes the AppDeps it was built with. An app without them
        (another app, gunicorn's error app after a reload's syntax error) answers every request
        itself, and its loop claims a door that no compute thread waits at."""
        super().load_wsgi()
        deps = deps_of(self.wsgi)
        self.early = deps.refusal if deps else None
        self.door = deps.door if deps else compute.FrontDoor()


class ThreadWorker(_ProcessSetup, gthread.ThreadWorker):
    """gthread that dispatches a request to a thread only when its head and body are buffered."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = Config.from_env()
        self.header_timeout = config.header_timeout
        self.body_timeout = config.body_timeout
        self.max_body = config.max_body
        self.max_head = head_limit(self.cfg)
        self.deadlines = []                 # heap (when, seq, deadline, conn): parked requests to time out
        self.lingering = Lingering(lambda: self.poller)
        self.seq = itertools.count()
        self.unlogged = []                  # early answers sent on this turn of the loop, to log after it

    def wait_for_and_dispatch_events(self, timeout):
        """One turn of the loop; the access lines of early answers wait for a turn that wrote none
        (the end of a burst) or at most LOG_DELAY seconds, so that refusals go out first."""
        logged = len(self.unlogged)
        super().wait_for_and_dispatch_events(0 if logged else timeout)
        if self.unlogged and (len(self.unlogged) == logged or self.unlogged[0].started + LOG_DELAY < time.monotonic()):
            unlogged, self.unlogged = self.unlogged, []
            for answer in unlogged:
                answer.log()

    def accept(self, listener):
        """Accepts every connection waiting (up to worker_connections), not one per poller turn."""
        name = listener.getsockname()
        door = self.door
        while self.nr_conns < self.worker_connections:
            try:
                client, addr = listener.accept()
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                    return
                raise
            self.nr_conns += 1
            door.arrived()
            self.enqueue_req(gthread.TConn(self.cfg, client, addr, name))

    def run(self):
        try:
            super().run()
        finally:
            for answer in self.unlogged:
                answer.log()

    def enqueue_req(self, conn):
        """On the loop's thread: buffers what the socket holds; a worker thread gets only a request
        that is all in (or a connection this worker does not buffer: TLS, HTTP/2)."""
        if self.cfg.is_ssl or negotiation.prior_knowledge_allowed(self.cfg, conn.client):
            return super().enqueue_req(conn)
        try:
            state = self.fill(conn)
        except OSError:
            return self.done(conn, False)   # reset while buffering: nothing to answer
        if state is _WAIT:
            return self.park(conn)          # on the poller until more bytes arrive
        if state is _CLOSED:
            self.nr_conns -= 1              # the client closed between requests: nothing to answer
            return util.close(conn.sock)
        if state is _EXPIRED:
            self.refuse(conn)
            return self.done(conn, False)
        if self.answer_early(conn):
            return None
        conn.parser.unreader.unread(bytes(conn.pending))
        conn.pending, conn.deadline, conn.framing = bytearray(), None, None
        return super().enqueue_req(conn)

    def fill(self, conn):
        """Reads what the socket holds now into `conn.pending`; _READY once it holds a whole request."""
        if not hasattr(conn, "pending"):
            conn.pending, conn.deadline, conn.framing = bytearray(), None, None
            conn.init()
        pending = conn.pending
        pending += take_buffered(conn.parser.unreader)
        eof = read_available(conn.sock, pending)
        if eof:
            return _READY if pending else _CLOSED
        return self.check(conn)

    def park(self, conn):
        """Waits on the poller for more of the request, under its head or body deadline."""
        conn.sock.setblocking(False)
        conn.timeout = time.monotonic() + self.cfg.keepalive
        self.pending_conns.append(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_pending_socket_readable, conn))
        conn.parked = self.alive
        if conn.deadline:
            heapq.heappush(self.deadlines, (conn.deadline[1], next(self.seq), conn.deadline, conn))

    def done(self, conn, keepalive):
        """Ends a request the loop answered (or dropped) itself, as a worker thread's would end."""
        fs = futures.Future()
        fs.set_result(keepalive)
        if keepalive and conn.parser.unreader.buf.getbuffer().nbytes:
            # NOTE(pipelining): finish_request dispatches the next buffered request, which may be
            # answered here again: on the loop's next turn, so that no chain of them recurses.
            self.method_queue.defer(self.finish_request, conn, fs)
        else:
            self.finish_request(conn, fs)

    def answer_early(self, conn):
        """Writes the app's answer from the head when its early refusal has one (a full server's 503,
        a body's 413 or 400 that its framing already decides); True if it did."""
        early, framing = self.early, conn.framing
        head = framing.head if early and framing else None
        if head is None:
            return False
        if framing.state is REFUSE:
            answer = ask_early(self.log, early.refuse, head.method, head.path, head.fields, conn.client,
                               framing.refused.status, framing.refused.message)
            keepalive, end = False, len(conn.pending)
        elif framing.state is WHOLE:
            answer = ask_early(self.log, early.answer, head.method, head.path, head.fields, conn.client)
            keepalive = (self.alive and head.version == 1 and len(self.keepalived_conns) < self.max_keepalived
                         and not wants_close(head.fields))
            end = framing.end
        else:
            return False
        if answer is None:
            return False
        self.door.claim()
        data = response_bytes(answer, head.version, keepalive)
        try:
            sent = conn.sock.send(data, socket.MSG_DONTWAIT)
        except OSError:
            sent = -1
        self.unlogged.append(answer)
        if sent != len(data):
            keepalive = False               # a client that does not read its answers loses its connection
        rest = bytes(conn.pending[end:])
        conn.pending, conn.deadline, conn.framing = bytearray(), None, None
        if keepalive and rest:
            conn.parser.unreader.unread(rest)   # a pipelined request: finish_request dispatches it
        self.done(conn, keepalive)
        return True

    def check(self, conn):
        """Whether `conn.pending` holds a whole request (_READY: or one to refuse, or to hand to the
        server's reader), needs more (_WAIT) or is late (_EXPIRED)."""
        if not conn.pending:
            return _WAIT
        if conn.framing is None:
            conn.framing = Framing(self.max_head, self.max_body, self.cfg)
        if conn.framing.feed(conn.pending) is not WAIT:
            return _READY
        stage = conn.framing.stage
        return _EXPIRED if late(conn, stage, self.header_timeout if stage == "head" else self.body_timeout) else _WAIT

    def finish_request(self, conn, fs):
        ok = not fs.cancelled() and fs.exception() is None
        result = fs.result() if ok else False
        if result is False:
            self.nr_conns -= 1
            self.lingering.add(conn.sock)   # NOTE(linger): not gunicorn's 2 s drain on the loop
            return
        super().finish_request(conn, fs)

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
        self.lingering.end_due(now)

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
        self.lingering.add(conn.sock)

    def refuse(self, conn):
        stage = conn.deadline[0] if conn.deadline else "head"
        self.log.debug("408 to %s: its request %s was not all in within the timeout", conn.client, stage)
        refuse_timeout(conn.sock, conn.pending)


class Lingering:
    """Closes that first wait for the client to stop sending, on the gthread loop's poller: FIN
    sent, input drained as it comes, the socket closed at EOF or after LINGER seconds.

    NOTE(linger): gunicorn drains a closing connection for up to 2 s on the loop's only thread, so a
    client that keeps sending would stall every other connection; the poller drains it instead."""

    def __init__(self, poller):
        self._poller = poller               # () -> the loop's selector (gthread makes it in init_process)
        self._socks = set()
        self._due = []                      # heap (when, seq, socket)
        self._seq = itertools.count()

    def add(self, sock):
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            self._poller().register(sock, selectors.EVENT_READ, self._drain)
        except (OSError, ValueError, KeyError):
            util.close(sock)
            return
        self._socks.add(sock)
        heapq.heappush(self._due, (time.monotonic() + LINGER, next(self._seq), sock))

    def end_due(self, now):
        while self._due and self._due[0][0] <= now:
            self._end(heapq.heappop(self._due)[2])

    def _drain(self, sock):
        try:
            if sock.recv(_RECV):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._end(sock)

    def _end(self, sock):
        if sock in self._socks:
            self._socks.discard(sock)
            with contextlib.suppress(OSError, KeyError, ValueError):
                self._poller().unregister(sock)
            util.close(sock)


class GeventWorker(_ProcessSetup, ggevent.GeventWorker):
    """gevent whose connections idle for the keep-alive time, then send a head within the limit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = Config.from_env()
        self.header_timeout = config.header_timeout
        self.max_body = config.max_body
        self.max_head = head_limit(self.cfg)
        self.connections = {}               # greenlet -> [client socket, parser's unreader or None]
        # NOTE(capacity): each connection is a greenlet and a socket buffer, so slow clients
        # cannot use up the pool before their timeouts end them.
        self.unlogged = []                  # early answers sent, their access lines not yet written

    def handle(self, listener, client, addr):
        import gevent

        self.door.arrived()
        if self.answer_early(client, addr):
            util.close(client)
            return
        me = gevent.getcurrent()
        self.connections[me] = [client, None]
        try:
            super().handle(listener, client, addr)
        finally:
            self.connections.pop(me, None)

    def answer_early(self, client, addr):
        """Answers a full server's 503s (and a body's 413 or 400 that the head or its first bytes
        decide) from the bytes the socket holds, without gunicorn's parser, for as long as each
        request in turn gets one. True when the connection is done with (EOF,
        idle past keep-alive, `Connection: close`); False hands it to gunicorn's parser with the
        request it did not answer still unread: the bytes are only peeked at until answered."""
        import gevent

        early = self.early
        if early is None or self.cfg.is_ssl or negotiation.prior_knowledge_allowed(self.cfg, addr):
            return False
        client.setblocking(1)
        while True:
            data = None
            with gevent.Timeout(self.cfg.keepalive or None, False):     # NOTE(keepalive): 0 = wait
                try:
                    data = client.recv(_PEEK, socket.MSG_PEEK)
                except OSError:
                    return True
            if not data:
                return True                 # EOF, or idle past keep-alive: closed quietly, as gunicorn does
            framing = Framing(self.max_head, self.max_body, self.cfg)
            state, head = framing.feed(data), framing.head
            if head is None or state not in (WHOLE, REFUSE):
                return False                # not all in, or not plain: the parser's turn (handle_request)
            if state is REFUSE:
                answer = ask_early(self.log, early.refuse, head.method, head.path, head.fields, addr,
                                   framing.refused.status, framing.refused.message)
            else:
                answer = ask_early(self.log, early.answer, head.method, head.path, head.fields, addr)
            if answer is None:
                return False
            self.door.claim()
            keepalive = (state is WHOLE and self.alive and self.cfg.keepalive and head.version == 1
                         and not wants_close(head.fields))
            try:
                take(client, framing.end if state is WHOLE else len(data))
                client.sendall(response_bytes(answer, head.version, keepalive))
                if state is REFUSE:
                    linger(client)          # the rest of the body may be on its way: no reset
            except OSError:
                return True
            finally:
                self.log_later(answer)
            if not keepalive:
                return True

    def log_later(self, answer):
        """Writes an early answer's access line once the burst it came in is answered (a turn of the
        hub that adds none) or LOG_DELAY seconds on, as the gthread loop does."""
        import gevent

        self.unlogged.append(answer)
        if len(self.unlogged) == 1:
            gevent.spawn(self.write_logs)

    def run(self):
        try:
            super().run()
        finally:
            unlogged, self.unlogged = self.unlogged, []
            for answer in unlogged:
                answer.log()

    def write_logs(self):
        import gevent

        start, seen = time.monotonic(), 0
        while len(self.unlogged) != seen and time.monotonic() - start < LOG_DELAY:
            seen = len(self.unlogged)
            gevent.sleep(0.001)
        unlogged, self.unlogged = self.unlogged, []
        for answer in unlogged:
            answer.log()

    def handle_request(self, listener_name, req, sock, addr):
        import gevent

        entry = self.connections.get(gevent.getcurrent())
        if entry is not None:
            entry[1] = req.unreader
        early = self.early
        answer = early and ask_early(self.log, early.answer, req.method, req.path, req.headers, addr)
        if not answer:
            return super().handle_request(listener_name, req, sock, addr)
        keepalive = self.alive and self.cfg.keepalive and req.version == (1, 1) and not req.should_close()
        try:
            sock.sendall(response_bytes(answer, req.version[1], keepalive))
        finally:
            answer.log()
        if not keepalive:
            raise StopIteration()
        return None

    @contextlib.contextmanager
    def timeout_ctx(self):
        """Around gunicorn's read of each request head: idle up to keepalive, then the head's limit."""
        import gevent

        client, unreader = self.connections.get(gevent.getcurrent(), (None, None))
        if client is None:
            with gevent.Timeout(self.cfg.keepalive or None, False):     # NOTE(keepalive): 0 = wait
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


def reserve_descriptors(count):
    """Grows this process's descriptor table to `count` entries now (capped by RLIMIT_NOFILE).

    PERF(descriptors): Linux grows the table by doubling, and in a process with more than one thread
    each growth waits for an RCU grace period: ~15 ms with the accept loop holding the GIL, so the
    first burst of a few hundred connections after start stalled twice (tools/bench_reject.py: the
    first burst's p99 ~50-60 ms against ~25 ms for the next ones). Called from init_process, before
    the worker starts a thread, where growing costs nothing."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = count if soft == resource.RLIM_INFINITY else min(count, soft - 1)
    try:
        fd = fcntl.fcntl(2, fcntl.F_DUPFD_CLOEXEC, top)
    except OSError:
        return False
    os.close(fd)
    return True


def linger(sock):
    """Sends FIN, then reads and drops what the client still sends until it closes, or for at most
    LINGER seconds (cooperative under gevent): closing with unread input would reset the answer."""
    import gevent

    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        with gevent.Timeout(LINGER, False):
            while sock.recv(_RECV):
                pass


def take(sock, count):
    """Reads and drops `count` bytes that the socket already holds (a request answered early)."""
    while count > 0:
        data = sock.recv(min(count, _RECV))
        if not data:
            return
        count -= len(data)


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


def wants_close(fields):
    return any(name.lower() == "connection" and "close" in value.lower() for name, value in fields)


def ask_early(log, call, *args):
    """`call(*args)` (an EarlyRefusal's answer or refuse), or None where it raises. NOTE(loop): on
    gthread it runs on the loop that accepts every connection, and on gevent before each request, so
    a fault in it is logged and the app answers the request itself; it never ends the worker or
    fails every request."""
    try:
        return call(*args)
    except Exception:       # noqa: BLE001 - the app's own path then answers, and logs what it does
        log.exception("the early answer failed; the app answers instead")
        return None


def response_bytes(answer, version, keepalive):
    """An early Answer as gunicorn would frame it (status line, Server, Date, Connection)."""
    head = [f"HTTP/1.{version} {answer.status}", f"Server: {SERVER}", f"Date: {util.http_date()}",
            f"Connection: {'keep-alive' if keepalive else 'close'}"]
    head += [f"{name}: {value}" for name, value in answer.headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + answer.body


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

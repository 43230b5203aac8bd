"""Cancellation: a token shared by the request side and the engine, and a client-socket watcher."""
import logging
import select
import socket
import threading
import time

log = logging.getLogger("turbospark.cancel")


class CancelToken:
    """Set once, read anywhere. `is_set` is the engine's `should_stop`; callbacks run on cancel."""

    __slots__ = ("reason", "_callbacks")

    def __init__(self):
        self.reason = None
        self._callbacks = []

    @property
    def cancelled(self):
        return self.reason is not None

    def is_set(self):
        return self.reason is not None

    def cancel(self, reason="cancelled"):
        """Marks the token cancelled (the first reason wins) and runs the callbacks once."""
        if self.reason is not None:
            return
        self.reason = reason
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def on_cancel(self, fn):
        """Calls `fn()` when the token is cancelled (at once if it already is). `fn` must be idempotent."""
        self._callbacks.append(fn)
        if self.reason is not None:
            fn()


def client_socket(environ):
    """The client's socket as gunicorn exposes it (`gunicorn.sock` under gevent_pywsgi), or None."""
    return environ.get("gunicorn.socket") or environ.get("gunicorn.sock")


def probe(sock, timeout=0.0):
    """"closed" (EOF or reset), "data" (bytes waiting behind the request) or "idle"."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if not poller.poll(int(timeout * 1000)):
            return "idle"
        # NOTE(gevent): peek on the OS socket under gevent's wrapper: the wrapper's recv waits for
        # data instead of returning, and then collides with gunicorn reading the next request on
        # a keep-alive connection (ConcurrentObjectUseError, connection reset).
        raw = getattr(sock, "_sock", sock)
        return "closed" if raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"" else "data"
    except (BlockingIOError, InterruptedError):
        return "idle"
    except (OSError, ValueError):       # ECONNRESET, EBADF, a closed socket object
        return "closed"


class DisconnectWatcher:
    """Polls the client socket on a side thread (a greenlet under gevent) and cancels on EOF/reset.

    `DisconnectWatcher(environ, token).start()`; `stop()` is idempotent. Without a socket in the
    environ (webtest, other servers) it does nothing.
    """

    def __init__(self, environ, token, interval=0.1):
        self._sock = client_socket(environ)
        self._token = token
        self._interval = interval
        self._stopped = False
        self._thread = None

    def start(self):
        if self._sock is not None and self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._watch, name="turbospark-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self):
        self._stopped = True

    def _watch(self):
        while not self._stopped and not self._token.cancelled:
            state = probe(self._sock, self._interval)
            if state == "closed" and not self._stopped:
                log.info("client disconnected; cancelling")
                self._token.cancel("client disconnected")
                return
            if state == "data":
                # NOTE(pipelining): bytes queued behind the request hide the EOF and make poll
                # return at once; back off, then look again.
                time.sleep(self._interval)

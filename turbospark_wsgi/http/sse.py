"""Server-sent events framing, and the response object that carries a stream to the WSGI server."""
import json
import logging

log = logging.getLogger("turbospark.sse")

DONE = b"data: [DONE]\n\n"


def _json(obj):
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def data_event(obj):
    """`data: {json}` as one frame."""
    return b"data: " + _json(obj) + b"\n\n"


def named_event(name, obj):
    """`event: name` + `data: {json}` as one frame."""
    return b"event: " + name.encode("ascii") + b"\ndata: " + _json(obj) + b"\n\n"


def comment(text):
    """A comment frame (ignored by clients); one `:` line per line of text."""
    lines = text.split("\n") or [""]
    return b"".join(b": " + line.encode("utf-8") + b"\n" for line in lines) + b"\n"


KEEPALIVE = comment("keep-alive")
OPENED = comment("ok")


class SSEStream:
    """`resp.stream` for an event stream: an iterable with `__next__` and an idempotent `close()`.

    Yields `first` at once (so headers leave before the queue wait), then the frames of `chunks`.
    An exception from `chunks` becomes the frame `on_error(exc)` and ends the stream. `close()`
    closes `chunks` and calls `on_close()` once, even when iteration never started: a bare
    generator closed before its first `next()` would never run its `finally`.
    """

    def __init__(self, chunks, on_error, on_close=None, first=OPENED):
        self._chunks = iter(chunks)
        self._on_error = on_error
        self._on_close = [on_close] if on_close else []
        self._first = first
        self._closed = False

    def add_close_callback(self, fn):
        self._on_close.append(fn)

    def __iter__(self):
        return self

    def __next__(self):
        if self._closed:
            raise StopIteration
        if self._first is not None:
            first, self._first = self._first, None
            return first
        try:
            return next(self._chunks)
        except StopIteration:
            self.close()
            raise
        except Exception as exc:
            frame = self._on_error(exc)
            self.close()
            return frame

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()
        finally:
            for fn in self._on_close:
                try:
                    fn()
                except Exception:
                    log.exception("stream close callback failed")

"""SSE framing and the SSEStream response object."""
from turbospark_wsgi.http import sse


def test_frames():
    assert sse.data_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse.named_event("error", {"x": 1}) == b'event: error\ndata: {"x":1}\n\n'
    assert sse.comment("keep-alive") == b": keep-alive\n\n"
    assert sse.comment("a\nb") == b": a\n: b\n\n"
    assert sse.DONE == b"data: [DONE]\n\n"


class Inner:
    def __init__(self, items, fail_after=None):
        self.items, self.fail_after, self.closed, self.n = list(items), fail_after, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.fail_after is not None and self.n == self.fail_after:
            raise RuntimeError("boom")
        if not self.items:
            raise StopIteration
        self.n += 1
        return self.items.pop(0)

    def close(self):
        self.closed += 1


def test_yields_a_comment_first_then_the_chunks_then_closes_itself():
    inner, closed = Inner([b"1", b"2"]), []
    stream = sse.SSEStream(inner, on_error=lambda e: b"err", on_close=lambda: closed.append(1))
    assert list(stream) == [b": ok\n\n", b"1", b"2"]
    assert inner.closed == 1 and closed == [1]
    stream.close()
    assert inner.closed == 1 and closed == [1]


def test_a_mid_stream_exception_becomes_the_error_frame_and_ends_the_stream():
    inner, seen = Inner([b"1", b"2"], fail_after=1), []
    stream = sse.SSEStream(inner, on_error=lambda e: seen.append(e) or b"event: error\n\n")
    assert list(stream) == [b": ok\n\n", b"1", b"event: error\n\n"]
    assert isinstance(seen[0], RuntimeError) and inner.closed == 1


def test_close_before_the_first_next_runs_the_close_callbacks():
    ran = []

    def gen():
        try:
            yield b"x"
        finally:
            ran.append("generator finally")

    stream = sse.SSEStream(gen(), on_error=None, on_close=lambda: ran.append("on_close"))
    stream.add_close_callback(lambda: ran.append("extra"))
    stream.close()
    assert ran == ["on_close", "extra"]     # the bare generator's finally never runs: why on_close exists
    assert list(stream) == []


def test_a_failing_close_callback_does_not_stop_the_others():
    ran = []
    stream = sse.SSEStream(iter([]), on_error=None, on_close=lambda: 1 / 0)
    stream.add_close_callback(lambda: ran.append(1))
    stream.close()
    assert ran == [1]

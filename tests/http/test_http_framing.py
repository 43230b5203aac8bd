"""Request framing and log lines: a badly framed, short or slow body gets its 4xx in the route's
envelope (never a 500, never a hung thread), and no request data can forge a log line.

Bodies are read through gunicorn's own readers (ChunkedReader, LengthReader), the objects
`wsgi.input` is under `turbospark serve`; the slow ones over a real socket pair.
"""
import json
import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import webob
from gunicorn.http.body import Body, ChunkedReader, LengthReader
from gunicorn.http.unreader import IterUnreader, SocketUnreader

from turbospark_wsgi.logsafe import EscapeFilter, escape

BODY = b'{"prompt": "hi", "max_tokens": 2}'
MESSAGES = json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()


def chunked_input(raw):
    return Body(ChunkedReader(SimpleNamespace(), IterUnreader([raw])))


def call(app, path, wsgi_input, headers, sock=None):
    """(status, parsed JSON body) for a POST whose body is `wsgi_input`."""
    env = webob.Request.blank(path, method="POST").environ
    env.pop("CONTENT_LENGTH", None)
    env.update({"CONTENT_TYPE": "application/json", "wsgi.input": wsgi_input, "HTTP_X_API_KEY": "k",
                "HTTP_ANTHROPIC_VERSION": "2023-06-01"})
    env.update(headers)
    if sock is not None:
        env["gunicorn.socket"] = sock
    seen = {}
    body = b"".join(app(env, lambda status, hdrs, exc=None: seen.update(status=status)))
    return int(seen["status"][:3]), json.loads(body)


CHUNKED = {"HTTP_TRANSFER_ENCODING": "chunked"}
BAD_CHUNKS = [
    ("non-hex size", b"zz\r\n" + BODY + b"\r\n0\r\n\r\n"),
    ("negative size", b"-5\r\n" + BODY + b"\r\n0\r\n\r\n"),
    ("size line over the limit", b"1" * 9000),
    ("missing CRLF after the data", b"%x\r\n" % len(BODY) + BODY + b"XX0\r\n\r\n"),
    ("bad chunk extension", b"%x;=\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"),
    ("ends inside a chunk", b"100\r\n" + BODY),
    ("no last chunk", b"%x\r\n" % len(BODY) + BODY + b"\r\n"),
]


@pytest.mark.parametrize("name, raw", BAD_CHUNKS, ids=[c[0] for c in BAD_CHUNKS])
def test_bad_chunked_framing_is_a_400_in_the_openai_envelope(harness, name, raw):
    harness.engine("fake", reply="Hello")
    status, body = call(harness.app(), "/v1/completions", chunked_input(raw), CHUNKED)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("The request body could not be read")


def test_bad_chunked_framing_is_a_400_in_the_anthropic_envelope(harness):
    harness.engine("fake", reply="Hello")
    raw = b"-5\r\n" + MESSAGES + b"\r\n0\r\n\r\n"
    status, body = call(harness.app(), "/v1/messages", chunked_input(raw), CHUNKED)
    assert status == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"


def test_a_good_chunked_body_still_reads(harness):
    harness.engine("fake", reply="Hello")
    raw = b"5\r\n" + BODY[:5] + b"\r\n%x\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n0\r\n\r\n"
    status, body = call(harness.app(), "/v1/completions", chunked_input(raw), CHUNKED)
    assert status == 200 and body["choices"][0]["text"] == "He"


@pytest.mark.parametrize("path, raw", [("/v1/completions", BODY), ("/v1/messages", MESSAGES)])
def test_a_body_shorter_than_its_content_length_is_a_400(harness, path, raw):
    """The client half-closed after a complete-looking JSON body: it must not reach generation."""
    engine = harness.engine("fake", reply="Hello")
    length = len(raw) + 50
    wsgi_input = Body(LengthReader(IterUnreader([raw]), length))
    status, body = call(harness.app(), path, wsgi_input, {"CONTENT_LENGTH": str(length)})
    assert status == 400, body
    message = body["error"]["message"]
    assert f"ended after {len(raw)} of its {length} bytes" in message
    assert engine.runs == []


@pytest.fixture
def socket_body():
    """(server socket as gunicorn's wsgi.input for a `length`-byte body, client socket)."""
    pairs = []

    def make(length):
        server, client = socket.socketpair()
        pairs.append((server, client))
        return server, Body(LengthReader(SocketUnreader(server), length)), client

    yield make
    for pair in pairs:
        for s in pair:
            s.close()


def call_in_thread(app, env_input, headers, sock, wait=5.0):
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        answer=call(app, "/v1/completions", env_input, headers, sock), at=time.monotonic()), daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(wait)
    assert "answer" in result, f"the body read was still blocked after {wait} s"
    return result["answer"], result["at"] - start


def test_a_stalled_body_is_a_408_after_the_body_timeout(make_harness, socket_body):
    h = make_harness(body_timeout=0.5)
    h.engine("fake", reply="Hello")
    server, wsgi_input, client = socket_body(100)
    client.sendall(BODY[:9])                 # 9 of 100 bytes, then nothing
    (status, body), took = call_in_thread(h.app(), wsgi_input, {"CONTENT_LENGTH": "100"}, server)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert 0.4 < took < 2.5


def test_a_trickled_body_is_cut_at_the_deadline_not_per_read(make_harness, socket_body):
    h = make_harness(body_timeout=0.5)
    h.engine("fake", reply="Hello")
    server, wsgi_input, client = socket_body(100)
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                client.send(b" ")
            except OSError:
                return
            time.sleep(0.05)

    threading.Thread(target=trickle, daemon=True).start()
    try:
        (status, body), took = call_in_thread(h.app(), wsgi_input, {"CONTENT_LENGTH": "100"}, server, wait=8)
    finally:
        stop.set()
    assert status == 408 and took < 2.5


def test_a_body_within_the_timeout_is_read(make_harness, socket_body):
    h = make_harness(body_timeout=2)
    h.engine("fake", reply="Hello")
    server, wsgi_input, client = socket_body(len(BODY))
    client.sendall(BODY[:9])
    threading.Timer(0.2, lambda: client.sendall(BODY[9:])).start()
    (status, body), took = call_in_thread(h.app(), wsgi_input, {"CONTENT_LENGTH": str(len(BODY))}, server)
    assert status == 200 and body["choices"][0]["text"] == "He"


# ---- log lines ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, shown", [
    ("a\nb", "a\\nb"), ("a\r\nb", "a\\r\\nb"), ("a\tb", "a\\tb"), ("\x00\x1b[31m", "\\x00\\x1b[31m"),
    ("\x7f\x85", "\\x7f\\x85"), ("a\u2028b\u2029", "a\\u2028b\\u2029"), ("\udcff", "\\udcff"),
    ("plain /v1/models/x é 日本", "plain /v1/models/x é 日本"),
])
def test_escape_writes_control_characters_as_escapes(raw, shown):
    assert escape(raw) == shown


def test_the_filter_escapes_a_record_once_and_keeps_its_traceback():
    record = logging.LogRecord("turbospark.x", logging.ERROR, __file__, 1, "bad %s", ("x\nFORGED",), None)
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        record.exc_info = sys.exc_info()
    f = EscapeFilter()
    assert f.filter(record) and f.filter(record)
    assert record.getMessage() == "bad x\\nFORGED"
    text = logging.Formatter("%(message)s").format(record)
    assert text.splitlines()[0] == "bad x\\nFORGED" and "Traceback" in text and "ValueError: boom" in text


def test_a_newline_in_the_path_is_one_escaped_access_line(client, caplog):
    caplog.set_level(logging.INFO, logger="turbospark.access")
    client.get("/v1/models/x%0aFORGED%22%0d%1b", status=404)
    lines = [r.getMessage() for r in caplog.records if r.name == "turbospark.access"]
    assert len(lines) == 1
    assert '"GET /v1/models/x\\nFORGED\\"\\r\\x1b" 404' in lines[0]
    assert "\n" not in lines[0] and "\r" not in lines[0]


# ---- what the workers buffer before a thread sees the request (framing.py, h11) -------------------

def framed(data, max_body=1 << 20):
    from turbospark_wsgi.http.framing import Framing
    framing = Framing(max_head=65536, max_body=max_body)
    return framing, framing.feed(bytearray(data))


@pytest.mark.parametrize("head, state", [
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n", "wait"),              # 12 bytes to buffer
    (b"POST / HTTP/1.1\r\nHost: x\r\ncontent-length:12\r\nContent-Length: 12 \r\n\r\n", "wait"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\nContent-Length: 13\r\n\r\n", "server"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 12\r\n\r\n", "wait"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 12\r\n\r\n", "server"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nX-Content-Length: 12\r\n\r\n", "whole"),              # no body
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1" + b"0" * 20 + b"\r\n\r\n", "server"),
])
def test_the_workers_buffer_a_body_only_when_its_length_is_plain(head, state):
    assert framed(head)[1] == state


@pytest.mark.parametrize("data, state, end", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\nBODY", "whole", 27),       # BODY: the next request's bytes
    (b"GET / HTTP/1.1\r\nHost: x\r\n", "wait", None),
    (b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n", "whole", 29),      # one empty line may come first
    (b"GET / HTTP/1.1\nHost: x\n\n", "whole", 24),                # bare LFs: whole, not plain
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nBODYGET", "whole", 51),
    (b"GET /\r\n", "server", None),                               # HTTP/0.9: gunicorn's 400, now
    (b"GET / HTTP/1.1\r\n", "wait", None),                        # a good line: the head may follow
])
def test_the_workers_find_where_a_request_ends(data, state, end):
    framing, got = framed(data)
    assert (got, framing.end) == (state, end)
    if data.startswith(b"GET / HTTP/1.1\nHost"):
        assert framing.head is None
    from turbospark_wsgi.http.framing import Framing
    bytewise, buf = Framing(max_head=65536, max_body=1 << 20), bytearray()
    for byte in data:                       # byte by byte: the same answer at the same byte
        buf.append(byte)
        if bytewise.feed(buf) != "wait":
            break
    assert (bytewise.state, bytewise.end) == (state, end)


def test_a_head_over_the_body_limit_is_refused_before_its_body():
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n"
    for extra in (b"", b"Expect: 100-continue\r\n"):
        framing, state = framed(head.replace(b"Host: x\r\n", b"Host: x\r\n" + extra) + b"{", max_body=1000)
        assert (state, framing.refused.status) == ("refuse", 413)


DATA = b'{"prompt": "hi"}'     # 16 bytes


@pytest.mark.parametrize("body, state, size", [
    (b"10\r\n" + DATA + b"\r\n0\r\n\r\n", "whole", 16),
    (b"10;ext=1\r\n" + DATA + b"\r\n0\r\nX-T: 1\r\n\r\n", "whole", 16),
    (b"8\r\n" + DATA[:8] + b"\r\n8\r\n" + DATA[8:] + b"\r\n0\r\n\r\n", "whole", 16),
    (b"10\r\n" + DATA + b"\r\n0\r\n", "wait", 16),                 # the final empty line is still to come
    (b"10\r\n" + DATA[:5], "wait", 5),
    (b"1", "wait", 0),
    (b"", "wait", 0),
    (b"zz\r\n" + DATA, "server", 0),                                # a bad size line: the reader's 400
    (b"-5\r\n" + DATA, "server", 0),
    (b"1" * 2000, "server", 0),                                     # a size line with no end
    (b"10\r\n" + DATA + b"XX0\r\n\r\n", "server", 16),              # no CRLF after the data
    (b"10000000000000000\r\n" + DATA, "refuse", 0),                  # 2^64: no 64-bit reader holds it (400)
    (b"ffffffff\r\n" + DATA, "refuse", 0),                          # over the limit: 413 at once
    (b"1\r\na\r\n" * 5000 + b"0\r\n\r\n", "server", 4096),          # many tiny chunks: a thread reads on
])
def test_the_workers_follow_a_chunked_body(body, state, size):
    from turbospark_wsgi.http.framing import Framing
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    framing, got = framed(head + body)
    assert (got, framing.size) == (state, size)
    bytewise = Framing(max_head=65536, max_body=1 << 20)
    buf = bytearray(head)
    for byte in body:                       # byte by byte: each byte read once, the same end
        buf.append(byte)
        if bytewise.feed(buf) != "wait":
            break
    assert bytewise.state == state
    if state == "refuse":
        assert framing.refused.status == (400 if body.startswith(b"1000") else 413)

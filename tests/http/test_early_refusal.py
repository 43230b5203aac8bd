"""A full server's 503 written by the worker from the request head (refusal.py) is the app's own
answer, and the worker leaves every other request to the app."""
import json
import subprocess
import sys
import textwrap

import pytest

from turbospark_wsgi.http.deps import deps_of
from turbospark_wsgi.http.framing import parse_head

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
BODY = b'{"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi", "input": "Hi"}'


class Limits:
    limit_request_line = 4094
    limit_request_fields = 100
    limit_request_field_size = 8190


def full_app(make_harness, **config):
    """(webtest app, the ticket holding the only slot): no place left to wait."""
    h = make_harness(max_waiting=0, **config)
    return h.client(), h.service.queue.enqueue()


def early(client):
    """The app's EarlyRefusal, found as the worker finds it: through the app (here inside webtest's)."""
    return deps_of(client).refusal


def compare(client, path, headers):
    """The app's response and the early answer to the same request, headers as lower-case dicts."""
    resp = client.post(path, BODY, headers=dict(headers, **{"Content-Type": "application/json"}),
                       expect_errors=True)
    answer = early(client).answer("POST", path, list(headers.items()) + [("Content-Length", str(len(BODY)))])
    assert answer is not None, "the worker left a refusal to the app"
    app_headers = {k.lower(): v for k, v in resp.headers.items()}
    return resp, app_headers, answer, dict(answer.headers)


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("headers", [{}, {"x-request-id": "abc-123"}, {"Origin": "https://app.example"},
                                     {"Authorization": "Bearer sk-1"}, {"x-api-key": "sk-1"}],
                         ids=["plain", "request-id", "cors", "bearer", "x-api-key"])
def test_the_early_answer_is_the_apps_answer(make_harness, path, headers):
    client, holder = full_app(make_harness, cors_origins=("https://app.example",), replica_id="r1",
                              api_keys=("sk-1",) if "sk-1" in str(headers) else ())
    try:
        resp, app_headers, answer, early_headers = compare(client, path, headers)
    finally:
        holder.release()
    assert resp.status == answer.status == "503 Service Unavailable"
    assert answer.body == resp.body
    assert json.loads(answer.body) == resp.json
    assert set(early_headers) == set(app_headers), (early_headers, app_headers)
    for name in app_headers:
        if name != "x-request-id" or "x-request-id" in headers:
            assert early_headers[name] == app_headers[name], name


def test_the_early_answer_logs_the_apps_access_line(make_harness, caplog):
    client, holder = full_app(make_harness)
    try:
        with caplog.at_level("INFO", logger="turbospark.access"):
            client.post("/v1/completions", BODY, headers={"x-request-id": "r-app"}, status=503)
            early(client).answer("POST", "/v1/completions/", [("x-request-id", "r-early")]).log()
    finally:
        holder.release()
    lines = [r.getMessage() for r in caplog.records if r.name == "turbospark.access"]
    assert [line.split(" ")[:4] for line in lines] == [
        ["r-app", '"POST', '/v1/completions"', "503"], ["r-early", '"POST', '/v1/completions"', "503"]]


NOT_EARLY = {
    "GET": ("GET", "/v1/chat/completions", []),
    "unknown route": ("POST", "/v1/chat/completion", []),
    "embeddings": ("POST", "/v1/embeddings", []),
    "count_tokens": ("POST", "/v1/messages/count_tokens", []),
    "two slashes": ("POST", "/v1/completions//", []),
    "encoded path": ("POST", "/v1/chat%2Fcompletions", []),
    "over the body limit": ("POST", "/v1/completions", [("Content-Length", str(10**9))]),
    "length not a number": ("POST", "/v1/completions", [("Content-Length", "12a")]),
    "negative length": ("POST", "/v1/completions", [("Content-Length", "-1")]),
    "signed length": ("POST", "/v1/completions", [("Content-Length", "+5")]),
    "zero-padded length": ("POST", "/v1/completions", [("Content-Length", "007")]),
    "two lengths": ("POST", "/v1/completions", [("Content-Length", "5"), ("content-length", "5")]),
    "chunked": ("POST", "/v1/completions", [("Transfer-Encoding", "chunked")]),
    "expect": ("POST", "/v1/completions", [("Expect", "100-continue")]),
    "two hosts": ("POST", "/v1/completions", [("Host", "a"), ("Host", "b")]),
    "two request ids": ("POST", "/v1/completions", [("x-request-id", "a"), ("X-Request-Id", "b")]),
}


@pytest.mark.parametrize("case", sorted(NOT_EARLY))
def test_the_worker_leaves_to_the_app_what_it_would_answer_otherwise(make_harness, case):
    client, holder = full_app(make_harness)
    try:
        assert early(client).answer(*NOT_EARLY[case]) is None
        assert early(client).answer("POST", "/v1/completions", []) is not None
    finally:
        holder.release()


@pytest.mark.parametrize("headers", [[], [("x-api-key", "wrong")], [("Authorization", "Bearer wrong")],
                                     [("Authorization", "Bearer sk-1"), ("authorization", "Bearer sk-1")]],
                         ids=["no key", "wrong x-api-key", "wrong bearer", "two keys"])
def test_a_request_without_a_valid_key_gets_the_apps_401(make_harness, headers):
    client, holder = full_app(make_harness, api_keys=("sk-1",))
    try:
        assert early(client).answer("POST", "/v1/chat/completions", headers) is None
        assert early(client).answer("POST", "/v1/chat/completions", [("x-api-key", "sk-1")]) is not None
    finally:
        holder.release()


def test_a_server_with_room_is_left_to_the_app(make_harness):
    app = make_harness(max_waiting=1).app()
    assert deps_of(app).refusal.answer("POST", "/v1/chat/completions", []) is None


HEAD = (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
        b"Authorization:  Bearer k \r\nEmpty:\r\nContent-Length: 2\r\n\r\n")


def test_a_plain_head_is_parsed():
    assert parse_head(HEAD, Limits) == ("POST", "/v1/chat/completions", 1, [
        ("Host", "h"), ("Content-Type", "application/json"), ("Authorization", "Bearer k"), ("Empty", ""),
        ("Content-Length", "2")])
    assert parse_head(b"\r\n" + HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"), Limits)[2] == 0


@pytest.mark.parametrize("head", [
    HEAD.replace(b"\r\n", b"\n"),                           # bare LF
    HEAD.replace(b"Host: h\r\n", b"Host: h\r\n folded\r\n"),  # obsolete folding
    HEAD.replace(b"Host: h", b"Host : h"),                  # space before the colon
    HEAD.replace(b"Host: h", b"Host: h\x00"),               # a control character
    HEAD.replace(b"Host: h", "Host: h\u00e9".encode()),     # not ASCII
    HEAD.replace(b"HTTP/1.1", b"HTTP/2.0"),
    HEAD.replace(b"POST /v1", b"POST http://h/v1"),         # absolute form
    HEAD.replace(b"POST ", b"post "),
    HEAD.replace(b"POST ", b"POST  "),
    HEAD[:-2],                                              # no empty line
    HEAD.replace(b"Host: h", b"X: " + b"a" * 9000),         # a field over the limit
    HEAD.replace(b"Host: h", b"\r\n".join([b"X: a"] * 101)),  # too many fields
    HEAD.replace(b"/v1/chat/completions", b"/" + b"a" * 5000),  # a request line over the limit
], ids=["bare-lf", "folding", "space-before-colon", "nul", "non-ascii", "http2", "absolute", "lower-method",
        "two-spaces", "unterminated", "long-field", "many-fields", "long-line"])
def test_anything_else_is_left_to_the_servers_parser(head):
    assert parse_head(head, Limits) is None


@pytest.mark.parametrize("headers, peer, refused", [
    ({}, ("10.0.0.7", 5000), True),                       # the client holding every slot: full for it
    ({}, ("10.0.0.8", 5000), False),                      # another address: a spare place is its
    ({"x-api-key": "sk-1"}, ("10.0.0.7", 5000), False),   # the same address with a key: another client
])
def test_the_early_answer_asks_for_the_client_the_app_would_name(make_harness, headers, peer, refused):
    """With spare places (TURBOSPARK_MAX_PAUSED) the server is full only for a client at its share;
    the worker must ask for the client the app would name, not for nobody."""
    h = make_harness(max_waiting=0, max_paused=2)
    client = h.client()
    holder = h.service.queue.enqueue(client="addr:10.0.0.7")
    try:
        answer = early(client).answer("POST", "/v1/completions", list(headers.items()), peer)
    finally:
        holder.release()
    assert (answer is not None) == refused


# ---- the descriptor table, grown before the first burst -----------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_grows_its_descriptor_table_before_connections_arrive():
    code = textwrap.dedent("""
        import os, re
        from turbospark_wsgi.http.workers import reserve_descriptors
        size = lambda: int(re.search(r"FDSize:\\s*(\\d+)", open("/proc/self/status").read()).group(1))
        before, open_before = size(), sorted(os.listdir("/proc/self/fd"))
        assert reserve_descriptors(1500)
        print(before, size(), open_before == sorted(os.listdir("/proc/self/fd")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after, same = out.stdout.split()
    assert int(before) < 1500 <= int(after), out.stdout
    assert same == "True", "a descriptor was left open"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/embeddings"])
def test_the_early_413_is_the_apps_413(make_harness, path):
    """A Content-Length over the limit: the worker's answer from the head is the app's."""
    from turbospark_wsgi.http.framing import Framing
    client = make_harness(max_body=50, cors_origins=("https://app.example",)).client()
    headers = {"Origin": "https://app.example", "x-request-id": "r-1", "Content-Type": "application/json"}
    resp = client.post(path, BODY, headers=headers, expect_errors=True)
    framing = Framing(max_head=65536, max_body=50)
    head = (f"POST {path} HTTP/1.1\r\nHost: h\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + f"Content-Length: {len(BODY)}\r\n\r\n").encode()
    assert framing.feed(head) == "refuse"
    answer = early(client).refuse("POST", path, framing.head.fields, None, framing.refused.status,
                              framing.refused.message)
    assert resp.status == answer.status and resp.status_int == 413
    assert json.loads(answer.body) == resp.json
    assert dict(answer.headers) == {k.lower(): v for k, v in resp.headers.items()}

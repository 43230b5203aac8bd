"""A full server says so at once: real gunicorn (gthread) with stories260K, its running batch and
its queue held by long streams, then a burst of short requests that must all be refused fast.

The bounds are loose (2 shared cores); tools/bench_reject.py measures the real figures.
"""
import importlib
import json
import re
import socket
import statistics
import sys
import time

import pytest

from ops_servers import REPO, Server, models_dir_with_stories

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SLOTS, MAX_WAITING, BURST = 2, 8, 150


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        yield importlib.import_module("bench_reject")
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("reject")
    srv = Server(work, models=models_dir_with_stories(work / "models"), model="stories",
                 max_waiting=MAX_WAITING, max_batch=SLOTS)
    yield srv.wait_ready()
    srv.stop()


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
def test_a_burst_against_a_full_server_is_refused_fast(server, bench, route):
    pids = server.worker_pids()
    # NOTE(fillers): plain completion streams keep the compute thread busy on every route's test
    # without the chat parsers' per-token work, which would only add noise to the timings.
    summary, results, queue = bench.measure(server.port, route, BURST, slots=SLOTS, rounds=2, filler_tokens=400,
                                            filler_route="completions")
    print(f"\n{route}: {summary}")
    assert queue["waiting"] == MAX_WAITING and queue["running"] == SLOTS
    # NOTE(fillers): a stream may end just before a burst; the few requests that then fit are admitted.
    assert set(summary["statuses"]) <= {"503", "200"}, summary
    rejected = [r for r in results if r["status"] == 503]
    assert len(rejected) >= 0.9 * len(results), summary
    assert all(bench.well_formed_503(r, route) for r in rejected), "a 503 without Retry-After or its envelope"
    times = [r["seconds"] for r in rejected]
    assert statistics.median(times) < 0.1, summary
    assert max(times) < 1.0, summary
    assert server.worker_pids() == pids, "a worker restarted"
    assert "Traceback" not in server.tail(400)


# ---- the worker answers a full server's 503 itself: no worker thread needed ---------------------

HELD_SLOTS, HELD_WAITING = 4, 2
HELD_THREADS = HELD_SLOTS + HELD_WAITING        # every gthread thread holds a running or waiting stream


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def held(request, tmp_path_factory):
    """slow_app (the fake engine, 0.5 s a token) whose every thread is held by a long stream."""
    srv = Server(tmp_path_factory.mktemp(request.param), app="slow_app:app", worker_class=request.param,
                 max_batch=HELD_SLOTS, max_waiting=HELD_WAITING, threads=HELD_THREADS,
                 env={"TURBOSPARK_TEST_STEP_DELAY": "0.5"}).wait_ready(timeout=60)
    streams = []
    try:
        for i in range(HELD_THREADS):
            if i == HELD_THREADS - 1:   # NOTE(threads): /health needs a thread, so it checks before the last
                deadline = time.monotonic() + 20
                while queue_of(srv) != (HELD_SLOTS, HELD_WAITING - 1) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert queue_of(srv) == (HELD_SLOTS, HELD_WAITING - 1)
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            sock.sendall(post("/v1/completions", {"prompt": "hi", "max_tokens": 100, "stream": True}))
            streams.append(sock)
        time.sleep(0.5)
        yield srv
    finally:
        for sock in streams:
            sock.close()
        srv.stop()


def post(path, body, extra=b""):
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
            % (path.encode(), extra, len(data))) + data


def queue_of(srv):
    queue = json.loads(srv.get("/health")[2] or b"{}").get("queue", {})
    return queue.get("running"), queue.get("waiting")


def responses(sock, count):
    """`count` whole responses (status, head, body) read off `sock`."""
    raw, out = b"", []
    while len(out) < count:
        head, sep, rest = raw.partition(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if sep and length and len(rest) >= int(length.group(1)):
            size = int(length.group(1))
            out.append((int(head.split(b" ")[1]), head, rest[:size]))
            raw = rest[size:]
            continue
        block = sock.recv(65536)
        if not block:
            break
        raw += block
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_a_full_server_refuses_with_every_thread_taken(held, path):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", held.port), timeout=5) as sock:
        sock.sendall(post(path, {"model": "m", "prompt": "hi", "messages": [], "input": "hi"}))
        [(status, head, body)] = responses(sock, 1)
    assert status == 503 and time.monotonic() - start < 2, "a full server waited for a thread to refuse"
    assert b"\r\nretry-after: 1\r\n" in head.lower()
    doc = json.loads(body)
    assert doc["type"] == "error" if path == "/v1/messages" else doc["error"]["code"] == "server_overloaded"


def test_one_connection_is_refused_again_and_again(held):
    """Keep-alive and pipelining after an early 503: each request its own answer, in order."""
    with socket.create_connection(("127.0.0.1", held.port), timeout=5) as sock:
        sock.sendall(post("/v1/completions", {"prompt": "a"}, b"x-request-id: one\r\n"))
        first = responses(sock, 1)
        sock.sendall(post("/v1/completions", {"prompt": "b"}, b"x-request-id: two\r\n")
                     + post("/v1/chat/completions", {"messages": []}, b"x-request-id: three\r\n")
                     + post("/v1/messages", {"messages": []}, b"x-request-id: four\r\nConnection: close\r\n"))
        rest = responses(sock, 3)
        assert sock.recv(10) == b"", "the connection stayed open after Connection: close"
    answers = first + rest
    assert [status for status, _, _ in answers] == [503] * 4
    ids = [re.search(rb"(?i)\r\nx-request-id: *(\S+)", head).group(1) for _, head, _ in answers]
    assert ids == [b"one", b"two", b"three", b"four"]



def test_a_body_that_comes_late_is_refused_too(held):
    """The early path sees the head first; the 503 still comes once the body is in, with no thread."""
    data = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]})
    head, body = data.split(b"\r\n\r\n", 1)
    with socket.create_connection(("127.0.0.1", held.port), timeout=5) as sock:
        sock.sendall(head + b"\r\n\r\n" + body[:10])
        time.sleep(0.3)
        sock.sendall(body[10:] + post("/v1/completions", {"prompt": "b"}))
        answers = responses(sock, 2)
    assert [status for status, _, _ in answers] == [503, 503]


@pytest.mark.parametrize("held", ["gevent"], indirect=True)   # NOTE(threads): under gthread /health needs one
def test_after_an_early_answer_the_connection_goes_on_to_the_app(held):
    """gevent's early path only peeks at a request it does not answer: the app reads it whole."""
    with socket.create_connection(("127.0.0.1", held.port), timeout=5) as sock:
        sock.sendall(post("/v1/completions", {"prompt": "a"})
                     + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
                     + post("/v1/completions", {"prompt": "b"}))
        answers = responses(sock, 3)
    assert [status for status, _, _ in answers] == [503, 200, 503]
    assert json.loads(answers[1][2])["queue"]["waiting"] == HELD_WAITING


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_fault_in_the_early_answer_leaves_the_request_to_the_app_and_the_worker_up(tmp_path, worker_class):
    srv = Server(tmp_path, app="broken_early_app:app", worker_class=worker_class,
                 models=models_dir_with_stories(tmp_path / "models"), model="stories").wait_ready()
    try:
        pids = srv.worker_pids()
        for _ in range(3):
            status, _, body = srv.post("/v1/completions", {"model": "stories", "prompt": "Once", "max_tokens": 2})
            assert status == 200, body
            assert json.loads(body)["choices"][0]["text"] is not None
        assert srv.worker_pids() == pids, "a worker restarted"
        assert "the early answer failed; the app answers instead" in srv.tail(400)
    finally:
        srv.stop()

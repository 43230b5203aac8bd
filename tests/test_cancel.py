"""Cancel tokens, the disconnect watcher on a socketpair, and slots released by close()."""
import json
import socket
import threading
import time

import webob

from turbospark_wsgi.serving.cancel import CancelToken, DisconnectWatcher, probe


def test_token_first_reason_wins_and_callbacks_run_once():
    token, calls = CancelToken(), []
    token.on_cancel(lambda: calls.append(1))
    assert not token.cancelled and not token.is_set()
    token.cancel("client disconnected")
    token.cancel("closed")
    assert token.reason == "client disconnected" and token.is_set() and calls == [1]
    token.on_cancel(lambda: calls.append(2))          # late registration runs at once
    assert calls == [1, 2]


def test_probe_sees_idle_data_and_close():
    server, client = socket.socketpair()
    assert probe(server) == "idle"
    client.sendall(b"x")
    assert probe(server, 0.1) == "data"
    server.recv(1)
    client.close()
    assert probe(server, 0.1) == "closed"
    server.close()
    assert probe(server) == "closed"


def test_watcher_cancels_when_the_client_closes(wait_until):
    server, client = socket.socketpair()
    token = CancelToken()
    watcher = DisconnectWatcher({"gunicorn.socket": server}, token, interval=0.02).start()
    time.sleep(0.05)
    assert not token.cancelled
    start = time.monotonic()
    client.close()
    wait_until(lambda: token.cancelled, 2)
    assert token.reason == "client disconnected" and time.monotonic() - start < 1
    watcher.stop()
    watcher.stop()
    server.close()


def test_watcher_accepts_the_gevent_pywsgi_key_and_stops_quietly():
    server, client = socket.socketpair()
    token = CancelToken()
    watcher = DisconnectWatcher({"gunicorn.sock": server}, token, interval=0.02).start()
    watcher.stop()
    time.sleep(0.1)
    client.close()
    time.sleep(0.1)
    assert not token.cancelled
    server.close()


def test_watcher_without_a_socket_is_a_no_op():
    token = CancelToken()
    watcher = DisconnectWatcher({}, token).start()
    assert watcher._thread is None
    watcher.stop()
    assert not token.cancelled


def test_the_watcher_cancels_a_non_streaming_request(harness):
    engine = harness.engine("fake", reply="x" * 200, max_context=512, step_delay=0.01)
    server, client = socket.socketpair()
    app = harness.client()
    threading.Timer(0.15, client.close).start()
    start = time.monotonic()
    resp = app.post_json("/v1/completions", {"prompt": "hi", "max_tokens": 200}, status=499,
                         extra_environ={"gunicorn.socket": server})
    assert time.monotonic() - start < 1.5           # 200 steps would take >= 2 s
    assert engine.closed == 1 and harness.service.queue.running == 0
    assert resp.status_int == 499
    server.close()


def _stream_environ(body, sock=None):
    req = webob.Request.blank("/v1/completions", method="POST", body=json.dumps(body).encode(),
                              content_type="application/json")
    if sock is not None:
        req.environ["gunicorn.socket"] = sock
    return req.environ


def _start_response(status, headers, exc_info=None):
    _start_response.status = status


def test_closing_a_stream_before_its_first_next_releases_the_slot(harness):
    harness.engine("fake")
    app = harness.app()
    queue = harness.service.queue
    stream = app(_stream_environ({"prompt": "hi", "stream": True}), _start_response)
    assert _start_response.status.startswith("200") and queue.running == 1
    stream.close()
    stream.close()
    assert queue.running == 0 and queue.depth == 0


def test_closing_a_stream_mid_run_stops_the_engine_and_releases_the_slot(harness):
    engine = harness.engine("fake", reply="abcdefgh", step_delay=0.01)
    app = harness.app()
    stream = app(_stream_environ({"prompt": "hi", "stream": True}), _start_response)
    frames = [next(stream) for _ in range(3)]
    assert frames[0] == b": ok\n\n" and b'"text":"a"' in frames[1]
    stream.close()
    assert engine.closed == 1 and harness.service.queue.running == 0
    assert list(stream) == []


def test_a_queued_stream_whose_client_leaves_drops_out(harness, wait_until):
    harness.engine("fake")
    app = harness.app()
    queue = harness.service.queue
    holder = queue.enqueue()
    holder.wait(0)
    server, client = socket.socketpair()
    stream = app(_stream_environ({"prompt": "hi", "stream": True}, server), _start_response)
    assert next(stream) == b": ok\n\n"
    assert next(stream) == b": keep-alive\n\n" and queue.depth == 1
    client.close()
    wait_until(lambda: queue.depth == 0, 2)
    rest = list(stream)
    assert all(f == b": keep-alive\n\n" for f in rest)      # nothing more than keep-alives
    stream.close()
    holder.release()
    assert queue.running == 0
    server.close()

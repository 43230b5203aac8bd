"""Graceful shutdown on real gunicorn: SIGTERM stops accepting, finishes the running stream, and
answers queued requests at once with 503 "server shutting down" (an SSE error event for a stream
already open). The engine is the suite's fake, slowed down so that a stream spans the signal."""
import http.client
import json
import signal
import threading
import time

import pytest

from ops_servers import Server, request, sse_data

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEP = 0.05
TOKENS = 60                                     # about 3 s of streaming


def body(stream, max_tokens=TOKENS):
    return {"prompt": "hi", "max_tokens": max_tokens, "stream": stream}


def open_stream(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body(True)), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def read_all(resp):
    try:
        return resp.read()
    except http.client.IncompleteRead as e:
        return e.partial


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_sigterm_finishes_the_running_stream_and_refuses_the_queued(tmp_path, worker_class):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "fake.gguf").write_bytes(b"GGUF")
    server = Server(tmp_path, app="slow_app:app", worker_class=worker_class, models=tmp_path / "models",
                    model="fake", max_waiting=8, keepalive=0.5, graceful_timeout=30,
                    env={"TURBOSPARK_TEST_STEP_DELAY": str(STEP)}).wait_ready()
    try:
        running_conn, running = open_stream(server.port)
        while not running.readline().startswith(b"data: "):
            pass                                  # the first token is out: it holds the engine
        queued_conn, queued = open_stream(server.port)
        assert queued.readline().startswith(b": ok")
        plain = {}
        t = threading.Thread(target=lambda: plain.update(r=request(server.port, "POST", "/v1/completions",
                                                                     body(False))))
        t.start()
        deadline = time.monotonic() + 10
        while json.loads(server.get("/health")[2])["queue"]["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

        signalled = time.monotonic()
        server.signal(signal.SIGTERM)
        queued_text = read_all(queued).decode()
        queued_after = time.monotonic() - signalled
        t.join(10)
        running_events = sse_data(read_all(running))
        finished_after = time.monotonic() - signalled
        running_conn.close()
        queued_conn.close()
        server.proc.wait(30)
        exited_after = time.monotonic() - signalled
        print(f"\n{worker_class}: queued answered {queued_after:.2f} s, running done {finished_after:.2f} s, "
              f"exited {exited_after:.2f} s after SIGTERM")

        assert "event: error" in queued_text and "server_shutting_down" in queued_text, server.tail()
        assert "[DONE]" not in queued_text and queued_after < 2.0
        status, headers, raw = plain["r"]
        assert status == 503 and headers["retry-after"], (status, raw)
        assert json.loads(raw)["error"]["code"] == "server_shutting_down"
        assert running_events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["text"] for e in running_events[:-1])
        assert len(text) == TOKENS - 1            # every token after the first arrived: nothing was cut
        assert finished_after < 10
        assert request(server.port, "GET", "/health", timeout=2)[0] is None      # no longer accepting
    finally:
        server.stop()

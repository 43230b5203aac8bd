"""Guardrails on real gunicorn (the suite's fake engine, slowed so streams span a signal): SIGHUP to
the master re-reads the guardrails file in the running worker while clients stream; no request is
dropped, a running stream keeps the rules it started under, and new requests get the new ones."""
import http.client
import json
import signal
import threading
import time

import pytest

from ops_servers import Server, request, sse_data

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEP = 0.02
TOKENS = 60                                     # about 1.2 s of streaming; the reply is "abcdefghij" * 10


def policy(path, literal):
    path.write_text('routes = ["/v1/completions", "/v1/chat/completions"]\n\n'
                    f'[[rules]]\nid = "word"\nstage = "output"\nmatch = "literal"\npatterns = ["{literal}"]\n'
                    'action = "redact"\n')
    return path


def complete(port, tokens=20):
    status, _, body = request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": tokens})
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def open_stream(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": TOKENS, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    while not resp.readline().startswith(b"data: "):
        pass                                    # the stream is generating
    return conn, resp


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_sighup_reloads_the_guardrails_under_load_and_drops_nothing(tmp_path, worker_class):
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake.gguf").write_bytes(b"GGUF")
    path = policy(tmp_path / "guardrails.toml", "zzz")
    srv = Server(tmp_path, app="slow_app:app", worker_class=worker_class, models=models, model="fake",
                 guardrails=path, max_batch=4, keepalive=0.5,
                 env={"TURBOSPARK_TEST_STEP_DELAY": str(STEP)}).wait_ready()
    try:
        workers = srv.worker_pids()
        assert "[REDACTED" not in complete(srv.port)
        conn, running = open_stream(srv.port)
        results, stop = [], threading.Event()

        def client():
            while not stop.is_set():
                results.append(request(srv.port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 5})[0])

        clients = [threading.Thread(target=client, daemon=True) for _ in range(2)]
        for t in clients:
            t.start()
        policy(path, "cde")
        srv.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "[REDACTED:word]" not in complete(srv.port):
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.05)
        events = sse_data(running.read())
        conn.close()
        stop.set()
        for t in clients:
            t.join(30)
        assert events[-1] == "[DONE]", srv.tail()
        chunks = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e).get("choices")]
        text = "".join(c["text"] for c in chunks)
        assert "cde" in text and "[REDACTED" not in text      # the stream kept the rules it started under
        assert chunks[-1]["finish_reason"] == "length"
        assert results and set(results) == {200}, results       # nothing refused or dropped meanwhile
        assert srv.worker_pids() == workers
        assert "guardrails reloaded" in srv.tail(400)
        path.write_text("[[rules]\n")                         # a bad file keeps the rules in force
        srv.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "guardrails not reloaded" not in srv.tail(400):
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.05)
        assert "[REDACTED:word]" in complete(srv.port)
    finally:
        srv.stop()


def test_a_bad_file_stops_the_server_at_start_naming_the_line(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake.gguf").write_bytes(b"GGUF")
    path = tmp_path / "guardrails.toml"
    path.write_text('[[rules]]\nid = "ok"\nmatch = "literal"\npatterns = ["x"]\naction = "block"\n\n'
                    '[[rules]]\nid = "repeat"\nmatch = "regex"\npatterns = [\'(ab)\\1\']\naction = "block"\n')
    srv = Server(tmp_path, app="slow_app:app", models=models, model="fake", guardrails=path)
    try:
        with pytest.raises(RuntimeError) as e:
            srv.wait_ready(60)
        assert "line 7" in str(e.value) and "backtracking" in str(e.value)
    finally:
        srv.stop()

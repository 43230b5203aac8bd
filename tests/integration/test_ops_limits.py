"""Limits on real gunicorn (the suite's fake engine, slowed so a stream spans a signal): SIGHUP to
the master re-reads the limits file in the running worker without restarting it or cutting a
stream, and two replicas sharing one Redis hold one key to one limit."""
import hashlib
import http.client
import json
import signal
import time

import pytest

from ops_servers import Server, request, sse_data

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "sk-team-1"
STEP = 0.02
TOKENS = 60                                     # about 1.2 s of streaming


def limits_file(path, rpm):
    path.write_text(f'[keys.team]\nsha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
                    f"requests_per_minute = {rpm}\n")
    return path


def server(tmp_path, worker_class="gthread", **settings):
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    (models / "fake.gguf").write_bytes(b"GGUF")
    return Server(tmp_path, app="slow_app:app", worker_class=worker_class, models=models, model="fake",
                  api_keys=KEY, keepalive=0.5, env={"TURBOSPARK_TEST_STEP_DELAY": str(STEP)}, **settings)


def completion(port, stream=False):
    return request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": stream},
                   headers={"Authorization": f"Bearer {KEY}"})


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_sighup_reloads_the_limits_in_place_and_keeps_the_running_stream(tmp_path, worker_class):
    path = limits_file(tmp_path / "limits.toml", 1000)
    srv = server(tmp_path, worker_class, limits_file=path, max_batch=2).wait_ready()
    try:
        workers = srv.worker_pids()
        assert completion(srv.port)[1]["x-ratelimit-limit-requests"] == "1000"
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": TOKENS,
                                                                 "stream": True}),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        running = conn.getresponse()
        while not running.readline().startswith(b"data: "):
            pass                                    # the stream is generating
        limits_file(path, 7)
        srv.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while completion(srv.port)[1].get("x-ratelimit-limit-requests") != "7":
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.05)
        events = sse_data(running.read())
        conn.close()
        assert events[-1] == "[DONE]", srv.tail()
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        assert len(text) == TOKENS - 1              # every token after the first: nothing was cut
        assert srv.worker_pids() == workers         # the same worker: no model reloaded, no queue dropped
        assert "limits reloaded" in srv.tail(200)
    finally:
        srv.stop()


def replicas(tmp_path, name, worker_class="gthread", **settings):
    out = []
    for rid in ("r1", "r2"):
        (tmp_path / name / rid).mkdir(parents=True)
        out.append(server(tmp_path / name / rid, worker_class, replica_id=rid, **settings))
    return out


def alternate(servers, count):
    return [completion(servers[i % 2].port) for i in range(count)]


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_two_replicas_on_one_redis_hold_a_key_to_one_limit(tmp_path, redis_url, worker_class):
    import redis
    redis.Redis.from_url(redis_url).flushdb()       # the key's counters start afresh
    path = limits_file(tmp_path / "limits.toml", 4)
    shared = replicas(tmp_path, "shared", worker_class, limits_file=path, limits_redis=redis_url)
    alone = replicas(tmp_path, "alone", limits_file=path) if worker_class == "gthread" else []
    try:
        for srv in shared + alone:
            srv.wait_ready()
        answers = alternate(shared, 6)
        assert [a[0] for a in answers] == [200, 200, 200, 200, 429, 429], [a[2] for a in answers]
        assert {a[1]["x-turbospark-replica"] for a in answers} == {"r1", "r2"}
        assert [a[1]["x-ratelimit-remaining-requests"] for a in answers[:4]] == ["3", "2", "1", "0"]
        assert json.loads(answers[4][2])["error"]["code"] == "rate_limit_exceeded"
        if alone:       # without Redis each replica holds the whole limit: the key gets it twice
            assert [a[0] for a in alternate(alone, 6)] == [200] * 6
    finally:
        for srv in shared + alone:
            srv.stop()

"""TURBOSPARK_LIMITS_REDIS: two replicas (two apps, each its own service and queue) keep one key's
counters in a real redis-server, so the key's limits hold across both; a replica that dies loses
its places within a lease; Redis out of reach leaves requests served, unmetered."""
import threading
import time
import uuid

import pytest

from test_limits import COMPLETION, KEYS, auth, digest, rate_file, start
from turbospark_wsgi.serving.limits import Limits

limits_redis = pytest.importorskip("turbospark_wsgi.serving.limits_redis")     # needs the redis package
RedisStore = limits_redis.RedisStore


def replicas(make_harness, tmp_path, redis_url, text, count=2, **config):
    """`count` apps as separate replicas (own service, queue and engine) sharing one Redis prefix."""
    path = tmp_path / "limits.toml"
    path.write_text(text)
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    out = []
    for _ in range(count):
        h = make_harness(api_keys=tuple(KEYS.values()), limits_file=str(path), **config)
        h.engine("fake")
        h.service.limits = Limits(str(path), True, RedisStore(redis_url, prefix=prefix))
        out.append(h)
    return out


def test_two_replicas_share_one_keys_requests_per_minute(make_harness, tmp_path, redis_url):
    a, b = replicas(make_harness, tmp_path, redis_url, rate_file(requests_per_minute=3))
    apps = [a.client(), b.client()]
    seen = [apps[i % 2].post_json("/v1/completions", COMPLETION, headers=auth("alice")) for i in range(3)]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in seen] == ["2", "1", "0"]
    for app in apps:
        refused = app.post_json("/v1/completions", COMPLETION, headers=auth("alice"), status=429)
        assert refused.json["error"]["type"] == "requests" and 15 <= int(refused.headers["Retry-After"]) <= 20
    apps[1].post_json("/v1/completions", COMPLETION, headers=auth("bob"))


def test_tokens_charged_on_one_replica_show_on_the_other(make_harness, tmp_path, redis_url):
    a, b = replicas(make_harness, tmp_path, redis_url, rate_file(tokens_per_minute=100_000))
    usage = a.client().post_json("/v1/completions", COMPLETION, headers=auth("alice")).json["usage"]
    resp = b.client().post_json("/v1/completions", COMPLETION, headers=auth("alice"))
    remaining = int(resp.headers["x-ratelimit-remaining-tokens"])
    # the first run's tokens and this one's prompt, give or take the refill in between (1667 a second)
    spent = usage["prompt_tokens"] + usage["completion_tokens"] + resp.json["usage"]["prompt_tokens"]
    assert 100_000 - spent <= remaining < 100_000 - spent + 500


def test_a_cancelled_stream_settles_in_redis(make_harness, tmp_path, redis_url):
    (a,) = replicas(make_harness, tmp_path, redis_url, rate_file(tokens_per_minute=60, tokens_per_day=1000), count=1)
    a.engine("fake", reply="abcdefghijklmnopqrstuvwxyz")
    _, _, frames = start(a.app(), "/v1/completions", dict(COMPLETION, stream=True, max_tokens=20), "alice")
    texts = []
    for frame in frames:
        texts += [p for p in frame.decode().split("\n\n") if p.startswith("data: {")]
        if len(texts) >= 5:
            break
    frames.close()
    store = a.service.limits.store
    subject = a.service.limits.subject(digest(KEYS["alice"]), "")
    used = store.settle(subject.bucket, subject.limit, 0, 0, None).day_used
    prompt = len(a.engine("fake").runs[0].ids)
    assert 5 <= used - prompt <= 6, used


def test_concurrency_is_shared_and_a_dead_replicas_places_lapse(make_harness, tmp_path, redis_url, monkeypatch):
    monkeypatch.setattr(limits_redis, "LEASE_MS", 600)
    a, b = replicas(make_harness, tmp_path, redis_url, rate_file(concurrent=1), max_batch=4)
    gate = threading.Event()
    a.engine("fake", gate=gate)
    _, _, held = start(a.app(), "/v1/completions", dict(COMPLETION, stream=True), "alice")
    time.sleep(0.9)                     # past a lease: the running one is renewed
    assert b.client().post_json("/v1/completions", COMPLETION, headers=auth("alice"),
                                status=429).json["error"]["type"] == "concurrency"
    gate.set()
    held.close()
    b.client().post_json("/v1/completions", COMPLETION, headers=auth("alice"))
    # a replica that dies holding a place: nobody renews it, it lapses
    subject = a.service.limits.subject(digest(KEYS["alice"]), "")
    assert a.service.limits.store.admit(subject.bucket, subject.limit)[0] is None
    with a.service.limits.store._lock:
        a.service.limits.store._leases.clear()
    b.client().post_json("/v1/completions", COMPLETION, headers=auth("alice"), status=429)
    time.sleep(0.7)
    b.client().post_json("/v1/completions", COMPLETION, headers=auth("alice"))


def test_redis_out_of_reach_serves_unmetered(make_harness, tmp_path, caplog):
    path = tmp_path / "limits.toml"
    path.write_text(rate_file(requests_per_minute=1))
    h = make_harness(api_keys=tuple(KEYS.values()))
    h.engine("fake")
    h.service.limits = Limits(str(path), True, RedisStore("redis://127.0.0.1:1/0"))
    for _ in range(2):
        resp = h.client().post_json("/v1/completions", COMPLETION, headers=auth("alice"))
        assert "x-ratelimit-limit-requests" not in resp.headers
    assert "Redis unreachable" in caplog.text

"""The response store behind /v1/responses: each response is its creating key's alone (any other key
gets the 404 of an unknown id, for GET, DELETE and previous_response_id), in memory or in Redis
(TURBOSPARK_REDIS) shared by replicas, with a TTL, a cap per response and no plain key in it; Redis
out of reach is a 503 naming the store, and the next request after it is back succeeds."""
import json
import uuid

import pytest

from test_limits import KEYS, auth
from turbospark_wsgi.config import Config, ConfigError
from turbospark_wsgi.http.middleware import caller_of
from turbospark_wsgi.serving.response_store import MemoryResponseStore, open_store

redis = pytest.importorskip("redis")
response_store_redis = pytest.importorskip("turbospark_wsgi.serving.response_store_redis")
RedisResponseStore = response_store_redis.RedisResponseStore


class FakeRedis:
    """The four commands the store uses, in a dict; `down` makes each raise as an unreachable server."""

    def __init__(self):
        self.data, self.expiry, self.down = {}, {}, False

    def _reach(self):
        if self.down:
            raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

    def ping(self):
        self._reach()
        return True

    def set(self, key, value, px=None):
        self._reach()
        self.data[key], self.expiry[key] = value.encode(), px
        return True

    def get(self, key):
        self._reach()
        return self.data.get(key)

    def delete(self, key):
        self._reach()
        return int(self.data.pop(key, None) is not None)


def body(rid, pad=0):
    return {"id": rid, "pad": "x" * pad}


def fake_store(**kw):
    settings = dict(size=10, item_bytes=10 ** 6, ttl=60, client=FakeRedis())
    settings.update(kw)
    return RedisResponseStore("redis://:secret@127.0.0.1:6399/2", **settings)


# ---- both stores, directly ----------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: MemoryResponseStore(10, 10 ** 6, 60), fake_store], ids=["memory", "redis"])
def test_an_entry_is_its_owners_alone(make):
    store = make()
    store.put("aa", body("r1"), [{"role": "user", "content": "hi"}])
    assert store.get("bb", "r1") is None and store.get("", "r1") is None
    assert store.delete("bb", "r1") is False
    entry = store.get("aa", "r1")
    assert entry.body == body("r1") and entry.history() == [{"role": "user", "content": "hi"}]
    store.put("aa", body("r2"), [{"role": "user", "content": "again"}], entry)
    assert [m["content"] for m in store.get("aa", "r2").history()] == ["hi", "again"]
    assert store.delete("aa", "r1") is True and store.get("aa", "r1") is None
    assert [m["content"] for m in store.get("aa", "r2").history()] == ["hi", "again"]    # kept its past


def test_redis_entries_have_the_ttl_the_cap_and_the_owners_digest_only():
    store = fake_store(item_bytes=2000, ttl=90)
    owner = caller_of(KEYS["alice"], "").owner
    store.put(owner, body("r1"), [{"role": "user", "content": "hello"}])
    store.put(owner, body("big", pad=3000), [])
    fake = store._redis
    assert list(fake.data) == [f"turbospark:responses:{owner}:r1"] and fake.expiry[list(fake.data)[0]] == 90_000
    assert KEYS["alice"].encode() not in "".join(fake.data).encode() + b"".join(fake.data.values())
    assert store.get(owner, "big") is None                         # over the cap: not kept


def test_redis_out_of_reach_is_store_unavailable_naming_it_without_the_password():
    store = fake_store()
    store.put("aa", body("r1"), [])
    store._redis.down = True
    for call in (store.check, lambda: store.get("aa", "r1"), lambda: store.put("aa", body("r2"), []),
                 lambda: store.delete("aa", "r1")):
        with pytest.raises(Exception) as e:
            call()
        assert e.value.status == 503 and e.value.code == "store_unavailable"
        assert "response store (Redis at 127.0.0.1:6399/2)" in e.value.message and "secret" not in e.value.message
        assert e.value.headers["Retry-After"]
    store._redis.down = False
    assert store.get("aa", "r1").body == body("r1")


def test_the_setting_and_its_older_name():
    assert Config.from_env({"TURBOSPARK_LIMITS_REDIS": "redis://h:1/0"}).redis == "redis://h:1/0"
    cfg = Config.from_env({"TURBOSPARK_REDIS": "redis://:pw@h:1/0"})
    assert cfg.redis == cfg.limits_redis == "redis://:pw@h:1/0" and "pw" not in repr(cfg)
    with pytest.raises(ConfigError, match="TURBOSPARK_REDIS"):
        Config.from_env({"TURBOSPARK_REDIS": "redis://a:1/0", "TURBOSPARK_LIMITS_REDIS": "redis://b:1/0"})
    with pytest.raises(ConfigError):
        Config.from_env({"TURBOSPARK_RESPONSES_STORE_ITEM_BYTES": "0"})
    with pytest.raises(ConfigError, match="redis://"):
        Config.from_env({"TURBOSPARK_REDIS": "localhost:6379"})
    assert isinstance(open_store(Config(load_default=False)), MemoryResponseStore)
    assert isinstance(open_store(Config(redis="redis://127.0.0.1:1/0", load_default=False)), RedisResponseStore)


# ---- through the app ------------------------------------------------------------------------------

def keyed(make_harness, **config):
    h = make_harness(api_keys=tuple(KEYS.values()), **config)
    h.engine("fake", reply="Paris.", max_context=1024)
    return h


def refusals(client, rid, who):
    """The bodies of GET, DELETE and a continuation of `rid` by `who`, each a 404."""
    out = [client.get(f"/v1/responses/{rid}", headers=auth(who), status=404).json,
           client.delete(f"/v1/responses/{rid}", headers=auth(who), status=404).json,
           client.post_json("/v1/responses", {"input": "more", "previous_response_id": rid}, headers=auth(who),
                            status=404).json]
    return json.loads(json.dumps(out).replace(rid, "ID"))


@pytest.fixture(params=["memory", "redis"])
def store_settings(request):
    if request.param == "memory":
        return {}
    return {"redis": request.getfixturevalue("redis_url")}


def test_another_key_gets_the_404_of_an_unknown_id(make_harness, store_settings):
    client = keyed(make_harness, **store_settings).client()
    rid = client.post_json("/v1/responses", {"input": "Capital of France?"}, headers=auth("alice")).json["id"]
    unknown = "resp_" + uuid.uuid4().hex * 2
    assert refusals(client, rid, "bob") == refusals(client, unknown, "bob")
    assert refusals(client, rid, "bob")[0]["error"]["code"] == "not_found"
    assert client.get(f"/v1/responses/{rid}", headers=auth("alice")).json["id"] == rid      # bob deleted nothing
    client.post_json("/v1/responses", {"input": "And Spain?", "previous_response_id": rid}, headers=auth("alice"))
    client.delete(f"/v1/responses/{rid}", headers=auth("alice"))


def test_on_an_open_server_a_presented_key_scopes_too(make_harness):
    h = make_harness()
    h.engine("fake", reply="ok")
    client = h.client()
    rid = client.post_json("/v1/responses", {"input": "x"}, headers={"Authorization": "Bearer mine"}).json["id"]
    client.get(f"/v1/responses/{rid}", status=404)
    client.get(f"/v1/responses/{rid}", headers={"Authorization": "Bearer other"}, status=404)
    client.get(f"/v1/responses/{rid}", headers={"Authorization": "Bearer mine"})
    anonymous = client.post_json("/v1/responses", {"input": "x"}).json["id"]
    client.get(f"/v1/responses/{anonymous}")


def test_replicas_share_responses_through_redis(make_harness, redis_url):
    a, b = keyed(make_harness, redis=redis_url), keyed(make_harness, redis=redis_url)
    ca, cb = a.client(), b.client()
    first = ca.post_json("/v1/responses", {"input": "Capital of France?"}, headers=auth("alice")).json
    assert cb.get(f"/v1/responses/{first['id']}", headers=auth("alice")).json == first
    engine, seen = b.engine("fake"), []
    render = engine.apply_chat_template
    engine.apply_chat_template = lambda messages, *args, **kw: seen.append(messages) or render(messages, *args, **kw)
    second = cb.post_json("/v1/responses", {"input": "And Spain?", "previous_response_id": first["id"]},
                          headers=auth("alice")).json
    assert [m["content"] for m in seen[-1]] == ["Capital of France?", "Paris.", "And Spain?"]
    ca.delete(f"/v1/responses/{first['id']}", headers=auth("alice"))
    cb.get(f"/v1/responses/{first['id']}", headers=auth("alice"), status=404)
    assert ca.get(f"/v1/responses/{second['id']}", headers=auth("alice")).json == second
    stored = redis.Redis.from_url(redis_url)
    for key in stored.scan_iter("turbospark:responses:*"):
        assert not any(k.encode() in key + stored.get(key) for k in KEYS.values())
        assert 0 < stored.pttl(key) <= 3600 * 1000


def test_redis_stopped_is_a_503_naming_the_store_and_back_it_serves_again(make_harness, start_redis):
    server = start_redis()
    client = keyed(make_harness, redis=server.url).client()
    rid = client.post_json("/v1/responses", {"input": "x"}, headers=auth("alice")).json["id"]
    server.stop()
    where = f"response store (Redis at 127.0.0.1:{server.port}/0)"
    for resp in (client.post_json("/v1/responses", {"input": "y"}, headers=auth("alice"), status=503),
                 client.post_json("/v1/responses", {"input": "y", "previous_response_id": rid},
                                  headers=auth("alice"), status=503),
                 client.get(f"/v1/responses/{rid}", headers=auth("alice"), status=503),
                 client.delete(f"/v1/responses/{rid}", headers=auth("alice"), status=503)):
        assert resp.json["error"]["code"] == "store_unavailable" and where in resp.json["error"]["message"]
        assert resp.headers["Retry-After"]
    client.post_json("/v1/responses", {"input": "y", "store": False}, headers=auth("alice"))   # needs no store
    assert server.start()
    again = client.post_json("/v1/responses", {"input": "z"}, headers=auth("alice")).json["id"]
    assert client.get(f"/v1/responses/{again}", headers=auth("alice")).json["id"] == again

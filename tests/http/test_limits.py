"""Limits per API key (TURBOSPARK_LIMITS_FILE): a key over its requests per minute gets a 429 in its
route's envelope while another key is served; tokens are charged as produced and settled at the
end (a stream cut midway pays for what it produced); concurrency caps per key and per model; the
daily quota; a reload; and the official SDKs' retries honouring Retry-After."""
import hashlib
import json
import re
import threading
import wsgiref.util

import pytest

from turbospark_wsgi import metrics
from turbospark_wsgi.config import ConfigError
from turbospark_wsgi.serving.limits import Limit, Limits, MemoryStore, duration, parse_table, read_table, reload_all

KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567", "carol": "sk-carol-89ab"}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "fake", "prompt": "Hi", "max_tokens": 4}
MESSAGE = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def sha(key):
    return digest(key).hex()


def digest(key):
    return hashlib.sha256(key.encode()).digest()


class Clock:
    """A wall clock the test moves by hand, so no bucket refills between two requests."""

    def __init__(self, now=1_800_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


def limited(make_harness, tmp_path, text, keys=tuple(KEYS.values()), suffix=".toml", **config):
    """A harness whose service has the limits in `text` (TOML) on a clock that stands still."""
    path = tmp_path / f"limits{suffix}"
    path.write_text(text)
    h = make_harness(api_keys=keys, limits_file=str(path), **config)
    h.engine("fake")
    h.clock = Clock()
    h.service.limits = Limits(str(path), bool(keys), MemoryStore(clock=h.clock))
    h.path = path
    return h


def auth(name):
    return {"Authorization": f"Bearer {KEYS[name]}"}


def rate_file(**alice):
    body = "".join(f"{k} = {v}\n" for k, v in alice.items())
    return f"""
[keys.alice]
sha256 = "{sha(KEYS['alice'])}"
{body}
[keys."{sha(KEYS['bob'])}"]
requests_per_minute = 100
"""


# ---- requests per minute -------------------------------------------------------------------------

def test_a_key_over_its_rpm_gets_429_in_the_openai_envelope_while_another_key_is_served(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=2))
    app = h.client()
    first = app.post_json("/v1/chat/completions", CHAT, headers=auth("alice"))
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "30s"         # one request back every 30 s
    second = app.post_json("/v1/chat/completions", CHAT, headers=auth("alice"))
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert second.headers["x-ratelimit-reset-requests"] == "1m0s"
    refused = app.post_json("/v1/chat/completions", CHAT, headers=auth("alice"), status=429)
    error = refused.json["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "alice" in error["message"] and "RPM" in error["message"] and KEYS["alice"] not in error["message"]
    assert refused.headers["Retry-After"] == "30" and refused.headers["retry-after-ms"] == "30000"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    served = app.post_json("/v1/chat/completions", CHAT, headers=auth("bob"))
    assert served.headers["x-ratelimit-limit-requests"] == "100"
    assert served.headers["x-ratelimit-remaining-requests"] == "99"
    h.clock.now += 30                           # half a minute: one request back
    app.post_json("/v1/chat/completions", CHAT, headers=auth("alice"))
    app.post_json("/v1/chat/completions", CHAT, headers=auth("alice"), status=429)


def test_the_anthropic_route_answers_in_its_envelope_with_its_headers(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=1, tokens_per_minute=1000))
    app = h.client()
    ok = app.post_json("/v1/messages", MESSAGE, headers=auth("alice"))
    assert ok.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert ok.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert ok.headers["anthropic-ratelimit-requests-reset"] == "2027-01-15T08:01:00Z"    # full again
    assert ok.headers["anthropic-ratelimit-tokens-limit"] == "1000"
    used = ok.json["usage"]["input_tokens"] + ok.json["usage"]["output_tokens"]
    assert int(ok.headers["anthropic-ratelimit-tokens-remaining"]) == 1000 - ok.json["usage"]["input_tokens"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", ok.headers["anthropic-ratelimit-tokens-reset"])
    assert ok.headers["x-ratelimit-limit-requests"] == "1"          # OpenAI's headers on every route
    refused = app.post_json("/v1/messages", MESSAGE, headers=auth("alice"), status=429)
    assert refused.json == {"type": "error", "error": {"type": "rate_limit_error",
                                                       "message": refused.json["error"]["message"]}}
    assert refused.headers["Retry-After"] == "60"
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert used > 0


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION),
                                        ("/v1/responses", {"model": "fake", "input": "Hi", "max_output_tokens": 4})])
def test_every_generation_route_counts_and_answers_429(make_harness, tmp_path, path, body):
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=1))
    app = h.client()
    assert app.post_json(path, body, headers=auth("alice")).headers["x-ratelimit-remaining-requests"] == "0"
    assert app.post_json(path, body, headers=auth("alice"), status=429).json["error"]["type"] == "requests"


def test_a_refused_request_does_not_count(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=1))
    app = h.client()
    app.post_json("/v1/chat/completions", dict(CHAT, model="nope"), headers=auth("alice"), status=404)
    app.post_json("/v1/chat/completions", dict(CHAT, max_tokens=10_000), headers=auth("alice"), status=400)
    app.post_json("/v1/chat/completions", CHAT, headers=auth("alice"))


def test_embeddings_count_a_request_and_their_tokens(make_harness, tmp_path):
    from turbospark_wsgi.errors import InvalidRequest
    from turbospark_wsgi.serving.service import EmbeddingResult
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=2, tokens_per_minute=100))
    h.service.embed = lambda req: EmbeddingResult([[0.5, 0.5]], 7, "fake")
    app = h.client()
    resp = app.post_json("/v1/embeddings", {"model": "fake", "input": "Hi"}, headers=auth("alice"))
    assert resp.json["usage"]["prompt_tokens"] == 7
    assert resp.headers["x-ratelimit-remaining-requests"] == "1"
    assert resp.headers["x-ratelimit-remaining-tokens"] == "93"

    def refuse(req):
        raise InvalidRequest("not an embedding model", param="model")
    h.service.embed = refuse
    app.post_json("/v1/embeddings", {"model": "fake", "input": "Hi"}, headers=auth("alice"), status=400)
    h.service.embed = lambda req: EmbeddingResult([[0.5, 0.5]], 7, "fake")
    app.post_json("/v1/embeddings", {"model": "fake", "input": "Hi"}, headers=auth("alice"))
    refused = app.post_json("/v1/embeddings", {"model": "fake", "input": "Hi"}, headers=auth("alice"), status=429)
    assert refused.json["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGE),
                                        ("/v1/embeddings", {"model": "fake", "input": "Hi"})])
def test_the_key_is_read_and_hashed_once_per_request(make_harness, tmp_path, monkeypatch, path, body):
    """Auth, the limits and the queue's fair share all name the client by the key's digest: one read
    of the headers and one sha256 per request serve all three."""
    from turbospark_wsgi.http import middleware
    from turbospark_wsgi.serving.service import EmbeddingResult
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=5))
    h.service.embed = lambda req: EmbeddingResult([[0.5, 0.5]], 7, "fake")
    app = h.client()
    reads, hashes, real_read, real_sha = [], [], middleware.presented_key, hashlib.sha256

    def read(*headers):
        reads.append(headers)
        return real_read(*headers)

    def sha256(data=b"", **kw):
        hashes.extend([data] if data == KEYS["alice"].encode() else [])
        return real_sha(data, **kw)
    monkeypatch.setattr(middleware, "presented_key", read)
    monkeypatch.setattr(hashlib, "sha256", sha256)
    resp = app.post_json(path, body, headers=auth("alice"))
    assert resp.headers["x-ratelimit-remaining-requests"] == "4"        # the limits knew alice
    assert len(reads) == 1 and len(hashes) == 1


def test_keys_not_listed_share_nothing_and_get_the_default(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, "[default]\nrequests_per_minute = 1\n" + rate_file(requests_per_minute=5))
    app = h.client()
    for name in ("carol", "alice"):
        assert app.post_json("/v1/completions", COMPLETION, headers=auth(name)).status_int == 200
    app.post_json("/v1/completions", COMPLETION, headers=auth("carol"), status=429)
    assert app.post_json("/v1/completions", COMPLETION, headers=auth("alice")).headers[
        "x-ratelimit-limit-requests"] == "5"


def test_an_open_server_limits_each_client_address_whatever_key_it_sends(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, "[default]\nrequests_per_minute = 1\n", keys=())
    app = h.client()
    app.post_json("/v1/completions", COMPLETION, extra_environ={"REMOTE_ADDR": "10.0.0.1"})
    app.post_json("/v1/completions", COMPLETION, headers={"Authorization": "Bearer made-up"},
                  extra_environ={"REMOTE_ADDR": "10.0.0.1"}, status=429)
    app.post_json("/v1/completions", COMPLETION, extra_environ={"REMOTE_ADDR": "10.0.0.2"})


def test_no_limits_file_means_no_headers(harness):
    harness.engine("fake")
    resp = harness.client().post_json("/v1/completions", COMPLETION)
    assert not [k for k in resp.headers if k.lower().startswith(("x-ratelimit", "anthropic-ratelimit"))]


# ---- tokens per minute ---------------------------------------------------------------------------

def start(app, path, body, key):
    """Calls the WSGI app as a server would: (status, headers, body iterator); closing the iterator
    is what gunicorn does when the client leaves."""
    raw = json.dumps(body).encode()
    env = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "CONTENT_TYPE": "application/json",
           "CONTENT_LENGTH": str(len(raw)), "HTTP_AUTHORIZATION": f"Bearer {KEYS[key]}"}
    wsgiref.util.setup_testing_defaults(env)
    env["wsgi.input"].write(raw)
    env["wsgi.input"].seek(0)
    started = {}
    body_iter = app(env, lambda status, headers, exc=None: started.update(status=status, headers=dict(headers)))
    return started["status"], started["headers"], body_iter


def test_tokens_settle_for_a_stream_cancelled_midway(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(tokens_per_minute=1000))
    engine = h.engine("fake", reply="abcdefghijklmnopqrstuvwxyz")
    before = metrics.KEY_TOKENS.labels("alice", "completion")._value.get()
    status, headers, frames = start(h.app(), "/v1/completions", dict(COMPLETION, stream=True, max_tokens=20), "alice")
    assert status.startswith("200") and headers["x-ratelimit-limit-tokens"] == "1000"
    texts = []
    for frame in frames:
        texts += [p for p in frame.decode().split("\n\n") if p.startswith("data: {")]
        if len(texts) >= 5:
            break
    frames.close()                  # the client leaves after five tokens
    bucket = h.service.limits.subject(digest(KEYS["alice"]), "").bucket
    counters = h.service.limits.store._counters[bucket]
    prompt = len(engine.runs[0].ids)
    produced = 1000 - prompt - counters.tokens
    assert 5 <= produced <= 6, produced         # what was sent, and at most the step in flight
    assert produced < 20
    assert counters.active == 0
    assert metrics.KEY_TOKENS.labels("alice", "completion")._value.get() - before == produced
    # NOTE(settle): a finished run is charged its usage exactly
    done = h.client().post_json("/v1/completions", dict(COMPLETION, max_tokens=7), headers=auth("alice"))
    usage = done.json["usage"]
    assert counters.tokens == 1000 - prompt - produced - usage["prompt_tokens"] - usage["completion_tokens"]
    assert int(done.headers["x-ratelimit-remaining-tokens"]) == 1000 - prompt - produced - usage["prompt_tokens"]


def test_settling_below_the_count_so_far_gives_tokens_back():
    # NOTE(eos): with logprobs the engine also sends the end token, which chat's usage leaves out
    from types import SimpleNamespace
    limits = Limits("", True, MemoryStore(clock=Clock()), table=parse_table(
        {"default": {"tokens_per_minute": 100}}))
    permit = limits.admit(digest("k"), "")
    closers, counters = [], []
    events = SimpleNamespace(model_id="m", prompt_tokens=3, produced_tokens=4, on_close=closers.append,
                             on_token=counters.append)
    permit.meter(events)
    for _ in range(5):
        counters[0]()
    closers[0]()
    assert permit.levels.tokens == 97
    assert limits.store.settle(permit.subject.bucket, permit.subject.limit, 0, 0, None).tokens == 100 - 3 - 4


def test_a_key_in_token_debt_waits_until_the_refill_pays_it_back(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(tokens_per_minute=60))
    app = h.client()
    long_prompt = dict(COMPLETION, prompt="x" * 50, max_tokens=20)
    h.engine("fake", reply="y" * 20, max_context=128)
    done = app.post_json("/v1/completions", long_prompt, headers=auth("alice")).json["usage"]
    debt = done["prompt_tokens"] + done["completion_tokens"] - 60
    assert debt > 0
    refused = app.post_json("/v1/completions", COMPLETION, headers=auth("alice"), status=429)
    assert refused.json["error"]["type"] == "tokens"
    assert refused.headers["Retry-After"] == str(debt + 1)              # one token a second
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    h.clock.now += debt + 1
    app.post_json("/v1/completions", COMPLETION, headers=auth("alice"))


def test_a_daily_quota_refuses_until_midnight_utc(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(tokens_per_day=10))
    app = h.client()
    app.post_json("/v1/completions", dict(COMPLETION, max_tokens=8), headers=auth("alice"))
    refused = app.post_json("/v1/completions", COMPLETION, headers=auth("alice"), status=429)
    assert refused.json["error"]["type"] == refused.json["error"]["code"] == "insufficient_quota"
    midnight = (int(h.clock.now) // 86400 + 1) * 86400
    assert int(refused.headers["Retry-After"]) == midnight - int(h.clock.now)
    h.clock.now = midnight
    app.post_json("/v1/completions", COMPLETION, headers=auth("alice"))


# ---- concurrency ---------------------------------------------------------------------------------

def test_a_key_runs_at_most_its_concurrent_generations(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(concurrent=1), max_batch=4)
    gate = threading.Event()
    h.engine("fake", gate=gate)
    app = h.app()
    _, _, held = start(app, "/v1/completions", dict(COMPLETION, stream=True), "alice")
    client = h.client()
    refused = client.post_json("/v1/completions", COMPLETION, headers=auth("alice"), status=429)
    assert refused.json["error"]["type"] == "concurrency"
    assert refused.headers["Retry-After"] == "1"
    gate.set()
    client.post_json("/v1/completions", COMPLETION, headers=auth("bob"))         # another key runs
    held.close()
    client.post_json("/v1/completions", COMPLETION, headers=auth("alice"))       # its place is back


def test_a_model_runs_at_most_its_cap_whoever_asks(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file() + "\n[models.fake]\nconcurrent = 1\n", max_batch=4)
    gate = threading.Event()
    h.engine("fake", gate=gate)
    _, _, held = start(h.app(), "/v1/completions", dict(COMPLETION, stream=True), "alice")
    client = h.client()
    refused = client.post_json("/v1/completions", COMPLETION, headers=auth("bob"), status=503)
    assert refused.json["error"]["code"] == "model_overloaded" and refused.headers["Retry-After"] == "1"
    gate.set()
    held.close()
    # NOTE(refund): the refused request did not spend one of bob's requests
    assert client.post_json("/v1/completions", COMPLETION, headers=auth("bob")).headers[
        "x-ratelimit-remaining-requests"] == "99"


# ---- the file and its reload ---------------------------------------------------------------------

def test_reload_applies_new_limits_and_keeps_running_streams(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=50), max_batch=4)
    gate = threading.Event()
    h.engine("fake", gate=gate)
    _, _, running = start(h.app(), "/v1/completions", dict(COMPLETION, stream=True), "alice")
    h.path.write_text(rate_file(requests_per_minute=3))
    reload_all()
    gate.set()
    resp = h.client().post_json("/v1/completions", COMPLETION, headers=auth("alice"))
    assert resp.headers["x-ratelimit-limit-requests"] == "3"
    body = b"".join(running).decode()
    running.close()
    assert body.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in body


def test_a_bad_file_on_reload_keeps_the_previous_limits(make_harness, tmp_path, caplog):
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=2))
    h.path.write_text("[keys.alice]\nrequests_per_minute = 1\n")          # no sha256
    h.service.limits.reload()
    assert "not reloaded" in caplog.text
    assert h.client().post_json("/v1/completions", COMPLETION, headers=auth("alice")).headers[
        "x-ratelimit-limit-requests"] == "2"


def test_json_files_and_keys_by_digest_alone(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"default": {"concurrent": 2},
                                "keys": {sha(KEYS["bob"]).upper(): {"tokens_per_minute": 9}}}))
    table = read_table(str(path))
    assert table.keys == {sha(KEYS["bob"]): (f"sha256:{sha(KEYS['bob'])[:12]}", Limit(0, 9, 2, 0))}


@pytest.mark.parametrize("data, fragment", [
    ({"keys": {"alice": {"requests_per_minute": 1}}}, "sha256"),
    ({"keys": {"alice": {"sha256": "abc"}}}, "sha256"),
    ({"keys": {"a": {"sha256": sha("x")}, "b": {"sha256": sha("x")}}}, "same sha256"),
    ({"default": {"requests_per_minut": 1}}, "unknown setting 'requests_per_minut'"),
    ({"default": {"requests_per_minute": -1}}, ">= 0"),
    ({"default": {"requests_per_minute": 1.5}}, "whole number"),
    ({"models": {"m": {"concurrent": True}}}, "whole number"),
    ({"limits": {}}, "unknown setting 'limits'"),
])
def test_a_bad_file_names_what_is_wrong(data, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse_table(data, "limits.toml")


def test_an_unreadable_file_stops_the_server_at_start(make_harness, tmp_path):
    (tmp_path / "bad.toml").write_text("[default\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        make_harness(limits_file=str(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match="cannot be read"):
        make_harness(limits_file=str(tmp_path / "absent.toml"))


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (0.0201, "21ms"), (1, "1s"), (1.5, "1.5s"), (360, "6m0s"),
                                           (3723.25, "1h2m3.25s")])
def test_durations_read_as_openai_writes_them(seconds, text):
    assert duration(seconds) == text


# ---- metrics -------------------------------------------------------------------------------------

def test_metrics_count_throttles_by_key_and_reason_and_tokens_per_key(make_harness, tmp_path):
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=1))
    app = h.client()
    app.post_json("/v1/completions", COMPLETION, headers=auth("alice"))
    app.post_json("/v1/completions", COMPLETION, headers=auth("alice"), status=429)
    text = app.get("/metrics", headers=auth("alice")).text
    assert re.search(r'turbospark_ratelimit_throttled_total\{key="alice",reason="requests"\} [1-9]', text)
    assert re.search(r'turbospark_key_tokens_total\{key="alice",kind="prompt"\} [1-9]', text)
    assert KEYS["alice"] not in text and sha(KEYS["alice"]) not in text


# ---- the official SDKs retry on the 429 ----------------------------------------------------------

def drained(make_harness, tmp_path):
    """alice's requests bucket emptied: her next request is refused, 100 ms later one is back."""
    h = limited(make_harness, tmp_path, rate_file(requests_per_minute=600))
    limits = h.service.limits
    subject = limits.subject(digest(KEYS["alice"]), "")

    def drain():
        level = limits.store.settle(subject.bucket, subject.limit, 0, 0, None).requests
        limits.store.settle(subject.bucket, subject.limit, 0, level, None)
    h.drain = drain
    drain()
    h.statuses = []
    app = h.app()

    def wsgi(environ, start_response):
        def record(status, headers, exc=None):
            h.statuses.append(int(status[:3]))
            if status.startswith("429"):
                h.clock.now += 0.2              # past the 100 ms the SDK sleeps on retry-after-ms
            return start_response(status, headers, exc)
        return app(environ, record)
    h.wsgi = wsgi
    return h


def sdk(cls, h, base_url, retries=2):
    """An official SDK client that calls the app in-process, as it would call a server."""
    httpx2 = pytest.importorskip("httpx2")
    return cls(base_url=base_url, api_key=KEYS["alice"], max_retries=retries,
               http_client=httpx2.Client(transport=httpx2.WSGITransport(app=h.wsgi)))


def test_the_openai_sdk_retries_the_429_and_then_succeeds(make_harness, tmp_path):
    openai = pytest.importorskip("openai")
    h = drained(make_harness, tmp_path)
    reply = sdk(openai.OpenAI, h, "http://limits.test/v1").chat.completions.create(**CHAT)
    assert reply.choices[0].message.content and h.statuses == [429, 200]
    h.drain()
    with pytest.raises(openai.RateLimitError):
        sdk(openai.OpenAI, h, "http://limits.test/v1", retries=0).completions.create(**COMPLETION)


def test_the_anthropic_sdk_retries_the_429_and_then_succeeds(make_harness, tmp_path):
    anthropic = pytest.importorskip("anthropic")
    h = drained(make_harness, tmp_path)
    reply = sdk(anthropic.Anthropic, h, "http://limits.test").messages.create(**MESSAGE)
    assert reply.content[0].text and h.statuses == [429, 200]


def test_the_redis_password_stays_out_of_the_configs_repr():
    from turbospark_wsgi.config import Config
    shown = repr(Config(limits_redis="redis://:hunter2@cache:6379/0", load_default=False))
    assert "hunter2" not in shown and "redis://***@cache:6379/0" in shown

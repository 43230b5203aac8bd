"""API keys (both header styles, key files, no timing signal) and CORS (preflight, streams, errors)."""
import ast
import hmac
import logging
import statistics
import time
from pathlib import Path

import pytest

from turbospark_wsgi.http import middleware
from turbospark_wsgi.config import Config, ConfigError
from turbospark_wsgi.http.middleware import _digest, key_matches

KEYS = ("sk-alpha-0123456789", "sk-beta-9876543210")


@pytest.fixture
def keyed(make_harness):
    return make_harness(api_keys=KEYS).client()


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_openai_routes_missing_wrong_right_key(keyed, path, body):
    r = keyed.post_json(path, body, status=401)
    assert r.json["error"]["type"] == "authentication_error" and r.json["error"]["code"] == "invalid_api_key"
    assert "Missing API key" in r.json["error"]["message"]
    r = keyed.post_json(path, body, headers={"Authorization": "Bearer sk-alpha-0123456788"}, status=401)
    assert r.json["error"]["message"] == "Incorrect API key provided"
    keyed.post_json(path, body, headers={"Authorization": f"Bearer {KEYS[0]}"}, status=200)
    keyed.post_json(path, body, headers={"x-api-key": KEYS[1]}, status=200)


def test_anthropic_route_uses_its_envelope_and_x_api_key(keyed):
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = keyed.post_json("/v1/messages", body, headers={"x-api-key": "nope"}, status=401)
    assert r.json == {"type": "error", "error": {"type": "authentication_error",
                                                  "message": "Incorrect API key provided"}}
    keyed.post_json("/v1/messages", body, headers={"x-api-key": KEYS[0]}, status=200)


def test_health_and_openapi_stay_open_metrics_does_not(keyed):
    keyed.get("/health", status=503)            # open; 503 because nothing is loaded yet
    keyed.get("/openapi.json", status=200)
    keyed.get("/metrics", status=401)
    keyed.get("/metrics", headers={"x-api-key": KEYS[0]}, status=200)


def test_keys_from_a_file_join_the_env_list(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# operators\nsk-file-1\n\n  sk-file-2  \n")
    config = Config.from_env({"TURBOSPARK_API_KEYS": "sk-env", "TURBOSPARK_API_KEY_FILE": str(path)})
    assert config.api_keys == ("sk-env", "sk-file-1", "sk-file-2")
    assert "sk-" not in repr(config)            # keys never reach a log through the config
    with pytest.raises(ConfigError, match="cannot be read"):
        Config(api_key_file=str(tmp_path / "absent"))


def test_keys_never_logged(make_harness, caplog):
    client = make_harness(api_keys=KEYS).client()
    with caplog.at_level(logging.DEBUG):
        client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"})
        client.get("/v1/models", headers={"Authorization": "Bearer sk-wrong-secret"}, status=401)
    assert KEYS[0] not in caplog.text and "sk-wrong-secret" not in caplog.text


def test_every_key_is_compared_by_digest_without_early_exit(monkeypatch):
    seen, real = [], hmac.compare_digest

    def spy(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    digests = [_digest(k) for k in KEYS + ("sk-gamma",)]
    assert key_matches(_digest(KEYS[0]), digests)   # the first key matches ...
    assert seen == [(32, 32)] * 3                   # ... and all three are still compared, 32-byte digests
    seen.clear()
    assert not key_matches(_digest("x" * 500), digests)
    assert seen == [(32, 32)] * 3


def test_the_comparison_loop_has_no_break_or_return():
    source = Path(middleware.__file__).read_text()
    fn = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "key_matches")
    loop = next(n for n in ast.walk(fn) if isinstance(n, ast.For))
    assert not [n for n in ast.walk(loop) if isinstance(n, (ast.Break, ast.Return, ast.If))]


def test_wrong_key_timing_does_not_depend_on_a_matching_prefix():
    digests = [_digest(k) for k in KEYS]
    same_prefix = KEYS[0][:-1] + "X"                # all but the last character right
    other = "Z" * len(KEYS[0])

    def median(key, n=4000):
        times = []
        for _ in range(n):
            t = time.perf_counter_ns()
            key_matches(_digest(key), digests)
            times.append(time.perf_counter_ns() - t)
        return statistics.median(times)

    median(other, 500)                              # warm up
    ratio = median(same_prefix) / median(other)
    assert 0.5 < ratio < 2.0, ratio              # generous: a shared machine is noisy


ORIGIN = "https://app.example"


@pytest.fixture
def cors(make_harness):
    return make_harness(cors_origins=(ORIGIN,), api_keys=KEYS).client()


def test_preflight_is_answered_before_auth(cors):
    r = cors.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"}, status=204)
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    allowed = r.headers["Access-Control-Allow-Headers"].lower()
    for name in ("authorization", "x-api-key", "anthropic-version", "content-type", "x-session-affinity"):
        assert name in allowed
    assert {"POST", "DELETE"} <= set(r.headers["Access-Control-Allow-Methods"].replace(" ", "").split(","))


def test_cors_headers_on_streams_and_errors(cors):
    auth = {"Origin": ORIGIN, "x-api-key": KEYS[0]}
    r = cors.post_json("/v1/completions", {"prompt": "hi", "stream": True}, headers=auth)
    assert r.content_type == "text/event-stream" and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "x-request-id" in r.headers["Access-Control-Expose-Headers"]
    r = cors.post_json("/v1/completions", {"prompt": "hi"}, headers={"Origin": ORIGIN}, status=401)
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN   # the browser may read the 401 body


def test_unlisted_origin_gets_no_cors_headers(cors):
    r = cors.get("/health", headers={"Origin": "https://evil.example"}, status="*")
    assert "Access-Control-Allow-Origin" not in r.headers


def test_wildcard_and_disabled(make_harness):
    star = make_harness(cors_origins=("*",)).client()
    assert star.get("/health", headers={"Origin": ORIGIN}, status="*").headers["Access-Control-Allow-Origin"] == "*"
    off = make_harness().client()
    assert "Access-Control-Allow-Origin" not in off.get("/health", headers={"Origin": ORIGIN}, status="*").headers

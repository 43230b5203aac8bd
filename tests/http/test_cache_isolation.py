"""TURBOSPARK_CACHE_ISOLATION and vLLM's per-request `cache_salt`: which runs may share cached prompt
prefixes. The salt the engine gets (fake engine), and on the real engine (stories260K) that another
key's identical prompt misses the cache while the same key's hits it, with the same output."""
import os
from pathlib import Path

import pytest

from test_limits import KEYS, auth
from turbospark_wsgi.config import Config, ConfigError
from turbospark_wsgi.http.middleware import caller_of

MODEL = Path(os.environ.get("TURBOSPARK_TEST_MODELS", "/work/shared/models")) / "stories260K.gguf"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def owner(name):
    return caller_of(KEYS[name], "").owner


def salts(make_harness, requests, **config):
    """The cache_salt of each engine run for `requests`: [(headers, body)] posted to chat."""
    h = make_harness(**config)
    engine = h.engine("fake", reply="ok")
    client = h.client()
    for headers, body in requests:
        client.post_json("/v1/chat/completions", body, headers=headers)
    return [run.cache_salt for run in engine.runs]


def test_a_server_with_keys_keeps_prefixes_per_key_by_default(make_harness):
    got = salts(make_harness, [(auth("alice"), CHAT), (auth("bob"), CHAT), (auth("alice"), dict(CHAT, cache_salt="s"))],
                api_keys=tuple(KEYS.values()))
    assert got == [owner("alice"), owner("bob"), owner("alice") + "s"]


def test_an_open_server_shares_them_unless_a_request_salts_its_own(make_harness):
    key = {"Authorization": "Bearer anything"}
    assert salts(make_harness, [({}, CHAT), (key, CHAT), (key, dict(CHAT, cache_salt="s"))]) == ["", "", "s"]


def test_the_setting_overrides_the_default_either_way(make_harness):
    keyed = salts(make_harness, [(auth("alice"), CHAT), (auth("bob"), dict(CHAT, cache_salt="s"))],
                  api_keys=tuple(KEYS.values()), cache_isolation="shared")
    assert keyed == ["", "s"]
    presented = salts(make_harness, [({"Authorization": f"Bearer {KEYS['alice']}"}, CHAT), ({}, CHAT)],
                      cache_isolation="key")
    assert presented == [owner("alice"), ""]
    assert Config.from_env({"TURBOSPARK_CACHE_ISOLATION": "KEY"}).cache_isolation == "key"
    with pytest.raises(ConfigError, match="TURBOSPARK_CACHE_ISOLATION"):
        Config.from_env({"TURBOSPARK_CACHE_ISOLATION": "per-key"})


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/v1/responses", {"input": "hi", "max_output_tokens": 2})])
def test_every_openai_generation_route_takes_a_salt(make_harness, route, body):
    h = make_harness()
    engine = h.engine("fake", reply="ok", max_context=1024)
    h.client().post_json(route, dict(body, cache_salt="tenant-7"))
    assert engine.runs[-1].cache_salt == "tenant-7"


@pytest.fixture(scope="module")
def stories_app(tmp_path_factory):
    if not MODEL.is_file():
        pytest.skip(f"{MODEL} not present")
    import webtest
    from turbospark_wsgi.http.app import create_app
    models = tmp_path_factory.mktemp("models")
    (models / "stories.gguf").symlink_to(MODEL)
    config = Config(models_dir=str(models), model="stories", device="cpu", load_default=False, keepalive=0.5,
                    api_keys=tuple(KEYS.values()))
    return webtest.TestApp(create_app(config))


def test_real_engine_another_keys_identical_prompt_misses_the_cache(stories_app):
    body = {"model": "stories", "messages": [{"role": "user", "content": "Once upon a time " * 40}],
            "max_tokens": 6, "temperature": 0}

    def ask(who, **extra):
        doc = stories_app.post_json("/v1/chat/completions", dict(body, **extra), headers=auth(who)).json
        return doc["usage"]["prompt_tokens_details"]["cached_tokens"], doc["choices"][0]["message"]["content"]

    first = ask("alice")
    again = ask("alice")
    other = ask("bob")
    assert first[0] == 0 and again[0] > 0, (first, again)
    assert other[0] == 0                                   # bob cannot time alice's prompt
    assert ask("bob")[0] > 0                               # ... but his own is cached for him
    assert ask("alice", cache_salt="other")[0] == 0        # a salt of her own keeps apart further
    assert first[1] == again[1] == other[1]                # the cache never changes the output

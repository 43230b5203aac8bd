"""Continuous batching through real gunicorn: concurrent clients share decode steps and get exactly
the text each would get alone; a second chat turn reuses the first turn's prefix."""
import concurrent.futures

import pytest

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = ["The three primary colors are", "Write a haiku about the sea:", "def fibonacci(n):",
           "The capital of France is"]


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def client(request, default_model, start_gunicorn):
    srv = start_gunicorn(request.param, model="smollm2-135m-instruct", max_batch=4, max_waiting=8)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    srv.stop()


def complete(client, prompt, stream):
    kw = dict(model="smollm2-135m-instruct", prompt=prompt, max_tokens=20, temperature=0)
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


def test_concurrent_streams_equal_solo_runs(client):
    solo = [complete(client, p, stream=False) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(client, p, stream=True), PROMPTS))
    assert together == solo


def test_second_chat_turn_reuses_the_first_turns_prefix(client):
    history = [{"role": "user", "content": "Tell me about the moon. " * 40}]
    kw = dict(model="smollm2-135m-instruct", max_tokens=8, temperature=0)
    first = client.chat.completions.create(messages=history, **kw)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And the sun?"}]
    second = client.chat.completions.create(messages=history, **kw)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 128


RECURSIVE_TOOL = {"type": "function", "function": {"name": "walk", "parameters": {
    "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}
HOSTILE = [("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "temperature": 5e-324}),
           ("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "temperature": 1.0, "repetition_penalty": 1e-40}),
           ("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "repetition_penalty": 1e-300, "stream": True}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "max_tokens": 20,
                                     "tools": [RECURSIVE_TOOL], "tool_choice": "required"})]


@pytest.mark.parametrize("path, body", HOSTILE, ids=["temperature", "penalty", "penalty-stream", "recursive-ref"])
def test_a_hostile_neighbour_leaves_the_running_streams_untouched(client, path, body):
    import requests
    solo = [complete(client, p, stream=False) for p in PROMPTS[:3]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(complete, client, p, True) for p in PROMPTS[:3]]
        hostile = pool.submit(requests.post, str(client.base_url).rstrip("/").removesuffix("/v1") + path,
                              json={"model": "smollm2-135m-instruct", **body}, timeout=300)
        assert [f.result() for f in streams] == solo
        reply = hostile.result()
    assert reply.status_code in (200, 400) and "event: error" not in reply.text, reply.text[:300]


def test_every_running_stream_advances(client):
    """No stream waits while its neighbours take every step: when the first of 4 streams has 40
    tokens, each of the others has at least 10 (gevent once gave 3 of 8 streams every step)."""
    import threading
    counts, started = [0] * len(PROMPTS), threading.Barrier(len(PROMPTS))
    snapshot = []

    def stream(i):
        started.wait()
        kw = dict(model="smollm2-135m-instruct", prompt=PROMPTS[i], max_tokens=60, temperature=0,
                  stream=True, extra_body={"ignore_eos": True})
        for chunk in client.completions.create(**kw):
            if chunk.choices:
                counts[i] += 1
                if counts[i] == 40 and not snapshot:
                    snapshot.append(list(counts))
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        list(pool.map(stream, range(len(PROMPTS))))
    assert snapshot and min(snapshot[0]) >= 10, snapshot

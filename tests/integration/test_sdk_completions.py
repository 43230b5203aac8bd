"""Prompt lists from the clients that send them, against real gunicorn: LangChain's `OpenAI.generate`
(one /v1/completions request for the whole list) and the openai SDK's `completions.create` with a
list. Each answer equals the same prompt sent alone. The model is a tiny random Llama (HF format)."""
import importlib.util
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
langchain_openai = pytest.importorskip("langchain_openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).parents[1] / "engine" / "conftest.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

PROMPTS = ["the cat sat on", "a dog ran in the", "the sun"]


@pytest.fixture(scope="module", params=["gthread", "gevent"])
def server(request, tmp_path_factory, start_gunicorn):
    models = tmp_path_factory.mktemp("models")
    cfg = tiny.hf_config(max_position_embeddings=128)
    tiny.write_hf_dir(models / "tiny", cfg, tiny.random_state(cfg, 3))
    srv = start_gunicorn(request.param, models=str(models), model="tiny", max_batch=4)
    yield srv
    srv.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def alone(oai, prompt, **kw):
    return oai.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, **kw)


def test_langchain_generate_answers_a_prompt_list(server, oai):
    llm = langchain_openai.OpenAI(base_url=server.url + "/v1", api_key="x", model="tiny", temperature=0,
                                  max_tokens=6, max_retries=0, timeout=60)
    result = llm.generate(PROMPTS)
    assert [g[0].text for g in result.generations] == [alone(oai, p).choices[0].text for p in PROMPTS]
    usage = result.llm_output["token_usage"]
    assert usage["prompt_tokens"] == sum(alone(oai, p).usage.prompt_tokens for p in PROMPTS)


def test_openai_sdk_prompt_list_with_n(oai):
    out = oai.completions.create(model="tiny", prompt=PROMPTS, max_tokens=6, temperature=0.9, seed=5, n=2)
    assert [c.index for c in out.choices] == list(range(6)) and out.model == "tiny"
    singles = [oai.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0.9, seed=5, n=2).choices
               for p in PROMPTS]
    assert [c.text for c in out.choices] == [c.text for s in singles for c in s]


def test_openai_sdk_streams_a_prompt_list(oai):
    stream = oai.completions.create(model="tiny", prompt=PROMPTS, max_tokens=6, temperature=0, stream=True)
    texts = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i: alone(oai, p).choices[0].text for i, p in enumerate(PROMPTS)}

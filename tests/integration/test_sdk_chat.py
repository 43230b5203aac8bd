"""The official openai and anthropic SDKs against real gunicorn with the default model."""
import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Name one colour."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def test_openai_create(oai):
    out = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8, temperature=0)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_openai_stream_matches_create(oai):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    body = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == body.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == body.usage.completion_tokens


def test_openai_stream_helper_with_forced_tool(oai):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    # NOTE(sdk): stop at the newline that ends a one-line call, so a 135M model finishes it
    with oai.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                     tools=TOOLS, tool_choice=choice, max_tokens=40, temperature=0,
                                     stop=["\n"]) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        try:
            final = stream.get_final_completion()
        except openai.LengthFinishReasonError:
            pytest.skip("the model did not finish the forced call within max_tokens")
    message = final.choices[0].message
    assert final.choices[0].finish_reason in ("tool_calls", "length", "stop")
    if final.choices[0].finish_reason == "tool_calls":
        # NOTE(sdk): the helper accumulated the deltas; the result must be the one named call
        assert message.tool_calls[0].function.name == "get_weather"
        json.loads(message.tool_calls[0].function.arguments)
        pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
        assert len(pieces) > 2        # the id/name delta, then the arguments in several pieces


def test_openai_validation_error(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    assert info.value.body["param"] == "messages[0].tool_call_id"


def test_anthropic_create_and_count(claude):
    kw = dict(model=MODEL, max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0})
    msg = claude.messages.create(**kw)
    assert msg.type == "message" and msg.content[0].type == "text"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert counted.input_tokens == msg.usage.input_tokens


def test_anthropic_stream(claude):
    kw = dict(model=MODEL, max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0})
    msg = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text == final.content[0].text
    assert final.usage.output_tokens == msg.usage.output_tokens and final.stop_reason == msg.stop_reason


def test_anthropic_stream_helper_with_forced_tool(claude):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    with claude.messages.stream(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                tools=tools, tool_choice={"type": "tool", "name": "get_weather"},
                                stop_sequences=["\n"], extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    if final.stop_reason == "max_tokens":
        pytest.skip("the model did not finish the forced call within max_tokens")
    [block] = [b for b in final.content if b.type == "tool_use"]
    # NOTE(sdk): the helper parsed the accumulated input_json_delta pieces into the block's input
    assert block.name == "get_weather" and isinstance(block.input, dict) and final.stop_reason == "tool_use"
    assert sum(1 for e in events if e.type == "input_json") > 2


def test_anthropic_error_envelope(claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=0, messages=MESSAGES)
    assert info.value.body["type"] == "error"


def test_the_chat_model_embeds_for_the_openai_sdk_and_langchain(oai, server, default_model):
    import numpy as np
    langchain_openai = pytest.importorskip("langchain_openai")
    from turbospark_wsgi.engine import load_engine
    texts = ["The cat sits on the mat.", "Paris is the capital of France.", "東京は日本の首都です。"]
    engine = load_engine(str(default_model), device="cpu")
    want = engine.embed(engine.encode_batch(texts))
    for fmt in ("float", None):             # None: the SDK asks for base64 and decodes it itself
        out = oai.embeddings.create(model=MODEL, input=texts, **({"encoding_format": fmt} if fmt else {}))
        got = np.array([d.embedding for d in out.data], dtype=np.float32)
        assert got.shape == (3, 576) and out.usage.prompt_tokens == sum(map(len, engine.encode_batch(texts)))
        np.testing.assert_allclose(got, want, atol=1e-5)
    lc = langchain_openai.OpenAIEmbeddings(model=MODEL, base_url=server.url + "/v1", api_key="x",
                                           check_embedding_ctx_length=False)
    np.testing.assert_allclose(np.array(lc.embed_documents(texts), dtype=np.float32), want, atol=1e-5)
    np.testing.assert_allclose(np.array(lc.embed_query(texts[1]), dtype=np.float32), want[1], atol=1e-5)

"""Output controls on a real engine (a tiny random Llama served from an HF directory), checked against
transformers: logprobs, echo, top_logprobs, n / best_of, seeds, logit_bias, tokenize / detokenize."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from turbospark_wsgi.http.app import create_app
from turbospark_wsgi.config import Config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
webtest = pytest.importorskip("webtest")

_spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).parents[1] / "engine" / "conftest.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

TOL = 1e-4
USER = [{"role": "user", "content": "the cat sat"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    cfg = tiny.hf_config(max_position_embeddings=128)
    tiny.write_hf_dir(root / "tiny", cfg, tiny.random_state(cfg, 0))
    return root / "tiny"


@pytest.fixture(scope="module")
def app(model_dir):
    config = Config(models_dir=str(model_dir.parent), model="tiny", device="cpu", load_default=False)
    return webtest.TestApp(create_app(config))


@pytest.fixture(scope="module")
def reference(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()

    def logprobs(ids):       # [T, V] float64 log_softmax of the reference logits
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, dim=-1).numpy()
    return logprobs


@pytest.fixture(scope="module")
def token_ids(model_dir):
    """Token text (as the logprobs report it) -> id, from the served model's own tokenizer."""
    from turbospark_wsgi.engine import load_engine
    tokenizer = load_engine(str(model_dir), device="cpu").tokenizer
    table = {tokenizer.token_text(i)[0]: i for i in range(tokenizer.vocab_size)}
    assert len(table) == tokenizer.vocab_size
    return lambda texts: [table[t] for t in texts]


def tokenize(app, **body):
    return app.post_json("/tokenize", body).json["tokens"]


def completion(app, **body):
    r = app.post_json("/v1/completions", body)
    assert "x-anyllm-degradation" not in r.headers
    return r.json


def chat(app, **body):
    r = app.post_json("/v1/chat/completions", dict(messages=USER, **body))
    assert "x-anyllm-degradation" not in r.headers
    return r.json


def test_completion_logprobs_equal_transformers(app, reference, token_ids):
    prompt = tokenize(app, prompt="the cat")
    body = completion(app, prompt="the cat", max_tokens=6, temperature=0.7, seed=3, logprobs=5)
    lp = body["choices"][0]["logprobs"]
    out = token_ids(lp["tokens"])
    ids = prompt + out
    ref = reference(ids)
    assert len(lp["token_logprobs"]) == len(out) == body["usage"]["completion_tokens"]
    for k, (token, got, top) in enumerate(zip(out, lp["token_logprobs"], lp["top_logprobs"])):
        row = ref[len(prompt) + k - 1]
        assert abs(got - row[token]) < TOL
        values = list(top.values())
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert np.allclose(values, np.sort(row)[::-1][:5], atol=TOL)


def test_echo_returns_prompt_text_and_prompt_logprobs(app, reference):
    ids = tokenize(app, prompt="the cat sat on the mat")
    body = completion(app, prompt="the cat sat on the mat", echo=True, logprobs=1, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == "the cat sat on the mat" and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(ids)
    ref = reference(ids)
    for k in range(1, len(ids)):
        assert abs(lp["token_logprobs"][k] - ref[k - 1, ids[k]]) < TOL
        assert abs(max(lp["top_logprobs"][k].values()) - ref[k - 1].max()) < TOL
    # NOTE(bos): the tiny model says add_bos_token false, so the prompt starts with its first word
    assert "".join(lp["tokens"]) == "the cat sat on the mat" and lp["text_offset"][:3] == [0, 1, 3]


def test_echo_with_token_ids_and_one_generated_token_as_lm_eval_asks(app, reference):
    ids = tokenize(app, prompt="in the")
    body = completion(app, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    ref = reference(ids)
    greedy = int(np.argmax(ref[-1]))
    assert lp["token_logprobs"][-1] == pytest.approx(ref[-1, greedy], abs=TOL)
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())


def test_streamed_logprobs_equal_the_body(app):
    body = dict(prompt="the", max_tokens=8, seed=11, logprobs=2, echo=True)
    plain = completion(app, **body)["choices"][0]
    frames = app.post_json("/v1/completions", dict(body, stream=True)).body.decode().split("\n\n")
    chunks = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    tokens, logprobs, offsets = [], [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp:
            tokens += lp["tokens"]
            logprobs += lp["token_logprobs"]
            offsets += lp["text_offset"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert tokens == plain["logprobs"]["tokens"] and logprobs == plain["logprobs"]["token_logprobs"]


def test_chat_logprobs_shape_and_values(app, reference, token_ids):
    body = chat(app, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = body["choices"][0]["logprobs"]["content"]
    prompt = tokenize(app, messages=USER)
    assert len(prompt) == body["usage"]["prompt_tokens"]
    generated = token_ids([e["token"] for e in content])
    ref = reference(prompt + generated)
    for k, e in enumerate(content):
        row = ref[len(prompt) + k - 1]
        assert abs(e["logprob"] - row.max()) < TOL                 # greedy: the chosen token is the best
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted((t["logprob"] for t in e["top_logprobs"]), reverse=True)
        assert all(isinstance(b, int) for t in e["top_logprobs"] for b in t["bytes"])


def test_n_choices_are_the_seeds_seed_plus_i(app):
    many = completion(app, prompt="the", max_tokens=6, seed=40, n=3)
    singles = [completion(app, prompt="the", max_tokens=6, seed=40 + i) for i in range(3)]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert [c["text"] for c in many["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert many["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)


def test_best_of_returns_the_most_likely_runs(app):
    bodies = [completion(app, prompt="the", max_tokens=6, seed=7 + i, logprobs=0) for i in range(4)]
    runs = [b["choices"][0] for b in bodies]
    scores = [sum(r["logprobs"]["token_logprobs"]) for r in runs]
    best = completion(app, prompt="the", max_tokens=6, seed=7, n=2, best_of=4)
    order = sorted(range(4), key=lambda i: -scores[i])[:2]
    assert [c["text"] for c in best["choices"]] == [runs[i]["text"] for i in order]
    assert all(c["logprobs"] is None for c in best["choices"])
    assert best["usage"]["completion_tokens"] == sum(b["usage"]["completion_tokens"] for b in bodies)


def test_streaming_n_tags_every_chunk_with_its_choice(app):
    frames = app.post_json("/v1/completions", dict(prompt="the", max_tokens=4, seed=1, n=2, stream=True,
                                                   stream_options={"include_usage": True})).body.decode()
    chunks = [json.loads(f[6:]) for f in frames.split("\n\n") if f.startswith("data: {")]
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    plain = completion(app, prompt="the", max_tokens=4, seed=1, n=2)
    assert [texts[0], texts[1]] == [c["text"] for c in plain["choices"]]
    assert chunks[-1]["usage"] == plain["usage"] and frames.rstrip().endswith("data: [DONE]")


def test_chat_n_and_stream(app):
    body = chat(app, max_tokens=4, seed=5, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    frames = app.post_json("/v1/chat/completions", dict(messages=USER, max_tokens=4, seed=5, n=2, stream=True)).body
    chunks = [json.loads(f[6:]) for f in frames.decode().split("\n\n") if f.startswith("data: {")]
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content") or ""
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in body["choices"]]


@pytest.mark.parametrize("sampling", [
    {}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.2}, {"temperature": 1.7, "top_k": 40, "top_p": 0.9},
    {"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"repetition_penalty": 1.3},
    {"logit_bias": {"70": 5}}, {"seed": -5}])
def test_seed_reproduces_every_sampler_combination(app, sampling):
    body = dict({"seed": 1234}, max_tokens=8, **sampling)
    assert completion(app, prompt="the", **body)["choices"] == completion(app, prompt="the", **body)["choices"]
    assert chat(app, **body)["choices"] == chat(app, **body)["choices"]


def test_logit_bias_on_chat_and_completions(app):
    forced = tokenize(app, prompt="Z", add_special=False)[0]
    body = chat(app, max_tokens=3, temperature=0, logit_bias={str(forced): 100})
    assert body["choices"][0]["message"]["content"] == "ZZZ"
    assert completion(app, prompt="the", max_tokens=3, temperature=0, logit_bias={str(forced): 100})["choices"][0]["text"] == "ZZZ"


def test_tokenize_detokenize_round_trip(app):
    text = "the cat sat on thé mat <|im_end|>"
    r = app.post_json("/tokenize", {"content": text, "add_special": False}).json
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    assert app.post_json("/detokenize", {"tokens": r["tokens"]}).json == {"prompt": text, "content": text}
    by_rule = app.post_json("/tokenize", {"prompt": text}).json["tokens"]      # the model's rule: no BOS
    assert by_rule == r["tokens"] and completion(app, prompt=text, max_tokens=1)["usage"]["prompt_tokens"] == len(by_rule)


def test_tokenize_messages_counts_like_the_chat_route(app):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    count = app.post_json("/tokenize", {"messages": messages}).json["count"]
    body = app.post_json("/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json
    assert count == body["usage"]["prompt_tokens"]


def test_tokenize_errors_name_the_field(app):
    assert app.post_json("/tokenize", {"content": 3}, status=400).json["error"]["param"] == "content"
    assert app.post_json("/detokenize", {"tokens": ["a"]}, status=400).json["error"]["param"] == "tokens"
    assert app.post_json("/detokenize", {"tokens": [10 ** 6]}, status=400).json["error"]["param"] == "tokens"
    assert app.post_json("/tokenize", {"content": "", "add_special": False}).json["tokens"] == []


def test_streamed_chat_logprobs_equal_the_body(app):
    body = dict(messages=USER, max_tokens=6, seed=2, logprobs=True, top_logprobs=2)
    plain = app.post_json("/v1/chat/completions", body).json["choices"][0]["logprobs"]["content"]
    frames = app.post_json("/v1/chat/completions", dict(body, stream=True)).body.decode().split("\n\n")
    chunks = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == plain and len(plain) > 0


def test_no_standard_field_is_reported_as_degraded(app):
    r = app.post_json("/v1/completions", {"prompt": "the", "max_tokens": 2, "logprobs": 2, "echo": True, "n": 2,
                                          "best_of": 3, "logit_bias": {"5": 1}, "seed": 1, "top_p": 0.9,
                                          "presence_penalty": 0.1, "frequency_penalty": 0.1, "stop": ["x"],
                                          "user": "u"})
    assert "x-anyllm-degradation" not in r.headers and len(r.json["choices"]) == 2
    r = app.post_json("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
                                               "n": 2, "logit_bias": {"5": 1}, "seed": 1,
                                               "response_format": {"type": "json_object"}})
    assert "x-anyllm-degradation" not in r.headers and len(r.json["choices"]) == 2

"""What common clients send, on a real engine (tiny random Llamas served from HF directories):
prompt lists on /v1/completions (each prompt its own sequence of the running batch), BOS by the
model's own rule, the generated end token in echo + logprobs, vLLM's tokenizer helpers, and
`model` echoed as the request named it on every route."""
import importlib.util
import json
from pathlib import Path

import pytest

from turbospark_wsgi.http.app import create_app
from turbospark_wsgi.config import Config
from turbospark_wsgi.serving.service import Service

webtest = pytest.importorskip("webtest")

_spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).parents[1] / "engine" / "conftest.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

USER = [{"role": "user", "content": "the cat sat"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """`tiny` (add_bos_token false, as SmolLM2) and `tiny-bos` (add_bos_token true, as Llama 2)."""
    root = tmp_path_factory.mktemp("models")
    cfg = tiny.hf_config(max_position_embeddings=128)
    for name, add_bos in (("tiny", False), ("tiny-bos", True)):
        tiny.write_hf_dir(root / name, cfg, tiny.random_state(cfg, 0))
        path = root / name / "tokenizer_config.json"
        path.write_text(json.dumps(dict(json.loads(path.read_text()), add_bos_token=add_bos)))
    return root


def served(models, **config):
    service = Service(Config(models_dir=str(models), model="tiny", device="cpu", load_default=False, **config))
    return service, webtest.TestApp(create_app(service.config, service=service))


@pytest.fixture(scope="module")
def server(models):
    return served(models, max_batch=4)


@pytest.fixture(scope="module")
def app(server):
    return server[1]


@pytest.fixture(scope="module")
def engine(server):
    return server[0].registry.resolve("tiny")


def completion(app, status=200, **body):
    return app.post_json("/v1/completions", body, status=status).json


# ---- BOS by the model's own rule ------------------------------------------------------------

def test_text_prompts_get_bos_only_where_the_model_asks_for_it(app, engine):
    plain = engine.encode("the cat", add_bos=False)
    assert engine.tokenizer.bos_id is not None and plain[0] != engine.tokenizer.bos_id
    assert app.post_json("/tokenize", {"prompt": "the cat"}).json["tokens"] == plain
    assert completion(app, prompt="the cat", max_tokens=1)["usage"]["prompt_tokens"] == len(plain)
    with_bos = [engine.tokenizer.bos_id] + plain
    assert app.post_json("/tokenize", {"prompt": "the cat", "model": "tiny-bos"}).json["tokens"] == with_bos
    assert completion(app, prompt="the cat", max_tokens=1, model="tiny-bos")["usage"]["prompt_tokens"] == len(with_bos)


@pytest.mark.parametrize("flag", ["add_special_tokens", "add_special"])
def test_add_special_false_turns_the_models_bos_off(app, engine, flag):
    plain = engine.encode("the cat", add_bos=False)
    assert app.post_json("/tokenize", {"prompt": "the cat", "model": "tiny-bos", flag: False}).json["tokens"] == plain
    body = completion(app, prompt="the cat", max_tokens=1, model="tiny-bos", **{flag: False})
    assert body["usage"]["prompt_tokens"] == len(plain)


def test_a_text_prompt_scores_as_its_token_ids(app, engine):
    """lm-eval's text requests (tokenized_requests=False) must score as its token-id requests."""
    text = "the cat sat on the mat"
    ids = engine.encode(text, add_bos=False)
    as_text = completion(app, prompt=text, echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]
    as_ids = completion(app, prompt=ids, echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]
    assert as_text["token_logprobs"] == as_ids["token_logprobs"] and len(as_ids["tokens"]) == len(ids)


# ---- the generated end token ----------------------------------------------------------------

def test_echo_logprobs_lists_the_generated_end_token_as_lm_eval_slices(app, engine):
    eos = engine.tokenizer.eos_id
    ctx, cont = engine.encode("the cat", add_bos=False), engine.encode(" sat", add_bos=False)
    body = completion(app, prompt=ctx + cont, echo=True, logprobs=1, max_tokens=1, temperature=0,
                      logit_bias={str(eos): 100})
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "stop" and len(lp["tokens"]) == len(ctx + cont) + 1
    assert lp["tokens"][-1] == engine.tokenizer.eos_token and lp["token_logprobs"][-1] is not None
    assert body["usage"]["completion_tokens"] == 1 and choice["text"] == engine.decode(ctx + cont)
    scored = completion(app, prompt=ctx + cont, echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]
    # lm-eval's local-completions: sum(token_logprobs[ctxlen:-1]), the last entry being the generated token
    assert sum(lp["token_logprobs"][len(ctx):-1]) == pytest.approx(sum(scored["token_logprobs"][len(ctx):]))


def test_streamed_end_token_logprob_equals_the_body(app, engine):
    eos = engine.tokenizer.eos_id
    body = dict(prompt="the cat", max_tokens=4, temperature=0, logprobs=2, logit_bias={str(eos): 100})
    plain = completion(app, **body)["choices"][0]["logprobs"]
    frames = app.post_json("/v1/completions", dict(body, stream=True)).body.decode().split("\n\n")
    chunks = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == plain["tokens"] == [engine.tokenizer.eos_token]


def test_chat_lists_no_end_token(app, engine):
    body = app.post_json("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True,
                                                  "logit_bias": {str(engine.tokenizer.eos_id): 100}}).json
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["logprobs"]["content"] == []
    assert body["usage"]["completion_tokens"] == 0


# ---- prompt lists ---------------------------------------------------------------------------

PROMPTS = ["the cat", "a dog sat on", "in the"]


def test_prompt_list_choices_are_indexed_prompt_then_choice(app, engine):
    body = completion(app, prompt=PROMPTS, n=2, max_tokens=5, temperature=0.8, seed=7)
    singles = [completion(app, prompt=p, n=2, max_tokens=5, temperature=0.8, seed=7) for p in PROMPTS]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [c["text"] for s in singles for c in s["choices"]]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert body["usage"][key] == sum(s["usage"][key] for s in singles)
    ids = [engine.encode(p, add_bos=False) for p in PROMPTS]
    assert completion(app, prompt=ids, n=2, max_tokens=5, temperature=0.8, seed=7)["choices"] == body["choices"]


def test_prompt_list_with_echo_and_logprobs_as_lm_eval_batches_it(app, engine):
    ids = [engine.encode(p, add_bos=False) for p in PROMPTS]
    body = completion(app, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    for p, (choice, prompt) in enumerate(zip(body["choices"], ids)):
        one = completion(app, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)["choices"][0]
        assert choice["index"] == p and choice["text"].startswith(PROMPTS[p])
        assert choice["logprobs"] == one["logprobs"] and len(choice["logprobs"]["tokens"]) == len(prompt) + 1


def test_streamed_prompt_list_chunks_carry_their_index(app):
    body = dict(prompt=PROMPTS, max_tokens=6, temperature=0, stream_options={"include_usage": True})
    plain = completion(app, **{k: v for k, v in body.items() if k != "stream_options"})
    frames = app.post_json("/v1/completions", dict(body, stream=True)).body.decode().split("\n\n")
    chunks = [json.loads(f[6:]) for f in frames if f.startswith("data: {")]
    texts, finishes = {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
    assert texts == {c["index"]: c["text"] for c in plain["choices"]} and finishes == {0: 1, 1: 1, 2: 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert frames.count("data: [DONE]") == 1


def test_prompt_list_runs_as_sequences_of_one_batch(server):
    """Every prompt is a sequence of the continuous batch: decode steps carry all of them at once."""
    service, app = server
    scheduler = service.registry.resolve("tiny").scheduler
    sizes, step = [], scheduler.step

    def recording_step():
        sizes.append(len(scheduler.active))
        return step()
    scheduler.step = recording_step
    try:
        completion(app, prompt=PROMPTS, max_tokens=8, temperature=0, logit_bias={"2": -100})
    finally:
        del scheduler.step
    assert max(sizes) == len(PROMPTS)


@pytest.mark.parametrize("prompt, param, words", [
    ([], "prompt", "empty"), (["a", 3], "prompt[1]", "string"), ([[5], "a"], "prompt[1]", "token ids"),
    ([[5], [10 ** 6]], "prompt[1]", "vocabulary"), (["a", ""], "prompt[1]", "empty"),
    (["a", "a " * 200], "prompt[1]", "context"), (["a"] * 17, "prompt", "TURBOSPARK_MAX_PROMPTS"),
])
def test_bad_prompt_lists_are_400_naming_the_prompt(app, prompt, param, words):
    err = completion(app, status=400, prompt=prompt, max_tokens=2)["error"]
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error"


def test_a_prompt_list_the_queue_can_never_hold_is_400(models):
    _, app = served(models, max_batch=1, max_waiting=1)
    err = completion(app, status=400, prompt=["a", "b", "c"], max_tokens=1)["error"]
    assert err["param"] == "prompt" and "TURBOSPARK_MAX_WAITING" in err["message"]
    assert len(completion(app, prompt=["a", "b"], max_tokens=1)["choices"]) == 2


def test_choices_and_prompts_fit_a_full_batch(models):
    """n, best_of and a list's prompts each free their engine slot before the next run takes one:
    with one slot (all the others busy, say) they still answer."""
    _, app = served(models, max_batch=1)
    assert len(completion(app, prompt="the cat", n=3, max_tokens=3)["choices"]) == 3
    assert len(completion(app, prompt="the cat", n=2, best_of=3, max_tokens=3)["choices"]) == 2
    assert len(completion(app, prompt=["the cat", "a dog"], n=2, max_tokens=3)["choices"]) == 4


# ---- vLLM's tokenizer helpers ---------------------------------------------------------------

def test_tokenizer_info_has_what_lm_evals_remote_tokenizer_reads(app, engine):
    info = app.get("/tokenizer_info").json
    tok = engine.tokenizer
    assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert info["chat_template"] == tok.chat_template and info["add_bos_token"] is False
    assert info["model_max_length"] == 128 and isinstance(info["tokenizer_class"], str)
    # RemoteTokenizer.eos_token_id: /tokenize the eos string without special tokens
    eos = app.post_json("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json["tokens"]
    assert eos == [tok.eos_id]
    assert app.get("/tokenizer_info", {"model": "tiny-bos"}).json["add_bos_token"] is True


@pytest.mark.parametrize("query, status, param", [
    ("model=nope", 404, "model"), ("model=", 400, "model"), ("model=a&model=b", 400, "model"),
    ("model=" + "x" * 5000, 400, "model"),
])
def test_tokenizer_info_refuses_bad_models_in_the_openai_envelope(app, query, status, param):
    err = app.get("/tokenizer_info?" + query, status=status).json["error"]
    assert err["param"] == param and set(err) == {"message", "type", "param", "code"}


def test_detokenize_answers_in_vllm_and_llama_cpp_style(app, engine):
    ids = app.post_json("/tokenize", {"content": "the cat <|im_end|>", "add_special": False}).json["tokens"]
    assert app.post_json("/detokenize", {"tokens": ids}).json == {"prompt": "the cat <|im_end|>",
                                                                 "content": "the cat <|im_end|>"}


# ---- `model` as the request named it --------------------------------------------------------

@pytest.mark.parametrize("named, echoed", [("TINY", "TINY"), (None, "tiny")])
def test_every_route_echoes_the_model_as_the_request_named_it(app, named, echoed):
    model = {} if named is None else {"model": named}
    assert completion(app, prompt="the", max_tokens=1, **model)["model"] == echoed
    chat = {"messages": USER, "max_tokens": 1, **model}
    assert app.post_json("/v1/chat/completions", chat).json["model"] == echoed
    frames = app.post_json("/v1/chat/completions", dict(chat, stream=True)).body.decode().split("\n\n")
    assert {json.loads(f[6:])["model"] for f in frames if f.startswith("data: {")} == {echoed}
    messages = {"messages": USER, "max_tokens": 1, "model": named or "tiny"}
    assert app.post_json("/v1/messages", messages).json["model"] == (named or "tiny")
    frames = app.post_json("/v1/messages", dict(messages, stream=True)).body.decode()
    assert f'"model":"{named or "tiny"}"' in frames

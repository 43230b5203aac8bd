"""/v1/completions parsing and response shapes (pure: no Falcon, no engine)."""
import math

import pytest

from turbospark_wsgi.config import Config
from turbospark_wsgi.errors import InvalidRequest
from turbospark_wsgi.http.schemas import openai
from turbospark_wsgi.serving.generation import Finished, KeepAlive, TextDelta, Usage
from turbospark_wsgi.serving.prompts import Prompts


def parse(**body):
    return openai.parse_completion({"model": "m", **body})


def admitted(req):
    """The SamplingParams admission builds for `req` (serving/prompts.py), on a fake engine."""
    from tests.conftest import FakeEngine
    return Prompts(Config(load_default=False)).prepare(FakeEngine(max_context=1000), req)[1]


# ---- the original server's unit-test cases ----------------------------------------------------

def test_a_single_string_prompt_passes_through():
    req, _ = parse(prompt="hi")
    assert req.prompt == "hi" and req.prompt_ids is None and req.prompts is None and req.add_special


def test_a_one_element_array_prompt_unwraps():
    req, _ = parse(prompt=["hi"])
    assert req.prompt == "hi"


def test_a_multi_element_array_prompt_is_a_prompt_list():
    req, _ = parse(prompt=["a", "b"])
    assert req.prompts == ["a", "b"] and req.prompt is None and req.prompt_ids is None
    req, _ = parse(prompt=[[5, 6], [7]])
    assert req.prompts == [[5, 6], [7]]


def test_an_empty_array_prompt_is_refused():
    with pytest.raises(InvalidRequest) as e:
        parse(prompt=[])
    assert "empty" in e.value.message and e.value.param == "prompt"


def test_a_prompt_list_over_the_limit_is_refused_before_its_items_are_read():
    assert openai.parse_completion({"prompt": ["a"] * 3}, max_prompts=3)[0].prompts == ["a"] * 3
    with pytest.raises(InvalidRequest) as e:
        openai.parse_completion({"prompt": ["a"] * 3 + [None]}, max_prompts=3)
    assert "at most 3" in e.value.message and "TURBOSPARK_MAX_PROMPTS" in e.value.message and e.value.param == "prompt"


@pytest.mark.parametrize("body, special", [
    ({}, True), ({"add_special_tokens": False}, False), ({"add_special": False}, False),
    ({"add_special_tokens": True, "add_special": True}, True),
])
def test_add_special_tokens_or_add_special_turns_bos_off(body, special):
    assert parse(prompt="hi", **body)[0].add_special is special


@pytest.mark.parametrize("body, param", [
    ({"add_special_tokens": "no"}, "add_special_tokens"), ({"add_special": 0}, "add_special"),
    ({"add_special_tokens": False, "add_special": True}, "add_special_tokens"),
])
def test_bad_add_special_is_refused(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse(prompt="hi", **body)
    assert e.value.param == param


def test_max_tokens_defaults_to_sixteen():
    req, _ = parse(prompt="hi")
    assert req.max_tokens == 16 and admitted(req).max_new_tokens == 16


@pytest.mark.parametrize("value", [0, -1])
def test_zero_or_negative_max_tokens_is_refused(value):
    with pytest.raises(InvalidRequest) as e:
        parse(prompt="hi", max_tokens=value)
    assert "max_tokens" in e.value.message and e.value.param == "max_tokens"


def test_max_tokens_is_read_when_present():
    req, _ = parse(prompt="hi", max_tokens=5)
    assert admitted(req).max_new_tokens == 5


def test_a_plain_request_has_no_warnings():
    assert parse(prompt="hi")[1] == []


def test_logprobs_best_of_and_echo_are_honoured_not_reported():
    req, degraded = parse(prompt="hi", logprobs=5, best_of=2, echo=True)
    assert degraded == [] and (req.logprobs, req.best_of, req.echo, req.n) == (5, 2, True, 1)


def test_echo_false_is_not_reported():
    assert parse(prompt="hi", echo=False)[1] == []


def test_logprobs_null_means_none():
    req, degraded = parse(prompt="hi", logprobs=None)
    assert degraded == [] and req.logprobs is None


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 21}, "n"), ({"best_of": 21}, "best_of"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens")])
def test_logprobs_n_best_of_and_max_tokens_bounds(fields, param):
    with pytest.raises(InvalidRequest) as e:
        parse(prompt="hi", **fields)
    assert e.value.param == param


def test_max_tokens_zero_is_allowed_with_echo():
    req, _ = parse(prompt="hi", echo=True, max_tokens=0, logprobs=1)
    assert req.max_tokens == 0 and admitted(req).max_new_tokens == 0


# ---- prompt shapes ---------------------------------------------------------------------------

def test_token_id_prompts_keep_their_ids_and_add_no_bos():
    req, _ = parse(prompt=[5, 6, 7])
    assert req.prompt_ids == [5, 6, 7] and req.prompt is None
    req, _ = parse(prompt=[[8, 9]])
    assert req.prompt_ids == [8, 9]


@pytest.mark.parametrize("prompt, words, param", [
    ([[]], "empty", "prompt[0]"), (["a", 1], "got integer", "prompt[1]"), ([[1], "a"], "got string", "prompt[1]"),
    ([True], "got boolean", "prompt[0]"), ([-1], "non-negative", "prompt"), ([[1], [-1]], "non-negative", "prompt[1]"),
    ({"a": 1}, "object", "prompt"), (5, "integer", "prompt"), ([["a"]], "token ids", "prompt[0]"),
    (["a", None], "got null", "prompt[1]"), ([[1], [2 ** 40]], "non-negative", "prompt[1]"),
])
def test_bad_prompt_shapes_are_refused(prompt, words, param):
    with pytest.raises(InvalidRequest) as e:
        parse(prompt=prompt)
    assert words in e.value.message and e.value.param == param


def test_prompt_is_required():
    with pytest.raises(InvalidRequest) as e:
        openai.parse_completion({"model": "m"})
    assert e.value.param == "prompt"


# ---- refusals and validation -----------------------------------------------------------------

def test_suffix_is_refused_but_null_suffix_is_not():
    with pytest.raises(InvalidRequest) as e:
        parse(prompt="hi", suffix="")
    assert e.value.param == "suffix"
    parse(prompt="hi", suffix=None)


def test_n_and_best_of_are_carried():
    req, _ = parse(prompt="hi", n=3, best_of=5)
    assert (req.n, req.best_of) == (3, 5)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"), ("temperature", math.nan),
    ("temperature", math.inf), ("top_p", 1.5), ("top_p", -1), ("top_k", -2), ("top_k", 1.5),
    ("min_p", 2), ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("seed", "x"), ("seed", 1.5), ("seed", 2 ** 70), ("logit_bias", []), ("logit_bias", {"a": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": "x"}), ("stop", 5), ("stop", ["a", 1]),
    ("stop", ["s"] * 17), ("max_tokens", "16"), ("max_tokens", 2 ** 40), ("max_tokens", True),
    ("stream", "yes"), ("stream_options", "x"), ("n", 0), ("n", "2"), ("model", 5), ("model", ""),
    ("logprobs", -1), ("logprobs", 99), ("best_of", 0), ("echo", "true"), ("ignore_eos", "yes"),
])
def test_bad_fields_name_their_param(field, value):
    with pytest.raises(InvalidRequest) as e:
        parse(**{"prompt": "hi", "stream": True, field: value})
    assert e.value.param == field, e.value.message


def test_sampling_fields_reach_sampling_params():
    req, _ = parse(prompt="hi", temperature=0, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                   frequency_penalty=-0.5, repetition_penalty=1.1, seed=-1, logit_bias={"7": -100},
                   stop=["\n", "", "\n"])
    p = admitted(req)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 0.9, 40, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.seed == 2 ** 64 - 1 and p.logit_bias == {7: -100.0} and p.stop == ("\n",)
    assert not p.ignore_eos and admitted(parse(prompt="hi", ignore_eos=True)[0]).ignore_eos


def test_top_k_minus_one_and_top_p_zero_mean_off_and_greedy():
    p = admitted(parse(prompt="hi", top_k=-1, top_p=0)[0])
    assert p.top_k == 0 and p.top_p == 1.0 and p.temperature == 0.0


def test_stop_may_be_a_string_and_unknown_fields_are_tolerated():
    req, _ = parse(prompt="hi", stop="END", user="u1", whatever={"x": [1]})
    assert admitted(req).stop == ("END",)


def test_model_is_optional_and_include_usage_needs_stream():
    req, _ = openai.parse_completion({"prompt": "hi"})
    assert req.model is None and not req.include_usage
    with pytest.raises(InvalidRequest) as e:        # as OpenAI answers it, and as chat does
        openai.parse_completion({"prompt": "hi", "stream_options": {"include_usage": True}})
    assert e.value.param == "stream_options"
    req, _ = parse(prompt="hi", stream=True, stream_options={"include_usage": True})
    assert req.stream and req.include_usage


def test_the_body_must_be_an_object():
    for doc in ([], "x", 1, None):
        with pytest.raises(InvalidRequest):
            openai.parse_completion(doc)


# ---- responses -------------------------------------------------------------------------------

META = openai.ResponseMeta("cmpl-1", 123, "m")


def test_completion_body_shape():
    body = openai.completion_body(META, "hey", Finished("length", Usage(3, 4)))
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "m",
                    "choices": [{"text": "hey", "index": 0, "logprobs": None, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_ids_have_the_openai_prefix():
    assert openai.new_id().startswith("cmpl-") and openai.new_id() != openai.new_id()


def test_stream_frames_deltas_finish_and_done():
    events = [KeepAlive("queued"), TextDelta("a"), TextDelta("b"), Finished("stop", Usage(1, 2))]
    frames = list(openai.completion_stream(iter(events), META))
    assert frames[0] == b": keep-alive\n\n" and frames[-1] == b"data: [DONE]\n\n"
    assert b'"text":"a"' in frames[1] and b'"finish_reason":null' in frames[1]
    assert b'"text":"","index":0,"logprobs":null,"finish_reason":"stop"' in frames[3]
    assert len(frames) == 5


def test_stream_with_include_usage_adds_one_chunk_without_choices():
    meta = openai.ResponseMeta("cmpl-1", 1, "m", include_usage=True)
    frames = list(openai.completion_stream(iter([Finished("stop", Usage(1, 2))]), meta))
    assert b'"choices":[]' in frames[1] and b'"total_tokens":3' in frames[1] and frames[2].endswith(b"[DONE]\n\n")


def test_a_cancelled_stream_ends_without_finish_or_done():
    frames = list(openai.completion_stream(iter([TextDelta("a")]), META))
    assert len(frames) == 1 and b"[DONE]" not in frames[0]


def test_error_envelope_and_event():
    err = InvalidRequest("bad", param="x", code="c")
    assert openai.error_body(err) == {"error": {"message": "bad", "type": "invalid_request_error",
                                                "param": "x", "code": "c"}}
    assert openai.error_event(err).startswith(b"event: error\ndata: {\"error\"")

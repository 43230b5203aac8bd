"""Constrained decoding on the engine: masks, the Sampler hook, and whole runs that must validate."""
import json

import numpy as np
import pytest

from turbospark_wsgi.engine import SamplingParams, Token, load_engine
from turbospark_wsgi.engine.sampling import Sampler

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "flag", "word"], "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 50}, "flag": {"type": "boolean"},
    "word": {"enum": ["the", "in", "tea"]}}}
GRAMMAR = {"grammars": [{"json_schema": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}}]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("tiny_models", Path(__file__).with_name("conftest.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    root = tmp_path_factory.mktemp("tiny")
    cfg = tiny.hf_config()
    tiny.write_hf_dir(root / "m", cfg, tiny.random_state(cfg, 0))
    return load_engine(str(root / "m"), device="cpu")


def run(engine, grammar, seed, **sampling):
    params = SamplingParams(max_new_tokens=80, seed=seed, constraint=grammar.start(), **sampling)
    prompt = engine.encode("json:", add_bos=True)
    return [e.id for e in engine.generate(prompt, params) if isinstance(e, Token)]


def test_the_first_mask_allows_only_an_object_start(engine):
    mask = engine.compile_grammar(GRAMMAR).start().allowed_mask()
    assert mask.dtype == bool and mask.shape == (engine.config.vocab_size,)
    allowed = {engine.tokenizer.token_bytes(int(i)) for i in np.nonzero(mask)[0]}
    assert allowed == {b"{"}


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 1.5, "top_k": 5},
                                      {"temperature": 0.8, "top_p": 0.5, "min_p": 0.1}, {"temperature": 0.0}])
def test_runs_parse_and_validate_under_every_sampler(engine, sampling):
    grammar = engine.compile_grammar(GRAMMAR)
    for seed in range(5):
        ids = run(engine, grammar, seed, **sampling)
        jsonschema.validate(json.loads(engine.decode(ids)), SCHEMA)


def test_the_sampler_never_draws_a_masked_token(engine):
    grammar = engine.compile_grammar(GRAMMAR)
    rng = np.random.default_rng(0)
    constraint = grammar.start()
    sample = Sampler(SamplingParams(temperature=2.0, seed=1, constraint=constraint, logprobs=0))
    for _ in range(12):
        mask = constraint.allowed_mask()
        token, logprob, _ = sample(rng.standard_normal(engine.config.vocab_size).astype(np.float32) * 5)
        assert mask[token] and logprob is not None
        if constraint.is_done():
            break


def test_same_seed_same_constrained_output(engine):
    grammar = engine.compile_grammar(GRAMMAR)
    assert run(engine, grammar, 7) == run(engine, grammar, 7)


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}, "nope"),
    ({"type": "strange"}, "strange")])
def test_a_grammar_that_cannot_compile_names_the_problem(engine, schema, words):
    with pytest.raises(ValueError, match=words):
        engine.compile_grammar({"grammars": [{"json_schema": schema}]})


def test_thinking_budget_forces_the_closing_tag_after_budget_tokens():
    from turbospark_wsgi.engine.constraints import ThinkingBudget
    budget = ThinkingBudget(3, open_ids=[7, 8], close_ids=[9, 10], prompt_ids=[1, 7, 8], vocab_size=12)
    for token in (5, 6, 5):                   # the prompt opened the tag: three tokens of thought
        assert budget.allowed_mask() is None
        budget.advance(token)
    for token in (9, 10):                     # then only the closing tag, token by token
        mask = budget.allowed_mask()
        assert mask.sum() == 1 and mask[token]
        budget.advance(token)
    for token in (5, 7, 8, 5, 9, 10, 5):      # after it anything; a tag reopened and closed in time is free
        assert budget.allowed_mask() is None
        budget.advance(token)


def test_thinking_budget_counts_only_inside_the_tag():
    from turbospark_wsgi.engine.constraints import ThinkingBudget
    budget = ThinkingBudget(2, open_ids=[7], close_ids=[9], prompt_ids=[1, 7, 9], vocab_size=12)  # closed
    for token in (5, 5, 5, 7, 5):
        assert budget.allowed_mask() is None
        budget.advance(token)
    budget.advance(5)                         # the second token inside the reopened tag
    assert budget.allowed_mask()[9] and budget.allowed_mask().sum() == 1


def test_thinking_budget_on_a_real_run(engine):
    open_ids, close_ids = engine.encode("<think>", add_bos=False), engine.encode("</think>", add_bos=False)
    prompt = engine.encode("Hello", add_bos=True) + open_ids
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                            constraint=engine.thinking_budget(4, prompt))
    out = [e.id for e in engine.generate(prompt, params) if isinstance(e, Token)]
    assert out[4:4 + len(close_ids)] == close_ids and len(out) == 12


def test_added_text_tokens_are_text_to_the_grammar():
    """Qwen's `<tool_call>`/`</tool_call>` are added tokens meant as text (GGUF user-defined): a grammar
    writing `</tool_call>` takes that one token as well as the text spelled out; control tokens stay out."""
    from turbospark_wsgi.engine.constraints import ConstraintCompiler
    from turbospark_wsgi.engine.tokenizer import Tokenizer
    tokens = ["<|im_end|>", "<tool_call>", "</tool_call>", "a", "b", "{", "}", "\"", ":", "Ċ", "Ġ", "<", "/", "t", "o",
              "l", "_", "c", ">"]
    tok = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                                        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
                                        "tokenizer.ggml.token_type": [3, 4, 4] + [1] * 16,
                                        "tokenizer.ggml.eos_token_id": 0})
    grammar = ConstraintCompiler(tok, len(tokens)).compile(
        {"grammars": [{"lark_grammar": 'start: "a" "\\n</tool_call>"'}]})
    whole = grammar.start()
    for token in (3, 9, 2):
        whole.advance(token)
    assert whole.is_done()
    spelled = grammar.start()
    for _ in range(20):
        if spelled.is_done():
            break
        spelled.advance(int(np.nonzero(spelled.allowed_mask())[0][0]))
    assert spelled.is_done()
    both = ConstraintCompiler(tok, len(tokens)).compile({"grammars": [{"lark_grammar": 'start: "<|im_end|>" | "b"'}]})
    assert 0 not in np.nonzero(both.start().allowed_mask())[0].tolist()

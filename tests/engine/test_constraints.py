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
    params = SamplingParams(max_new_tokens=80, seed=seed, **sampling)
    prompt = engine.encode("json:", add_bos=True)
    return [e.id for e in engine.generate(prompt, params, constraint=grammar.start()) if isinstance(e, Token)]


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
    sample = Sampler(SamplingParams(temperature=2.0, seed=1, logprobs=0), constraint=constraint)
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
    for token in (5, 7, 8):                   # after it anything, a tag opened again too...
        assert budget.allowed_mask() is None
        budget.advance(token)
    for token in (9, 10):                     # ...but the budget is the reply's: it is closed at once
        assert budget.allowed_mask().sum() == 1 and budget.allowed_mask()[token]
        budget.advance(token)
    assert budget.allowed_mask() is None and budget.thought == 3


def test_a_zero_budget_closes_an_open_tag_at_once_and_none_only_counts():
    from turbospark_wsgi.engine.constraints import ThinkingBudget
    zero = ThinkingBudget(0, open_ids=[7], close_ids=[9], prompt_ids=[1, 7], vocab_size=12)
    assert zero.allowed_mask()[9] and zero.allowed_mask().sum() == 1
    counting = ThinkingBudget(None, open_ids=[7], close_ids=[9], prompt_ids=[1], vocab_size=12)
    for token in (5, 7, 5, 5, 5, 9, 5, 7, 5):
        assert counting.allowed_mask() is None
        counting.advance(token)
    assert counting.thought == 4


def test_thinking_budget_counts_only_inside_the_tag():
    from turbospark_wsgi.engine.constraints import ThinkingBudget
    budget = ThinkingBudget(2, open_ids=[7], close_ids=[9], prompt_ids=[1, 7, 9], vocab_size=12)  # closed
    for token in (5, 5, 5, 7):
        assert budget.allowed_mask() is None
        budget.advance(token)
    inside = budget.allowed_mask()            # inside the reopened tag: anything but opening it again
    assert not inside[7] and inside.sum() == 11
    budget.advance(5)
    budget.advance(5)                         # the second token inside the reopened tag
    assert budget.allowed_mask()[9] and budget.allowed_mask().sum() == 1
    budget.advance(9)
    after = budget.allowed_mask()             # spent: a one-token tag may not open again
    assert not after[7] and after.sum() == 11 and budget.thought == 2


def test_a_budget_before_a_grammar_reasons_first_then_the_grammar_governs():
    from turbospark_wsgi.engine.constraints import ThinkingBudget, ThinkThenGrammar

    class Grammar:                            # allows only tokens 3 and 4, records what it was fed
        def __init__(self):
            self.fed = []

        def allowed_mask(self):
            mask = np.zeros(12, dtype=bool)
            mask[[3, 4]] = True
            return mask

        def advance(self, token):
            assert token in (3, 4)
            self.fed.append(token)

        def valid_prefix(self, tokens):
            return len(tokens)

        def is_done(self):
            return len(self.fed) >= 2

    # the reply opens the block itself (a Qwen3-style template): open tag beside the grammar's tokens
    grammar = Grammar()
    both = ThinkThenGrammar(ThinkingBudget(2, [7], [9], [1], 12), grammar)
    assert both.allowed_mask().nonzero()[0].tolist() == [3, 4, 7]
    for token in (7, 5, 6):
        both.advance(token)
    assert both.allowed_mask().nonzero()[0].tolist() == [9] and both.valid_prefix([3]) == 0
    both.advance(9)
    assert both.allowed_mask().nonzero()[0].tolist() == [3, 4] and both.thought == 2
    both.advance(3)
    both.advance(4)
    assert grammar.fed == [3, 4] and both.is_done()
    # a reply that goes straight into the grammar feeds it its first token
    grammar = Grammar()
    straight = ThinkThenGrammar(ThinkingBudget(2, [7], [9], [1], 12), grammar)
    straight.advance(4)
    assert grammar.fed == [4] and straight.allowed_mask().nonzero()[0].tolist() == [3, 4]
    # a template that opened the block in the prompt (DeepSeek-R1): thought first, a zero budget closes at once
    grammar = Grammar()
    opened = ThinkThenGrammar(ThinkingBudget(0, [7], [9], [1, 7], 12), grammar)
    assert opened.allowed_mask().nonzero()[0].tolist() == [9]
    opened.advance(9)
    assert grammar.fed == [] and opened.allowed_mask().nonzero()[0].tolist() == [3, 4]


def test_thinking_budget_on_a_real_run(engine):
    open_ids, close_ids = engine.encode("<think>", add_bos=False), engine.encode("</think>", add_bos=False)
    prompt = engine.encode("Hello", add_bos=True) + open_ids
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    out = [e.id for e in engine.generate(prompt, params, constraint=engine.thinking_budget(4, prompt))
           if isinstance(e, Token)]
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


EXTREME_BOUNDS = [0, -1, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 + 1, -2 ** 63, -2 ** 63 - 1, 10 ** 30, 1e308, -1e308, -0.0]
SWEEP = r"""
import itertools, json, sys
from turbospark_wsgi.engine.constraints import ConstraintCompiler
from turbospark_wsgi.engine.tokenizer import Tokenizer
from turbospark_wsgi.errors import InvalidRequest
from turbospark_wsgi.http.schemas.json_schema import check_schema
tokens = list('0123456789-.e+"{}[],: ') + ["<eos>"]
tok = Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                                    "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
                                    "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
                                    "tokenizer.ggml.eos_token_id": len(tokens) - 1})
compiler, counts = ConstraintCompiler(tok, len(tokens)), {"refused": 0, "failed": 0, "compiled": 0}
for lo, hi, lo_key, hi_key, form in itertools.product(*json.loads(sys.argv[1])):
    leaf = {lo_key: lo, hi_key: hi}
    schema = {"plain": {"type": "integer", **leaf}, "nullable": {"type": ["integer", "null"], **leaf},
              "allOf": {"allOf": [{"type": "integer"}, leaf]},
              "nested": {"type": "object", "properties": {"a": {"$ref": "#/$defs/d"}},
                         "$defs": {"d": {"type": "array", "items": {"type": "integer", **leaf}}}}}[form]
    try:
        check_schema(schema, "p")
    except InvalidRequest:
        counts["refused"] += 1
        continue
    try:
        compiler.compile({"grammars": [{"json_schema": schema}]})
        counts["compiled"] += 1
    except ValueError:
        counts["failed"] += 1
print(json.dumps(counts))
"""


def test_no_integer_bounds_crash_the_grammar_compiler():
    """Every pair of extreme integer bounds, as a checked client schema would reach the compiler: an
    upper bound that saturates to -2**63 overflows llguidance's native stack (a segfault, not an
    exception), so the sweep runs in a child process that must exit cleanly."""
    import subprocess
    import sys
    axes = [EXTREME_BOUNDS, EXTREME_BOUNDS, ["minimum", "exclusiveMinimum"], ["maximum", "exclusiveMaximum"],
            ["plain", "nullable", "allOf", "nested"]]
    done = subprocess.run([sys.executable, "-c", SWEEP, json.dumps(axes)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    counts = json.loads(done.stdout)
    assert counts["refused"] and counts["compiled"] and counts["failed"], counts

"""Speculative decoding (prompt lookup): the output must be the output without it, token for token,
logprobs, seeds, grammars, stop strings, budgets and cancellation included, solo and batched."""
import dataclasses

import numpy as np
import pytest

from turbospark_wsgi.engine import Finish, FinishReason, SamplingParams, Token, load_engine
from turbospark_wsgi.engine.speculative import Acceptance, PromptLookup, plan_rows

TEXTS = ["Once upon a time", "The little dog saw the little dog and the little dog",
         "One day, Lily went to the park and", "Tom", "a b c a b c a b c a b", "the the the the",
         "Lily and Tom. Lily and Tom. Lily and", "She said hello. She said hello. She said",
         "123 456 123 456 123", "x"]


def engine_for(kind, request, tiny_gguf, mode, **kw):
    if kind == "stories":
        path = request.getfixturevalue("stories_gguf")
    else:
        path = tiny_gguf(qtype={"tiny_q8": "Q8_0", "tiny_f32": "F32"}[kind]).path
    return load_engine(path, device="cpu", max_batch=4, max_paused=4, prefill_chunk=8, speculative=mode, **kw)


@pytest.fixture(params=["stories", "tiny_q8", "tiny_f32"])
def engines(request, tiny_gguf):
    """(without speculation, with it on every proposal) for one model."""
    return tuple(engine_for(request.param, request, tiny_gguf, mode) for mode in ("off", "on"))


def prompts_for(engine, n=len(TEXTS)):
    return [engine.encode(t, add_bos=True) for t in TEXTS[:n]]


def run(engine, prompt, params, should_stop=None, constraint=None):
    events = [e for e in engine.generate(prompt, params, should_stop, constraint=constraint)
              if isinstance(e, (Token, Finish))]
    return [(e.id, e.text, e.logprob, e.top_logprobs) for e in events[:-1]], events[-1]


def together(engine, prompts, params_list):
    gens = [engine.generate(p, q) for p, q in zip(prompts, params_list)]
    outs, ends, live = [[] for _ in gens], [None] * len(gens), set(range(len(gens)))
    while live:
        for i in sorted(live):
            event = next(gens[i])
            if isinstance(event, Token):
                outs[i].append((event.id, event.text, event.logprob, event.top_logprobs))
            elif isinstance(event, Finish):
                ends[i] = event
                live.discard(i)
    return outs, ends


def finish_key(f):
    return f.reason, f.stop_string, f.text, f.completion_tokens


def test_greedy_solo_equals_plain_over_many_prompts(engines):
    plain, spec = engines
    proposed = accepted = 0
    for prompt in prompts_for(plain):
        params = SamplingParams(temperature=0, max_new_tokens=40, logprobs=2)
        want, want_end = run(plain, prompt, params)
        got, end = run(spec, prompt, params)
        assert got == want and finish_key(end) == finish_key(want_end)
        assert want_end.proposed_tokens == 0
        proposed, accepted = proposed + end.proposed_tokens, accepted + end.accepted_tokens
    assert proposed > accepted > 0          # proposals ran, some kept and some not


def test_batched_mixed_rows_equal_solo_plain(engines):
    plain, spec = engines
    prompts = prompts_for(plain, 8)
    params = [SamplingParams(temperature=0, max_new_tokens=32, logprobs=1, speculative=i % 3 != 2)
              for i in range(len(prompts))]
    want = [run(plain, p, q)[0] for p, q in zip(prompts, params)]
    outs, ends = together(spec, prompts, params)    # 8 runs over 4 rows: paused ones too
    assert outs == want
    assert all(e.proposed_tokens == 0 for e, q in zip(ends, params) if not q.speculative)
    assert sum(e.accepted_tokens for e in ends) > 0


@pytest.mark.parametrize("sampling", [dict(temperature=0.9, top_k=40, top_p=0.95),
                                      dict(temperature=0.7, min_p=0.05, repetition_penalty=1.05),
                                      dict(temperature=0.6, presence_penalty=0.2, frequency_penalty=0.1)])
def test_fixed_seed_sampling_equals_plain(engines, sampling, request):
    plain, spec = engines
    accepted = 0
    for i, prompt in enumerate(prompts_for(plain)):
        params = SamplingParams(max_new_tokens=32, seed=100 + i, logprobs=1, **sampling)
        want, want_end = run(plain, prompt, params)
        got, end = run(spec, prompt, params)
        assert got == want and finish_key(end) == finish_key(want_end)
        accepted += end.accepted_tokens
    if request.node.callspec.params["engines"] == "stories":     # a tiny random model's draws rarely repeat
        assert accepted > 0


def test_batched_seeded_sampling_equals_plain(engines):
    plain, spec = engines
    prompts = prompts_for(plain, 6)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_new_tokens=24) for i in range(len(prompts))]
    want = [run(plain, p, q)[0] for p, q in zip(prompts, params)]
    assert together(spec, prompts, params)[0] == want


def test_stop_strings_budgets_and_end_ids_end_where_plain_does(engines):
    plain, spec = engines
    prompt = prompts_for(plain)[1]
    first = plain.decode([t for t, *_ in run(plain, prompt, SamplingParams(temperature=0, max_new_tokens=30))[0]])
    cases = [SamplingParams(temperature=0, max_new_tokens=n) for n in (1, 2, 3, 7)]
    cases += [SamplingParams(temperature=0, max_new_tokens=30, stop=(first[5:8],)),
              SamplingParams(temperature=0, max_new_tokens=30, stop=(first[-3:], "zz")),
              SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=(plain.encode(first, False)[4],))]
    for params in cases:
        want, want_end = run(plain, prompt, params)
        got, end = run(spec, prompt, params)
        assert got == want and finish_key(end) == finish_key(want_end)


def test_a_full_context_ends_where_plain_does(request, tiny_gguf):
    outs = []
    for mode in ("off", "on"):
        eng = engine_for("tiny_q8", request, tiny_gguf, mode, max_context=40)
        prompt = eng.encode("a b c a b c a b c", add_bos=True)
        outs.append(run(eng, prompt, SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True)))
    (want, want_end), (got, end) = outs
    assert want_end.reason == FinishReason.LENGTH and len(prompt) + len(want) - 1 == 40    # the last needs no K/V
    assert got == want and finish_key(end) == finish_key(want_end) and end.accepted_tokens > 0


def test_cancel_inside_a_verified_block_ends_as_plain_decoding_would(request, tiny_gguf):
    spec = engine_for("tiny_q8", request, tiny_gguf, "on")
    plain = engine_for("tiny_q8", request, tiny_gguf, "off")
    prompt = plain.encode("a b c a b c a b c a b c a b", add_bos=True)
    params = SamplingParams(temperature=0, max_new_tokens=60)
    full = run(plain, prompt, params)[0]
    seqs = []
    add = spec.scheduler.add
    spec.scheduler.add = lambda *a, **k: seqs.append(add(*a, **k)) or seqs[-1]
    stop = [False]
    got = []
    for event in spec.generate(prompt, params, lambda: stop[0]):
        if isinstance(event, Token):
            got.append((event.id, event.text, event.logprob, event.top_logprobs))
            if seqs[0].ahead and len(got) >= 2:
                stop[0] = True              # kept proposals wait: the client leaves inside the block
        elif isinstance(event, Finish):
            break
    assert stop[0], "no verified block of several tokens happened"
    assert event.reason == FinishReason.CANCELLED and event.completion_tokens == len(got)
    assert got == full[:len(got)]
    slot = seqs[0].slot
    assert slot.cache.length == len(slot.ids) and slot.ids[:len(prompt)] == prompt
    # the slot's K/V stays exact: a run reusing it equals plain decoding
    assert run(spec, prompt, params)[0] == full


def test_proposals_the_grammar_forbids_are_cut(request, tiny_gguf):
    pytest.importorskip("llguidance")
    plain = engine_for("tiny_q8", request, tiny_gguf, "off")
    spec = engine_for("tiny_q8", request, tiny_gguf, "on")
    # the prompt repeats "ab" and "c": lookup proposes them, the grammar allows only a's and b's
    prompt = plain.encode("ab ab c ab ab c ab ab c ab", add_bos=True)
    grammar = {"grammars": [{"lark_grammar": 'start: /[ab ]{1,40}/'}]}
    run_rows = []
    propose = spec.scheduler._proposals

    def spy(seqs):
        out = propose(seqs)
        run_rows.extend((list(s.lookup.propose(8)), p) for s, p in zip(seqs, out) if s.lookup is not None)
        return out
    spec.scheduler._proposals = spy
    for temperature in (0.0, 0.9):
        params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=30)
        want = run(plain, prompt, params, constraint=plain.compile_grammar(grammar).start())
        got = run(spec, prompt, params, constraint=spec.compile_grammar(grammar).start())
        assert got[0] == want[0] and finish_key(got[1]) == finish_key(want[1])
        assert set(spec.decode([t for t, *_ in got[0]])) <= set("ab ")
    c_id = spec.encode("c", add_bos=False)[0]
    assert any(c_id in raw for raw, ran in run_rows), "lookup never proposed the forbidden token"
    assert all(c_id not in ran for raw, ran in run_rows)


def test_auto_proposes_on_repeats_and_stays_exact(request, tiny_gguf):
    plain = engine_for("tiny_q8", request, tiny_gguf, "off")
    auto = engine_for("tiny_q8", request, tiny_gguf, "auto")
    for prompt in prompts_for(plain):
        params = SamplingParams(temperature=0, max_new_tokens=40)
        assert run(auto, prompt, params)[0] == run(plain, prompt, params)[0]


# ---- the pieces ------------------------------------------------------------------------------

def test_prompt_lookup_follows_the_latest_match_and_then_its_copy():
    lk = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8], min_n=2, max_n=3)
    assert lk.propose(3) == []                      # "7 8" never came before
    for t in (1, 2, 3):
        lk.append(t)
    assert lk.propose(2) == [4, 5]                  # "1 2 3" came before: the longest match wins
    lk = PromptLookup([5, 6, 1, 2, 3, 4, 0, 1, 2], min_n=2, max_n=2)
    assert lk.propose(3) == [3, 4, 0]
    lk.append(3)
    assert lk.propose(2) == [4, 0]                  # the copy goes on from where it was found
    lk.append(9)
    assert lk.propose(2) == []                      # it broke off; "3 9" never came before


def test_plan_rows_adds_likely_rows_while_they_pay():
    assert plan_rows([(0.9, 8)], 1, 0.0) == [8]
    assert plan_rows([(0.2, 8)], 1, 0.3) == [0]
    assert 3 <= plan_rows([(0.9, 8)], 1, 0.3)[0] <= 6
    many = plan_rows([(0.9, 8)] + [(0.0, 0)] * 7, 8, 0.3)
    assert many[0] < plan_rows([(0.9, 8)], 1, 0.3)[0]      # a busy batch pays more per row
    a, b = plan_rows([(0.95, 4), (0.6, 4)], 2, 0.3)
    assert a >= b


def test_acceptance_falls_after_misses_and_recovers_without_proposals():
    acc = Acceptance()
    acc.step(4, 0)
    low = acc.rate
    assert low < 0.3
    for _ in range(40):
        acc.step(0, 0)
    assert acc.rate > 0.3 > low
    acc.step(5, 5)
    assert acc.rate > 0.7


def test_decode_batch_rows_of_one_sequence_equal_single_steps(engines):
    model = engines[0].model
    prompt = prompts_for(engines[0])[1]
    a, b = model.new_cache(128), model.new_cache(128)
    model.forward(prompt, a, "none")
    model.forward(prompt, b, "none")
    tokens = prompt[:6]
    single = np.stack([model.decode_batch([t], [a])[0] for t in tokens])
    other = model.new_cache(128)
    model.forward(prompt[:3], other, "none")
    rows = model.decode_batch([tokens[0], 5, *tokens[1:]], [b, other] + [b] * (len(tokens) - 1))
    assert np.array_equal(np.delete(rows, 1, axis=0), single)
    assert a.length == b.length == len(prompt) + len(tokens) and other.length == 4
    assert np.array_equal(a.k[:, :a.length], b.k[:, :b.length])


def test_request_switch_off_proposes_nothing(request, tiny_gguf):
    spec = engine_for("tiny_q8", request, tiny_gguf, "on")
    prompt = spec.encode("a b c a b c a b c", add_bos=True)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    on = run(spec, prompt, params)
    off = run(spec, prompt, dataclasses.replace(params, speculative=False))
    assert on[0] == off[0] and on[1].proposed_tokens > 0 and off[1].proposed_tokens == 0


# ---- a draft model ---------------------------------------------------------------------------

@pytest.fixture(params=["same", "other"])
def drafted(request, tiny_gguf):
    """(plain engine, engine whose draft is the model itself or another model of the same tokenizer)."""
    target = tiny_gguf(qtype="Q8_0").path
    draft = target if request.param == "same" else tiny_gguf(qtype="Q8_0", seed=1, hidden_size=32, num_hidden_layers=1).path
    plain = load_engine(target, device="cpu", max_batch=4, max_paused=4, prefill_chunk=8, speculative="off")
    spec = load_engine(target, device="cpu", max_batch=4, max_paused=4, prefill_chunk=8, speculative="on",
                       draft_model=str(draft))
    return plain, spec, request.param


def test_draft_greedy_and_seeded_runs_equal_plain_solo_and_batched(drafted):
    plain, spec, kind = drafted
    prompts = prompts_for(plain, 6)
    for params in (SamplingParams(temperature=0, max_new_tokens=30, logprobs=1, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=30, seed=5, max_new_tokens=30, ignore_eos=True)):
        proposed = accepted = 0
        for prompt in prompts:
            want, want_end = run(plain, prompt, params)
            got, end = run(spec, prompt, params)
            assert got == want and finish_key(end) == finish_key(want_end)
            proposed, accepted = proposed + end.proposed_tokens, accepted + end.accepted_tokens
        assert proposed > 0
        if kind == "same" and params.temperature == 0:
            assert accepted == proposed         # a model agrees with itself
        many = [dataclasses.replace(params, seed=None if params.seed is None else params.seed + i)
                for i in range(len(prompts))]
        assert together(spec, prompts, many)[0] == [run(plain, p, q)[0] for p, q in zip(prompts, many)]


def test_a_draft_with_another_tokenizer_is_refused(request, tiny_gguf):
    stories = request.getfixturevalue("stories_gguf")
    with pytest.raises(ValueError, match="tokenizer"):
        load_engine(tiny_gguf(qtype="Q8_0").path, device="cpu", draft_model=str(stories))


def test_the_server_setting_gives_every_generation_model_its_draft(tiny_gguf, tmp_path):
    from turbospark_wsgi.config import Config
    from turbospark_wsgi.errors import ModelLoadError
    from turbospark_wsgi.serving.registry import Registry
    tiny_gguf(qtype="Q8_0", name="target.gguf")
    tiny_gguf(qtype="Q8_0", seed=1, num_hidden_layers=1, name="small.gguf")
    config = Config(models_dir=str(tmp_path), model="target", device="cpu", load_default=False, draft_model="small")
    registry = Registry(config)
    assert registry.resolve("target").draft is not None
    assert registry.resolve("small").draft is None           # the draft itself runs without one
    missing = Registry(Config(models_dir=str(tmp_path), model="target", device="cpu", load_default=False,
                              draft_model="nothing-here"))
    with pytest.raises(ModelLoadError, match="TURBOSPARK_DRAFT_MODEL"):
        missing.resolve("target")

"""Batched decoding and the prefix cache on real models: outputs must not depend on either."""
import numpy as np
import pytest

from turbospark_wsgi.engine import Finish, FinishReason, SamplingParams, Token, load_engine
from turbospark_wsgi.engine.kernels import cpu as kernels_cpu
from turbospark_wsgi.engine.model import SMALL_WINDOW


def run_alone(engine, prompt, params):
    tokens = [e.id for e in engine.generate(prompt, params) if isinstance(e, Token)]
    return tokens


def run_together(engine, prompts, params_list):
    gens = [engine.generate(p, params) for p, params in zip(prompts, params_list)]
    outs = [[] for _ in gens]
    live = set(range(len(gens)))
    while live:
        for i in sorted(live):              # round-robin, as concurrent request threads would
            event = next(gens[i])
            if isinstance(event, Token):
                outs[i].append(event.id)
            elif isinstance(event, Finish):
                live.discard(i)
    return outs


def prompts_for(engine, n=4):
    texts = ["Once upon a time", "The little dog", "One day, Lily went to the park and", "Tom"]
    return [engine.encode(t, add_bos=True) for t in texts[:n]]


@pytest.fixture(params=["stories", "tiny_q8"])
def engine(request, tiny_gguf):
    if request.param == "stories":
        stories = request.getfixturevalue("stories_gguf")
        return load_engine(stories, device="cpu", max_batch=4, prefill_chunk=8)
    return load_engine(tiny_gguf(qtype="Q8_0").path, device="cpu", max_batch=4, prefill_chunk=8)


def test_batched_greedy_equals_solo(engine):
    prompts = prompts_for(engine)
    params = [SamplingParams(temperature=0, max_new_tokens=24) for _ in prompts]
    solo = [run_alone(engine, p, q) for p, q in zip(prompts, params)]
    assert run_together(engine, prompts, params) == solo


def test_batched_seeded_sampling_equals_solo(engine):
    prompts = prompts_for(engine)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11 + i, max_new_tokens=24)
              for i in range(len(prompts))]
    solo = [run_alone(engine, p, q) for p, q in zip(prompts, params)]
    assert run_together(engine, prompts, params) == solo


def test_prefix_cache_hit_gives_identical_logits_and_tokens(engine):
    base = prompts_for(engine, 3)[2]
    first = base * 3                         # several whole chunks
    second = first + base[1:]
    params = SamplingParams(temperature=0, max_new_tokens=16, logprobs=3)

    def events(prompt):
        return [e for e in engine.generate(prompt, params) if isinstance(e, (Token, Finish))]

    engine.scheduler.slots.clear()           # a cold engine: no cached prefix anywhere
    cold = events(second)
    assert cold[-1].cached_tokens == 0
    events(first)                            # leaves `first` in a slot
    warm = events(second)
    assert warm[-1].cached_tokens >= 16
    assert [(e.id, e.logprob, e.top_logprobs) for e in warm[:-1]] == \
           [(e.id, e.logprob, e.top_logprobs) for e in cold[:-1]]



def test_a_prefix_copied_from_another_slot_gives_identical_logits_and_tokens(engine):
    """NOTE(copied-prefix): a prompt sharing only a start with another slot's (too little to take
    that slot over, NOTE(related)) runs in a new slot holding a copy of the start's K/V: the same
    tokens and log-probabilities as a cold run, and the other slot keeps its own ids."""
    base = prompts_for(engine, 3)[2]
    start = base * 2                         # whole chunks, shared
    a, b = start + base[1:] * 3, start + prompts_for(engine, 2)[1][1:]
    params = SamplingParams(temperature=0, max_new_tokens=16, logprobs=3)

    def events(prompt):
        return [e for e in engine.generate(prompt, params) if isinstance(e, (Token, Finish))]

    engine.scheduler.slots.clear()
    cold = events(b)
    assert cold[-1].cached_tokens == 0
    engine.scheduler.slots.clear()
    events(a)                                # leaves a (and its reply) in a slot
    warm = events(b)
    assert warm[-1].cached_tokens >= 8
    assert len(engine.scheduler.slots) == 2  # b ran in a new slot
    assert [(e.id, e.logprob, e.top_logprobs) for e in warm[:-1]] == \
           [(e.id, e.logprob, e.top_logprobs) for e in cold[:-1]]
    assert events(a + base[1:2])[-1].cached_tokens > len(start)   # a found its own slot, not the copy

def test_decode_batch_rows_are_bit_identical_to_single_rows(engine):
    model = engine.model
    prompts = prompts_for(engine)
    caches = []
    for p in prompts:
        c = model.new_cache(64)
        model.forward(p, c, logits="none")
        caches.append(c)
    singles = [model.decode_batch([7], [c])[0] for c in caches]
    for c, p in zip(caches, prompts):
        c.truncate(len(p))
    batched = model.decode_batch([7] * len(caches), caches)
    for a, b in zip(singles, batched):
        assert np.array_equal(a, b)


def test_quantized_engine_batches_exactly_and_agrees_with_fp32(default_gguf, monkeypatch):
    pytest.importorskip("numba")
    quant = load_engine(default_gguf, device="cpu", max_batch=3)
    assert type(quant.model.w.head).__name__ == "QLinear"
    prompts = [quant.encode(t, add_bos=False) for t in ("The capital of France is", "def add(a, b):", "Hi")]
    params = [SamplingParams(temperature=0, max_new_tokens=12) for _ in prompts]
    solo = [run_alone(quant, p, q) for p, q in zip(prompts, params)]
    assert run_together(quant, prompts, params) == solo
    fp32 = load_engine(default_gguf, device="cpu", max_batch=1, weights="fp32")
    assert type(fp32.model.w.head).__name__ != "QLinear"
    monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "float32")      # the kernels equal to the float32 reference
    ids = prompts[0]
    a = quant.model.forward(ids, quant.model.new_cache(32), logits="all")
    b = fp32.model.forward(ids, fp32.model.new_cache(32), logits="all")
    assert np.abs(a - b).max() < 1e-3


def events_of(engine, prompt, params):
    return [e for e in engine.generate(prompt, params) if isinstance(e, (Token, Finish))]


def assert_same_run(warm, cold):
    assert [(e.id, e.logprob, e.top_logprobs) for e in warm[:-1]] == \
           [(e.id, e.logprob, e.top_logprobs) for e in cold[:-1]]


def check_next_turn_reuses_the_whole_prompt(engine, turn1, follow_up, max_new_tokens, reused=None):
    """A second turn = turn 1's prompt + its reply + more: a hit on every prompt token of turn 1,
    and where decode steps give prefill's bits (model.decode_exact) on every reply token that ran
    too; the same run as a cold one. `reused`: the hit expected instead on other engines, when
    turn 1 ends in a short window."""
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, logprobs=3)
    assert engine.prefill_chunk > SMALL_WINDOW
    if not engine.model.rows_exact:
        pytest.skip("this BLAS gives rows of few-row products other bits: prefixes reuse whole chunks")
    engine.scheduler.slots.clear()
    first = events_of(engine, turn1, params)
    reply = [e.id for e in first if isinstance(e, Token)]
    ran = len(reply) - (first[-1].reason == FinishReason.LENGTH)    # a last token cut by length never ran
    turn2 = turn1 + reply + follow_up
    warm = events_of(engine, turn2, params)
    if engine.model.decode_exact:
        assert warm[-1].cached_tokens == len(turn1) + ran
    else:
        assert warm[-1].cached_tokens == (len(turn1) if reused is None else reused)
    assert len(turn1) % engine.prefill_chunk
    engine.scheduler.slots.clear()
    cold = events_of(engine, turn2, params)
    assert cold[-1].cached_tokens == 0
    assert_same_run(warm, cold)


@pytest.mark.parametrize("kind", ["stories", "tiny_q8"])
def test_next_turn_reuses_every_prompt_token_exactly(kind, tiny_gguf, request):
    path = request.getfixturevalue("stories_gguf") if kind == "stories" else tiny_gguf(qtype="Q8_0").path
    engine = load_engine(path, device="cpu", max_batch=2, prefill_chunk=32)
    base = prompts_for(engine, 3)[2] * 9
    # chunks of 32: turn 1 ends in a 26-token piece, or 41 = 32 + a 9-token tail run in one call;
    # a prompt of at most SMALL_WINDOW tokens runs on the few-row kernels and is not reused
    check_next_turn_reuses_the_whole_prompt(engine, base[:90], base[1:6], 12)
    check_next_turn_reuses_the_whole_prompt(engine, base[:105], base[1:40], 12)
    check_next_turn_reuses_the_whole_prompt(engine, base[:SMALL_WINDOW - 1], base[1:40], 12, reused=0)


def test_quantized_default_model_reuses_every_prompt_token_exactly(default_gguf):
    pytest.importorskip("numba")
    engine = load_engine(default_gguf, device="cpu", max_batch=2)
    turn1 = engine.encode("You are a helpful assistant. " * 30 + "Tell me about the sea.", add_bos=False)
    check_next_turn_reuses_the_whole_prompt(engine, turn1, engine.encode(" And the sky?", add_bos=False), 6)


def test_a_reply_is_reused_like_prompt_tokens_and_the_next_turn_equals_a_cold_run(engine):
    if not engine.model.decode_exact:
        pytest.skip("decode steps here do not give the bits a prefill gives (no fused CPU kernels)")
    prompt = prompts_for(engine, 3)[2]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=3)

    def events(p):
        return [e for e in engine.generate(p, params) if isinstance(e, (Token, Finish))]

    engine.scheduler.slots.clear()
    reply = [e.id for e in events(prompt) if isinstance(e, Token)]
    turn2 = prompt + reply + prompts_for(engine, 2)[1][1:]          # history, the reply, a new message
    warm = events(turn2)
    assert warm[-1].cached_tokens == len(prompt) + len(reply) - 1   # the last reply token never ran
    engine.scheduler.slots.clear()
    cold = events(turn2)
    assert cold[-1].cached_tokens == 0
    assert [(e.id, e.logprob, e.top_logprobs) for e in warm[:-1]] == \
           [(e.id, e.logprob, e.top_logprobs) for e in cold[:-1]]

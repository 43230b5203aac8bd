"""LoRA adapters (engine/lora.py) against transformers + peft, batches mixing adapters exactly, the
prefix cache kept apart per adapter, and the refusals of adapters that do not fit."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from lora_models import ALL_TARGETS, edit_config, peft_model, reference, tiny, write_adapter, write_base, \
    write_gguf_adapter, write_gguf_base  # noqa: E402
from turbospark_wsgi.engine import Finish, SamplingParams, Token, load_engine  # noqa: E402
from turbospark_wsgi.engine.lora import AdapterError  # noqa: E402

PROMPT = [1, 40, 72, 101, 108, 108, 111, 260, 263, 32, 119, 111, 114, 108, 100, 33, 7, 200, 3, 50]
STEPS = 16
TOL = 1e-3          # as test_parity_hf.py's float32 parity
INT8_TOL = 2e-2     # the int8 setting: Hugging Face bases run the float products either way


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def ref_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def ref_greedy(model, ids, steps=STEPS):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=10**9,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def tokens_of(engine, prompt, adapter=None, steps=STEPS):
    params = SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True)
    return [e.id for e in engine.generate(prompt, params, adapter=adapter) if isinstance(e, Token)]


@pytest.mark.parametrize("family, targets, rslora", [
    ("llama", ALL_TARGETS, False),
    ("llama", ["q_proj", "v_proj"], True),
    ("qwen2", ALL_TARGETS, False),
    ("qwen2", ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_adapter_matches_peft(tmp_path, family, targets, rslora, activations, monkeypatch):
    base = write_base(tmp_path / "base", family)
    lora_dir = write_adapter(tmp_path / "lora", base, targets, r=4, alpha=8, rslora=rslora)
    engine = load_engine(str(base), device="cpu", activations=activations, max_batch=2, prefill_chunk=8)
    adapter = engine.load_adapter(str(lora_dir), "lora", max_rank=64)
    assert adapter.targets == tuple(sorted(targets)) and adapter.scale == (8 / 2 if rslora else 2)
    ref = peft_model(base, lora_dir)
    cache = engine.model.new_cache()
    split = len(PROMPT) // 3                                        # the second piece reads the cache
    ours = np.concatenate([engine.model.forward(PROMPT[:split], cache, "all", adapter=adapter),
                           engine.model.forward(PROMPT[split:], cache, "all", adapter=adapter)])
    want = ref_logits(ref, PROMPT)
    delta = np.abs(ours - want).max()
    assert delta <= (TOL if activations == "float32" else INT8_TOL), delta
    assert np.abs(ref_logits(reference(base), PROMPT) - want).max() > 0.1     # the adapter changes the model
    if activations == "float32":
        assert tokens_of(engine, PROMPT, adapter) == ref_greedy(ref, PROMPT)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A llama base, three adapters of it (different targets, ranks, seeds), an engine of 4 rows."""
    root = tmp_path_factory.mktemp("mixed")
    base = write_base(root / "base")
    engine = load_engine(str(base), device="cpu", activations="float32", max_batch=4, prefill_chunk=8,
                         speculative="off")
    specs = [(ALL_TARGETS, 4, 1), (["q_proj", "k_proj", "v_proj"], 8, 2), (["o_proj", "down_proj"], 2, 3)]
    adapters = [engine.load_adapter(str(write_adapter(root / f"a{i}", base, t, r=r, seed=s)), f"a{i}", 64)
                for i, (t, r, s) in enumerate(specs)]
    return engine, adapters


def _run_together(engine, jobs, steps=STEPS):
    """Round-robin over generators, as concurrent request threads would drive them."""
    params = SamplingParams(temperature=0, max_new_tokens=steps, ignore_eos=True, logprobs=2)
    gens = [engine.generate(p, params, adapter=a) for p, a in jobs]
    outs, live = [[] for _ in gens], set(range(len(gens)))
    while live:
        for i in sorted(live):
            event = next(gens[i])
            if isinstance(event, Token):
                outs[i].append((event.id, event.logprob, event.top_logprobs))
            elif isinstance(event, Finish):
                live.discard(i)
    return outs


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_what_it_gets_alone(mixed):
    engine, adapters = mixed
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:], PROMPT[::-1]]
    jobs = list(zip(prompts, [None] + adapters))
    engine.scheduler.slots.clear()
    alone = [_run_together(engine, [job])[0] for job in jobs]
    engine.scheduler.slots.clear()
    together = _run_together(engine, jobs)
    assert together == alone                 # ids and logprobs, bit for bit
    assert len({tuple(t for t, _, _ in run) for run in alone}) == 4
    # the same prompt under each adapter: every adapter really is another model
    same = _run_together(engine, [(PROMPT, a) for a in [None] + adapters])
    assert len({tuple(t for t, _, _ in run) for run in same}) == 4


def test_decode_rows_of_different_adapters_are_bit_identical_to_single_rows(mixed):
    engine, adapters = mixed
    model, rows = engine.model, [None] + adapters
    caches = []
    for i, a in enumerate(rows):
        c = model.new_cache(64)
        model.forward(PROMPT[i:], c, "none", adapter=a)
        caches.append(c)
    singles = [model.decode_batch([7], [c], adapters=[a])[0] for c, a in zip(caches, rows)]
    for i, c in enumerate(caches):
        c.truncate(len(PROMPT) - i)
    batched = model.decode_batch([7] * 4, caches, adapters=rows)
    for a, b in zip(singles, batched):
        assert np.array_equal(a, b)


def test_the_prefix_cache_never_shares_kv_between_adapters(mixed):
    engine, adapters = mixed
    long = PROMPT * 2
    engine.scheduler.slots.clear()
    cold = _run_together(engine, [(long + [5], adapters[1])])[0]

    def cached(prompt, adapter):
        params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
        return [e for e in engine.generate(prompt, params, adapter=adapter) if isinstance(e, Finish)][0].cached_tokens

    engine.scheduler.slots.clear()
    assert cached(long, adapters[0]) == 0
    assert cached(long + [5], adapters[1]) == 0          # adapter 0's K/V of the same ids: not reused
    assert cached(long + [5], None) == 0                 # nor the base's
    assert cached(long + [9], adapters[1]) > 0           # its own are
    engine.scheduler.slots.clear()
    cached(long, adapters[1])
    warm = _run_together(engine, [(long + [5], adapters[1])])[0]
    assert warm == cold                                   # a hit within one adapter changes nothing


@pytest.fixture
def base_engine(tmp_path):
    base = write_base(tmp_path / "base")
    return base, load_engine(str(base), device="cpu", activations="float32", max_batch=1)


def test_refusals(tmp_path, base_engine):
    base, engine = base_engine
    good = write_adapter(tmp_path / "good", base, ["q_proj"], r=4)

    def refused(directory, words, max_rank=64):
        with pytest.raises(AdapterError, match=words):
            engine.load_adapter(str(directory), "x", max_rank)

    refused(good, "over this server's limit of 2", max_rank=2)
    other = write_base(tmp_path / "other", hidden_size=32, intermediate_size=64)
    refused(write_adapter(tmp_path / "wide", other, ["q_proj"]), "does not fit the model")
    deep = write_base(tmp_path / "deep", num_hidden_layers=3)
    refused(write_adapter(tmp_path / "deep-lora", deep, ["v_proj"]), "the model has 2 layers")
    unknown = write_adapter(tmp_path / "unknown", base, ["q_proj"])
    edit_config(unknown, target_modules=["q_proj", "lm_head"])
    refused(unknown, "unknown target module 'lm_head'")
    from safetensors.numpy import load_file, save_file
    skew = write_adapter(tmp_path / "skew", base, ["q_proj"], r=4)
    tensors = load_file(str(skew / "adapter_model.safetensors"))
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name] = np.ones((tensors[name].shape[0], 3), np.float32)
    save_file(tensors, str(skew / "adapter_model.safetensors"))
    refused(skew, "lora_A has rank 4, lora_B rank 3")
    pickled = write_adapter(tmp_path / "pickled", base, ["q_proj"])
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    refused(pickled, "is a pickle and is not read")
    garbage = write_adapter(tmp_path / "garbage", base, ["q_proj"])
    (garbage / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    refused(garbage, "is not a safetensors file")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no adapter_config.json")
    dora = write_adapter(tmp_path / "dora", base, ["q_proj"])
    edit_config(dora, use_dora=True)
    refused(dora, "use_dora")
    assert json.loads((good / "adapter_config.json").read_text())["r"] == 4
    engine.load_adapter(str(good), "x", 64)                 # the good one loads


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    """A Q8_0 GGUF llama running fused int8 layers, its held values as an HF directory, and two
    adapters of it."""
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gguf-lora")
    path, held = write_gguf_base(root)
    engine = load_engine(str(path), device="cpu", activations="int8", max_batch=4, prefill_chunk=8,
                         speculative="off")
    if not engine.model.fused:
        pytest.skip("this machine does not run fused int8 layers")
    dirs = [write_adapter(root / "a0", held, ALL_TARGETS, r=4, seed=1),
            write_adapter(root / "a1", held, ["q_proj", "k_proj", "down_proj"], r=8, seed=2)]
    return engine, held, dirs, [engine.load_adapter(str(d), f"a{i}", 64) for i, d in enumerate(dirs)]


def test_an_adapter_on_a_fused_gguf_base_matches_peft(gguf_base):
    """The GGUF's q/k rows are put in Hugging Face's order at load, so a PEFT adapter made on the
    Hugging Face model applies unchanged; its rows run step by step on the same int8 products."""
    engine, held, dirs, adapters = gguf_base
    for directory, adapter in zip(dirs, adapters):
        cache = engine.model.new_cache()
        assert cache.k.dtype == np.float16                         # the fused base's cache format
        split = len(PROMPT) // 3
        ours = np.concatenate([engine.model.forward(PROMPT[:split], cache, "all", adapter=adapter),
                               engine.model.forward(PROMPT[split:], cache, "all", adapter=adapter)])
        want = ref_logits(peft_model(held, directory), PROMPT)
        assert np.abs(ours - want).max() <= INT8_TOL * np.abs(want).max(), np.abs(ours - want).max()
        assert np.abs(ref_logits(reference(held), PROMPT) - want).max() > 0.1
    base = engine.model.forward(PROMPT, engine.model.new_cache(), "all")
    assert np.abs(base - ref_logits(reference(held), PROMPT)).max() <= INT8_TOL * np.abs(base).max()


def test_a_fused_gguf_batch_mixing_adapters_and_the_base_gives_each_what_it_gets_alone(gguf_base):
    """Base rows run the fused layers, adapter rows step by step beside them in the same step."""
    engine, _, _, adapters = gguf_base
    jobs = list(zip([PROMPT, PROMPT[:7], PROMPT[3:], PROMPT[::-1]], [None, adapters[0], None, adapters[1]]))
    engine.scheduler.slots.clear()
    alone = [_run_together(engine, [job])[0] for job in jobs]
    engine.scheduler.slots.clear()
    assert _run_together(engine, jobs) == alone                   # ids and logprobs, bit for bit
    same = _run_together(engine, [(PROMPT, a) for a in [None] + adapters])
    assert len({tuple(t for t, _, _ in run) for run in same}) == 3
    assert engine.model.variant.name in ("native", "numba")       # the base still runs fused


def test_a_gguf_lora_file_is_the_peft_adapter_it_was_converted_from(gguf_base, tmp_path):
    """llama.cpp's GGUF LoRA (its converter's names, B's q/k rows permuted, alpha / rank): the
    same logits, bit for bit, as the PEFT directory it came from; on the float32 path of an HF base too."""
    engine, held, dirs, adapters = gguf_base
    cfg = json.loads((held / "config.json").read_text())
    for directory, peft in zip(dirs, adapters):
        converted = engine.load_adapter(str(write_gguf_adapter(tmp_path / f"{directory.name}.gguf", directory, cfg)),
                                        "converted", 64)
        assert (converted.rank, converted.scale, converted.targets) == (peft.rank, peft.scale, peft.targets)
        got, want = (engine.model.forward(PROMPT, engine.model.new_cache(), "all", adapter=a) for a in (converted, peft))
        assert np.array_equal(got, want)
    hf = load_engine(str(held), device="cpu", activations="float32", max_batch=1)
    converted = hf.load_adapter(str(tmp_path / "a0.gguf"), "converted", 64)
    ours = hf.model.forward(PROMPT, hf.model.new_cache(), "all", adapter=converted)
    assert np.abs(ours - ref_logits(peft_model(held, dirs[0]), PROMPT)).max() <= TOL


def test_gguf_lora_files_that_do_not_fit_are_refused_naming_why(gguf_base, tmp_path):
    engine, held, dirs, _ = gguf_base
    cfg = json.loads((held / "config.json").read_text())
    bad = {
        "not a GGUF": lambda p: p.write_bytes(b"not a gguf file at all"),
        "not a LoRA adapter": lambda p: tiny.write_gguf(p, cfg, tiny.random_state(cfg, 0), "F32"),
        "for 'qwen2' models": lambda p: write_gguf_adapter(p, dirs[0], cfg, arch="qwen2"),
        "not a LoRA matrix": lambda p: write_gguf_adapter(p, dirs[0], cfg, extra={"blk.0.attn_norm.weight": np.ones(64, np.float32)}),
        "for layer 7": lambda p: write_gguf_adapter(p, dirs[0], cfg, extra={
            "blk.7.attn_q.weight.lora_a": np.ones((4, 64), np.float32), "blk.7.attn_q.weight.lora_b": np.ones((64, 4), np.float32)}),
        "lora_b missing": lambda p: write_gguf_adapter(p, dirs[1], cfg, extra={
            "blk.0.attn_v.weight.lora_a": np.ones((8, 64), np.float32)}),
        "ranks": lambda p: write_gguf_adapter(p, dirs[1], cfg, extra={
            "blk.0.attn_v.weight.lora_a": np.ones((2, 64), np.float32), "blk.0.attn_v.weight.lora_b": np.ones((32, 2), np.float32)}),
        "does not fit the model": lambda p: write_gguf_adapter(p, dirs[1], cfg, extra={
            "blk.0.attn_v.weight.lora_a": np.ones((8, 64), np.float32), "blk.0.attn_v.weight.lora_b": np.ones((7, 8), np.float32)}),
        "over this server's limit": lambda p: write_gguf_adapter(p, dirs[1], cfg),
    }
    for i, (words, make) in enumerate(bad.items()):
        path = tmp_path / f"bad{i}.gguf"
        make(path)
        with pytest.raises(AdapterError, match=words):
            engine.load_adapter(str(path), "bad", 4 if "limit" in words else 64)
    assert np.isfinite(engine.model.forward(PROMPT, engine.model.new_cache(), "last")).all()   # unharmed

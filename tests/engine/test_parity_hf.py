"""Parity with Hugging Face transformers (torch, CPU, float32): logits at every position and greedy tokens."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from turbospark_wsgi.engine import load_engine  # noqa: E402
from turbospark_wsgi.engine.kernels import cpu as kernels_cpu  # noqa: E402
from turbospark_wsgi.engine.loader import load_model  # noqa: E402

PROMPT = [1, 40, 72, 101, 108, 108, 111, 260, 263, 32, 119, 111, 114, 108, 100, 33, 7, 200, 3, 50]
TOL = 1e-3
GREEDY_STEPS = 32
_CONFIG_ONLY = ("architectures", "model_type", "torch_dtype")


@pytest.fixture(autouse=True)
def _one_thread():
    # NOTE(threads): torch's and OpenBLAS's spinning worker threads collapse when the cores are
    # shared with other jobs (seconds per step); one thread each keeps this suite's time steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from threadpoolctl import threadpool_limits
        limits = threadpool_limits(1, user_api="blas")
    except ImportError:
        limits = None
    yield
    torch.set_num_threads(threads)
    if limits is not None:
        limits.restore_original_limits()


@pytest.fixture(autouse=True)
def _float32_activations(monkeypatch):
    # the float kernels equal the float32 reference; int8 activations are checked on their own below
    monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "float32")


def hf_from_state(tiny):
    """A transformers LlamaForCausalLM holding exactly the values the tiny file holds."""
    kw = {k: v for k, v in tiny.config.items() if k not in _CONFIG_ONLY}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, attn_implementation="eager"))
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in tiny.state.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if tiny.config["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(model, ids, steps):
    with torch.no_grad():
        # an eos id that never occurs: generation runs all `steps` and eos stays an ordinary token
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                             eos_token_id=10**9, pad_token_id=0)
    return out[0, len(ids):].tolist()


def our_greedy(model, ids, steps):
    cache = model.new_cache()
    logits, out = model.forward(ids, cache), []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]], cache)
    return out


def assert_parity(loaded, hf_model, prompt=PROMPT):
    model = loaded.model
    cache = model.new_cache()
    split = len(prompt) // 3                            # two chunks: the second reads the cache
    ours = np.concatenate([model.forward(prompt[:split], cache, logits="all"),
                           model.forward(prompt[split:], cache, logits="all")])
    ref = hf_logits(hf_model, prompt)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    assert np.abs(ours - ref).max() <= TOL
    assert cache.length == len(prompt)
    greedy = our_greedy(model, prompt, GREEDY_STEPS)
    assert greedy == hf_greedy(hf_model, prompt, GREEDY_STEPS)
    cache = model.new_cache()                           # the last decode position, after a "none" prefill
    assert model.forward(prompt + greedy[:-1], cache, logits="none") is None
    last = model.forward(greedy[-1:], cache)
    assert np.abs(hf_logits(hf_model, prompt + greedy)[-1] - last).max() <= TOL


@pytest.mark.parametrize("qtype, tied, n_kv_head", [
    ("F32", False, 2),      # GQA, kv_mul 2, separate head
    ("F32", True, 1),       # kv_mul 4, tied head
    ("Q8_0", True, 2),
    ("Q4_1", False, 4),     # plain multi-head attention
    ("F16", False, 2),
])
def test_gguf_matches_transformers(tiny_gguf, qtype, tied, n_kv_head):
    tiny = tiny_gguf(qtype=qtype, tied=tied, n_kv_head=n_kv_head)
    loaded = load_model(tiny.path, device="cpu")
    assert loaded.kind == "gguf" and loaded.config.tied_embeddings == tied
    assert_parity(loaded, hf_from_state(tiny))


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def test_gguf_linear_rope_scaling_matches_transformers(tiny_gguf):
    tiny = tiny_gguf(rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=500.0)
    loaded = load_model(tiny.path, device="cpu")
    assert loaded.config.rope_scaling == {"type": "linear", "factor": 4.0}
    assert_parity(loaded, hf_from_state(tiny))


def test_gguf_llama3_rope_freqs_match_transformers(tiny_gguf):
    tiny = tiny_gguf(rope_scaling=LLAMA3_SCALING, rope_theta=50.0)
    loaded = load_model(tiny.path, device="cpu")
    assert loaded.config.rope_scaling == {} and loaded.model.w.rope_freqs is not None
    assert_parity(loaded, hf_from_state(tiny))


@pytest.mark.parametrize("kw", [
    {},
    {"tied": True, "n_kv_head": 1, "shards": 3},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_scaling": LLAMA3_SCALING, "rope_theta": 50.0},
    {"dtype": "F16"},
    {"dtype": "BF16", "tied": True},
])
def test_hf_dir_matches_transformers(tiny_hf_dir, kw):
    tiny = tiny_hf_dir(**kw)
    loaded = load_model(tiny.path, device="cpu")
    assert loaded.kind == "hf" and loaded.metadata["config"] == tiny.config
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tiny.path, dtype=torch.float32, attn_implementation="eager").eval()
    assert_parity(loaded, reference)


def test_dir_saved_by_transformers_loads(tiny_gguf, tmp_path):
    """A directory written by save_pretrained (rope_parameters, transformers' own layout)."""
    reference = hf_from_state(tiny_gguf(tied=True, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    reference.save_pretrained(tmp_path / "saved")
    assert_parity(load_model(tmp_path / "saved", device="cpu"), reference)


@pytest.mark.slow
def test_default_model_matches_transformers(default_gguf, default_reference):
    """The real SmolLM2-135M Q4_1 GGUF, dequantized by transformers itself."""
    reference = default_reference
    loaded = load_model(default_gguf, device="cpu")
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3575, 2, 198, 1, 4093, 198, 504, 3575, 282]
    assert_parity(loaded, reference, prompt)


def hf_hidden(model, ids):
    """transformers' last hidden state (the final norm applied): what the head reads."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_hidden_states_match_transformers(tiny_gguf, qtype):
    tiny = tiny_gguf(qtype=qtype)
    model = load_model(tiny.path, device="cpu").model
    cache = model.new_cache()
    split = len(PROMPT) // 3                            # two calls: the second reads the cache
    ours = np.concatenate([model.forward(PROMPT[:split], cache, logits="hidden"),
                           model.forward(PROMPT[split:], cache, logits="hidden")])
    ref = hf_hidden(hf_from_state(tiny), PROMPT)
    assert ours.shape == ref.shape == (len(PROMPT), tiny.config["hidden_size"])
    assert np.abs(ours - ref).max() <= TOL


EMBED_TEXTS = ["a", ".", "Hello, world!", "The quick brown fox jumps over the lazy dog.",
               "東京は日本の首都です。", "Привет, как у тебя дела сегодня?", "مرحبا بالعالم، كيف حالك؟",
               "🙂🙃 emoji only 🚀", "def f(x): return x ** 2  # code", "UPPER CASE and lower case",
               "word " * 120, " ".join(f"token{i} and some filler text" for i in range(25)),
               "Numbers: 3.14159, 2.71828; dates 2024-01-01.", "A man is eating food.",
               "A man is eating a piece of bread.", "The girl is carrying a baby.",
               "Paris is the capital of France.", "Stock markets fell sharply on Monday.",
               "The recipe needs flour, eggs and sugar.", "Python is a programming language."]


@pytest.mark.slow
def test_default_model_embeddings_match_transformers(default_gguf, default_reference):
    """/v1/embeddings on the default SmolLM2 GGUF: transformers' hidden states of the same file,
    mean-pooled and normalised, on 20 varied texts."""
    reference = default_reference
    engine = load_engine(default_gguf, device="cpu")
    seqs = engine.encode_batch(EMBED_TEXTS)
    ours = engine.embed(seqs)
    ref = np.stack([hf_hidden(reference, s).mean(axis=0) for s in seqs])
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    cos = (ours * ref).sum(axis=1)
    assert cos.min() >= 0.9999, list(zip(EMBED_TEXTS, cos))


CHAT_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3575, 2, 198, 1, 4093, 198, 504, 3575, 282]
MARGIN = 2.0        # logits by which transformers' best token must lead for int8 to be held to it
INT8_TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
              "The theory of relativity states that", "List three fruits:", "import numpy as np\n",
              "Dear Sir or Madam,", "Water boils at")


@pytest.mark.slow
def test_default_model_with_int8_activations_keeps_greedy_parity(default_gguf, default_reference, monkeypatch):
    """int8 activations (the default kernels) round each activation block: logits move, and a near
    tie on a greedy path can tip either way, after which a free-running path leaves transformers'.
    So the check runs along transformers' greedy paths, 9 prompts x 32 tokens, on both layer paths,
    and holds the int8 path to bounds rather than bits: the float steps around the exact integer
    products round differently with 8- and 16-wide vectors, so a tie tips one way on AVX2 and the
    other on AVX-512. Where transformers' best token leads its second by more than MARGIN, ours
    must be the same; the mean and largest |dlogit| and the share of other argmaxes are bounded.
    tools/accuracy.py measures the same path against the float32 one and llama.cpp (README)."""
    monkeypatch.setattr(kernels_cpu, "ACTIVATIONS", "int8")
    reference = default_reference
    engine = load_engine(default_gguf, device="cpu")
    model = engine.model
    prompts = [CHAT_PROMPT] + [engine.encode(t, add_bos=False) for t in INT8_TEXTS]
    paths = [(p, hf_greedy(reference, p, GREEDY_STEPS)) for p in prompts]
    refs = [hf_logits(reference, p + theirs) for p, theirs in paths]
    for fused in (True, False):
        monkeypatch.setattr(model, "plan", dataclasses.replace(model.plan, fused=fused))
        assert model.fused == fused
        diffs, other, clear_misses = [], 0, []
        for (p, theirs), ref in zip(paths, refs):
            ours = model.forward(p + theirs, model.new_cache(), logits="all")
            diffs.append(np.abs(ours - ref)[len(p) - 1:])
            along = ours[len(p) - 1:-1].argmax(axis=-1)
            top2 = np.sort(ref[len(p) - 1:-1], axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > MARGIN
            clear_misses += [(fused, i) for i in np.flatnonzero(clear & (along != np.asarray(theirs)))]
            other += int((along != np.asarray(theirs)).sum())
        d = np.concatenate(diffs)
        assert d.mean() < 0.6 and d.max() < 8.0, (fused, d.mean(), d.max())
        assert other <= 0.1 * GREEDY_STEPS * len(prompts), (fused, other)
        assert not clear_misses, clear_misses

"""Model families beyond llama (Qwen2 attention biases, Qwen3 q/k norms, Phi-3 fused matrices and
partial rotary): parity with Hugging Face
transformers on tiny random models, as GGUF and as Hugging Face directories, and the exactness that
batching and the prefix cache rely on."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from turbospark_wsgi.engine import EngineOptions, SamplingParams, Token, load_engine  # noqa: E402
from turbospark_wsgi.engine.loader import load_model  # noqa: E402


def _module(name, filename):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny = _module("tiny_models_families", "conftest.py")
parity = _module("parity_hf_families", "test_parity_hf.py")
batching = _module("batching_families", "test_batching.py")
_one_thread = parity._one_thread          # the same one-thread fixture as the llama parity tests
_float32_activations = parity._float32_activations

FAMILIES = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
              "attention_bias": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "partial_rotary_factor": 0.5,
             "pad_token_id": 0, "sliding_window": None},
    # six layers: five local (rotary base 10 000, a window of 8 positions, far shorter than the prompts
    # and replies here) and one global (1 000 000), as llama.cpp's pattern has it
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 6,
               "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8, "rms_norm_eps": 1e-6,
               "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "final_logit_softcapping": None,
               "rope_theta": 1000000.0,
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}


def family_config(family, tied=False, n_kv_head=2):
    return tiny.hf_config(n_kv_head, tied, **FAMILIES[family])


def family_state(family, cfg, seed=0):
    """The llama tensors plus the family's own: Qwen2's q/k/v biases, Qwen3's per-head norms."""
    rng = np.random.default_rng(seed + 100)
    state = tiny.random_state(cfg, seed)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if family == "qwen2":
            for proj, heads in (("q", cfg["num_attention_heads"]), ("k", cfg["num_key_value_heads"]),
                                ("v", cfg["num_key_value_heads"])):
                state[f"{p}{proj}_proj.bias"] = (0.5 * rng.standard_normal(heads * hd)).astype(np.float32)
        if family == "qwen3":
            for proj in ("q", "k"):
                state[f"{p}{proj}_norm.weight"] = (1.0 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
        if family == "gemma3":      # norms around both sub-layers and on q/k heads, stored as w - 1
            m = f"model.layers.{i}."
            for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                state[f"{m}{n}.weight"] = (1.0 + 0.1 * rng.standard_normal(cfg["hidden_size"])).astype(np.float32)
            for proj in ("q", "k"):
                state[f"{p}{proj}_norm.weight"] = (1.0 + 0.2 * rng.standard_normal(hd)).astype(np.float32)
        if family == "phi3":        # one q|k|v and one gate|up matrix
            state[p + "qkv_proj.weight"] = np.concatenate([state.pop(p + f"{x}_proj.weight") for x in "qkv"])
            m = f"model.layers.{i}.mlp."
            state[m + "gate_up_proj.weight"] = np.concatenate([state.pop(m + "gate_proj.weight"),
                                                               state.pop(m + "up_proj.weight")])
    if family == "gemma3":
        state = {k: v - np.float32(1.0) if k.endswith("norm.weight") else v for k, v in state.items()}
    return state


_EXTRA_GGUF = {"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
               "mlp.gate_up_proj.weight": "ffn_up.weight"}
_GEMMA3_GGUF = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def gguf_name(hf_name, family):
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        table = {**_EXTRA_GGUF, **(_GEMMA3_GGUF if family == "gemma3" else {})}
        if rest in table:
            return f"blk.{i}.{table[rest]}"
    return tiny.gguf_name(hf_name)


def gguf_value(name, value, family):
    """llama.cpp's converter adds Gemma's 1 to every norm weight."""
    return value + np.float32(1.0) if family == "gemma3" and name.endswith("norm.weight") else value


def write_family_gguf(path, family, cfg, state, qtype):
    """A GGUF laid out as llama.cpp's converter writes these families: Q/K rows as in Hugging Face
    (no llama interleave), vectors (norms, biases) in float32. Returns the values the file holds."""
    import gguf
    w = gguf.GGUFWriter(str(path), family)
    tiny.add_gguf_hparams(w, cfg, f"tiny-{family}")
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    tiny._add_gguf_tokenizer(w)
    held = {name: tiny.store_gguf_tensor(w, gguf_name(name, family), gguf_value(name, value, family), qtype)
            for name, value in state.items()}
    held = {k: v - np.float32(1.0) if family == "gemma3" and k.endswith("norm.weight") else v
            for k, v in held.items()}
    tiny.finish_gguf(w)
    return held


def hf_model(cfg, state):
    """A transformers model of cfg's family holding exactly `state`."""
    kw = {k: v for k, v in cfg.items() if k not in parity._CONFIG_ONLY}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **kw, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


def family_gguf(tmp_path, family, qtype="F32", tied=False, n_kv_head=2):
    cfg = family_config(family, tied, n_kv_head)
    path = tmp_path / f"tiny-{family}-{qtype}.gguf"
    return path, cfg, write_family_gguf(path, family, cfg, family_state(family, cfg), qtype)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("qtype, tied", [("F32", False), ("Q8_0", True)])
def test_gguf_family_matches_transformers(tmp_path, family, qtype, tied):
    path, cfg, held = family_gguf(tmp_path, family, qtype, tied)
    loaded = load_model(path, device="cpu")
    assert loaded.config.arch == family and loaded.config.tied_embeddings == tied
    assert loaded.config.rope_dim == loaded.config.head_dim // (2 if family == "phi3" else 1)   # partial
    parity.assert_parity(loaded, hf_model(cfg, held))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_dir_family_matches_transformers(tmp_path, family):
    cfg = family_config(family, tied=True)
    tiny.write_hf_dir(tmp_path / family, cfg, family_state(family, cfg))
    loaded = load_model(tmp_path / family, device="cpu")
    assert loaded.kind == "hf" and loaded.config.arch == family
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / family, dtype=torch.float32, attn_implementation="eager").eval()
    parity.assert_parity(loaded, reference)


def test_the_family_tensors_matter(tmp_path):
    """Without its biases a Qwen2 model is another model: the parity above is not vacuous."""
    path, cfg, held = family_gguf(tmp_path, "qwen2")
    model = load_model(path, device="cpu").model
    ours = model.forward(parity.PROMPT, model.new_cache(), logits="all")
    unbiased = {k: 0 * v if k.endswith(".bias") else v for k, v in held.items()}
    assert np.abs(ours - parity.hf_logits(hf_model(cfg, unbiased), parity.PROMPT)).max() > 0.1


def test_missing_family_tensor_is_named(tmp_path):
    cfg = family_config("qwen3")
    state = family_state("qwen3", cfg)
    del state["model.layers.1.self_attn.k_norm.weight"]
    tiny.write_hf_dir(tmp_path / "m", cfg, state)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_norm.weight"):
        load_model(tmp_path / "m", device="cpu")


@pytest.mark.parametrize("arch", ["gemma2", "phi2"])
def test_unsupported_architecture_is_named_at_load(tmp_path, arch):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch)
    w.add_block_count(1)
    tiny.finish_gguf(w)
    with pytest.raises(ValueError, match=f"unsupported model architecture '{arch}'"):
        load_model(tmp_path / "x.gguf", device="cpu")


@pytest.fixture(params=list(FAMILIES))
def family_engine(request, tmp_path):
    path, _, _ = family_gguf(tmp_path, request.param, "Q8_0")
    return load_engine(path, device="cpu", max_batch=4, prefill_chunk=8)


def test_family_batched_greedy_equals_solo(family_engine):
    batching.test_batched_greedy_equals_solo(family_engine)


def test_family_prefix_cache_hit_equals_miss(family_engine):
    batching.test_prefix_cache_hit_gives_identical_logits_and_tokens(family_engine)


def test_family_decode_batch_rows_equal_single_rows(family_engine):
    batching.test_decode_batch_rows_are_bit_identical_to_single_rows(family_engine)


def test_family_reply_is_reused_exactly(family_engine):
    assert family_engine.model.decode_exact
    batching.test_a_reply_is_reused_like_prompt_tokens_and_the_next_turn_equals_a_cold_run(family_engine)


def test_family_fused_layers_follow_the_step_by_step_path(family_engine, monkeypatch):
    """Biases, q/k norms, partial rotary, post norms, GELU and windows in the one-call layer kernel."""
    fused = _module("kernels_layer_families", "test_kernels_layer.py")
    monkeypatch.setattr(fused.kernels_cpu, "ACTIVATIONS", "int8")
    fused.assert_fused_follows_step_by_step(family_engine.model, monkeypatch, prompt=parity.PROMPT)


def test_family_engine_generates(family_engine):
    from turbospark_wsgi.engine import SamplingParams
    prompt = family_engine.encode("the cat", add_bos=True)
    events = list(family_engine.generate(prompt, SamplingParams(temperature=0, max_new_tokens=4)))
    assert sum(isinstance(e, Token) for e in events) >= 1


def test_gemma3_legacy_config_and_softcap_match_transformers(tmp_path):
    """config.json as Gemma 3 checkpoints ship it (rope_theta + rope_local_base_freq, no layer_types),
    with a query_pre_attn_scalar other than head_dim and final logit soft-capping."""
    cfg = family_config("gemma3", tied=True)
    state = family_state("gemma3", cfg)
    del cfg["rope_parameters"], cfg["layer_types"]
    cfg.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
               query_pre_attn_scalar=24, final_logit_softcapping=5.0)
    tiny.write_hf_dir(tmp_path / "g", cfg, state)
    loaded = load_model(tmp_path / "g", device="cpu")
    c = loaded.config
    assert (c.local_layers, c.rope_local_theta, c.rope_theta) == ((0, 1, 2, 3, 4), 10000.0, 1000000.0)
    assert (c.query_scalar, c.final_softcap, c.max_seq_len, c.sliding_window) == (24.0, 5.0, 256, 8)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "g", dtype=torch.float32, attn_implementation="eager").eval()
    assert reference.config.final_logit_softcapping == 5.0
    parity.assert_parity(loaded, reference)


def test_gemma3_local_layers_use_their_own_rotary_base(tmp_path):
    """The parity above needs both bases: with the global base everywhere the logits move."""
    path, cfg, held = family_gguf(tmp_path, "gemma3")
    model = load_model(path, device="cpu").model
    ours = model.forward(parity.PROMPT, model.new_cache(), logits="all")
    model.rotary.layer_kind = [0] * len(model.rotary.layer_kind)
    assert np.abs(model.forward(parity.PROMPT, model.new_cache(), logits="all") - ours).max() > 0.01


@pytest.mark.parametrize("window", [None, 8])
def test_mistral_dir_matches_transformers(tmp_path, window):
    """MistralForCausalLM runs as llama; its sliding window applies to every layer, the context
    stays the model's whole length."""
    cfg = tiny.hf_config(2, False, architectures=["MistralForCausalLM"], model_type="mistral",
                         sliding_window=window)
    tiny.write_hf_dir(tmp_path / "m", cfg, tiny.random_state(cfg))
    loaded = load_model(tmp_path / "m", device="cpu")
    c = loaded.config
    assert (c.max_seq_len, c.sliding_window) == (cfg["max_position_embeddings"], window or 0)
    assert c.local_layers == ((0, 1) if window else ())
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", dtype=torch.float32, attn_implementation="eager").eval()
    parity.assert_parity(loaded, reference)


@pytest.mark.parametrize("family, extra, local", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}, (1,)),   # layers >= 1
    ("qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0}, (0, 1)),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 6}, ()),                            # off
    ("phi3", {"sliding_window": 7}, (0, 1)),
])
def test_windowed_dirs_match_transformers(tmp_path, family, extra, local):
    """Qwen's window on the layers from max_window_layers on (when use_sliding_window), Phi-3's on all."""
    cfg = {**family_config(family), **extra}
    tiny.write_hf_dir(tmp_path / "m", cfg, family_state(family, cfg))
    loaded = load_model(tmp_path / "m", device="cpu")
    assert (loaded.config.local_layers, loaded.config.sliding_window) == (local, extra["sliding_window"] if local else 0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", dtype=torch.float32, attn_implementation="eager").eval()
    parity.assert_parity(loaded, reference)


def test_windowed_phi3_gguf_matches_transformers(tmp_path):
    """A GGUF attention.sliding_window (outside Gemma 3's pattern) windows every layer."""
    cfg = {**family_config("phi3"), "sliding_window": 7}
    held = write_family_gguf(tmp_path / "p.gguf", "phi3", cfg, family_state("phi3", cfg), "Q8_0")
    loaded = load_model(tmp_path / "p.gguf", device="cpu")
    assert (loaded.config.local_layers, loaded.config.sliding_window) == ((0, 1), 7)
    parity.assert_parity(loaded, hf_model(cfg, held))


def test_gemma3_window_on_the_blocked_attention_path(tmp_path, monkeypatch):
    """The attention the CuPy backend runs (aligned blocks, masks; here on numpy) windows like the
    fused CPU kernel, on a prompt that crosses an attention block's end."""
    from turbospark_wsgi.engine import attention, model as model_mod
    monkeypatch.setattr(attention, "ATTN_BLOCK", 16)
    monkeypatch.setattr(model_mod.Transformer, "fused_attention", property(lambda self: False))
    path, cfg, held = family_gguf(tmp_path, "gemma3")
    loaded = load_model(path, device="cpu")
    assert not loaded.model.fused_attention and loaded.config.local_layers == (0, 1, 2, 3, 4)
    parity.assert_parity(loaded, hf_model(cfg, held), prompt=parity.PROMPT + parity.PROMPT[3:])


def test_gemma3_window_matters(tmp_path):
    """With the window removed the logits past the window move: the parity above is not vacuous."""
    path, cfg, held = family_gguf(tmp_path, "gemma3")
    model = load_model(path, device="cpu").model
    ours = model.forward(parity.PROMPT, model.new_cache(), logits="all")
    model._layer_window = [0] * len(model._layer_window)
    full = model.forward(parity.PROMPT, model.new_cache(), logits="all")
    w = cfg["sliding_window"]
    assert np.array_equal(full[:w], ours[:w]) and np.abs(full[w:] - ours[w:]).max() > 0.01


def test_biased_llama_projections_are_refused(tmp_path):
    cfg = tiny.hf_config(attention_bias=True)
    tiny.write_hf_dir(tmp_path / "m", cfg, tiny.random_state(cfg))
    with pytest.raises(ValueError, match="attention_bias"):
        load_model(tmp_path / "m", device="cpu")


def test_norm_weight_owns_gemmas_plus_one():
    """Hugging Face Gemma weights hold w - 1, llama.cpp's GGUF holds w; every other family holds w."""
    from turbospark_wsgi.engine.config import ModelConfig
    from turbospark_wsgi.engine.weights import norm_weight
    w = np.array([-0.5, 0.0, 0.25], dtype=np.float32)
    shape = dict(n_layer=1, dim=4, n_head=1, n_kv_head=1, ffn_dim=4, vocab_size=4, max_seq_len=8)
    gemma, llama = ModelConfig(arch="gemma3", **shape), ModelConfig(arch="llama", **shape)
    assert np.array_equal(norm_weight(gemma, w, "hf"), w + 1) and norm_weight(gemma, w, "hf").dtype == np.float32
    assert np.array_equal(norm_weight(gemma, w, "gguf"), w)
    assert np.array_equal(norm_weight(llama, w, "hf"), w)


@pytest.mark.parametrize("family, template", [("gemma3", "gemma3"), ("qwen3", "chatml")])
def test_a_file_without_a_template_gets_its_architectures(tmp_path, family, template):
    """Gemma 3 GGUF conversions of the base models ship no chat template: they get Gemma's own
    (no system role, "model" turns), the other families ChatML."""
    from turbospark_wsgi.engine.chat_template import CHATML_TEMPLATE, GEMMA3_TEMPLATE
    from turbospark_wsgi.engine.engine import Engine
    path, _, _ = family_gguf(tmp_path, family, "Q8_0")
    shipped = load_engine(path, device="cpu", max_batch=1)
    shipped.tokenizer.chat_template = None
    engine = Engine(shipped.loaded, shipped.tokenizer, EngineOptions(max_batch=1))
    assert engine.template.source == {"gemma3": GEMMA3_TEMPLATE, "chatml": CHATML_TEMPLATE}[template]
    text = engine.render_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "u"}])
    assert text == {"gemma3": f"{engine.tokenizer.bos_token}<start_of_turn>user\nS\n\nu<end_of_turn>\n<start_of_turn>model\n",
                    "chatml": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nu<|im_end|>\n"
                              "<|im_start|>assistant\n"}[template]


LLAMA_SERVER = Path("/opt/llama.cpp/bin/llama-server")


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason="llama.cpp's llama-server is not installed")
def test_qwen2_gguf_matches_llama_cpp(tmp_path):
    """A tiny Qwen2 GGUF with a Qwen-shaped vocabulary ("qwen2" pre-tokenizer) in llama.cpp's
    llama-server: the same ids for tricky text (llama.cpp has no NFC step, so decomposed text is left
    out: there Qwen's own tokenizer is the reference) and the same 16 greedy tokens."""
    import json
    import socket
    import subprocess
    import time
    import unicodedata
    import urllib.request

    import gguf
    toks = _module("tokenizer_cases_families", "test_tokenizer.py")
    _, meta = toks.qwen_meta()
    cfg = {**family_config("qwen2"), "vocab_size": len(meta["tokenizer.ggml.tokens"]), "max_position_embeddings": 512}
    path = tmp_path / "tiny-qwen2-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    tiny.add_gguf_hparams(w, cfg, "tiny-qwen2")
    toks.add_qwen_tokenizer(w, meta)
    for name, value in family_state("qwen2", cfg).items():
        tiny.store_gguf_tensor(w, gguf_name(name, "qwen2"), value, "F32")
    tiny.finish_gguf(w)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(LLAMA_SERVER), "-m", str(path), "--port", str(port), "-t", "1", "-c", "512",
                               "--no-warmup", "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def post(route, body):
        request = urllib.request.Request(f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            return json.load(resp)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        engine = load_engine(str(path), device="cpu")
        texts = [t for t in toks.QWEN_TRICKY + toks.fuzz_strings(21, 200, toks.QWEN_PARTS)
                 if unicodedata.is_normalized("NFC", t)]
        assert len(texts) > 150
        for text in texts:
            theirs = post("/tokenize", {"content": text, "add_special": False, "parse_special": True})["tokens"]
            assert engine.tokenizer.encode(text) == theirs, text
        for prompt in ["Hello, world! It's 2024;", "你好，世界。 😀 numbers 12345"]:
            ids = engine.tokenizer.encode(prompt)
            theirs = post("/completion", {"prompt": ids, "n_predict": 16, "temperature": 0, "top_k": 1,
                                          "cache_prompt": False, "samplers": ["top_k"], "return_tokens": True})
            params = SamplingParams(max_new_tokens=16, temperature=0.0)
            assert [e.id for e in engine.generate(ids, params) if isinstance(e, Token)] == theirs["tokens"]
    finally:
        server.terminate()
        server.wait()

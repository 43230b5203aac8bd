"""Tiny seeded llama models written to tmp_path, for engine tests and for anything built on them.

    def test_x(tiny_gguf, tiny_hf_dir):
        gg = tiny_gguf(qtype="Q8_0", tied=True)      # TinyModel(path, config, state)
        hf = tiny_hf_dir(n_kv_head=1, shards=2)

`config` is the Hugging Face config.json dict; `state` maps Hugging Face tensor names to the float32
values the file really holds (after quantization, in Hugging Face row layout), so a reference model
built from it must agree with ours. Both formats carry the same tiny byte-level BPE tokenizer
(ids 0-2 `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`; 256 byte symbols; 5 merges) and a ChatML template.
"""
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODELS_DIR = Path(os.path.expanduser(os.environ.get("TURBOSPARK_MODELS", "~/.cache/turbospark/models")))
DEFAULT_GGUF = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
_REPO = Path(__file__).resolve().parents[2]
STORIES_CANDIDATES = [Path(p) for p in [os.environ.get("TURBOSPARK_STORIES", "")] if p] + [
    _REPO / "shared" / "models" / "stories260K.gguf", _REPO.parent / "shared" / "models" / "stories260K.gguf",
    MODELS_DIR / "stories260K.gguf"]


@dataclass
class TinyModel:
    path: Path
    config: dict        # Hugging Face config.json
    state: dict         # HF name -> float32 values held by the file (HF row layout)


def byte_symbols():
    """GPT-2's byte -> printable unicode symbol table (256 entries, in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra, table = 0, {}
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def vocab_tokens():
    return SPECIAL_TOKENS + byte_symbols() + [a + b for a, b in MERGES]


def hf_config(n_kv_head=2, tied=False, rope_scaling=None, **overrides):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(vocab_tokens()),
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": n_kv_head, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": tied, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    if rope_scaling:
        cfg["rope_scaling"] = dict(rope_scaling)
    cfg.update(overrides)
    return cfg


def random_state(cfg, seed=0):
    """HF-named float32 weights with enough spread that greedy choices are not near-ties."""
    rng = np.random.default_rng(seed)
    dim, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or dim // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)

    state = {"model.embed_tokens.weight": rng.standard_normal((vocab, dim)).astype(np.float32),
             "model.norm.weight": norm()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                      p + "self_attn.q_proj.weight": mat(q_out, dim), p + "self_attn.k_proj.weight": mat(kv_out, dim),
                      p + "self_attn.v_proj.weight": mat(kv_out, dim), p + "self_attn.o_proj.weight": mat(dim, q_out),
                      p + "mlp.gate_proj.weight": mat(ffn, dim), p + "mlp.up_proj.weight": mat(ffn, dim),
                      p + "mlp.down_proj.weight": mat(dim, ffn)})
    if not cfg["tie_word_embeddings"]:
        state["lm_head.weight"] = mat(vocab, dim)
    return state


def llama_cpp_permute(w, n_head):
    """HF Q/K rows -> GGUF rows, as llama.cpp's convert_hf_to_gguf.py does it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name):
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        return f"blk.{i}.{GGUF_NAMES[rest.rsplit('.', 1)[0]]}.weight"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def store_gguf_tensor(writer, name, w, qtype):
    """Adds w (float32) as `qtype`; returns the float32 values the file then holds."""
    from gguf import GGMLQuantizationType, quants
    qt = GGMLQuantizationType[qtype]
    if w.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, w)
        return w
    if qtype == "F16":
        writer.add_tensor(name, w.astype(np.float16))
        return w.astype(np.float16).astype(np.float32)
    q = quants.quantize(w, qt)
    writer.add_tensor(name, q, raw_dtype=qt)
    return quants.dequantize(q, qt).reshape(w.shape).astype(np.float32)


def llama3_rope_factors(cfg):
    """The divisors llama.cpp's converter writes as rope_freqs.weight for llama3 rope scaling."""
    s, hd = cfg["rope_scaling"], cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            factors.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, cfg, state, qtype="F32", drop=(), raw=None, arch="llama"):
    """Writes a llama GGUF the way llama.cpp's converter lays it out; returns the held values.
    drop: GGUF tensor names to leave out; raw: {GGUF name: (uint8 rows, GGMLQuantizationType)} to
    store instead of the computed tensor (for unsupported-type tests)."""
    import gguf
    raw = raw or {}
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_hparams(w, cfg, "tiny-llama")
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif scaling.get("rope_type") == "llama3":     # llama.cpp stores per-frequency divisors instead
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    _add_gguf_tokenizer(w)
    held = {}
    for name, value in state.items():
        if gguf_name(name) in drop:
            continue
        if gguf_name(name) in raw:
            data, qt = raw[gguf_name(name)]
            w.add_tensor(gguf_name(name), data, raw_dtype=qt)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            stored = store_gguf_tensor(w, gguf_name(name), llama_cpp_permute(value, heads), qtype)
            # row permutation commutes with row-wise block quantization: undo it on the held values
            held[name] = stored.reshape(heads, -1, 2, stored.shape[1]).swapaxes(1, 2).reshape(stored.shape)
        else:
            held[name] = store_gguf_tensor(w, gguf_name(name), value, qtype)
    finish_gguf(w)
    return held


def add_gguf_hparams(w, cfg, name):
    """The model keys llama.cpp's converter writes from a config.json (head_dim and a partial
    rotary factor only where the config sets them)."""
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    w.add_vocab_size(cfg["vocab_size"])


def finish_gguf(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_gguf_tokenizer(w):
    tokens = vocab_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def write_hf_dir(directory, cfg, state, dtype="F32", shards=1):
    """config.json, *.safetensors (sharded with an index when shards > 1), tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    held = _save_safetensors(directory, state, dtype, shards)
    _write_hf_tokenizer(directory)
    return held


def _save_safetensors(directory, state, dtype, shards):
    if dtype == "BF16":
        torch = pytest.importorskip("torch")
        from safetensors.torch import save_file
        tensors = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in state.items()}
        held = {k: t.float().numpy() for k, t in tensors.items()}
    else:
        from safetensors.numpy import save_file
        np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
        tensors = {k: v.astype(np_dtype) for k, v in state.items()}
        held = {k: v.astype(np.float32) for k, v in tensors.items()}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return held
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k] for k in part}, str(directory / fname))
        weight_map.update({k: fname for k in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return held


def _write_hf_tokenizer(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(vocab_tokens())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


@pytest.fixture
def tiny_gguf(tmp_path):
    """Factory: tiny_gguf(qtype="F32", tied=False, n_kv_head=2, rope_scaling=None, seed=0, name=...,
    drop=(), raw=None, arch="llama", **config_overrides) -> TinyModel."""
    def make(qtype="F32", tied=False, n_kv_head=2, rope_scaling=None, seed=0, name=None,
             drop=(), raw=None, arch="llama", **overrides):
        cfg = hf_config(n_kv_head, tied, rope_scaling, **overrides)
        path = tmp_path / (name or f"tiny-{qtype}-{seed}.gguf")
        held = write_gguf(path, cfg, random_state(cfg, seed), qtype, drop, raw, arch)
        return TinyModel(path, cfg, held)
    return make


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """Factory: tiny_hf_dir(dtype="F32", shards=1, tied=False, n_kv_head=2, rope_scaling=None, seed=0, **cfg)."""
    def make(dtype="F32", shards=1, tied=False, n_kv_head=2, rope_scaling=None, seed=0, name=None, **overrides):
        cfg = hf_config(n_kv_head, tied, rope_scaling, **overrides)
        path = tmp_path / (name or f"tiny-hf-{dtype}-{seed}")
        held = write_hf_dir(path, cfg, random_state(cfg, seed), dtype, shards)
        return TinyModel(path, cfg, held)
    return make


@pytest.fixture
def default_gguf():
    if not DEFAULT_GGUF.exists():
        pytest.skip(f"default model not present at {DEFAULT_GGUF}")
    return DEFAULT_GGUF


@pytest.fixture(scope="session")
def default_reference():
    """transformers' float32 model of the default GGUF (dequantized by transformers itself), loaded
    once for the tests that compare with it (~19 s a load on 2 cores); they only read it."""
    if not DEFAULT_GGUF.exists():
        pytest.skip(f"default model not present at {DEFAULT_GGUF}")
    return hf_causal_lm(DEFAULT_GGUF)


def hf_causal_lm(gguf_file):
    """transformers' float32 model of `gguf_file`, dequantized by transformers and gguf-py themselves
    (eager attention, loaded on one thread).

    PERF(reader): gguf-py's reader walks every metadata value through a numpy memmap, twice a load
    (config, then weights): ~40 s for Gemma 3's 262k-token vocabulary on 2 cores, ~10 s of it the
    memmap's per-slice overhead. It reads here from the whole file in memory instead (np.fromfile,
    the same bytes), for the load alone."""
    import types

    import gguf.gguf_reader as reader
    import torch
    import transformers

    class _WholeFile(types.ModuleType):
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def memmap(path, mode="r", **_):
            return np.fromfile(path, dtype=np.uint8)

    threads, numpy_module = torch.get_num_threads(), reader.np
    torch.set_num_threads(1)
    reader.np = _WholeFile("numpy")
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, attn_implementation="eager").eval()
    finally:
        reader.np = numpy_module
        torch.set_num_threads(threads)


@pytest.fixture
def minilm_dir():
    """The pulled all-minilm-l6-v2 sentence-transformers directory (an embedding model)."""
    path = MODELS_DIR / "all-minilm-l6-v2"
    if not (path / "modules.json").is_file():
        pytest.skip(f"{path} absent (turbospark pull all-minilm-l6-v2)")
    return path


@pytest.fixture
def stories_gguf():
    found = [p for p in STORIES_CANDIDATES if p.exists()]
    if not found:
        pytest.skip("stories260K.gguf not present (set TURBOSPARK_STORIES)")
    return found[0]

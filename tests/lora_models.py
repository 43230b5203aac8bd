"""Tiny random base models (Hugging Face llama and qwen2 directories) and PEFT LoRA adapters for
them, written on the fly: the adapters are made by peft itself (get_peft_model + save_pretrained),
with random B (PEFT starts B at zero, which would make every adapter the base model).

    base = write_base(tmp_path / "base", "qwen2")
    lora = write_adapter(tmp_path / "a1", base, ["q_proj", "down_proj"], r=4, seed=1)
"""
import importlib.util
import json
from pathlib import Path

import numpy as np

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {"llama": {},
            "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
                      "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}}


def _tiny():
    spec = importlib.util.spec_from_file_location("tiny_models_lora", Path(__file__).parent / "engine" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny = _tiny()


def write_base(directory, family="llama", seed=0, **overrides):
    """A tiny random HF directory of `family` (llama, or qwen2 with q/k/v biases); returns its Path."""
    cfg = tiny.hf_config(2, False, **FAMILIES[family], **overrides)
    state = tiny.random_state(cfg, seed)
    if family == "qwen2":
        rng = np.random.default_rng(seed + 100)
        hd = cfg["hidden_size"] // cfg["num_attention_heads"]
        for i in range(cfg["num_hidden_layers"]):
            for proj, heads in (("q", cfg["num_attention_heads"]), ("k", 2), ("v", 2)):
                state[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = \
                    (0.5 * rng.standard_normal(heads * hd)).astype(np.float32)
    tiny.write_hf_dir(Path(directory), cfg, state)
    return Path(directory)


def write_gguf_base(directory, qtype="Q8_0", seed=0):
    """A tiny random llama as a GGUF file (`qtype` matrices, q/k rows permuted as llama.cpp's
    converter does) beside the Hugging Face directory of the values the file holds (so transformers
    runs the same model); returns (GGUF path, HF directory)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny.hf_config(2, False, **FAMILIES["llama"])
    held = tiny.write_gguf(directory / f"base-{qtype}.gguf", cfg, tiny.random_state(cfg, seed), qtype)
    tiny.write_hf_dir(directory / "held", cfg, held)
    return directory / f"base-{qtype}.gguf", directory / "held"


GGUF_TENSORS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_gguf_adapter(path, adapter, cfg, arch="llama", alpha=None, dtype=np.float32, extra=None, meta=None):
    """PEFT adapter directory `adapter` as llama.cpp's convert_lora_to_gguf.py writes it: general.type
    "adapter", adapter.type "lora", adapter.lora.alpha (the config's lora_alpha unless given), each
    A and B as blk.N.<tensor>.weight.lora_a / .lora_b, B's q/k rows permuted as the base's are (llama).
    `extra`: {tensor name: array} added as they are; `meta`: {key: int or str} metadata added. Returns `path`."""
    import gguf
    from safetensors.numpy import load_file
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(config["lora_alpha"] if alpha is None else alpha))
    for key, value in (meta or {}).items():
        w.add_uint64(key, value) if isinstance(value, int) else w.add_string(key, value)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for name, value in sorted(load_file(str(Path(adapter) / "adapter_model.safetensors")).items()):
        layer, module, ab = name.split(".layers.")[1].split(".")[0], name.split(".")[-3], name.split(".")[-2][-1]
        if ab == "B" and module in heads and arch == "llama":
            value = tiny.llama_cpp_permute(value, heads[module])
        w.add_tensor(f"blk.{layer}.{GGUF_TENSORS[module]}.weight.lora_{ab.lower()}", value.astype(dtype))
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    tiny.finish_gguf(w)
    return Path(path)


def reference(base):
    """transformers' float32 model of the base directory (eager attention, eval mode)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32, attn_implementation="eager").eval()


def write_adapter(directory, base, targets, r=4, alpha=8, seed=1, rslora=False, base_name=None, spread=0.5):
    """A PEFT LoRA adapter of `base` saved to `directory` (adapter_config.json with
    base_model_name_or_path = `base_name` or the base's directory name); returns its Path."""
    import torch
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(reference(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                       lora_dropout=0.0, use_rslora=rslora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * spread / np.sqrt(p.shape[1]))
    model.save_pretrained(str(directory))
    config_path = Path(directory) / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_name or Path(base).name
    config_path.write_text(json.dumps(config, indent=1))
    return Path(directory)


def peft_model(base, adapter):
    """transformers + peft: the base with the adapter, as the reference."""
    from peft import PeftModel
    return PeftModel.from_pretrained(reference(base), str(adapter)).eval()


def edit_config(adapter, **changes):
    """Rewrites keys of an adapter's adapter_config.json (None deletes one)."""
    path = Path(adapter) / "adapter_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def lora_app(models, base, activations):
    """A webtest app serving the models directory `models` with `base` the default model."""
    import webtest
    from turbospark_wsgi.config import Config
    from turbospark_wsgi.http.app import create_app
    config = Config(models_dir=str(models), model=base, device="cpu", load_default=False, keepalive=0.5,
                    activations=activations, speculative="off")
    return webtest.TestApp(create_app(config))


def complete(client, model, **kw):
    """POST /v1/completions of a fixed prompt, greedy, 12 tokens; the response, whatever its status."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, **kw}
    return client.post_json("/v1/completions", body, expect_errors=True)


def listed(client):
    """GET /v1/models as {id: entry}."""
    return {m["id"]: m for m in client.get("/v1/models").json["data"]}

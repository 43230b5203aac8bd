"""In-process decode throughput with LoRA adapters: 8 streams over 4 adapters against 8 streams of
the base model, on one engine (the same scheduler, batched together).

    python tools/bench_lora.py [--streams 8] [--adapters 4] [--rank 16] [--tokens 64] [--rounds 3]
        [--dim 512] [--layers 8] [--dir DIR] [--model GGUF]

The model is a small random Hugging Face llama written to `--dir` (default: a temporary directory):
`--dim` hidden, 4 * dim // 3 rounded to 64 MLP, `--layers` layers, 8 heads (4 KV heads), the 264-id
byte vocabulary of the test models; each adapter targets all seven projections at `--rank`. A round
runs the base case, then the adapter case (the order alternating between rounds): every stream
prefilled first, then timed from the first decode step to the last token. Printed: each case's
median aggregate decode tok/s over the rounds and the adapters' share of the base's.

--model GGUF runs a GGUF base instead (tools/make_bench_model.py writes one), whose base rows run
the fused int8 layers and whose adapter rows run step by step beside them (engine/lora.py
NOTE(lora-path)); a third case mixes both, half the streams on the base and half over the adapters.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.engine import SamplingParams, Token, load_engine  # noqa: E402

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dir", default="")
    p.add_argument("--model", default="", help="a GGUF llama base instead of the random HF one")
    return p.parse_args(argv)


def config_of(engine):
    """The Hugging Face config keys write_adapter reads, of a loaded engine's model."""
    c = engine.config
    return {"hidden_size": c.dim, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "vocab_size": c.vocab_size}


def write_model(directory, dim, layers, seed=0):
    """A random llama directory: config.json, model.safetensors, a byte-level tokenizer."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    rng = np.random.default_rng(seed)
    vocab = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(ByteLevel.alphabet())
    heads, kv, ffn = 8, 4, (4 * dim // 3 + 63) // 64 * 64
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(vocab),
           "hidden_size": dim, "intermediate_size": ffn, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 1024,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    hd = dim // heads

    def mat(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
    state = {"model.embed_tokens.weight": rng.standard_normal((len(vocab), dim)).astype(np.float32),
             "model.norm.weight": np.ones(dim, np.float32), "lm_head.weight": mat(len(vocab), dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": np.ones(dim, np.float32),
                      p + "post_attention_layernorm.weight": np.ones(dim, np.float32),
                      p + "self_attn.q_proj.weight": mat(heads * hd, dim), p + "self_attn.k_proj.weight": mat(kv * hd, dim),
                      p + "self_attn.v_proj.weight": mat(kv * hd, dim), p + "self_attn.o_proj.weight": mat(dim, heads * hd),
                      p + "mlp.gate_proj.weight": mat(ffn, dim), p + "mlp.up_proj.weight": mat(ffn, dim),
                      p + "mlp.down_proj.weight": mat(dim, ffn)})
    os.makedirs(directory, exist_ok=True)
    save_file(state, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(vocab[:3])
    tok.save(os.path.join(directory, "tokenizer.json"))
    return cfg


def write_adapter(directory, cfg, rank, seed):
    """A PEFT-format adapter of every projection (random A and B) at `rank`."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    dim, ffn, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (dim, q), "k_proj": (dim, kv), "v_proj": (dim, kv), "o_proj": (q, dim),
              "gate_proj": (dim, ffn), "up_proj": (dim, ffn), "down_proj": (ffn, dim)}
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{i}.{TARGETS[module]}.{module}"
            tensors[name + ".lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
            tensors[name + ".lora_B.weight"] = (0.1 * rng.standard_normal((fan_out, rank))).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "base_model_name_or_path": "bench-llama"}, f)


def decode_tok_s(engine, prompts, adapters, tokens):
    """Aggregate decode tok/s of one stream per prompt (adapters[i] or the base), batched together."""
    params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    gens = [engine.generate(p, params, adapter=a) for p, a in zip(prompts, adapters)]
    counts, start = [0] * len(gens), None
    live = set(range(len(gens)))
    while live:
        for i in sorted(live):
            event = next(gens[i], None)
            if event is None:
                live.discard(i)
            elif isinstance(event, Token):
                counts[i] += 1
                if start is None and all(counts):       # every stream prefilled: decode steps from here
                    start, first = time.perf_counter(), sum(counts)
    return (sum(counts) - first) / (time.perf_counter() - start)


def main(argv=None):
    args = parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="bench-lora-")
    if args.model:
        engine = load_engine(args.model, device="cpu", max_batch=args.streams, speculative="off")
        cfg = config_of(engine)
    else:
        cfg = write_model(os.path.join(root, "bench-llama"), args.dim, args.layers)
        engine = load_engine(os.path.join(root, "bench-llama"), device="cpu", max_batch=args.streams, speculative="off")
    adapters = []
    for j in range(args.adapters):
        write_adapter(os.path.join(root, f"lora-{j}"), cfg, args.rank, seed=10 + j)
        adapters.append(engine.load_adapter(os.path.join(root, f"lora-{j}"), f"lora-{j}", max_rank=args.rank))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg["vocab_size"], 32).tolist() for _ in range(args.streams)]
    cases = {"base": [None] * args.streams, "adapters": [adapters[i % len(adapters)] for i in range(args.streams)]}
    if args.model:
        cases["mixed"] = [None if i % 2 == 0 else adapters[i // 2 % len(adapters)] for i in range(args.streams)]
    results = {name: [] for name in cases}
    shape = f"dim {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, ffn {cfg['intermediate_size']}"
    print(f"model: {os.path.basename(args.model) if args.model else 'random HF llama'} {shape}; "
          f"kernels: {engine.kernels}; layers: {engine.model.variant.name}", flush=True)
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(cases)[::-1]
        for name in order:
            engine.scheduler.slots.clear()
            results[name].append(decode_tok_s(engine, prompts, cases[name], args.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{n} {results[n][-1]:.1f} tok/s" for n in cases), flush=True)
    base, lora = statistics.median(results["base"]), statistics.median(results["adapters"])
    print(f"{args.streams} streams of the base model: {base:.1f} tok/s (median of {args.rounds})")
    print(f"{args.streams} streams over {args.adapters} adapters (rank {args.rank}, all 7 projections): "
          f"{lora:.1f} tok/s ({lora / base:.2f}x the base)")
    if "mixed" in results:
        mixed = statistics.median(results["mixed"])
        print(f"{args.streams} streams, half on the base, half over the adapters: {mixed:.1f} tok/s "
              f"({mixed / base:.2f}x the base)")


if __name__ == "__main__":
    main()

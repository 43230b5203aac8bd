"""Writes a ~1B-parameter llama-shaped GGUF with random weights, for speed measurements at a size
the 135M default hides (decode there is bound by memory bandwidth, not by Python or dispatch).

    python tools/make_bench_model.py OUT.gguf [--dim 2048] [--layers 16] [--ffn 8192] [--heads 32]
        [--kv-heads 8] [--type Q4_0|Q8_0] [--tokenizer-from GGUF]

Matrices are Q4_0 (or Q8_0), quantized by gguf-py from normal values scaled like an initialised
model; norms are ones; the tied token embedding is Q8_0. The tokenizer (vocabulary, merges, chat
template) is copied from `--tokenizer-from` (default: the default model), so both this server and
llama-server load the file as they would a real one. The weights are random: the text means
nothing, so benchmarks run it with `ignore_eos` (the same tokens cost the same on either server).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from turbospark_wsgi.pull import default_model_path  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0"))
    p.add_argument("--tokenizer-from", default=str(default_model_path()))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def tokenizer_fields(path):
    """(key, value, GGUFValueType, sub-type) of every tokenizer.* field of the GGUF at `path`."""
    from gguf import GGUFReader, GGUFValueType
    out = []
    for key, f in GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return out


def main(argv=None):
    import gguf
    from gguf import GGMLQuantizationType as GT
    args = parse_args(argv)
    fields = tokenizer_fields(args.tokenizer_from)
    vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    head_dim = args.dim // args.heads
    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name("random llama for benchmarks")
    w.add_block_count(args.layers)
    w.add_context_length(args.context)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type({"Q4_0": 2, "Q8_0": 7}[args.type])
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    rng = np.random.default_rng(args.seed)
    qtype = GT[args.type]

    def matrix(name, rows, cols, kind=qtype):
        x = (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02))
        w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)      # bytes [rows, row bytes]

    matrix("token_embd.weight", vocab, args.dim, GT.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(args.dim, np.float32))
    kv = args.kv_heads * head_dim
    for i in range(args.layers):
        print(f"layer {i + 1}/{args.layers}", file=sys.stderr, flush=True)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(args.dim, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(args.dim, np.float32))
        for name, rows, cols in (("attn_q", args.dim, args.dim), ("attn_k", kv, args.dim), ("attn_v", kv, args.dim),
                                 ("attn_output", args.dim, args.dim), ("ffn_gate", args.ffn, args.dim),
                                 ("ffn_up", args.ffn, args.dim), ("ffn_down", args.dim, args.ffn)):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(args.out)


if __name__ == "__main__":
    main()

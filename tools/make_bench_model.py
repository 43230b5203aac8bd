"""Writes a llama-shaped GGUF with random weights at the shapes of Llama 3.2 1B / 3B or Llama 3.1 8B,
for speed measurements at sizes the 135M default hides (decode there is bound by memory bandwidth,
not by Python or dispatch).

    python tools/make_bench_model.py OUT.gguf [--preset 1b|3b|8b] [--type Q4_0|Q8_0|Q4_K_M]
        [--dim N] [--layers N] [--ffn N] [--heads N] [--kv-heads N] [--[no-]tied-embeddings]
        [--tokenizer-from GGUF] [--llama-quantize PATH]

Presets (from the models' config.json; an explicit flag overrides its preset's value, and without
--preset the shape is 1b's):
    1b  Llama 3.2 1B: dim 2048, 16 layers, FFN 8192, 32 heads, 8 KV heads, tied embeddings
    3b  Llama 3.2 3B: dim 3072, 28 layers, FFN 8192, 24 heads, 8 KV heads, tied embeddings
    8b  Llama 3.1 8B: dim 4096, 32 layers, FFN 14336, 32 heads, 8 KV heads, a separate output head

The vocabulary is the tokenizer's, not Llama 3's 128,256 tokens: the tokenizer (vocabulary, merges,
chat template) is copied from `--tokenizer-from` (default: the default model, SmolLM2's 49,152), so
both this server and llama-server load the file as they would a real one. The embedding and a
separate head are smaller than Llama's by that much (at 8b 0.2 B parameters each, not 0.5 B).

Q4_0 and Q8_0: matrices are quantized by gguf-py from normal values scaled like an initialised
model; norms are ones; the token embedding (the head where tied) and a separate head are Q8_0. The
tensor table is written first, then each tensor is generated, quantized in row chunks and written
before the next, so memory holds about one quantized tensor (an 8b-shaped file: 0.36 GB peak RSS).
Q4_K_M: the Q8_0 file is written beside OUT, llama.cpp's `llama-quantize --allow-requantize` makes
OUT from it with its own mix of types, and the Q8_0 file is removed. llama-quantize is
--llama-quantize, else the one tools/build_llama_server.sh builds, else the first on PATH.

The weights are random: the text means nothing, so benchmarks run it with `--ignore-eos` (the same
tokens cost the same on either server).
"""
import argparse
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_http_servers import llama_binary  # noqa: E402
from turbospark_wsgi.pull import default_model_path  # noqa: E402


@dataclass(frozen=True)
class Shape:
    dim: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    tied_embeddings: bool


PRESETS = {
    "1b": Shape(dim=2048, layers=16, ffn=8192, heads=32, kv_heads=8, tied_embeddings=True),
    "3b": Shape(dim=3072, layers=28, ffn=8192, heads=24, kv_heads=8, tied_embeddings=True),
    "8b": Shape(dim=4096, layers=32, ffn=14336, heads=32, kv_heads=8, tied_embeddings=False),
}
TYPES = ("Q4_0", "Q8_0", "Q4_K_M")
CHUNK = 1 << 22        # weights generated and quantized at a time (16 MiB of float32)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--preset", choices=PRESETS, help="the shape of a Llama model (default: 1b's)")
    p.add_argument("--dim", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--tied-embeddings", action=argparse.BooleanOptionalAction,
                   help="the token embedding is the output head (no output.weight)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--type", default="Q4_0", choices=TYPES)
    p.add_argument("--tokenizer-from", default=str(default_model_path()))
    p.add_argument("--llama-quantize", help="llama.cpp's llama-quantize, for --type Q4_K_M")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preset = PRESETS[args.preset or "1b"]
    for name, value in vars(preset).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dim % args.heads or args.heads % args.kv_heads or args.dim % 32 or args.ffn % 32:
        p.error("dim must divide by heads and by 32, heads by kv-heads, ffn by 32")
    return args


def tokenizer_fields(path):
    """(key, value, GGUFValueType, sub-type) of every tokenizer.* field of the GGUF at `path`."""
    from gguf import GGUFReader, GGUFValueType
    out = []
    for key, f in GGUFReader(path).fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return out


def tensor_plan(args, vocab, matrix_type):
    """(name, shape in numpy order, ggml type name) of every tensor, in the file's order."""
    dim, kv = args.dim, args.kv_heads * (args.dim // args.heads)
    plan = [("token_embd.weight", (vocab, dim), "Q8_0"), ("output_norm.weight", (dim,), "F32")]
    if not args.tied_embeddings:
        plan.append(("output.weight", (vocab, dim), "Q8_0"))
    for i in range(args.layers):
        plan += [(f"blk.{i}.attn_norm.weight", (dim,), "F32"), (f"blk.{i}.ffn_norm.weight", (dim,), "F32")]
        plan += [(f"blk.{i}.{name}.weight", shape, matrix_type) for name, shape in (
            ("attn_q", (dim, dim)), ("attn_k", (kv, dim)), ("attn_v", (kv, dim)), ("attn_output", (dim, dim)),
            ("ffn_gate", (args.ffn, dim)), ("ffn_up", (args.ffn, dim)), ("ffn_down", (dim, args.ffn)))]
    return plan


def tensor_bytes(shape, type_name):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return math.prod(shape) // block * size


def make_tensor(shape, type_name, rng):
    """A norm of ones, or a random matrix as stored: uint8 [rows, row bytes], quantized a chunk of rows at a time."""
    from gguf import GGMLQuantizationType, quants
    if type_name == "F32":
        return np.ones(shape, np.float32)
    rows, cols = shape
    kind = GGMLQuantizationType[type_name]
    out = np.empty((rows, tensor_bytes((1, cols), type_name)), np.uint8)
    step = max(1, CHUNK // cols)
    for r in range(0, rows, step):
        x = rng.standard_normal((min(step, rows - r), cols), dtype=np.float32) * np.float32(0.02)
        out[r:r + len(x)] = quants.quantize(x, kind)
    return out


def write_gguf(path, args, fields, plan, matrix_type):
    """Writes the metadata and the tensor table, then each tensor of `plan` made just before it is written."""
    import gguf
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("random llama for benchmarks")
    w.add_block_count(args.layers)
    w.add_context_length(args.context)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(args.dim // args.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(plan[0][1][0])                                   # token_embd [vocab, dim]
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{matrix_type}"])
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, shape, type_name in plan:
        w.add_tensor_info(name, shape, np.float32, tensor_bytes(shape, type_name),
                          raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    for name, shape, type_name in plan:
        if name.endswith("attn_norm.weight"):
            print(f"layer {int(name.split('.')[1]) + 1}/{args.layers}", file=sys.stderr, flush=True)
        w.write_tensor_data(make_tensor(shape, type_name, rng))
    w.close()


def requantize(quantize, source, out, type_name):
    """llama-quantize's `type_name` file at `out` from the GGUF `source`."""
    done = subprocess.run([quantize, "--allow-requantize", source, out, type_name], stdout=sys.stderr)
    if done.returncode:
        sys.exit(f"{quantize} exited with {done.returncode}")


def main(argv=None):
    args = parse_args(argv)
    quantize = None
    if args.type == "Q4_K_M":
        quantize = args.llama_quantize or llama_binary("llama-quantize")
        if not quantize:
            sys.exit("--type Q4_K_M needs llama.cpp's llama-quantize: tools/build_llama_server.sh builds it "
                     "(or name one with --llama-quantize, or TURBOSPARK_LLAMA_PREFIX)")
    fields = tokenizer_fields(args.tokenizer_from)
    vocab = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    matrix_type = "Q8_0" if quantize else args.type
    plan = tensor_plan(args, vocab, matrix_type)
    if not quantize:
        write_gguf(args.out, args, fields, plan, matrix_type)
    else:
        source = f"{args.out}.q8_0.tmp"
        try:
            write_gguf(source, args, fields, plan, matrix_type)
            requantize(quantize, source, args.out, args.type)
        finally:
            if os.path.exists(source):
                os.remove(source)
    print(args.out)


if __name__ == "__main__":
    main()

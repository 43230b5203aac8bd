"""Weights: the one table from outside tensor names to ours, the rotary row layout, fused and
pre-transposed float32 matrices, and the upload to the compute device."""
from dataclasses import dataclass

import numpy as np

# ours -> (GGUF name, Hugging Face name); "{i}" is the layer index. None: the format has no such tensor.
LAYER_TENSORS = {
    "attn_norm": ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    "wq": ("blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    "wk": ("blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    "wv": ("blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    "wo": ("blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    "ffn_norm": ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    "w_gate": ("blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    "w_up": ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    "w_down": ("blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
}
MODEL_TENSORS = {
    "tok_embd": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "head": ("output.weight", "lm_head.weight"),        # absent when the head is tied to tok_embd
    "rope_freqs": ("rope_freqs.weight", None),          # optional: llama3-style rotary frequency divisors
}
FORMATS = {"gguf": 0, "hf": 1}


@dataclass(slots=True)
class LayerWeights:
    attn_norm: object   # [dim]
    wqkv: object        # [dim, (n_head + 2*n_kv_head) * head_dim]  q (pre-scaled by 1/sqrt(head_dim)) | k | v
    wo: object          # [n_head * head_dim, dim]
    ffn_norm: object    # [dim]
    w_gate_up: object   # [dim, 2 * ffn_dim]  gate | up
    w_down: object      # [ffn_dim, dim]


@dataclass(slots=True)
class Weights:
    layers: list        # [LayerWeights] * n_layer
    norm: object        # [dim]
    head: object        # [dim, vocab]
    tok_embd: object    # [vocab, dim]; None when tied (rows are then gathered from head's columns)
    rope_freqs: object  # host float32 [rope_dim / 2] or None


def tensor_name(ours, fmt, layer=None):
    """The outside name of our tensor `ours` in format `fmt` ("gguf" | "hf")."""
    table = LAYER_TENSORS if layer is not None else MODEL_TENSORS
    name = table[ours][FORMATS[fmt]]
    return None if name is None else name.format(i=layer)


def fetch(source, ours, fmt, layer=None):
    """Our tensor from `source` (anything with `.names` and `.tensor(name)`) as float32."""
    name = tensor_name(ours, fmt, layer)
    if name is None or name not in source.names:
        where = f" (layer {layer})" if layer is not None else ""
        raise ValueError(f"model file lacks tensor {name or ours!r}{where}")
    return source.tensor(name)


def unpermute_rotary_rows(w, n_heads):
    """GGUF llama Q/K rows -> Hugging Face rows. llama.cpp's converter stores each head's HF row
    j*half + i at row 2i + j (rotary pairs adjacent); this undoes it, so that rotary pairs are the
    two halves of each head (rotate_half). `n_heads` is the head count of this matrix (K: n_kv_head)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_weights(cfg, source, fmt, xp):
    """Every tensor the model needs, mapped, fused, transposed and uploaded with `xp.asarray`."""
    if fmt == "gguf" and cfg.rope_dim != cfg.head_dim:
        raise ValueError(f"partial rotary (rope_dim {cfg.rope_dim} < head_dim {cfg.head_dim}) in a "
                         "llama GGUF is not supported")
    layers = [_layer(cfg, source, fmt, i, xp) for i in range(cfg.n_layer)]
    embd = fetch(source, "tok_embd", fmt)                                   # [vocab, dim]
    if embd.shape != (cfg.vocab_size, cfg.dim):
        raise ValueError(f"token embedding has shape {embd.shape}, config says {(cfg.vocab_size, cfg.dim)}")
    head = embd if cfg.tied_embeddings else fetch(source, "head", fmt)      # [vocab, dim]
    rope_name = tensor_name("rope_freqs", fmt)
    rope_freqs = source.tensor(rope_name) if rope_name in source.names else None
    return Weights(
        layers=layers, norm=xp.asarray(fetch(source, "norm", fmt)), head=_upload_t(head, xp),
        tok_embd=None if cfg.tied_embeddings else xp.asarray(embd), rope_freqs=rope_freqs)


def _layer(cfg, source, fmt, i, xp):
    def get(ours):
        return fetch(source, ours, fmt, i)

    wq, wk = get("wq"), get("wk")                                           # [H*D, dim], [G*D, dim]
    if fmt == "gguf" and cfg.arch == "llama":
        wq, wk = unpermute_rotary_rows(wq, cfg.n_head), unpermute_rotary_rows(wk, cfg.n_kv_head)
    # NOTE(scale): the attention scale 1/sqrt(head_dim) is folded into Wq (rotary is linear, so
    # scaling before or after it is the same); for power-of-two head sizes this is exact.
    wq = wq * np.float32(1.0 / np.sqrt(cfg.head_dim))
    return LayerWeights(
        attn_norm=xp.asarray(get("attn_norm")),
        wqkv=_upload_t(np.concatenate([wq, wk, get("wv")]), xp),
        wo=_upload_t(get("wo"), xp),
        ffn_norm=xp.asarray(get("ffn_norm")),
        w_gate_up=_upload_t(np.concatenate([get("w_gate"), get("w_up")]), xp),
        w_down=_upload_t(get("w_down"), xp))


def _upload_t(w, xp):
    # PERF(layout): x @ Wt with a contiguous (in, out) matrix; measured faster for decode GEMVs.
    return xp.asarray(np.ascontiguousarray(w.T, dtype=np.float32))

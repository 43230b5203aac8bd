"""Weights: the one table from outside tensor names to ours, the rotary row layout, fused and
pre-transposed float32 matrices, and the upload to the compute device. On the CPU, GGUF matrices
of the types engine/quant.py supports can stay in their block form (`load_quantized_weights`)."""
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
    # only where the config asks for them (ModelConfig.attn_bias, .qk_norm)
    "bq": ("blk.{i}.attn_q.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    "bk": ("blk.{i}.attn_k.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    "bv": ("blk.{i}.attn_v.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    "q_norm": ("blk.{i}.attn_q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    "k_norm": ("blk.{i}.attn_k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    # fused in the file (ModelConfig.fused_qkv, .fused_gate_up): rows q | k | v and gate | up
    "wqkv": ("blk.{i}.attn_qkv.weight", "model.layers.{i}.self_attn.qkv_proj.weight"),
    "w_gate_up": ("blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.gate_up_proj.weight"),
    # ModelConfig.post_norms: on the attention output and the MLP output, before each residual add
    "post_attn_norm": ("blk.{i}.post_attention_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    "post_ffn_norm": ("blk.{i}.post_ffw_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
}
# where an architecture names a tensor otherwise: Gemma's post_attention_layernorm is a post norm
ARCH_TENSORS = {
    "gemma3": {"ffn_norm": ("blk.{i}.ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight")},
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
    post_attn_norm: object = None   # [dim] or None (ModelConfig.post_norms)
    post_ffn_norm: object = None    # [dim] or None
    bqkv: object = None     # [(n_head + 2*n_kv_head) * head_dim]  q (pre-scaled) | k | v biases, or None
    q_norm: object = None   # [head_dim] per-head RMSNorm of q, pre-scaled by 1/sqrt(head_dim), or None
    k_norm: object = None   # [head_dim] per-head RMSNorm of k, or None


@dataclass(slots=True)
class Weights:
    layers: list        # [LayerWeights] * n_layer
    norm: object        # [dim]
    head: object        # [dim, vocab]
    tok_embd: object    # [vocab, dim]; None when tied (rows are then gathered from head's columns)
    rope_freqs: object  # host float32 [rope_dim / 2] or None


def tensor_name(ours, fmt, layer=None, arch="llama"):
    """The outside name of our tensor `ours` in format `fmt` ("gguf" | "hf") for architecture `arch`."""
    table = LAYER_TENSORS if layer is not None else MODEL_TENSORS
    name = ARCH_TENSORS.get(arch, {}).get(ours, table[ours])[FORMATS[fmt]]
    return None if name is None else name.format(i=layer)


def fetch(source, ours, fmt, layer=None, arch="llama"):
    """Our tensor from `source` (anything with `.names` and `.tensor(name)`) as float32."""
    name = tensor_name(ours, fmt, layer, arch)
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


def layer_shapes(cfg):
    """ours -> shape of every matrix and norm a layer's file tensors must have (the optional
    biases and q/k norms are checked when read)."""
    q, kv, dim, ffn = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.dim, cfg.ffn_dim
    qkv = {"wqkv": (q + 2 * kv, dim)} if cfg.fused_qkv else {"wq": (q, dim), "wk": (kv, dim), "wv": (kv, dim)}
    gate_up = {"w_gate_up": (2 * ffn, dim)} if cfg.fused_gate_up else {"w_gate": (ffn, dim), "w_up": (ffn, dim)}
    # in file order, so that the first bad tensor named is the first a reader meets
    return {"attn_norm": (dim,), **qkv, "wo": (dim, q), "ffn_norm": (dim,), **gate_up, "w_down": (dim, ffn)}


def split_rows(w, sizes):
    """A matrix (float32 array or quant.Blocks) cut into consecutive row ranges of `sizes`."""
    ends = np.cumsum([0, *sizes])
    if hasattr(w, "map_rows"):
        return [w.map_rows(lambda a, a0=a0, a1=a1: a[a0:a1]) for a0, a1 in zip(ends[:-1], ends[1:])]
    return [w[a0:a1] for a0, a1 in zip(ends[:-1], ends[1:])]


def qkv_parts(cfg, get):
    """(wq, wk, wv) as the file holds them, `get(ours)` reading one tensor (None where unsupported)."""
    if not cfg.fused_qkv:
        return get("wq"), get("wk"), get("wv")
    w = get("wqkv")
    if w is None:
        return None, None, None
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    return tuple(split_rows(w, [q, kv, kv]))


def gate_up_parts(cfg, get):
    """[gate, up] or the one fused [gate|up] matrix: either way their rows stacked give gate | up."""
    return [get("w_gate_up")] if cfg.fused_gate_up else [get("w_gate"), get("w_up")]


def gguf_rows_permuted(cfg):
    """Whether llama.cpp's converter interleaved this GGUF's Q/K rows (it does so for the llama
    architecture only; Qwen's and the other families' files keep Hugging Face's rows)."""
    return cfg.arch == "llama"


def query_scale(cfg):
    """The attention scale 1/sqrt(head_dim) (Gemma: 1/sqrt(query_pre_attn_scalar)) as float32."""
    return np.float32(1.0 / np.sqrt(cfg.query_scalar or cfg.head_dim))


def norm_weight(cfg, w, fmt):
    """An RMSNorm weight as the forward pass multiplies by it. Gemma's Hugging Face weights hold
    w - 1 (its norm computes x * (1 + w)); llama.cpp's converter already added the 1 to the GGUF's."""
    w = np.asarray(w, dtype=np.float32)
    return w + np.float32(1.0) if cfg.norm_plus_one and fmt == "hf" else w


def _vector(source, ours, fmt, layer, size, arch="llama"):
    v = fetch(source, ours, fmt, layer, arch)
    if tuple(v.shape) != (size,):
        raise ValueError(f"tensor {tensor_name(ours, fmt, layer, arch)!r} has shape {tuple(v.shape)}, "
                         f"the model's config implies {(size,)}")
    return np.asarray(v, dtype=np.float32)


def layer_norms(cfg, source, fmt, i, xp):
    """{attn_norm, ffn_norm, post_attn_norm, post_ffn_norm} of layer i (post norms None unless the
    architecture has them), uploaded with `xp.asarray`."""
    names = ("attn_norm", "ffn_norm") + (("post_attn_norm", "post_ffn_norm") if cfg.post_norms else ())
    return {n: xp.asarray(norm_weight(cfg, _vector(source, n, fmt, i, cfg.dim, cfg.arch), fmt)) for n in names}


def attention_extras(cfg, source, fmt, i, xp):
    """(bqkv, q_norm, k_norm) of layer i, host float32 uploaded with `xp.asarray`, None where the
    architecture has none. The attention scale lands on the q bias (q is scaled with Wq) or, with a
    q norm, on the norm weight instead (the norm would undo a scale folded into Wq)."""
    H, G, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    bqkv = q_norm = k_norm = None
    if cfg.qk_norm:
        q_norm = xp.asarray(norm_weight(cfg, _vector(source, "q_norm", fmt, i, D), fmt) * query_scale(cfg))
        k_norm = xp.asarray(norm_weight(cfg, _vector(source, "k_norm", fmt, i, D), fmt))
    if cfg.attn_bias:
        bq = _vector(source, "bq", fmt, i, H * D)
        if not cfg.qk_norm:
            bq = bq * query_scale(cfg)
        bqkv = xp.asarray(np.concatenate([bq, _vector(source, "bk", fmt, i, G * D),
                                          _vector(source, "bv", fmt, i, G * D)]))
    return bqkv, q_norm, k_norm


def load_weights(cfg, source, fmt, xp):
    """Every tensor the model needs, mapped, fused, transposed and uploaded with `xp.asarray`."""
    if fmt == "gguf" and gguf_rows_permuted(cfg) and cfg.rope_dim != cfg.head_dim:
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
        layers=layers, norm=xp.asarray(norm_weight(cfg, fetch(source, "norm", fmt), fmt)), head=_upload_t(head, xp),
        tok_embd=None if cfg.tied_embeddings else xp.asarray(embd), rope_freqs=rope_freqs)


def _layer(cfg, source, fmt, i, xp):
    def get(ours):
        return fetch(source, ours, fmt, i, cfg.arch)

    bqkv, q_norm, k_norm = attention_extras(cfg, source, fmt, i, xp)
    return LayerWeights(
        **layer_norms(cfg, source, fmt, i, xp),
        wqkv=_upload_t(_wqkv(cfg, get, fmt), xp),
        wo=_upload_t(get("wo"), xp),
        w_gate_up=_upload_t(np.concatenate(gate_up_parts(cfg, get)), xp),
        w_down=_upload_t(get("w_down"), xp),
        bqkv=bqkv, q_norm=q_norm, k_norm=k_norm)


def _wqkv(cfg, get, fmt):
    """The float32 q | k | v rows [(H + 2G) * D, dim], rotary rows as Hugging Face has them and q
    scaled; `get(ours)` reads one tensor."""
    wq, wk, wv = qkv_parts(cfg, get)                                        # [H*D, dim], [G*D, dim] x2
    if fmt == "gguf" and gguf_rows_permuted(cfg):
        wq, wk = unpermute_rotary_rows(wq, cfg.n_head), unpermute_rotary_rows(wk, cfg.n_kv_head)
    # NOTE(scale): the attention scale 1/sqrt(head_dim) is folded into Wq (rotary is linear, so
    # scaling before or after it is the same); for power-of-two head sizes this is exact. A q norm
    # takes it instead (see attention_extras).
    if not cfg.qk_norm:
        wq = wq * query_scale(cfg)
    return np.concatenate([wq, wk, wv])


def _upload_t(w, xp):
    # PERF(layout): x @ Wt with a contiguous (in, out) matrix; measured faster for decode GEMVs.
    return xp.asarray(np.ascontiguousarray(w.T, dtype=np.float32))


def load_quantized_weights(cfg, source, plan=None, store=None):
    """GGUF weights with every supported matrix kept in its quantized block form (numpy backend):
    `x @ QLinear` reads the blocks directly, with the kernels of KernelPlan `plan`. A fused matrix
    with any unsupported part, and every vector, is float32 as in `load_weights`. `store` (a
    packed.Store) builds or maps each block matrix (`store.matrix(key, make)`); none: built here."""
    from . import packed, quant
    from .kernels import cpu as kernels_cpu
    store = store or packed.Private("")

    def kept(names, layer=None):
        """Whether every tensor in `names` can stay in block form (looked up, not read)."""
        for ours in names:
            name = tensor_name(ours, "gguf", layer)
            if name not in source.names:
                fetch(source, ours, "gguf", layer)      # raises, naming the missing tensor
            info = source.tensors[name]
            if not quant.supported(info.ggml_type, info.shape):
                return False
        return True

    def blocks(ours, layer=None):
        name = tensor_name(ours, "gguf", layer)
        info = source.tensors[name]
        decoded = quant.decode(source.raw(name), info.ggml_type, info.shape)    # copies the blocks out
        if hasattr(source, "release"):
            source.release(name)
        return decoded

    def linear(names, layer, fp32):
        # NOTE(read-once): support is decided from the tensor table, so a matrix with any part
        # without a block kernel is read once, as float32, and its other parts are not decoded first
        if not kept(names, layer):
            return fp32()
        key = f"{layer}.{'+'.join(names)}"
        return kernels_cpu.QLinear(store.matrix(key, lambda: quant.pack([blocks(ours, layer) for ours in names])), plan=plan)

    def qkv_blocks(i):
        wq, wk, wv = qkv_parts(cfg, lambda ours: blocks(ours, i))
        if gguf_rows_permuted(cfg):
            wq = wq.map_rows(lambda a: unpermute_rotary_rows(a, cfg.n_head))
            wk = wk.map_rows(lambda a: unpermute_rotary_rows(a, cfg.n_kv_head))
        if not cfg.qk_norm:
            wq = wq.scaled(query_scale(cfg))
        return quant.pack([wq, wk, wv])

    def qkv(i):
        return kernels_cpu.QLinear(store.matrix(f"{i}.qkv", lambda: qkv_blocks(i)), plan=plan)

    def layer(i):
        def get(ours):
            return fetch(source, ours, "gguf", i, cfg.arch)

        qkv_names = ("wqkv",) if cfg.fused_qkv else ("wq", "wk", "wv")
        gate_up_names = ("w_gate_up",) if cfg.fused_gate_up else ("w_gate", "w_up")
        bqkv, q_norm, k_norm = attention_extras(cfg, source, "gguf", i, np)
        return LayerWeights(
            **layer_norms(cfg, source, "gguf", i, np),
            wqkv=qkv(i) if kept(qkv_names, i) else _upload_t(_wqkv(cfg, get, "gguf"), np),
            wo=linear(["wo"], i, lambda: _upload_t(get("wo"), np)),
            w_gate_up=linear(gate_up_names, i, lambda: _upload_t(np.concatenate(gate_up_parts(cfg, get)), np)),
            w_down=linear(["w_down"], i, lambda: _upload_t(get("w_down"), np)),
            bqkv=bqkv, q_norm=q_norm, k_norm=k_norm)

    head, tok_embd = _quantized_head(cfg, source, kept, blocks, kernels_cpu, quant, plan, store)
    rope_name = tensor_name("rope_freqs", "gguf")
    return Weights(
        layers=[layer(i) for i in range(cfg.n_layer)], norm=fetch(source, "norm", "gguf"),
        head=head, tok_embd=tok_embd,
        rope_freqs=source.tensor(rope_name) if rope_name in source.names else None)


def _quantized_head(cfg, source, kept, blocks, kernels_cpu, quant, plan, store):
    """(head, tok_embd): block form where supported; float32 (tok_embd None when tied) otherwise."""
    embd_ours = "tok_embd" if cfg.tied_embeddings else "head"
    head_q = store.matrix(embd_ours, lambda: quant.pack(blocks(embd_ours))) if kept([embd_ours]) else None
    head = kernels_cpu.QLinear(head_q, plan=plan) if head_q is not None else _upload_t(fetch(source, embd_ours, "gguf"), np)
    if cfg.tied_embeddings:
        return head, None if head_q is None else kernels_cpu.QEmbedding(head_q)
    if kept(["tok_embd"]):
        return head, kernels_cpu.QEmbedding(store.matrix("tok_embd", lambda: quant.pack(blocks("tok_embd"))))
    return head, fetch(source, "tok_embd", "gguf")

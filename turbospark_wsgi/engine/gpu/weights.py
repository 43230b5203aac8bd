"""A GGUF model's weights on the device: every Q4_0, Q4_1, Q8_0, Q4_K and Q6_K matrix kept as the
file's own blocks (launch.KERNEL_TYPES), anything else dequantized to float32, vectors float32."""
from dataclasses import dataclass

import numpy as np

from ..weights import (LayerWeights, Weights, attention_extras, fetch, gate_up_parts, gguf_rows_permuted,
                       layer_norms, norm_weight, qkv_parts, query_scale, tensor_name, unpermute_rotary_rows)
from .launch import supported


@dataclass(slots=True)
class Part:
    """Consecutive output rows of a matrix: GGUF blocks of `qtype` (uint8 [n, row_bytes]) or, with
    qtype 0, float32 rows [n, k]; the product is multiplied by `scale`."""

    qtype: int
    data: object
    n: int
    k: int
    scale: float = 1.0


class DeviceLinear:
    """A weight that `x @ lin` multiplies like the pre-transposed float32 (k, n) matrix it stands
    for: x [..., k] -> [..., n], its parts' rows in order."""

    __array_ufunc__ = None   # NOTE(dispatch): numpy's and CuPy's __matmul__ defer to __rmatmul__

    def __init__(self, parts, kernels):
        self.parts, self.kernels = parts, kernels
        self.k, self.n = parts[0].k, sum(p.n for p in parts)
        self.shape = (self.k, self.n)
        self.nbytes = sum(p.data.nbytes for p in parts)

    def __rmatmul__(self, x):
        xp = self.kernels.xp
        lead = x.shape[:-1]
        x = xp.ascontiguousarray(x.reshape(-1, self.k), dtype=np.float32)
        out = xp.empty((x.shape[0], self.n), dtype=np.float32)
        col = 0
        for p in self.parts:
            if p.qtype:
                self.kernels.matmul(x, p.data, p.qtype, p.k, out, col, p.scale)
            else:
                out[:, col:col + p.n] = x @ p.data.T
                if p.scale != 1.0:
                    out[:, col:col + p.n] *= np.float32(p.scale)
            col += p.n
        return out.reshape(*lead, self.n)


class DeviceEmbedding:
    """Row lookup `emb[ids]` -> float32 [len(ids), k] from a DeviceLinear's [vocab, k] rows."""

    def __init__(self, linear):
        self.linear, self.shape, self.nbytes = linear, (linear.n, linear.k), linear.nbytes

    def __getitem__(self, ids):
        kernels, xp = self.linear.kernels, self.linear.kernels.xp
        ids = xp.asarray(ids).reshape(-1)
        out = xp.empty((ids.shape[0], self.linear.k), dtype=np.float32)
        start = 0
        for p in self.linear.parts:
            sel = (ids >= start) & (ids < start + p.n)
            if bool(sel.any()):
                local = (ids[sel] - start).astype(np.int32)
                out[sel] = kernels.dequantize(p.data, p.qtype, p.k, rows=local, scale=p.scale) if p.qtype \
                    else p.data[local] * np.float32(p.scale)
            start += p.n
        return out


def load_device_weights(cfg, source, kernels):
    """Weights of a GGUF `source` (engine.gguf.GGUFFile) uploaded for `kernels` (launch.Kernels):
    the layout load_weights gives the float path (Q/K rows as Hugging Face has them, q scaled,
    gate | up), with the matrices as DeviceLinear."""
    xp = kernels.xp

    def part(ours, layer, rows=None, scale=1.0):
        """A Part of one file tensor; `rows(a)` reorders its rows (Q/K un-permuting)."""
        name = tensor_name(ours, "gguf", layer, cfg.arch)
        if name not in source.names:
            fetch(source, ours, "gguf", layer, cfg.arch)      # raises, naming the missing tensor
        info = source.tensors[name]
        n, k = info.shape
        rows = rows or (lambda a: a)
        if supported(info.ggml_type, info.shape):
            return Part(info.ggml_type, xp.asarray(np.ascontiguousarray(rows(np.asarray(source.raw(name))))), n, k,
                        float(scale))
        return Part(0, xp.asarray(np.ascontiguousarray(rows(source.tensor(name)), dtype=np.float32)), n, k, float(scale))

    def split(parts, sizes):
        """Row ranges of one fused file tensor (a block part is cut between whole rows)."""
        (p,), out, start = parts, [], 0
        for size in sizes:
            out.append(Part(p.qtype, p.data[start:start + size], size, p.k, p.scale))
            start += size
        return out

    def layer(i):
        H, G, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        scale = 1.0 if cfg.qk_norm else query_scale(cfg)
        permuted = gguf_rows_permuted(cfg)
        if cfg.fused_qkv:
            if permuted:
                raise ValueError("a fused q|k|v tensor in a llama GGUF is not supported on the device")
            wq, wk, wv = split([part("wqkv", i)], [H * D, G * D, G * D])
            wq.scale = float(scale)
        else:
            wq, wk, wv = qkv_parts(cfg, lambda ours: part(
                ours, i, rows=(lambda a, h=(H if ours == "wq" else G): unpermute_rotary_rows(a, h))
                if permuted and ours != "wv" else None, scale=scale if ours == "wq" else 1.0))
        gate_up = gate_up_parts(cfg, lambda ours: part(ours, i))
        bqkv, q_norm, k_norm = attention_extras(cfg, source, "gguf", i, xp)
        return LayerWeights(
            **layer_norms(cfg, source, "gguf", i, xp),
            wqkv=DeviceLinear([wq, wk, wv], kernels), wo=DeviceLinear([part("wo", i)], kernels),
            w_gate_up=DeviceLinear(gate_up, kernels), w_down=DeviceLinear([part("w_down", i)], kernels),
            bqkv=bqkv, q_norm=q_norm, k_norm=k_norm)

    head = DeviceLinear([part("tok_embd" if cfg.tied_embeddings else "head", None)], kernels)
    tok_embd = DeviceEmbedding(head if cfg.tied_embeddings else DeviceLinear([part("tok_embd", None)], kernels))
    rope_name = tensor_name("rope_freqs", "gguf")
    return Weights(
        layers=[layer(i) for i in range(cfg.n_layer)],
        norm=xp.asarray(norm_weight(cfg, fetch(source, "norm", "gguf"), "gguf")), head=head, tok_embd=tok_embd,
        rope_freqs=source.tensor(rope_name) if rope_name in source.names else None)


def weight_bytes(weights):
    """Bytes of every matrix and vector a forward pass reads once per step (the embedding excluded
    unless it is the tied head)."""
    total = weights.head.nbytes + weights.norm.nbytes
    for lw in weights.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            total += getattr(lw, name).nbytes
        total += sum(getattr(lw, n).nbytes for n in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm",
                                                    "bqkv", "q_norm", "k_norm") if getattr(lw, n) is not None)
    return total

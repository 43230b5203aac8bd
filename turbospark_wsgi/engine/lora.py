"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) on a loaded
llama or qwen2 model, a Hugging Face directory or a GGUF file (whose q/k rows the loader puts in
Hugging Face's order: weights.py unpermute_rotary_rows): each target's A and B mapped onto our
fused products (q|k|v, gate|up), and the low-rank terms y += scale * (x A^T) B^T added to the rows that run an adapter.

    adapter = load_adapter("models/my-lora", "my-lora", engine.config, engine.model, max_rank=64)
    events = engine.generate(ids, params, adapter=adapter)

NOTE(lora-rows): a step's rows may run different adapters or none (RowLora). The base products
stay as they are; each adapter's terms are computed on its own rows only, one row per product
(`x[:, None, :] @ a_t`, a stack of single-row products), so a row's bits never depend on the rows
beside it, on how its prompt was cut, or on which adapters its neighbours run.
"""
import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np

from .gguf import GGUFFile, short_repr
from .safetensors_io import SafetensorsFile
from .weights import gguf_rows_permuted, query_scale, unpermute_rotary_rows

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (our product, which of its fused parts)
TARGETS = {"q_proj": ("wqkv", 0), "k_proj": ("wqkv", 1), "v_proj": ("wqkv", 2), "o_proj": ("wo", 0),
           "gate_proj": ("w_gate_up", 0), "up_proj": ("w_gate_up", 1), "down_proj": ("w_down", 0)}
ARCHES = ("llama", "qwen2")
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_keys = itertools.count(1)


class AdapterError(ValueError):
    """An adapter that cannot run on this model; the message names the problem (never a path)."""


@dataclass(slots=True)
class LoraTerm:
    """One target's low-rank term on one of our products."""

    a_t: object         # [in, r]    A transposed
    b_t: object         # [r, out]   B transposed, times the adapter's scale (and q's attention scale)
    cols: slice         # the columns of our (possibly fused) product it adds to


@dataclass(slots=True)
class LoraAdapter:
    """A loaded adapter: `layers[i]` maps our product names to the LoraTerms layer i adds to them.
    `key` is unique to this load (the prefix cache's salt: NOTE(lora-salt) in scheduler.py)."""

    name: str
    rank: int
    scale: float
    targets: tuple
    base: str                   # the adapter's base_model_name_or_path, as its config says
    layers: list = field(default_factory=list)
    key: str = ""


def read_adapter_config(directory):
    """adapter_config.json of an adapter directory as a dict (AdapterError when absent or not JSON)."""
    path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"the adapter directory has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{CONFIG_FILE} cannot be read: {type(e).__name__}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def load_adapter(directory, name, cfg, model, max_rank):
    """The LoraAdapter in PEFT directory `directory` (or llama.cpp's GGUF LoRA file: gguf_adapter)
    for ModelConfig `cfg` and Transformer `model`, ranks at most `max_rank`. AdapterError naming the
    problem: an unsupported config, a file that is not safetensors, unknown targets, shapes that do
    not fit the model, ranks that disagree."""
    if os.path.isfile(directory):
        return gguf_adapter(directory, name, cfg, model, max_rank)
    config = read_adapter_config(directory)
    rank, scale, targets = _check_config(config, max_rank)
    if cfg.arch not in ARCHES:
        raise AdapterError(f"LoRA adapters run on llama and qwen2 models, not {cfg.arch}")
    path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(path):
        other = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.exists(os.path.join(directory, f))]
        raise AdapterError(f"the adapter has no {WEIGHTS_FILE}" + (
            f" ({other[0]} is a pickle and is not read: save with safe_serialization=True)" if other else ""))
    try:
        source = SafetensorsFile(path)
    except (OSError, ValueError) as e:
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file ({e})") from None
    pairs = _pairs(source, cfg, targets)
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA matrices")
    return _adapter(name, rank, scale, str(config.get("base_model_name_or_path") or ""), source, pairs, cfg, model)


def _adapter(name, rank, scale, base, source, pairs, cfg, model):
    """The LoraAdapter of `pairs` ({(layer, PEFT module): {"A": tensor name, "B": ...}} in `source`)."""
    layers = [{} for _ in range(cfg.n_layer)]
    for (i, module), ab in sorted(pairs.items()):
        term = _term(cfg, model.xp, module, source, ab, rank, scale, i)
        layers[i].setdefault(TARGETS[module][0], []).append(term)
    return LoraAdapter(name, rank, scale, tuple(sorted({m for _, m in pairs})), base, layers, f"{name}#{next(_keys)}")


# llama.cpp's GGUF LoRA (convert_lora_to_gguf.py): blk.N.<tensor>.weight.lora_a [r, in] / .lora_b [out, r]
GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GGUF_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def gguf_adapter(path, name, cfg, model, max_rank):
    """The LoraAdapter in llama.cpp's GGUF LoRA file `path` (general.type "adapter", adapter.type
    "lora", adapter.lora.alpha; its A and B as llama.cpp's converter writes them).

    NOTE(lora-gguf): the converter permutes B's q/k rows as it does the base's (llama only:
    weights.py gguf_rows_permuted), and our loader puts the base's back in Hugging Face's order, so
    B's go back too. The scale is llama.cpp's: alpha / rank, or 1 where alpha is 0 or absent. One
    rank for every matrix (PEFT's rank_pattern, which llama.cpp reads, is refused)."""
    try:
        source = GGUFFile(path)
    except (OSError, ValueError) as e:
        raise AdapterError(f"the adapter file is not a GGUF file ({e})") from None
    meta = source.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError("the GGUF file is not a LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    if meta.get("general.architecture") != cfg.arch:
        raise AdapterError(f"the adapter is for {short_repr(meta.get('general.architecture'))} models; "
                           f"this model is {cfg.arch}")
    if cfg.arch not in ARCHES:
        raise AdapterError(f"LoRA adapters run on llama and qwen2 models, not {cfg.arch}")
    pairs = _pairs(source, cfg, None, _GGUF_TENSOR, GGUF_TARGETS)
    if not pairs:
        raise AdapterError("the GGUF file holds no LoRA matrices")
    shapes = [source.shape(ab["A"]) for ab in pairs.values()]
    if any(len(shape) != 2 for shape in shapes):
        raise AdapterError("the adapter's lora_a tensors must be matrices")
    ranks = sorted({shape[0] for shape in shapes})
    if len(ranks) != 1:
        raise AdapterError(f"the adapter's matrices have ranks {ranks}; one rank for every matrix is supported")
    rank, alpha = _rank_and_alpha(ranks[0], meta.get("adapter.lora.alpha", 0), max_rank, "adapter.lora.alpha")
    scale = alpha / rank if alpha else 1.0
    source = _GGUFRows(source, cfg) if gguf_rows_permuted(cfg) else source
    return _adapter(name, rank, scale, str(meta.get("general.base_model.0.name") or ""), source, pairs, cfg, model)


class _GGUFRows:
    """A GGUF LoRA's tensors with q's and k's B rows in Hugging Face's order (NOTE(lora-gguf))."""

    def __init__(self, source, cfg):
        self._source, self._heads = source, {"attn_q": cfg.n_head, "attn_k": cfg.n_kv_head}

    def shape(self, name):
        return self._source.shape(name)

    def tensor(self, name):
        w = self._source.tensor(name)
        m = _GGUF_TENSOR.match(name)
        heads = self._heads.get(m.group(2)) if m and m.group(3) == "b" else None
        return w if heads is None else unpermute_rotary_rows(w, heads)


def _check_config(config, max_rank):
    """(rank, scale, target module names or None for a pattern) from PEFT's adapter config."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not supported (LORA only)")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(key, off) not in (off, None):
            raise AdapterError(f"{key}={config[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise AdapterError(f"{key} is not supported")
    rank, alpha = _rank_and_alpha(config.get("r"), config.get("lora_alpha", config.get("r")), max_rank, "lora_alpha")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(str(t) for t in targets if t not in TARGETS)
        if unknown:
            raise AdapterError(f"unknown target module {unknown[0]!r}; supported: {', '.join(TARGETS)}")
        targets = set(targets)
    elif not isinstance(targets, str):         # a string is PEFT's pattern: the tensors say what it chose
        raise AdapterError("target_modules must be a list of module names or a pattern")
    else:
        targets = None
    return rank, float(scale), targets


def _rank_and_alpha(rank, alpha, max_rank, alpha_key):
    """(rank, alpha) where the rank is a positive integer within `max_rank` and alpha (the file's
    `alpha_key`) a finite number; else AdapterError naming which is not."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"the adapter's rank r must be a positive integer, not {short_repr(rank)}")
    if rank > max_rank:
        raise AdapterError(f"the adapter's rank {rank} is over this server's limit of {max_rank} (TURBOSPARK_MAX_LORA_RANK)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{alpha_key} must be a number, not {short_repr(alpha)}")
    return rank, alpha


def _pairs(source, cfg, targets, pattern=_TENSOR, modules=None):
    """{(layer, PEFT module): {"A": name, "B": name}} of the file's tensors, each name checked.
    `pattern` reads (layer, module, a or b) off a name as the file spells them (PEFT's by default),
    `modules` maps its module names to PEFT's (GGUF_TARGETS; default: PEFT's own)."""
    modules = modules or {m: m for m in TARGETS}
    pairs = {}
    for name in source.names:
        m = pattern.match(name)
        if m is None:
            raise AdapterError(f"tensor {short_repr(name)} is not a LoRA matrix of a supported target "
                               f"({', '.join(modules)})")
        layer, module, ab = int(m.group(1)), modules.get(m.group(2)), m.group(3)
        if module is None or (targets is not None and module not in targets):
            raise AdapterError(f"tensor {name!r} is for module {m.group(2)!r}, not one of the adapter's targets")
        if layer >= cfg.n_layer:
            raise AdapterError(f"tensor {name!r} is for layer {layer}; the model has {cfg.n_layer} layers")
        pairs.setdefault((layer, module), {})[ab.upper()] = name
    for (layer, module), ab in pairs.items():
        if len(ab) != 2:
            (have,) = ab.values()
            missing = {"A": "B", "B": "A", "a": "b", "b": "a"}[pattern.match(have).group(3)]   # as the file spells it
            raise AdapterError(f"layer {layer} {module} has lora_{missing} missing")
    return pairs


def product_parts(cfg, product):
    """(in features, [out features of each fused part]) of our product `product`."""
    q, kv, dim, ffn = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.dim, cfg.ffn_dim
    return {"wqkv": (dim, [q, kv, kv]), "wo": (q, [dim]), "w_gate_up": (dim, [ffn, ffn]), "w_down": (ffn, [dim])}[product]


def _term(cfg, xp, module, source, ab, rank, scale, layer):
    """The LoraTerm of one target: A [r, in] and B [out, r] checked against the model's shapes.

    NOTE(lora-layout): Hugging Face rows are ours (the q/k row permutation is GGUF's only), so B's
    rows go to their part's columns of the fused product unchanged; q's attention scale is folded
    into Wq (weights.py NOTE(scale)), so into q's B too, unless a q norm takes it."""
    product, part = TARGETS[module]
    fan_in, outs = product_parts(cfg, product)
    a_shape, b_shape = source.shape(ab["A"]), source.shape(ab["B"])      # checked before either is read
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise AdapterError(f"layer {layer} {module}: lora_A {a_shape} and lora_B {b_shape} must be matrices")
    if a_shape[0] != b_shape[1]:
        raise AdapterError(f"layer {layer} {module}: lora_A has rank {a_shape[0]}, lora_B rank {b_shape[1]}")
    if a_shape[0] != rank:
        raise AdapterError(f"layer {layer} {module}: rank {a_shape[0]}, the adapter's config says r={rank}")
    if a_shape[1] != fan_in or b_shape[0] != outs[part]:
        raise AdapterError(f"the adapter does not fit the model: layer {layer} {module} maps {a_shape[1]} -> "
                           f"{b_shape[0]} features, the model's {module} maps {fan_in} -> {outs[part]}")
    a, b = _matrix(source, ab["A"]), _matrix(source, ab["B"])
    s = np.float32(scale) * (query_scale(cfg) if module == "q_proj" and not cfg.qk_norm else np.float32(1))
    start = sum(outs[:part])
    return LoraTerm(xp.asarray(np.ascontiguousarray(a.T)), xp.asarray(np.ascontiguousarray((b * s).T)),
                    slice(start, start + outs[part]))


def _matrix(source, name):
    try:
        w = np.asarray(source.tensor(name), dtype=np.float32)
    except (OSError, ValueError) as e:
        raise AdapterError(f"tensor {name!r} cannot be read ({e})") from None
    if not np.isfinite(w).all():
        raise AdapterError(f"tensor {name!r} holds values that are not finite")
    return w


class RowLora:
    """The LoRA terms of one call's rows: `adapters[r]` the LoraAdapter row r runs, or None."""

    def __init__(self, adapters, xp):
        self.xp = xp
        groups = {}
        for r, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(r)
        every = len(adapters)
        self.groups = [(a, slice(None) if len(rows) == every else np.asarray(rows, np.int64))
                       for a, rows in groups.values()]

    @classmethod
    def of(cls, model, adapters):
        """The RowLora of a call of Transformer `model` whose row r runs adapters[r] (None: the
        base), or None where no row runs one. ValueError where the model cannot add LoRA terms.

        NOTE(lora-path): the fused layer kernels (kernels/layer.py, the C `ts_layer`) have no hook
        for a low-rank term, so rows that run an adapter always run the step-by-step DecoderLayers,
        the terms added row by row (NOTE(lora-rows)). Hugging Face bases never run fused here
        (float32 weights, BLAS products): all their rows run so in one call. On a fused (GGUF) base
        a step's base rows run fused and its adapter rows step by step, two calls over the weights
        (Transformer._fused_decode); a sequence runs one way from its first token to its last (its
        prompt too: Transformer.forward), so each row is what it is alone and its K/V, in the
        base's cache format, are its own. PERF(lora-path): a step that mixes both reads the weights
        twice; the step-by-step products are the same int8 kernels, row by row."""
        if all(a is None for a in adapters):
            return None
        return cls(adapters, model.xp)

    def add(self, layer, product, x, y):
        """y (the product of x `[R, (1,) in]` by our matrix `product` in layer `layer`) plus each
        row's adapter terms, in place. Returns y."""
        rows_x, rows_y = x.reshape(len(x), 1, -1), y.reshape(len(y), -1)     # [R, 1, in], [R, out]
        for adapter, rows in self.groups:
            for term in adapter.layers[layer].get(product, ()):
                # one row per product (NOTE(lora-rows)): [n, 1, in] @ [in, r] @ [r, out]
                delta = (rows_x[rows] @ term.a_t) @ term.b_t
                rows_y[rows, term.cols] += delta[:, 0]
        return rows_y.reshape(y.shape)          # y itself where the reshape was a view

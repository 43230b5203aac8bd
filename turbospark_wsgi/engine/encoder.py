"""Sentence embeddings: a BERT encoder and the pooling a sentence-transformers directory declares.

A small module beside the decoder rather than data in its configuration: BERT differs in almost
every step (absolute position and token-type embeddings, LayerNorm after each block instead of
before, GELU instead of a gated MLP, bidirectional attention with a padding mask, no KV cache), so
sharing `Transformer` would add a branch to each of its steps for one forward pass with no cache.

    enc = load_encoder("/models/all-minilm-l6-v2")
    vectors = enc.embed([enc.encode("a sentence"), enc.encode("another")])   # float32 [2, dim]

numpy, float32, CPU. The directory holds model.safetensors, config.json, tokenizer.json,
modules.json and 1_Pooling/config.json (the files sentence-transformers writes). `BertStack`, the
encoder without its pooling, is what cross_encoder.py's rerankers run too.
"""
import contextlib
import os

import numba
import numpy as np
from tokenizers import Tokenizer

from . import model_json, yielding
from .options import EngineOptions
from .safetensors_io import SafetensorsFile

MODULES_FILE = "modules.json"
POOLING_MODES = ("mean", "cls", "lasttoken")
# PERF(batch): sequences of one call run through the encoder together, padded to the longest of a
# chunk; chunks bound the attention scores' memory (batch x heads x T x T floats).
MAX_BATCH_TOKENS = 8192
ATTN_SCORES = 1 << 17       # attention scores computed at once (floats), see _attention


def is_encoder_dir(path):
    """True for a sentence-transformers directory (the only encoders this engine loads)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MODULES_FILE))


class EncoderError(ValueError):
    """The directory is not a BERT sentence-transformers model this encoder can run."""


def load_encoder(path, options=None, *, name=None):
    """An `Encoder` for the sentence-transformers directory `path`. It runs on the CPU in its own
    batches: of the EngineOptions only `encoder_threads` applies (device, max_batch, ... do not)."""
    return Encoder(path, name=name, threads=(options or EngineOptions()).encoder_threads)


class BertStack:
    """A BERT (or XLM-RoBERTa) encoder stack with its tokenizer: what embedding and reranking models
    (cross_encoder.py) share, from config.json, tokenizer.json and model.safetensors."""

    model_types = ("bert",)
    backend = "numpy"
    backend_reason = "the encoder runs on the CPU"

    def __init__(self, path, name=None, threads=1):
        self.path = str(path)
        self.threads = threads      # BLAS threads of the products (ENCODER_THREADS below)
        self.name = name or os.path.basename(self.path.rstrip(os.sep))
        cfg = self.config = _read_json(path, "config.json")
        model_type = cfg.get("model_type")
        if model_type not in self.model_types:
            raise EncoderError(f"unsupported encoder model_type {model_type!r} "
                               f"({', '.join(self.model_types)} only)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise EncoderError("only absolute position embeddings are supported")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise EncoderError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        self.n_layers = int(cfg["num_hidden_layers"])
        self.n_heads = int(cfg["num_attention_heads"])
        self.hidden = int(cfg["hidden_size"])
        self.eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.vocab_size = int(cfg["vocab_size"])
        self.pad_id = int(cfg.get("pad_token_id", 0) or 0)
        # NOTE(positions): XLM-RoBERTa numbers positions from padding_idx + 1 (its pad token's id)
        self.position_offset = self.pad_id + 1 if model_type == "xlm-roberta" else 0
        self.max_positions = int(cfg.get("max_position_embeddings", 512)) - self.position_offset
        try:
            self.tokenizer = model_json.tokenizer_from_file(os.path.join(path, "tokenizer.json"), Tokenizer)
        except ValueError as exc:
            raise EncoderError(str(exc)) from None
        # NOTE(tokenizer): truncation and padding here are ours to do (limits are checked, not cut)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.special_span = _special_span(self.tokenizer)
        self._load_weights(SafetensorsFile(os.path.join(path, "model.safetensors")))

    # ---- weights ---------------------------------------------------------------------------------

    def _load_weights(self, st):
        stem = next((p for p in ("bert.", "roberta.") if p + "embeddings.word_embeddings.weight" in st.names), "")

        def t(name):
            return self._tensor(st, stem + name)

        e = "embeddings."
        self.word = t(e + "word_embeddings.weight")
        if self.word.shape != (self.vocab_size, self.hidden):
            raise EncoderError(f"word embeddings are {self.word.shape}, config says "
                               f"({self.vocab_size}, {self.hidden})")
        self.position = t(e + "position_embeddings.weight")
        if len(self.position) < self.position_offset + 1:
            raise EncoderError(f"position embeddings have {len(self.position)} rows, "
                               f"too few for padding_idx {self.pad_id}")
        self.token_type = t(e + "token_type_embeddings.weight")
        self.emb_norm = (t(e + "LayerNorm.weight"), t(e + "LayerNorm.bias"))
        self.layers = []
        for i in range(self.n_layers):
            p = f"encoder.layer.{i}."
            a = p + "attention."
            # NOTE(layout): q, k, v fused into one [in, 3*hidden] matrix: one matmul per layer
            qkv_w = np.concatenate([t(a + f"self.{n}.weight") for n in ("query", "key", "value")]).T
            qkv_b = np.concatenate([t(a + f"self.{n}.bias") for n in ("query", "key", "value")])
            self.layers.append(dict(
                qkv=(np.ascontiguousarray(qkv_w), qkv_b),
                attn_out=(np.ascontiguousarray(t(a + "output.dense.weight").T), t(a + "output.dense.bias")),
                attn_norm=(t(a + "output.LayerNorm.weight"), t(a + "output.LayerNorm.bias")),
                up=(np.ascontiguousarray(t(p + "intermediate.dense.weight").T), t(p + "intermediate.dense.bias")),
                down=(np.ascontiguousarray(t(p + "output.dense.weight").T), t(p + "output.dense.bias")),
                out_norm=(t(p + "output.LayerNorm.weight"), t(p + "output.LayerNorm.bias"))))

    @staticmethod
    def _tensor(st, name):
        try:
            return st.tensor(name)
        except KeyError:
            raise EncoderError(f"model.safetensors has no tensor {name!r}") from None

    @property
    def nbytes(self):
        arrays = [self.word, self.position, self.token_type]
        arrays += [a for layer in self.layers for pair in layer.values() for a in pair]
        return sum(a.nbytes for a in arrays)

    # ---- forward ---------------------------------------------------------------------------------

    def forward(self, ids, mask, type_ids=None):
        """Last hidden states [B, T, hidden] for padded ids [B, T] with boolean mask [B, T];
        `type_ids` [B, T]: the segment of each token (None: all the first)."""
        B, T = ids.shape
        start = self.position_offset
        types = self.token_type[0] if type_ids is None else self.token_type[type_ids]
        x = self.word[ids] + self.position[start:start + T][None] + types
        x = _layer_norm(x, *self.emb_norm, self.eps)
        # NOTE(mask): padded keys get a large negative score, as the reference does (not -inf: a
        # row of padding must not turn into NaN)
        bias = np.where(mask, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None, None, :]
        H, d = self.n_heads, self.hidden // self.n_heads
        scale = np.float32(1.0 / np.sqrt(d))
        with _blas_threads(self.threads):
            return self._layers(x, bias, scale, B, T, H, d)

    def _layers(self, x, bias, scale, B, T, H, d):
        for layer in self.layers:
            yielding.point()
            # PERF(layout): contiguous heads, so every matmul below is a plain batched BLAS call
            qkv = _linear(x, *layer["qkv"]).reshape(B, T, 3, H, d).transpose(2, 0, 3, 1, 4)
            qkv = np.ascontiguousarray(qkv)
            q, k, v = qkv[0], qkv[1].transpose(0, 1, 3, 2), qkv[2]
            ctx = _attention(q, k, v, scale, bias).transpose(0, 2, 1, 3).reshape(B, T, self.hidden)
            x = _layer_norm(x + _linear(ctx, *layer["attn_out"]), *layer["attn_norm"], self.eps)
            up = _gelu(_linear(x, *layer["up"]))
            x = _layer_norm(x + _linear(up, *layer["down"]), *layer["out_norm"], self.eps)
        return x


class Encoder(BertStack):
    """A BERT encoder with its tokenizer, pooling and normalisation."""

    kind = "embedding"
    capabilities = ("embedding",)
    embed_chunk_tokens = MAX_BATCH_TOKENS   # tokens of inputs one compute-thread call embeds

    def __init__(self, path, name=None, threads=1):
        self.pooling, self.normalize = _pooling(path)
        super().__init__(path, name, threads)
        self.max_tokens = min(self.max_positions, _max_seq_length(path))
        self.max_context = self.max_tokens      # what /health reports for any model
        self.dim = self.hidden
        self.matryoshka = _declares_matryoshka(path)

    # ---- tokens ----------------------------------------------------------------------------------

    def encode(self, text):
        """Token ids for `text`, with the model's own special tokens ([CLS] ... [SEP])."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts):
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    # ---- forward ---------------------------------------------------------------------------------

    def embed(self, sequences, dimensions=None):
        """float32 [len(sequences), dim] embeddings of token-id lists (each 1..max_tokens ids, all
        below vocab_size: the caller checks), pooled and normalised as the model declares.
        `dimensions`: keep the first that many (Matryoshka models), normalised again."""
        out = np.empty((len(sequences), self.dim), dtype=np.float32)
        for run in padded_runs([len(s) for s in sequences]):
            ids, mask, lengths = pad([sequences[i] for i in run], self.pad_id)
            out[run] = self._pool(self.forward(ids, mask), mask, lengths)
        if dimensions is not None and dimensions < self.dim:
            out = normalize(out[:, :dimensions]).astype(np.float32)
        return out

    def _pool(self, hidden, mask, lengths):
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "lasttoken":
            pooled = hidden[np.arange(len(lengths)), lengths - 1]
        else:
            m = mask[..., None].astype(np.float32)
            pooled = (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        if self.normalize:
            pooled = normalize(pooled)
        return pooled.astype(np.float32)


def padded_runs(lengths):
    """Index lists covering range(len(lengths)), shortest sequences first, each run's padded size
    (its count x its longest length) within MAX_BATCH_TOKENS (one sequence at least).

    NOTE(padding): sorted by length so each padded run wastes little on padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * lengths[order[end]] <= MAX_BATCH_TOKENS:
            end += 1
        yield order[start:end]
        start = end


def pad(seqs, value):
    """(ids [B, T] int64 padded with `value`, mask [B, T], lengths [B]) for lists of ids."""
    lengths = np.array([len(s) for s in seqs])
    T = int(lengths.max())
    ids = np.full((len(seqs), T), value, dtype=np.int64)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
    return ids, np.arange(T)[None, :] < lengths[:, None], lengths


def _attention(q, k, v, scale, bias):
    """softmax(q k * scale + bias) v for q [B, H, T, d], k [B, H, d, T] (transposed), v [B, H, T, d].

    PERF(cache): a few sequences at a time, so each one's scores (H x T x T) stay in cache through
    the softmax's passes: batch 32 of 134 tokens, one layer, 86 -> 65 ms (one at a time)."""
    B, H, T, d = q.shape
    out = np.empty((B, H, T, d), dtype=q.dtype)
    step = max(1, ATTN_SCORES // (H * T * T))
    with _one_blas_thread():
        for s in range(0, B, step):
            scores = np.matmul(q[s:s + step], k[s:s + step])          # [b, H, T, T]
            scores *= scale
            scores += bias[s:s + step]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            np.matmul(scores, v[s:s + step], out=out[s:s + step])
    return out


# PERF(threads): the encoder's products (float32 GEMMs over every token of a batch) run on
# Encoder.threads BLAS threads (EngineOptions.encoder_threads, TURBOSPARK_ENCODER_THREADS, default
# 1), whatever a quantized decoder capped BLAS at (kernels_cpu.limit_blas_threads; put back after
# each forward pass). On 2 shared cores (load 9-10, batch 32, medians of 7 interleaved) 2 threads ran
# at 0.33-0.41x the speed of 1 for 15-token inputs and 0.71-0.84x for 134-token ones: a thread that
# waits for a core stalls every product. A machine with cores to spare for the compute thread may
# set more.
_libs = None


@contextlib.contextmanager
def _blas_threads(n):
    """BLAS on `n` threads inside the block, its previous count after it.

    PERF(threads): one set_num_threads call per library (threadpoolctl's `limit` re-reads every
    library's state each time: 0.6 ms a call, 4 % of a short batch's forward pass)."""
    global _libs
    if _libs is None:
        from threadpoolctl import ThreadpoolController
        _libs = ThreadpoolController().select(user_api="blas").lib_controllers
    before = [lib.num_threads for lib in _libs]
    for lib in _libs:
        lib.set_num_threads(n)
    try:
        yield
    finally:
        for lib, count in zip(_libs, before):
            lib.set_num_threads(count)


def _one_blas_thread():
    """BLAS on one thread for attention's many small per-head products.

    PERF(threads): a stacked matmul is one BLAS call per head and sequence; on two threads each call
    pays a thread hand-off, and with the cores busy those hand-offs dominated: 32 inputs of 134
    tokens took 52 s with OpenBLAS on 2 threads and 1.4 s on 1 (2 shared cores under load)."""
    return _blas_threads(1)


def normalize(vectors):
    """Rows scaled to unit length (a zero row stays zero), as sentence-transformers' Normalize."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def _linear(x, w, b):
    # PERF(gemm): one 2-D product over every token of the batch, not one per sequence
    out = np.matmul(x.reshape(-1, x.shape[-1]), w)
    out += b
    return out.reshape(*x.shape[:-1], w.shape[1])


def _layer_norm(x, w, b, eps):
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = (centered * centered).mean(axis=-1, keepdims=True)
    return centered / np.sqrt(var + np.float32(eps)) * w + b


_GELU = []


def _gelu(x):
    """`_gelu_value` over an array, compiled (or loaded from numba's cache) at its first call.

    PERF(cold-start): with its signature given at import, numba compiled this ufunc whenever the
    engine was imported, ~1 s of every decoder server's first start with an empty cache."""
    if not _GELU:
        _GELU.append(numba.vectorize(["float32(float32)"], nopython=True, fastmath=True, cache=True)(_gelu_value))
    return _GELU[0](x)


def _gelu_value(x):
    """Exact (erf) GELU, as BERT's "gelu", in one pass.

    PERF(erf): erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7, within float32's rounding of
    the result: max |difference| 4.8e-7 from a float64 erf on N(0, 9) inputs); libm's erf took
    3.5x as long, a quarter of a batch's forward time.
    PERF(exp): its exp(-z^2) without a libm call, so the loop runs on SIMD lanes: z^2 is capped at
    16 (erf is 1 in float32 long before), exp(u / 16) for u / 16 in [-1, 0] is its Taylor series to
    degree 9 (error < 3e-7 relative), squared four times. 33 -> 1.7 ms for 6.6 M values (batch 32
    of 134 tokens, one layer), same max |difference| from a float64 erf GELU (3.8e-7)."""
    z = x * np.float32(0.7071067811865476)
    a = abs(z)
    t = np.float32(1.0) / (np.float32(1.0) + np.float32(0.3275911) * a)
    poly = t * (np.float32(0.254829592) + t * (np.float32(-0.284496736) + t * (np.float32(1.421413741)
                + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))))
    u = max(-a * a, np.float32(-16.0)) * np.float32(0.0625)
    e = np.float32(1.0)
    for k in range(9, 0, -1):
        e = np.float32(1.0) + u * e / np.float32(k)
    e = e * e
    e = e * e
    e = e * e
    e = e * e
    erf = np.float32(1.0) - poly * e
    if z < 0:
        erf = -erf
    return np.float32(0.5) * x * (np.float32(1.0) + erf)


def _special_span(tokenizer):
    """(leading, trailing) special tokens the tokenizer adds around a text: (1, 1) for [CLS] ... [SEP]."""
    mask = tokenizer.encode("a", add_special_tokens=True).special_tokens_mask
    head = next((i for i, m in enumerate(mask) if not m), len(mask))
    tail = next((i for i, m in enumerate(reversed(mask)) if not m), 0)
    return head, tail


# ---- the directory's own declarations ------------------------------------------------------------

def _read_json(path, name, default=None):
    file = os.path.join(path, name)
    if default is not None and not os.path.isfile(file):
        return default
    try:
        return model_json.loads(model_json.read_text(file, name), name)
    except ValueError as exc:
        raise EncoderError(str(exc)) from None


def _pooling(path):
    """(mode, normalize) from modules.json and the Pooling module's config.json."""
    modules = _read_json(path, MODULES_FILE)
    if not isinstance(modules, list):
        raise EncoderError(f"{MODULES_FILE}: expected a list of modules")
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize_ = any(t.endswith(".Normalize") for t in types)
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return "cls", normalize_
    cfg = _read_json(os.path.join(path, pooling.get("path", "")), "config.json")
    if cfg.get("pooling_mode_mean_tokens"):
        mode = "mean"
    elif cfg.get("pooling_mode_cls_token"):
        mode = "cls"
    elif cfg.get("pooling_mode_lasttoken"):
        mode = "lasttoken"
    else:
        raise EncoderError(f"{pooling.get('path')}/config.json: unsupported pooling mode "
                           f"(supported: {', '.join(POOLING_MODES)})")
    return mode, normalize_


def _max_seq_length(path):
    cfg = _read_json(path, "sentence_bert_config.json", default={})
    value = cfg.get("max_seq_length") if isinstance(cfg, dict) else None
    return int(value) if isinstance(value, int) and value > 0 else 512


def _declares_matryoshka(path):
    """True where the model card says the model was trained with MatryoshkaLoss (its vectors keep
    their meaning when cut to fewer dimensions)."""
    try:
        with open(os.path.join(path, "README.md"), encoding="utf-8") as f:
            card = f.read(65536)
    except OSError:
        return False
    return "MatryoshkaLoss" in card

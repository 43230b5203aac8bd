"""Rerankers: a BERT or XLM-RoBERTa encoder with a sequence-classification head scores (query,
document) pairs, as sentence-transformers' `CrossEncoder.predict` does.

    ce = load_cross_encoder("/models/ms-marco-minilm-l6-v2")
    pairs, cut = ce.encode_pairs([("a query", "a passage"), ("a query", "another")])
    scores = ce.score(pairs)        # float32 [2]: sigmoid(logit), or the activation config.json names

The directory is a plain Hugging Face one: config.json (architectures BertForSequenceClassification
or XLMRobertaForSequenceClassification, one label), tokenizer.json and model.safetensors. A pair goes
through the tokenizer's own pair template ([CLS] a [SEP] b [SEP] with segment ids 0 then 1 for BERT,
<s> a </s></s> b </s> for XLM-R); the head is a dense layer with tanh on the first token, then the
classifier (BERT's pooler + classifier, XLM-R's classifier.dense + classifier.out_proj).
"""
import os

import numpy as np
from tokenizers import Tokenizer

from . import model_json
from .encoder import MAX_BATCH_TOKENS, BertStack, EncoderError, _linear, pad, padded_runs
from .events import QueryTooLong
from .options import EngineOptions

ARCHITECTURES = ("BertForSequenceClassification", "XLMRobertaForSequenceClassification")
# the head's two layers (dense + tanh, then the classifier), by model_type
HEADS = {"bert": ("bert.pooler.dense", "classifier"), "xlm-roberta": ("classifier.dense", "classifier.out_proj")}
# NOTE(activation): sentence-transformers' CrossEncoder applies Sigmoid to a one-label model's
# logit unless config.json names another activation (a torch.nn class); so does vLLM's /score.
ACTIVATIONS = {
    "Sigmoid": lambda x: np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)),   # no exp overflow
    "Identity": lambda x: x,
    "Tanh": np.tanh,
}


def load_cross_encoder(path, options=None, *, name=None):
    """A `CrossEncoder` for the directory `path`; like the embedding encoder it runs on the CPU and
    of the EngineOptions only `encoder_threads` applies."""
    return CrossEncoder(path, name=name, threads=(options or EngineOptions()).encoder_threads)


class CrossEncoder(BertStack):
    """A cross-encoder: the encoder stack, its classification head and the score's activation."""

    kind = "rerank"
    capabilities = ("rerank",)
    model_types = ("bert", "xlm-roberta")
    score_chunk_tokens = MAX_BATCH_TOKENS   # tokens of pairs one compute-thread call scores

    def __init__(self, path, name=None, threads=1):
        super().__init__(path, name, threads)
        cfg = self.config
        archs = cfg.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise EncoderError(f"unsupported reranker architecture {archs!r} (supported: {', '.join(ARCHITECTURES)})")
        labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else int(cfg.get("num_labels", 1))
        if labels != 1:
            # NOTE(labels): a relevance score is one number; a model of several classes says which
            # class a pair is in, and which one means "relevant" is the model card's to say
            raise EncoderError(f"the classifier has {labels} labels; reranking needs one (num_labels 1)")
        if self.head[1][0].shape[1] != 1:
            raise EncoderError(f"the classifier has {self.head[1][0].shape[1]} outputs, config.json says one")
        self.activation_name = _activation(path, cfg)
        self.activation = ACTIVATIONS[self.activation_name]
        self.max_tokens = min(self.max_positions, _model_max_length(path))
        self.max_context = self.max_tokens
        # NOTE(segments): XLM-RoBERTa has one segment embedding and no segment ids
        self.segments = len(self.token_type) > 1
        self.n_special = self.tokenizer.num_special_tokens_to_add(True)
        self._pairs = Tokenizer.from_str(self.tokenizer.to_str())     # the same tokenizer, cutting pairs
        self._pairs.no_padding()
        self._pairs.enable_truncation(self.max_tokens, strategy="only_second")

    def _load_weights(self, st):
        super()._load_weights(st)
        dense, out = HEADS[self.config["model_type"]]
        self.head = [(np.ascontiguousarray(self._tensor(st, f"{n}.weight").T), self._tensor(st, f"{n}.bias"))
                     for n in (dense, out)]
        if self.head[0][0].shape != (self.hidden, self.hidden) or self.head[1][0].shape[0] != self.hidden:
            raise EncoderError(f"classification head shapes {[w.shape for w, _ in self.head]} do not fit "
                               f"hidden size {self.hidden}")

    @property
    def nbytes(self):
        return super().nbytes + sum(w.nbytes + b.nbytes for w, b in self.head)

    # ---- tokens ----------------------------------------------------------------------------------

    def encode_pairs(self, pairs):
        """([(ids, segment ids or None)], [bool]) for (first, second) text pairs, each through the
        tokenizer's pair template: the second text's tail is cut where the pair would pass
        `max_tokens` (the bools say which were cut). QueryTooLong when a first text leaves no room."""
        firsts = list(dict.fromkeys(a for a, _ in pairs))
        sizes = dict(zip(firsts, (len(e.ids) for e in self.tokenizer.encode_batch(firsts, add_special_tokens=False))))
        for i, (a, _) in enumerate(pairs):
            if sizes[a] + self.n_special >= self.max_tokens:
                raise QueryTooLong(i, sizes[a], self.max_tokens)
        encoded = self._pairs.encode_batch(list(pairs), add_special_tokens=True)
        seqs = [(e.ids, e.type_ids if self.segments else None) for e in encoded]
        return seqs, [bool(e.overflowing) for e in encoded]

    # ---- forward ---------------------------------------------------------------------------------

    def score(self, pairs):
        """float32 [len(pairs)] relevance scores of encoded pairs (encode_pairs' first list)."""
        out = np.empty(len(pairs), dtype=np.float32)
        for run in padded_runs([len(ids) for ids, _ in pairs]):
            ids, mask, _ = pad([pairs[i][0] for i in run], self.pad_id)
            segments = pad([pairs[i][1] for i in run], 0)[0] if self.segments else None
            first = self.forward(ids, mask, segments)[:, 0]              # [B, hidden]
            pooled = np.tanh(_linear(first, *self.head[0]))              # [B, hidden]
            out[run] = self.activation(_linear(pooled, *self.head[1])[:, 0])
        return out


def _activation(path, cfg):
    """The activation's name in ACTIVATIONS, from the first of: config_sentence_transformers.json's
    `activation_fn` (what CrossEncoder.save writes), config.json's `sentence_transformers.activation_fn`
    or older `sbert_ce_default_activation_function`, where it is a torch.nn class; else Sigmoid.

    NOTE(activation): a path outside torch is code sentence-transformers runs only with
    trust_remote_code; without it, as here, it takes the default."""
    saved = _json_object(path, "config_sentence_transformers.json")
    st = cfg.get("sentence_transformers")
    for value in (saved.get("activation_fn"), st.get("activation_fn") if isinstance(st, dict) else None,
                  cfg.get("sbert_ce_default_activation_function")):
        if isinstance(value, str) and value.startswith("torch."):
            name = value.rsplit(".", 1)[-1]
            if name not in ACTIVATIONS:
                raise EncoderError(f"unsupported activation_fn {value!r} (supported: {', '.join(ACTIVATIONS)})")
            return name
    return "Sigmoid"


def _json_object(path, name):
    try:
        return model_json.read_object(os.path.join(path, name), name) or {}
    except ValueError as exc:
        raise EncoderError(str(exc)) from None


def _model_max_length(path):
    """tokenizer_config.json's model_max_length (what the reference's tokenizer truncates pairs to),
    or no limit of its own."""
    value = _json_object(path, "tokenizer_config.json").get("model_max_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1 << 30

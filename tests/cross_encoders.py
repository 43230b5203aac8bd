"""Tiny random cross-encoders written on the fly: a Hugging Face BertForSequenceClassification or
XLMRobertaForSequenceClassification directory (model.safetensors, config.json, tokenizer.json with
its pair template, tokenizer_config.json) as transformers saves it, readable by transformers,
sentence-transformers' CrossEncoder and the engine alike."""
import json
from pathlib import Path

WORDS = ("the a an is of to in and for on with what how where who capital city france paris berlin germany cat "
         "dog sits mat stock market fell python code language recipe flour eggs sugar football match draw game "
         "won bake cake kitten shares").split()
LETTERS = list("abcdefghijklmnopqrstuvwxyz0123456789.,?!'")
SPECIAL = {"bert": {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
                    "mask_token": "[MASK]"},
           "xlm-roberta": {"bos_token": "<s>", "cls_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>",
                           "sep_token": "</s>", "unk_token": "<unk>", "mask_token": "<mask>"}}


def tokenizer(kind):
    """A WordPiece tokenizer over WORDS and single letters with BERT's or XLM-R's pair template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    names = SPECIAL[kind]
    # ids as the real vocabularies have them: BERT's pad 0, XLM-R's pad 1
    special = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if kind == "bert"
               else ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    vocab = list(dict.fromkeys(special + WORDS + LETTERS + ["##" + c for c in LETTERS]))
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token=names["unk_token"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls, sep = names["cls_token"], names["sep_token"]
    ids = [(cls, vocab.index(cls)), (sep, vocab.index(sep))]
    pair = f"{cls} $A {sep} $B:1 {sep}:1" if kind == "bert" else f"{cls} $A {sep} {sep} $B {sep}"
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=pair, special_tokens=ids)
    tok.add_special_tokens(special)
    return tok


def build_cross_encoder(path, kind="bert", num_labels=1, seed=0, max_positions=64, config=None):
    """Writes a random cross-encoder to `path` (hidden 32, 2 layers, 4 heads; weights N(0, 0.3) so
    that pairs score apart) and returns it; `config`: extra config.json keys."""
    import torch
    from transformers import (BertConfig, BertForSequenceClassification, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification)
    torch.manual_seed(seed)
    path = Path(path)
    tok = tokenizer(kind)
    common = dict(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=num_labels, **(config or {}))
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(max_position_embeddings=max_positions, pad_token_id=0,
                                                         **common))
    else:
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
            max_position_embeddings=max_positions + 2, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            type_vocab_size=1, layer_norm_eps=1e-5, **common))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.eval().save_pretrained(str(path), safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    # NOTE(tokenizer_class): BertTokenizer gives transformers' tokenizer token_type_ids; XLM-R has none
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        SPECIAL[kind], model_max_length=max_positions,
        tokenizer_class="BertTokenizer" if kind == "bert" else "PreTrainedTokenizerFast")))
    return path

import json
import logging
import os
import random
import unicodedata

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from turbospark_wsgi.engine.gguf import read_metadata
from turbospark_wsgi.engine.tokenizer import Tokenizer, merges_from_scores

MODELS = os.path.expanduser(os.environ.get("TURBOSPARK_MODELS", "~/.cache/turbospark/models"))
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STORIES = os.path.normpath(os.path.join(os.path.dirname(__file__), "../../../shared/models/stories260K.gguf"))


def hf_gguf_tokenizer(directory, name):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="module")
def smol():
    path = os.path.join(MODELS, SMOL_FILE)
    if not os.path.exists(path):
        pytest.skip(f"default model not found at {path}")
    return Tokenizer.from_gguf_metadata(read_metadata(path))


@pytest.fixture(scope="module")
def smol_hf(smol):
    return hf_gguf_tokenizer(MODELS, SMOL_FILE)


@pytest.fixture(scope="module")
def stories():
    if not os.path.exists(STORIES):
        pytest.skip("stories260K.gguf not found")
    return Tokenizer.from_gguf_metadata(read_metadata(STORIES))


@pytest.fixture(scope="module")
def stories_hf(stories):
    return hf_gguf_tokenizer(os.path.dirname(STORIES), os.path.basename(STORIES))


# Chars for fuzzing: letters, digits, whitespace, punctuation, other numerics, CJK, emoji, special tokens.
FUZZ_PARTS = list("abcXYZ019 \n\t.,;:!?'\"()[]{}<>|=_-+*/\\#@$%&~^`") + [
    "²", "½", "①", "Ⅻ", "٣", "é", "ß", "ñ", "Ж", "你", "好", "世界", "😀", "🎉", "👍🏽", "\u200b",
    "  ", "\n\n", "    ", "the", " the", "'s", "'ll", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
]


def fuzz_strings(seed, count, parts=FUZZ_PARTS):
    rng = random.Random(seed)
    return ["".join(rng.choice(parts) for _ in range(rng.randint(0, 24))) for _ in range(count)]


def whitespace_before_numeric(text):
    # Where the 'smollm' digit rule and transformers' GGUF tokenizer (which lacks it) disagree.
    return any(a.isspace() and unicodedata.numeric(b, None) is not None for a, b in zip(text, text[1:]))


SMOL_CASES = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "It's v2024; we'll see.",
    "def add(a, b):\n    return a+b\n\nprint(add(1,2))\n", "for (int i=0; i<n; ++i) { x[i] *= k; }",
    "😀 emoji 🎉👍🏽 mix", "你好，世界。日本語のテキスト", " leading space", "   three leading", "multiple   inner  spaces",
    "tabs\tand\nnewlines\r\n", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more", "", " ", "\n", "x²+y½", "Ünïcödé ñ", "a  b", "trailing  ",
]


def test_smol_cases_avoid_the_digit_rule_difference():
    assert not any(whitespace_before_numeric(s) for s in SMOL_CASES)


@pytest.mark.parametrize("text", SMOL_CASES)
def test_smol_ids_match_transformers(smol, smol_hf, text):
    assert smol.encode(text) == smol_hf.encode(text, add_special_tokens=False)


def test_smol_fuzz_ids_match_transformers(smol, smol_hf):
    texts = [s for s in fuzz_strings(1, 600) if not whitespace_before_numeric(s)]
    assert len(texts) > 300
    assert [smol.encode(s) for s in texts] == [smol_hf.encode(s, add_special_tokens=False) for s in texts]


@pytest.mark.parametrize("text, pieces", [
    ("a  5", ["a", "ĠĠ", "5"]),                   # transformers without the rule: a, Ġ, Ġ, 5
    ("[\n    1,", ["[", "ĊĠĠĠĠ", "1", ","]),      # transformers: ĊĠĠĠ, Ġ, 1
    ("12345", ["1", "2", "3", "4", "5"]),
])
def test_smollm_digit_rule(smol, text, pieces):
    assert [smol.id_to_piece(i) for i in smol.encode(text)] == pieces


def test_smol_decode_matches_transformers(smol, smol_hf):
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(smol.vocab_size) if rng.random() < 0.8 else rng.randrange(20) for _ in range(rng.randint(0, 12))]
        for skip in (True, False):
            assert smol.decode(ids, skip_special=skip) == smol_hf.decode(ids, skip_special_tokens=skip), ids


def test_smol_round_trip_fuzz(smol):
    for text in fuzz_strings(3, 1500) + SMOL_CASES:
        assert smol.decode(smol.encode(text), skip_special=False) == text


def test_smol_special_tokens(smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == smol.piece_to_id("<|im_start|>") == 1 and ids[-1] == 2
    assert smol.decode(ids) == "user\nhi"
    assert smol.is_special(1) and smol.is_special(2) and not smol.is_special(ids[1])
    assert (smol.bos_id, smol.eos_id, smol.bos_token, smol.eos_token) == (1, 2, "<|im_start|>", "<|im_end|>")
    assert smol.stop_ids == frozenset({2}) and smol.add_bos is False and smol.vocab_size == 49152
    assert smol.chat_template.startswith("{% for message in messages %}")


def test_smol_token_bytes(smol):
    ids = smol.encode("😀 a\n")
    assert b"".join(smol.token_bytes(i) for i in ids) == "😀 a\n".encode()
    assert smol.token_bytes(smol.piece_to_id("Ġworld")) == b" world"


# ---- stories260K (SentencePiece-style vocabulary with byte fallback)

STORY_CASES = ["Once upon a time, there was a little girl.", "Tom said: \"Hi!\"\nThe end.", "a  b", "x 5 9",
               "😀 and 你好", "tabs\there", "", "<s>hi</s> there"]


@pytest.mark.parametrize("text", STORY_CASES)
def test_stories_ids_match_transformers(stories, stories_hf, text):
    assert stories.encode(text) == stories_hf.encode(text, add_special_tokens=False)
    if not text.startswith("<s>"):         # ours never doubles a BOS the text already has
        assert stories.encode(text, add_bos=True) == stories_hf.encode(text)
    ids = stories.encode(text)
    assert stories.decode(ids) == stories_hf.decode(ids, skip_special_tokens=True)
    assert stories.decode(ids, skip_special=False) == stories_hf.decode(ids, skip_special_tokens=False)


def test_stories_round_trip(stories):
    texts = [t for t in STORY_CASES if "<s>" not in t] + [
        s.lstrip() for s in fuzz_strings(4, 500, [p for p in FUZZ_PARTS if "<|" not in p])]
    for text in texts:
        assert stories.decode(stories.encode(text)) == text


def test_stories_bos(stories):
    assert (stories.bos_id, stories.bos_token, stories.add_bos) == (1, "<s>", True)
    assert (stories.eos_id, stories.eos_token, stories.stop_ids) == (2, "</s>", frozenset({2}))
    ids = stories.encode("Once", add_bos=True)
    assert ids[0] == 1 and ids[1:] == stories.encode("Once")
    assert stories.encode("<s>Once", add_bos=True).count(1) == 1
    assert stories.encode("", add_bos=True) == [1]
    assert stories.decode([1, *stories.encode("Once")]) == "Once"


def test_stories_byte_fallback(stories):
    ids = stories.encode("a😀")
    assert [stories.id_to_piece(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert b"".join(stories.token_bytes(i) for i in ids[-4:]) == "😀".encode()
    assert stories.decode(ids) == "a😀"
    assert stories.token_bytes(stories.piece_to_id("\u2581a")) == b" a"


def test_token_text_is_what_logprobs_show(stories):
    lead, *rest = stories.encode("a😀")[-4:]
    assert stories.token_text(lead) == ("\\xf0", b"\xf0", 1)        # a lead byte: one character of the text
    assert [stories.token_text(i)[2] for i in rest] == [0, 0, 0]      # continuation bytes add none
    assert stories.token_text(stories.piece_to_id("\u2581a")) == (" a", b" a", 2)
    assert stories.token_text(1) == ("<s>", stories.token_bytes(1), 0)     # special: by name, no width


def test_merges_from_scores_orders_by_score_then_length():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    merges = merges_from_scores(tokens, [0, 0, 0, -2.0, -1.0, -3.0])
    assert merges == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


# ---- GGUF metadata edge cases


def tiny_gpt2_meta(**extra):
    tokens = ["<|endoftext|>", "<think>", "h", "i", "Ġ", "hi", "Ġhi"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 4, 1, 1, 1, 1, 1], "tokenizer.ggml.merges": ["h i", "Ġ hi"],
            "tokenizer.ggml.eos_token_id": 0, **extra}


def test_unknown_tokenizer_model_is_named():
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": []})


def test_unknown_pre_tokenizer_falls_back_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_gguf_metadata(tiny_gpt2_meta(**{"tokenizer.ggml.pre": "mystery"}))
    assert "mystery" in caplog.text
    assert tok.encode("hi hi") == [5, 6]


def test_user_defined_tokens_stay_whole_and_decode_as_text():
    tok = Tokenizer.from_gguf_metadata(tiny_gpt2_meta())
    assert tok.encode("<think>hi<|endoftext|>") == [1, 5, 0]
    assert tok.decode([1, 5, 0]) == "<think>hi"
    assert tok.stop_ids == frozenset({0})      # <|endoftext|> counts because it is eos


@pytest.mark.parametrize("pre, text, pieces", [
    ("llama-bpe", "abc 12345", ["abc", "Ġ", "123", "45"]),
    ("qwen2", "abc 123", ["abc", "Ġ", "1", "2", "3"]),
    ("default", "abc 123", ["abc", "Ġ123"]),
])
def test_pre_tokenizer_splits(pre, text, pieces):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": ["a", "b", "c", "ab", "abc", "Ġ", "1", "2", "3", "4", "5", "12", "123", "45",
                                      "Ġ1", "Ġ12", "Ġ123"],
            "tokenizer.ggml.merges": ["a b", "ab c", "Ġ 1", "Ġ1 2", "Ġ12 3", "1 2", "12 3", "4 5"]}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert [tok.id_to_piece(i) for i in tok.encode(text)] == pieces


# ---- Hugging Face directory


def write_hf_dir(path, backend, config, generation=None):
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


def trained_byte_level(corpus):
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.train_from_iterator(corpus, trainer)
    return backend


def test_from_hf_dir_byte_level(tmp_path):
    corpus = ["hello world, the tokenizer test", "numbers 12345 and more words", "emoji 😀 and 你好"] * 20
    backend = trained_byte_level(corpus)
    path = write_hf_dir(tmp_path, backend, {
        "bos_token": None, "eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages[0]['content'] }}",
    }, {"eos_token_id": [2, 0]})
    tok = Tokenizer.from_hf_dir(path)
    text = "<|im_start|>hello 😀 world<|im_end|>"
    ids = tok.encode(text)
    assert ids == backend.encode(text, add_special_tokens=False).ids and ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "hello 😀 world" and tok.decode(ids, skip_special=False) == text
    assert (tok.eos_id, tok.eos_token, tok.bos_id, tok.add_bos) == (2, "<|im_end|>", None, False)
    assert tok.stop_ids == frozenset({0, 2})
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert tok.vocab_size == backend.get_vocab_size()
    for text in fuzz_strings(5, 200):
        assert tok.decode(tok.encode(text), skip_special=False) == text


def spm_backend():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "h", "i", "hi", "\u2581h", "\u2581hi"]
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = Backend(models.BPE(vocab, [("\u2581", "h"), ("\u2581h", "i"), ("h", "i")],
                                 unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return backend


def test_from_hf_dir_sentencepiece_style(tmp_path):
    backend = spm_backend()
    path = write_hf_dir(tmp_path, backend, {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    tok = Tokenizer.from_hf_dir(path)
    ids = tok.encode("hi hi😀", add_bos=True)
    assert ids[:3] == [1, 264, 264] and len(ids) == 7
    assert tok.decode(ids) == "hi hi😀" == backend.decode(ids)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template) == (1, 2, True, None)
    assert tok.token_bytes(264) == b" hi" and tok.token_bytes(3 + 0xF0) == b"\xf0"


def test_from_hf_dir_reads_bos_from_the_post_processor(tmp_path):
    from tokenizers import processors
    backend = spm_backend()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = Tokenizer.from_hf_dir(write_hf_dir(tmp_path, backend, {"bos_token": "<s>", "eos_token": "</s>"}))
    assert tok.add_bos is True and tok.encode("hi") == [264]


def test_from_hf_dir_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    corpus = ["def main():\n    print('hi')\n", "Quick brown fox. 42 jumps!", "naïve café 😀"] * 20
    path = write_hf_dir(tmp_path, trained_byte_level(corpus), {"eos_token": "<|endoftext|>"})
    ours, hf = Tokenizer.from_hf_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in fuzz_strings(6, 200):
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


# ---- Qwen byte-level BPE ("qwen2" pre-tokenizer), against Hugging Face's Qwen2 tokenizer

QWEN_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_USER = ["<tool_call>", "</tool_call>", "<think>", "</think>"]     # added tokens that are not special
QWEN_CORPUS = [
    "Hello, world! It's 2024; we'll see what they've done. I'M SURE YOU'LL LIKE IT.",
    "def add(a, b):\n    return a + b\n\n\nprint(add(12, 345))\n", "    indented\n\tline\r\n",
    "你好，世界。日本語のテキストと한국어 문장。", "emoji 😀🎉👍🏽 and café naïve Ünïcödé façade",
    "numbers 1 22 333 4444 3.14159 1,000,000 x² ½ ① Ⅻ ٣", "the the the they there their then",
]
QWEN_TRICKY = [
    "It's 2024; we'll see. I'M HERE, YOU'LL SEE: 'Re 'VE 'd 'LL", "12345 678.9 0x1F 1,000,000 3.14",
    "   leading and    inner runs\t\t\ttabs\n\n\n  newline runs  ", "trailing   ", "a  5", "[\n    1,\n]",
    "你好，世界。日本語のテキスト한국어", "😀 emoji 🎉👍🏽 👨‍👩‍👧 mix", "café naïve", "cafe\u0301 A\u030a",
    "x²+y½ ① Ⅻ ٣ ＡＢＣ ﬁ", "def f(a, b):\n    return a+b\n", "\r\n\r\n", " ", "",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<think>\nhmm\n</think>\n\nok",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|endoftext|>',
]
QWEN_PARTS = FUZZ_PARTS + ["e\u0301", "A\u030a", "ﬁ", "'S", "'LL", "한", "<think>", "</tool_call>"]


def add_qwen_tokenizer(writer, meta):
    """Writes qwen_meta()'s tokenizer into a gguf.GGUFWriter, as a Qwen GGUF file carries it."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)


def qwen_meta():
    """GGUF tokenizer metadata shaped like Qwen2.5's: a byte-level BPE trained here with Qwen's split,
    its control tokens and the not-special added tokens (`<think>`, `<tool_call>`) after the merges."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    from tokenizers import Regex, normalizers
    backend = Backend(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(QWEN_CORPUS * 10, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + QWEN_CONTROL + QWEN_USER
    n = len(tokens) - len(QWEN_CONTROL) - len(QWEN_USER)
    return transformers, {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * n + [3] * len(QWEN_CONTROL) + [4] * len(QWEN_USER),
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in model["merges"]],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"), "tokenizer.ggml.add_bos_token": False}


@pytest.fixture(scope="module")
def qwen_pair():
    """Ours from GGUF metadata, and transformers' own Qwen2 tokenizer on the same vocabulary."""
    transformers, meta = qwen_meta()
    tokens = meta["tokenizer.ggml.tokens"]
    hf = transformers.Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]])
    hf.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_CONTROL], special_tokens=True)
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_USER])
    assert [hf.convert_tokens_to_ids(t) for t in QWEN_CONTROL + QWEN_USER] == \
        [tokens.index(t) for t in QWEN_CONTROL + QWEN_USER]
    return Tokenizer.from_gguf_metadata(meta), hf, meta


@pytest.mark.parametrize("text", QWEN_TRICKY)
def test_qwen_ids_match_transformers_qwen2_tokenizer(qwen_pair, text):
    ours, hf, _ = qwen_pair
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_qwen_fuzz_ids_match_transformers_qwen2_tokenizer(qwen_pair):
    ours, hf, _ = qwen_pair
    texts = fuzz_strings(11, 800, QWEN_PARTS)
    assert sum(not unicodedata.is_normalized("NFC", t) for t in texts) > 100     # decomposed input is covered
    assert [ours.encode(t) for t in texts] == [hf.encode(t, add_special_tokens=False) for t in texts]


@pytest.mark.parametrize("text, pieces", [
    ("abc 123", ["abc", "Ġ", "1", "2", "3"]),                   # every digit alone, the space apart
    ("I'M HERE'S", ["I", "'M", "ĠHERE", "'S"]),                 # contractions in any case
    ("a\n\n  b", ["a", "ĊĊ", "Ġ", "Ġb"]),                       # newlines apart, one space kept for the word
    ("x, y!!\n", ["x", ",", "Ġy", "!!Ċ"]),                      # punctuation takes the newlines after it
    ("你好 😀👍", ["ä½łå¥½", "ĠðŁĺĢðŁĳį"]),
])
def test_qwen_split(qwen_pair, text, pieces):
    ours, hf, _ = qwen_pair
    split = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str(text)]
    assert split == [p for p, _ in hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)] == pieces


def test_qwen_composes_to_nfc_before_the_split(qwen_pair):
    ours, hf, _ = qwen_pair
    assert ours.encode("cafe\u0301") == ours.encode("café") == hf.encode("café", add_special_tokens=False)


def test_qwen_gguf_file_matches_transformers_gguf_tokenizer_on_nfc_text(qwen_pair, tmp_path):
    """transformers reading the same GGUF file (it applies no NFC, as llama.cpp): equal on NFC text."""
    import gguf
    ours, hf, meta = qwen_pair
    w = gguf.GGUFWriter(str(tmp_path / "qwen-vocab.gguf"), "qwen2")
    add_qwen_tokenizer(w, meta)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from_file = Tokenizer.from_gguf_metadata(read_metadata(tmp_path / "qwen-vocab.gguf"))
    gguf_hf = hf_gguf_tokenizer(str(tmp_path), "qwen-vocab.gguf")
    texts = [t for t in QWEN_TRICKY + fuzz_strings(12, 300, QWEN_PARTS) if unicodedata.is_normalized("NFC", t)]
    assert [from_file.encode(t) for t in texts] == [gguf_hf.encode(t, add_special_tokens=False) for t in texts]
    assert from_file.stop_ids == frozenset({meta["tokenizer.ggml.eos_token_id"]})

"""Tokenizers built from GGUF metadata or a Hugging Face directory, and incremental detokenization."""
import bisect
import codecs
import json
import logging
import os

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from . import model_json

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp): 2 unknown, 3 control, 4 user-defined, 6 byte
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex applied before the byte-level mapping
_PRE_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# NOTE(nfc): Qwen2/2.5/3's own tokenizer (Qwen2TokenizerFast, tokenizer.json) composes the text to NFC before
# the split; llama.cpp and transformers' GGUF tokenizer skip that step, so they differ on decomposed input.
_NFC_FIRST = ("qwen2",)
_DIGITS_FIRST = ("smollm", "starcoder", "refact")   # every numeric char alone, then the GPT-2 regex
_DEFAULT_PRE = ("default", "gpt2", "gpt-2")

# Token strings that end a turn in common chat formats; stop ids include those present in the vocabulary.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _byte_alphabet():
    """GPT-2's byte -> printable unicode char table (printable latin-1 bytes map to themselves)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_CHAR_TO_BYTE = {c: b for b, c in _byte_alphabet().items()}


def _byte_level_bytes(piece):
    # NOTE(bytes): chars outside the alphabet stand for their own UTF-8, as the ByteLevel decoder does.
    return b"".join(bytes((_CHAR_TO_BYTE[c],)) if c in _CHAR_TO_BYTE else c.encode() for c in piece)


def _spm_bytes(piece):
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes((int(piece[3:5], 16),))
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()


_PIECE_BYTES = {"byte_level": _byte_level_bytes, "spm": _spm_bytes}


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens, stop ids and chat template."""

    def __init__(self, backend, *, kind, bos_id=None, eos_id=None, add_bos=False, chat_template=None,
                 extra_stop_ids=(), strip_leading_space=False, vocab_size=None):
        self._tk = backend
        self._kind = kind
        self._piece_bytes = _PIECE_BYTES[kind]
        self._strip = strip_leading_space
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, bool(add_bos)
        self.chat_template = chat_template or None
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        added = sorted(backend.get_added_tokens_decoder().items())
        self._special = frozenset(i for i, t in added if t.special)
        self.special_tokens = tuple(t.content for _, t in added if t.special)
        self._plain = None        # (start, after a control token) backends that leave special strings as text
        self._bytes = {}
        self.stop_ids = self._find_stop_ids(extra_stop_ids)

    # ---- construction

    @classmethod
    def from_gguf_metadata(cls, meta):
        """Builds the tokenizer a GGUF file describes (`meta` from `engine.gguf.read_metadata`)."""
        model = meta.get("tokenizer.ggml.model")
        if model in ("gpt2", "llama") and not meta.get("tokenizer.ggml.tokens"):
            raise ValueError("the GGUF file holds no vocabulary (tokenizer.ggml.tokens is missing or empty)")
        if model == "gpt2":
            backend, kind, strip = _gguf_byte_level(meta), "byte_level", False
        elif model == "llama":
            strip = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            backend, kind = _gguf_spm(meta, strip), "spm"
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {model!r} (supported: 'gpt2', 'llama')")
        extra = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        # NOTE(bos): llama.cpp adds BOS to an SPM vocabulary unless the file says otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", model == "llama")
        return cls(backend, kind=kind, bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_id=meta.get("tokenizer.ggml.eos_token_id"), add_bos=add_bos,
                   chat_template=meta.get("tokenizer.chat_template"), extra_stop_ids=extra,
                   strip_leading_space=strip, vocab_size=len(meta["tokenizer.ggml.tokens"]))

    @classmethod
    def from_hf_dir(cls, path):
        """Builds the tokenizer of a Hugging Face model directory (`tokenizer.json` and its configs)."""
        backend = model_json.tokenizer_from_file(os.path.join(path, "tokenizer.json"), _Backend)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        kind, strip = _decoder_kind(json.loads(backend.to_str()).get("decoder"))
        bos_id = _token_id(backend, config.get("bos_token"), gen.get("bos_token_id"))
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        eos_id = _token_id(backend, config.get("eos_token"), gen_eos[0] if gen_eos else None)
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(backend, bos_id)
        return cls(backend, kind=kind, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos,
                   chat_template=_hf_chat_template(path, config), extra_stop_ids=gen_eos,
                   strip_leading_space=strip)

    def _find_stop_ids(self, extra_ids):
        ids = {i for i in extra_ids if isinstance(i, int)}
        if self.eos_id is not None:
            ids.add(self.eos_id)
        ids.update(i for i in map(self._tk.token_to_id, END_OF_TURN_TOKENS) if i is not None)
        return frozenset(ids)

    # ---- encode / decode

    def encode(self, text, add_bos=False, plain=()):
        """Token ids of `text`; special-token strings map to their ids, except inside the `plain`
        (start, end) character spans (sorted, disjoint), which are text. BOS first when asked and known."""
        encoding = self._tk.encode(text, add_special_tokens=False)
        ids = self._encode_around(text, encoding, plain) if plain else encoding.ids
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _encode_around(self, text, encoding, plain):
        # NOTE(plain): `tokenizers` cuts the text at every special string and encodes the runs between
        # them apart. Runs between the control tokens that stay are kept; a run that held a special
        # string from a plain span is encoded again with special parsing off.
        starts, ends = [a for a, _ in plain], [b for _, b in plain]
        ids, run, begin, again = [], [], 0, False
        for token, (a, b) in zip(encoding.ids, encoding.offsets):
            if token not in self._special:
                run.append(token)
            elif _overlaps(starts, ends, a, b):
                run.append(token)
                again = True
            else:
                ids += self._as_text(text, begin, a) if again else run
                ids.append(token)
                run, begin, again = [], b, False
        return ids + (self._as_text(text, begin, len(text)) if again else run)

    def _as_text(self, text, start, end):
        """Ids of text[start:end] with special strings as text, as one run of a whole-text encode."""
        if self._plain is None:
            self._plain = _plain_backends(self._tk)
        at_start, later = self._plain
        piece = text[start:end]
        encoding = (later if start else at_start).encode(piece, add_special_tokens=False)
        ids = []
        for token, (a, b) in zip(encoding.ids, encoding.offsets):
            # NOTE(plain): BPE may merge plain text back into a control token; spell it out instead.
            if token in self._special:
                ids += [i for ch in piece[a:b] for i in later.encode(ch, add_special_tokens=False).ids]
            else:
                ids.append(token)
        return ids

    def decode(self, ids, skip_special=True):
        """Text of `ids`: token bytes joined, invalid UTF-8 replaced by U+FFFD."""
        # NOTE(decode): byte-level output equals the `tokenizers` ByteLevel decoder. For SPM byte
        # fallback we decode the joined bytes (as llama.cpp does), so a run of byte tokens with one
        # bad byte keeps its valid characters where `tokenizers` would replace the whole run.
        data = b"".join(self.token_bytes(i) for i in ids if not (skip_special and i in self._special))
        text = data.decode("utf-8", "replace")
        return text[1:] if self._strip and text.startswith(" ") else text

    def incremental_decoder(self, skip_special=True):
        """A fresh `IncrementalDecoder` for one generated sequence."""
        return IncrementalDecoder(self, skip_special)

    # ---- vocabulary

    @property
    def bos_token(self):
        return None if self.bos_id is None else self._tk.id_to_token(self.bos_id)

    @property
    def eos_token(self):
        return None if self.eos_id is None else self._tk.id_to_token(self.eos_id)

    @property
    def strips_leading_space(self):
        """True for SPM vocabularies whose decode drops the prefix space of the first piece."""
        return self._strip

    @property
    def backend(self):
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tk

    def id_to_piece(self, token_id):
        return self._tk.id_to_token(token_id)

    def piece_to_id(self, piece):
        return self._tk.token_to_id(piece)

    def is_special(self, token_id):
        return token_id in self._special

    def token_bytes(self, token_id):
        """The raw bytes one token stands for (b"" for an id outside the vocabulary)."""
        data = self._bytes.get(token_id)
        if data is None:
            piece = self._tk.id_to_token(token_id) if 0 <= token_id else None
            data = self._bytes[token_id] = b"" if piece is None else self._piece_bytes(piece)
        return data

    def token_text(self, token_id):
        """(text, bytes, width) of one token as logprobs show it: a special token by its name (width
        0), any other as its bytes decoded, invalid UTF-8 as \\x escapes; width is the characters it
        adds to the decoded text."""
        data = self.token_bytes(token_id)
        if self.is_special(token_id) or not data:
            return self.id_to_piece(token_id) or "", data, 0
        return data.decode("utf-8", "backslashreplace"), data, sum(1 for b in data if b & 0xC0 != 0x80)


class IncrementalDecoder:
    """Turns generated ids into text deltas whose concatenation (plus `flush`) equals `decode`.

    Each push decodes only the new token's bytes; an incomplete UTF-8 sequence is held back.
    """

    def __init__(self, tokenizer, skip_special=True):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._strip = tokenizer.strips_leading_space

    def push(self, token_id):
        """Text newly completed by `token_id` (may be empty)."""
        if self._skip and self._tok.is_special(token_id):
            return ""
        return self._emit(self._utf8.decode(self._tok.token_bytes(token_id)))

    def flush(self):
        """Whatever was held back, with any incomplete tail as U+FFFD."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text):
        if self._strip and text:
            # NOTE(spm-space): the SPM prefix space comes off the first character of the sequence only.
            self._strip = False
            if text[0] == " ":
                text = text[1:]
        return text


def _overlaps(starts, ends, a, b):
    """Whether [a, b) meets one of the sorted, disjoint spans (starts[i], ends[i])."""
    i = bisect.bisect_right(ends, a)
    return i < len(starts) and starts[i] < b


def _plain_backends(backend):
    """Copies of `backend` that tokenize special-token strings as text: one for a run at the text's
    start, one for a run after a control token (no SentencePiece "first" prefix space there)."""
    spec = json.loads(backend.to_str())
    at_start = _Backend.from_str(json.dumps(spec))
    later = _Backend.from_str(json.dumps(spec)) if _no_first_prefix(spec.get("pre_tokenizer")) else at_start
    for b in (at_start, later):
        b.encode_special_tokens = True      # set once here: encoding threads never toggle it
    return at_start, later


def _no_first_prefix(pre):
    """Turns Metaspace prepend_scheme "first" into "never" in a pre-tokenizer spec; True if it did."""
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "Sequence":
        return any([_no_first_prefix(p) for p in pre.get("pretokenizers", ())])
    if pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first":
        pre["prepend_scheme"] = "never"
        return True
    return False


# ---- GGUF builders


def _register_added(backend, meta):
    kinds = zip(meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ())
    special, user = [], []
    for token, kind in kinds:
        if kind in (_CONTROL, _UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:   # NOTE(user-defined): like `<think>`: kept whole, decoded as text
            user.append(AddedToken(token, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    return backend


def _gguf_byte_level(meta):
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = _Backend(_bpe(vocab, merges))
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _NFC_FIRST:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _byte_level_pre(pre)
    backend.decoder = decoders.ByteLevel()
    return _register_added(backend, meta)


def _byte_level_pre(pre):
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)   # GPT-2 split, then bytes
    if pre in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in _PRE_SPLITS:
        split = pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), "isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in _DEFAULT_PRE:
        log.warning("unknown GGUF pre-tokenizer %r; using the GPT-2 split", pre)
    return gpt2


def _gguf_spm(meta, add_space_prefix):
    tokens, scores = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = merges_from_scores(tokens, scores if scores is not None else [-float(i) for i in range(len(tokens))])
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = _Backend(_bpe(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # NOTE(spm-prefix): "first" prepends U+2581 to the text's start only, as transformers' GGUF
    # tokenizer does (llama.cpp also prepends after each special token).
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return _register_added(backend, meta)


def _bpe(vocab, merges, **options):
    """models.BPE from GGUF metadata; a vocabulary it refuses (a merge of unknown tokens, say) is a
    load error: ValueError, where tokenizers raises a bare Exception."""
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as e:   # the Rust side raises a plain Exception
        raise ValueError(f"the GGUF tokenizer cannot be built: {e}") from None


MAX_MERGE_WORK = 2 * 10 ** 9


def merges_from_scores(tokens, scores):
    """BPE merges for an SPM vocabulary: every split of a token into two vocabulary pieces, best
    resulting-token score first (ties: longer left piece, then longer right piece, then file order)."""
    # NOTE(merges-work): every split of every token is sliced: characters copied grow with the square
    # of a token's length. Real vocabularies (Gemma's 262k) copy ~10**7; a file's long tokens may not.
    work = sum(len(t) * len(t) for t in tokens)
    if work > MAX_MERGE_WORK:
        raise ValueError(f"the GGUF vocabulary's tokens are too long to derive merges from "
                         f"(longest {max(len(t) for t in tokens):,} characters)")
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in index and p[1] in index), key=lambda p: (index[p[0]], index[p[1]]))
        found.extend((score, left, right) for left, right in pairs)
    found.sort(key=lambda m: (-m[0], -len(m[1]), -len(m[2])))
    return [(left, right) for _, left, right in found]


# ---- Hugging Face directory helpers


def _read_json(path):
    return model_json.read_object(path, missing={})


def _decoder_kind(decoder):
    """("byte_level" | "spm", strip_leading_space) from a tokenizer.json decoder description."""
    steps = decoder.get("decoders", []) if decoder and decoder.get("type") == "Sequence" else [decoder or {}]
    types = {d.get("type") for d in steps}
    if "ByteLevel" in types:
        return "byte_level", False
    if types & {"ByteFallback", "Metaspace", "Replace"}:
        strip = any(d.get("type") == "Strip" and d.get("start", 0) > 0 for d in steps) or any(
            d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never"
            and d.get("add_prefix_space", True) for d in steps)
        return "spm", strip
    raise ValueError(f"unsupported tokenizer decoder {sorted(t for t in types if t)}")


def _token_id(backend, token, fallback_id):
    if isinstance(token, dict):
        token = token.get("content")
    found = backend.token_to_id(token) if isinstance(token, str) else None
    return found if found is not None else fallback_id


def _post_processor_adds(backend, bos_id):
    with_special = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    return bos_id is not None and len(with_special) > len(plain) and with_special[0] == bos_id


def _hf_chat_template(path, config):
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template     # not text: ChatTemplate.checked reports it

"""The JSON a model directory ships (config.json, tokenizer.json, tokenizer_config.json, ...), read as
untrusted input: every failure is a ValueError naming the file, never another exception, a hang or
a huge allocation.

- `loads` / `read_object`: bad UTF-8, bad JSON, nesting past the parser's depth (RecursionError) and
  files over their size limit are ValueErrors;
- `tokenizer_from_file`: tokenizer.json checked before `tokenizers` builds it (token ids bounded by
  the number of tokens it lists: an id of 2**31 makes `tokenizers` build tables that large, ~30 s),
  and a panic in its Rust code (pyo3's PanicException, a BaseException) turned into a ValueError.
"""
import json
import os

MAX_JSON_BYTES = 64 << 20           # config-like files (real ones: a few KB)
MAX_TOKENIZER_BYTES = 512 << 20     # tokenizer.json (Gemma 3's: 33 MB)
ID_SLACK = 1 << 16                  # ids past the listed tokens' count a vocabulary may leave unused


def loads(text, name):
    """The JSON value of `text` (str or bytes); ValueError naming `name` for any failure."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{name} nests too deeply to read") from None
    except ValueError as exc:   # bad JSON or bad UTF-8
        raise ValueError(f"{name} is not valid JSON ({str(exc)[:200]})") from None


def read_text(path, name=None, limit=MAX_JSON_BYTES):
    """The bytes of `path`, at most `limit` of them. ValueError past it, or when the file is missing
    or unreadable (naming the file, not its path: load errors reach clients)."""
    name = name or os.path.basename(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise ValueError(f"{name} is {size:,} bytes, over the {limit:,} this server reads")
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"the model has no {name}") from None
    except OSError as exc:
        raise ValueError(f"{name} cannot be read ({exc.strerror or type(exc).__name__})") from None


def read_object(path, name=None, missing=None, limit=MAX_JSON_BYTES):
    """The JSON object in `path`; `missing` when there is no such file; ValueError when it is not
    one."""
    name = name or os.path.basename(path)
    if not os.path.isfile(path):
        return missing
    value = loads(read_text(path, name, limit), name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def is_classifier_dir(path):
    """True for a directory whose config.json names a ...ForSequenceClassification architecture (a
    cross-encoder: cross_encoder.py loads the ones it supports); False for anything unreadable."""
    try:
        cfg = read_object(os.path.join(path, "config.json"), "config.json") if os.path.isdir(path) else None
    except ValueError:
        return False
    archs = cfg.get("architectures") if cfg else None
    return isinstance(archs, list) and any(isinstance(a, str) and a.endswith("ForSequenceClassification")
                                           for a in archs)


def tokenizer_from_file(path, tokenizer_class=None):
    """A `tokenizers.Tokenizer` from tokenizer.json at `path`, checked first (see check_tokenizer)."""
    if tokenizer_class is None:
        from tokenizers import Tokenizer as tokenizer_class
    raw = read_text(path, "tokenizer.json", MAX_TOKENIZER_BYTES)
    spec = loads(raw, "tokenizer.json")
    check_tokenizer(spec)
    try:
        return tokenizer_class.from_str(raw.decode("utf-8"))
    except BaseException as exc:    # noqa: BLE001 - tokenizers raises plain Exceptions, and panics
        if not (isinstance(exc, Exception) or type(exc).__name__ == "PanicException"):
            raise
        raise ValueError(f"tokenizer.json cannot be read: {str(exc)[:300]}") from None


def check_tokenizer(spec):
    """What `tokenizers` would trust in tokenizer.json and pay for by its value: every token id (in
    the model's vocabulary and the added tokens) a natural number below the count of tokens listed
    plus ID_SLACK. Shapes are `tokenizers`' own to check."""
    if not isinstance(spec, dict):
        raise ValueError("tokenizer.json is not a JSON object")
    model = spec.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = spec.get("added_tokens")
    ids = []
    if isinstance(vocab, dict):                       # BPE, WordPiece, WordLevel: token -> id
        ids.extend(vocab.values())
    n = len(vocab) if isinstance(vocab, (dict, list)) else 0   # Unigram: a list, ids are positions
    if isinstance(added, list):
        n += len(added)
        ids.extend(t.get("id") for t in added if isinstance(t, dict))
    top = n + ID_SLACK
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < top:
            raise ValueError(f"tokenizer.json has token id {str(i)[:40]}: ids run from 0 to below {top:,} "
                             f"for its {n:,} tokens")
    if isinstance(model, dict) and model.get("type") == "Unigram":
        unk = model.get("unk_id")
        if unk is not None and (isinstance(unk, bool) or not isinstance(unk, int) or not 0 <= unk < max(n, 1)):
            raise ValueError(f"tokenizer.json's unk_id {str(unk)[:40]} is not one of its {n:,} tokens")

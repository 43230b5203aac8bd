import os
import random

import pytest

from turbospark_wsgi.engine.gguf import read_metadata
from turbospark_wsgi.engine.tokenizer import Tokenizer

MODELS = os.path.expanduser(os.environ.get("TURBOSPARK_MODELS", "~/.cache/turbospark/models"))
SMOL = os.path.join(MODELS, "SmolLM2-135M-Instruct.Q4_1.gguf")
STORIES = os.path.normpath(os.path.join(os.path.dirname(__file__), "../../../shared/models/stories260K.gguf"))

TEXTS = ["😀 emoji 🎉👍🏽 mix", "你好，世界。日本語のテキスト", "naïve café ① Ⅻ", "plain ascii text", "a😀b你c"]


def load(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} not found")
    return Tokenizer.from_gguf_metadata(read_metadata(path))


@pytest.fixture(scope="module", params=["smol", "stories"])
def tok(request):
    return load(SMOL if request.param == "smol" else STORIES)


def stream(tok, ids, skip_special=True):
    dec = tok.incremental_decoder(skip_special=skip_special)
    chunks = [dec.push(i) for i in ids]
    return chunks, dec.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_split_characters_never_yield_replacement_mid_stream(tok, text):
    ids = tok.encode(text)
    chunks, tail = stream(tok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) + tail == text == tok.decode(ids)
    assert tail == ""


def test_multibyte_characters_really_span_several_tokens(tok):
    ids = tok.encode("😀")
    assert len(ids) >= 2                        # so the test above exercises the hold-back
    chunks, _ = stream(tok, ids)
    assert chunks[:-1] == [""] * (len(ids) - 1) and chunks[-1] == "😀"


def random_ids(tok, rng):
    # Bias towards short, byte-heavy and special tokens, where UTF-8 gets split.
    pools = [range(tok.vocab_size), range(0, 300), range(min(20, tok.vocab_size))]
    return [rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 40))]


def test_concatenation_equals_decode_for_random_ids(tok):
    rng = random.Random(7)
    for _ in range(2000):
        ids = random_ids(tok, rng)
        for skip in (True, False):
            chunks, tail = stream(tok, ids, skip)
            assert "".join(chunks) + tail == tok.decode(ids, skip_special=skip), ids


def test_incomplete_tail_is_flushed_like_decode(tok):
    ids = tok.encode("ok😀")[:-1]                # the emoji's last byte missing
    chunks, tail = stream(tok, ids)
    assert "".join(chunks) == "ok" and tail == "\ufffd" == tok.decode(ids)[-1]


def test_sentencepiece_prefix_space_is_stripped_once():
    tok = load(STORIES)
    ids = [tok.bos_id, *tok.encode("Once upon a time")]
    chunks, tail = stream(tok, ids)
    assert chunks[1] == "Once" and "".join(chunks) + tail == "Once upon a time"


def test_special_tokens_are_skipped_or_kept():
    tok = load(SMOL)
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert "".join(stream(tok, ids)[0]) == "assistant\nHi"
    assert "".join(stream(tok, ids, skip_special=False)[0]) == "<|im_start|>assistant\nHi<|im_end|>"

import itertools

import pytest

from turbospark_wsgi.http.parsers.reasoning import CONTENT, REASONING, ReasoningSplitter

CASES = [
    # (text, in_reasoning, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nThe answer is 4.", False, "Let me see.", "The answer is 4."),
    ("No thinking here.", False, None, "No thinking here."),
    ("Let me see.</think>Four.", True, "Let me see.", "Four."),
    ("<think>unfinished thought", False, "unfinished thought", ""),
    ("<think></think>Just this.", False, "", "Just this."),
    ("Before </think>after", False, None, "Before after"),      # orphan end tag removed
    ("a < b and c <th d", False, None, "a < b and c <th d"),   # tag look-alikes stay
    ("<think>x < y</thin k></think>done", False, "x < y</thin k>", "done"),
]


def split_reasoning(text, in_reasoning=False):
    """(reasoning, content) of a whole generated text; reasoning is None when there was none."""
    splitter = ReasoningSplitter(in_reasoning=in_reasoning)
    pieces = splitter.feed(text) + splitter.flush()
    return (joined(pieces, REASONING) if splitter.saw_reasoning else None), joined(pieces, CONTENT)


def stream(text, cuts, in_reasoning):
    splitter = ReasoningSplitter(in_reasoning=in_reasoning)
    bounds = [0, *cuts, len(text)]
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        pieces += splitter.feed(text[a:b])
    return pieces + splitter.flush()


def joined(pieces, kind):
    return "".join(t for k, t in pieces if k == kind)


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_split_whole_text(text, in_reasoning, reasoning, content):
    assert split_reasoning(text, in_reasoning) == (reasoning, content)


@pytest.mark.parametrize("text,in_reasoning,reasoning,content", CASES)
def test_every_two_cut_split_gives_the_same_result(text, in_reasoning, reasoning, content):
    for cuts in itertools.combinations(range(1, len(text)), 2):
        pieces = stream(text, cuts, in_reasoning)
        assert joined(pieces, REASONING) == (reasoning or ""), cuts
        assert joined(pieces, CONTENT) == content, cuts
        for _, piece in pieces:  # no tag or fragment of one, ever
            assert "<think>" not in piece and "</think>" not in piece
            assert piece, "empty pieces are never emitted"


def test_char_by_char_never_leaks_tag_fragments():
    text = "<think>\nstep one\nstep two\n</think>\n\nResult."
    pieces = stream(text, range(1, len(text)), False)
    assert joined(pieces, REASONING) == "step one\nstep two"
    assert joined(pieces, CONTENT) == "Result."
    assert all("<" not in t for _, t in pieces)


def test_reasoning_is_streamed_before_the_end_tag():
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>abc") == [(REASONING, "abc")]
    assert splitter.feed(" def</") == [(REASONING, " def")]
    assert splitter.feed("think>ok") == [(CONTENT, "ok")]

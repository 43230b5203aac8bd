import itertools

import pytest

from turbospark_wsgi.engine.stops import StopMatcher


def run(pieces, stops):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit is not None:
            return out, hit
    out.append(m.flush())
    return out, None


def test_no_stops_passes_text_through():
    assert run(["a", "b"], []) == (["a", "b", ""], None)


@pytest.mark.parametrize("cut", range(1, 12))
def test_stop_split_anywhere_never_leaks(cut):
    text = "hello STOP world"
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    out, hit = run(pieces, ["STOP"])
    assert hit == "STOP"
    assert "".join(out) == "hello "
    for emitted in itertools.accumulate(out):
        assert "S" not in emitted


def test_partial_prefix_that_does_not_complete_is_released():
    out, hit = run(["ab", "S", "T", "x", "y"], ["STOP"])
    assert hit is None
    assert out == ["ab", "", "", "STx", "y", ""]


def test_earliest_stop_wins_and_longest_on_tie():
    assert run(["xx END yy ST"], ["ST", "END"]) == (["xx "], "END")
    assert run(["a<end>"], ["<e", "<end>"]) == (["a"], "<end>")


def test_held_text_is_released_at_flush():
    out, hit = run(["abc", "<|e"], ["<|end|>"])
    assert hit is None and "".join(out) == "abc<|e"
    assert out[1] == ""

from turbospark_wsgi.http.parsers.holdback import partial_tag_len, split_at_tag


def test_partial_tag_len_finds_longest_proper_prefix():
    assert partial_tag_len("abc <thi", ["<think>"]) == 4
    assert partial_tag_len("abc <", ["<think>", "</think>"]) == 1
    assert partial_tag_len("abc </", ["<think>", "</think>"]) == 2
    assert partial_tag_len("abc", ["<think>"]) == 0
    # a complete tag is not "partial": the caller finds it with split_at_tag
    assert partial_tag_len("x<think>", ["<think>"]) == 0


def test_partial_tag_len_short_text():
    assert partial_tag_len("<", ["<tool_call>"]) == 1
    assert partial_tag_len("", ["<tool_call>"]) == 0


def test_split_at_tag_picks_earliest():
    assert split_at_tag("a</think>b<think>c", ["<think>", "</think>"]) == ("a", "</think>", "b<think>c")
    assert split_at_tag("plain", ["<think>"]) == ("plain", None, "")


def test_hold_len_includes_whitespace_before_a_partial_tag():
    from turbospark_wsgi.http.parsers.holdback import hold_len
    assert hold_len("Hello there <", ["<tool_call>"]) == 2
    assert hold_len("Hello there\n\n", ["<tool_call>"]) == 2
    assert hold_len("Hello there", ["<tool_call>"]) == 0

"""The one "withhold the ambiguous tail" routine shared by the streaming tag parsers."""


def partial_tag_len(text, tags):
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`.

    A streaming parser releases `text[:len(text) - partial_tag_len(text, tags)]` and keeps the rest,
    so no fragment of a tag split across deltas ever reaches a client.
    """
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def split_at_tag(text, tags):
    """(before, tag, after) at the earliest complete tag, or (text, None, "") when none occurs."""
    hit, hit_tag = -1, None
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (hit < 0 or i < hit):
            hit, hit_tag = i, tag
    if hit < 0:
        return text, None, ""
    return text[:hit], hit_tag, text[hit + len(hit_tag):]


def hold_len(text, tags):
    """How much of `text`'s tail to withhold: a partial tag plus the whitespace just before it.

    The whitespace waits too because it is dropped when a tag does follow.
    """
    partial = partial_tag_len(text, tags)
    head = text[:len(text) - partial]
    return partial + len(head) - len(head.rstrip())

"""Split `<think>...</think>` out of generated text, incrementally, tags split anywhere."""
from .holdback import hold_len, split_at_tag

REASONING = "reasoning"
CONTENT = "content"


class ReasoningSplitter:
    """Feed text deltas; get back `(kind, text)` pieces, kind REASONING or CONTENT.

    `in_reasoning=True` when the prompt already opened the block (DeepSeek-R1 style templates end
    the generation prompt with `<think>`). Whitespace around the block is dropped, and an orphan
    end tag in content is removed rather than shown.
    """

    def __init__(self, start="<think>", end="</think>", in_reasoning=False):
        self._start, self._end = start, end
        self._kind = REASONING if in_reasoning else CONTENT
        self._buf = ""
        self._strip_lead = in_reasoning
        self.saw_reasoning = in_reasoning

    def feed(self, text):
        self._buf += text
        out = []
        while self._step(out):
            pass
        return out

    def flush(self):
        out = []
        rest, self._buf = self._buf, ""
        self._emit(out, rest.rstrip() if self._kind == REASONING else rest)
        return out

    def _tags(self):
        # NOTE(reasoning): in content an end tag is an orphan (continuation turns); it is removed.
        return (self._end,) if self._kind == REASONING else (self._start, self._end)

    def _step(self, out):
        tags = self._tags()
        before, tag, after = split_at_tag(self._buf, tags)
        if tag is None:
            cut = len(self._buf) - hold_len(self._buf, tags)
            self._emit(out, self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        if self._kind == REASONING:
            self._emit(out, before.rstrip())
            self._kind = CONTENT
        else:
            self._emit(out, before.rstrip() if tag == self._start else before)
            if tag == self._start:
                self._kind = REASONING
                self.saw_reasoning = True
        self._strip_lead = True
        self._buf = after
        return True

    def _emit(self, out, text):
        if self._strip_lead:
            text = text.lstrip()
        if text:
            self._strip_lead = False
            out.append((self._kind, text))

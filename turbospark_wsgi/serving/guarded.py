"""Output guardrails on a generation's service events: text is held back while it may still become a
match, redacted, or cut off by a block before any of the blocked text is sent.

    events = GuardedEvents(events, rules, choices)     # same interface as a Generation

NOTE(holdback): of each choice's text, the tail that could still grow into a match (the longest
start of a literal, the run of characters a PII kind is made of, a regex's longest match) is held
back, as stop strings are; a match is acted on once it is complete (text after it has come, or the
run ended). The model's raw output is guarded, so reasoning text and tool-call arguments are too.
"""
import dataclasses

from ..errors import InvalidRequest
from .generation import Finished, TextDelta, Usage
from .guardrails import Folded, Hit, record, redact, select, unique

CONTENT_FILTER = "content_filter"
CONTEXT = 16        # folded characters before the unsent text that regexes see (word boundaries)


class _Choice:
    """One choice's text as the guard holds it."""

    def __init__(self, detectors):
        self._detectors = detectors
        self._tail = ""             # the raw text not sent yet: from raw index self._sent on
        self._folded = Folded()
        self._done = 0              # folded characters decided (sent, or redacted and sent)
        self._sent = 0              # raw characters sent (or redacted): where the next text starts
        self._entries = []          # [(TokenLogprob, raw end)] not yet sent
        self._raw_tokens = 0        # raw characters the logprob entries account for
        self._redacted = []         # raw spans redacted, for the entries over them
        self.fired = []             # [(rule id, action)]

    def feed(self, text, logprobs, final=False):
        """(the text now safe to send, its logprob entries or None, the blocking Hit or None)."""
        self._tail += text
        folded = self._folded
        folded.feed(text)
        if logprobs is not None:
            for entry in logprobs:
                self._raw_tokens += entry.text_len
                self._entries.append((entry, self._raw_tokens))
        n, done = len(folded), self._done
        start = done - CONTEXT if done > CONTEXT else 0
        found, held = self._detectors.scan(folded.text(start), done - start, final)
        ready = n if final else max(done, n - held)
        acted = select([Hit(h.start + start, h.end + start, h.rule, h.label) for h in found
                        if h.start + start < ready]) if found else ()
        block = next((h for h in acted if h.rule.action == "block"), None)
        if block is not None:
            acted = [h for h in acted if h.end <= block.start]
            upto = block.start
        else:
            upto = max([ready] + [h.end for h in acted])
        sent = folded.raw_at(upto)
        if acted:
            out = redact(self._tail, folded, acted, done, upto, at=self._sent, base=self._sent)
            for hit in acted:
                self._redacted.append((folded.raw_at(hit.start), folded.raw_at(hit.end)))
                record(hit.rule, "output", "redact")
                self.fired.append((hit.rule.id, "redact"))
        else:
            out = self._tail[:sent - self._sent]
        self._tail = self._tail[sent - self._sent:]
        self._done, self._sent = upto, sent
        entries = self._take(folded.raw_len if final and block is None else sent, block is not None) \
            if self._entries else []
        return out, (entries if logprobs is not None or entries else None), block

    def _take(self, upto, dropping):
        """The logprob entries of text sent up to raw index `upto`; those over a redaction show it."""
        out = []
        while self._entries and self._entries[0][1] <= upto:
            entry, end = self._entries.pop(0)
            begin = end - entry.text_len
            if any(a < end and begin < b for a, b in self._redacted):
                entry = dataclasses.replace(entry, token="[REDACTED]", bytes=b"[REDACTED]", top=[])
            out.append(entry)
        if dropping:
            self._entries = []      # NOTE(block): the blocked text's tokens are never shown
        return out


class GuardedEvents:
    """A Generation (or PromptBatch) whose TextDeltas pass through the output rules of `rules`;
    `choices`: how many choice indices it has. Everything else is the wrapped generation's."""

    def __init__(self, events, rules, choices):
        self._events, self._detectors, self._total = events, rules.output, choices
        self._choices, self._finished = {}, set()
        self.blocked = None         # the rule id that cut the generation
        self._usage = None
        self._gen = self._run()

    def __getattr__(self, name):
        return getattr(self._events, name)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._gen)

    def close(self):
        try:
            self._gen.close()
        finally:
            self._events.close()

    @property
    def finish_reason(self):
        return CONTENT_FILTER if self.blocked else self._events.finish_reason

    @property
    def usage(self):
        return self._usage if self.blocked else self._events.usage

    @property
    def guardrails_fired(self):
        fired = [f for c in self._choices.values() for f in c.fired]
        return unique(fired + ([(self.blocked, "block")] if self.blocked else []))

    def _choice(self, index):
        found = self._choices.get(index)
        if found is None:
            found = self._choices[index] = _Choice(self._detectors)
        return found

    def _run(self):
        for event in self._events:
            if isinstance(event, TextDelta):
                text, logprobs, block = self._choice(event.index).feed(event.text, event.logprobs)
            elif isinstance(event, Finished):
                text, logprobs, block = self._choice(event.index).feed("", None, final=True)
            else:
                yield event
                continue
            if text or logprobs:
                yield TextDelta(text, logprobs, event.index)
            if block is not None:
                yield from self._block(block, event.index)
                return
            if isinstance(event, Finished):
                self._finished.add(event.index)
                yield dataclasses.replace(event, guardrails=tuple(unique(self._choice(event.index).fired)))

    def _block(self, hit, index):
        """Ends the whole generation: the engine stops now; every choice not finished yet ends with
        content_filter (the blocked one naming its rule)."""
        record(hit.rule, "output", "block")
        self.blocked = hit.rule.id
        events = self._events
        self._usage = Usage(events.prompt_tokens, events.produced_tokens)
        events.close()      # NOTE(slot): the engine stops and the queue slot is freed before the reply ends
        remaining = sorted(set(range(self._total)) - self._finished) or [index]
        for k, i in enumerate(remaining):
            fired = unique(self._choice(i).fired + ([(hit.rule.id, "block")] if i == index else []))
            yield Finished(CONTENT_FILTER, self._usage, None, i, k == len(remaining) - 1, tuple(fired))


_NOT_TEXT = frozenset(("role", "type", "id", "tool_call_id", "name"))


def input_fields(gen, prefix="messages"):
    """Every client text of a GenerationRequest that input rules read, as (param, text, put) with
    `put(new_text)` writing a redaction back: the messages' contents and tool-call arguments (chat),
    the prompt or prompts (completions). Token-id prompts are refused: no rule could read them."""
    fields = []
    if gen.chat is not None:
        for i, message in enumerate(gen.chat.messages):
            _strings(message, f"{prefix}[{i}]", fields)
        return fields
    if gen.prompt_ids is not None or any(not isinstance(p, str) for p in gen.prompts or ()):
        raise InvalidRequest("This server's guardrails read prompts as text: send 'prompt' as a string "
                             "(or strings), not token ids.", param="prompt", code="content_filter")
    if gen.prompt is not None:
        fields.append(("prompt", gen.prompt, lambda v: setattr(gen, "prompt", v)))
    for i, _ in enumerate(gen.prompts or ()):
        fields.append((f"prompt[{i}]", gen.prompts[i], lambda v, i=i: gen.prompts.__setitem__(i, v)))
    return fields


def _strings(node, param, fields):
    """(param, text, put) of every string under a message dict or list (ids and roles left out)."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in list(items):
        where = f"{param}.{key}" if isinstance(node, dict) else f"{param}[{key}]"
        if isinstance(value, str):
            if not (isinstance(node, dict) and key in _NOT_TEXT):
                fields.append((where, value, lambda v, node=node, key=key: node.__setitem__(key, v)))
        elif isinstance(value, (dict, list)):
            _strings(value, where, fields)

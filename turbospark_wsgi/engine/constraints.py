"""Constrained decoding: a grammar compiled against the model's tokenizer, one matcher per sequence.

    compiler = ConstraintCompiler(tokenizer, vocab_size)     # one per engine; builds llguidance's tokenizer once
    grammar = compiler.compile({"grammars": [{"json_schema": {...}}]})   # ValueError names the problem
    c = grammar.start()                                      # a fresh Constraint for one sequence
    mask = c.allowed_mask()                                  # bool[V]; the Sampler sets the rest to -inf
    c.advance(token)                                         # after the choice; c.is_done() at the end

The grammar spec is llguidance's JSON grammar format (`{"grammars": [{"json_schema": ...} |
{"lark_grammar": "..."}]}`), so callers describe what they want without importing the library.
"""
import json
import threading

import numpy as np

from .events import ConstraintError


class ConstraintCompiler:
    """Compiles grammar specs for one tokenizer; the llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer, vocab_size):
        self._tokenizer = tokenizer
        self._vocab = int(vocab_size)
        self._ll = None
        self._lock = threading.Lock()

    def compile(self, grammar):
        """A `Grammar` for the spec (a dict or its JSON text); ValueError when it cannot compile.

        Every failure is a ValueError (the caller's 400), whatever raised it: client schemas can
        be deep, odd or huge. A grammar that fails at its very first step fails here, not in the
        middle of a batch."""
        tokenizer = self.ll_tokenizer()
        try:
            spec = grammar if isinstance(grammar, str) else json.dumps(grammar)
            compiled = Grammar(self._matcher(tokenizer, spec), self._vocab)
            compiled.start().allowed_mask()
        except Exception as e:                      # RecursionError, TypeError, llguidance's own
            raise ValueError(_short(e)) from None
        except BaseException as e:
            if type(e).__name__ != "PanicException":    # NOTE(pyo3): a Rust panic is a BaseException
                raise
            raise ValueError(f"the grammar compiler failed: {_short(e)}") from None
        return compiled

    @staticmethod
    def _matcher(tokenizer, spec):
        import llguidance
        matcher = llguidance.LLMatcher(tokenizer, spec, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def ll_tokenizer(self):
        # NOTE(llg-tokenizer): building it walks the whole vocabulary (~0.1-1 s): once per engine.
        with self._lock:
            if self._ll is None:
                import llguidance
                eos = self._tokenizer.eos_id
                self._ll = llguidance.LLTokenizer(_text_tokens_unmarked(self._tokenizer.backend.to_str()),
                                                  n_vocab=self._vocab, eos_token=eos)
            return self._ll


def _text_tokens_unmarked(spec):
    """The tokenizer.json llguidance reads, with only control tokens left in `added_tokens`.

    NOTE(added-tokens): llguidance takes an added token spelled `<...>` for a special one even when the
    vocabulary means it as text (Qwen's `<tool_call>`, `<think>`): its mask then offers `</tool_call>`
    as one token and its matcher refuses it. Left in the vocabulary only, such a token is plain text
    to the grammar, as it is to our decoder."""
    spec = json.loads(spec)
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or () if t.get("special")]
    return json.dumps(spec)


class Grammar:
    """A compiled grammar; `start()` gives each sequence its own matcher state."""

    def __init__(self, matcher, vocab_size):
        self._matcher = matcher
        self._vocab = vocab_size

    def start(self):
        return Constraint(self._matcher.deep_copy(), self._vocab)


class Constraint:
    """The grammar state of one sequence: which tokens may come next."""

    def __init__(self, matcher, vocab_size):
        self._m = matcher
        self._vocab = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed_mask(self):
        """bool[V]: True where the token keeps the output inside the grammar (EOS once it may end)."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._m.is_error():
            raise ConstraintError(f"constraint failed: {_short(self._m.get_error())}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")     # [32 * words]
        return bits[:self._vocab].astype(bool)

    def advance(self, token):
        if not self._m.consume_token(int(token)):
            raise ConstraintError(f"constraint rejected token {token}: {_short(self._m.get_error())}")

    def valid_prefix(self, tokens):
        """How many of `tokens` the grammar allows in a row from here (the state does not move)."""
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def is_done(self):
        """True once the grammar is complete and only the end of the sequence may follow."""
        return self._m.is_stopped() or self._m.is_accepting() and not self.allowed_mask().sum() > 1


class ThinkingBudget:
    """Ends reasoning after `budget` tokens (Anthropic's `thinking.budget_tokens`, OpenAI's
    `reasoning_effort` through TURBOSPARK_REASONING_BUDGETS): once that many tokens were generated
    inside open think tags, only the closing tag's tokens may come until it is written; then the
    model answers. The budget is for the whole reply. Where the open tag is one token (every
    template we know), it may not come inside an open block, nor again once the budget is spent;
    a longer open tag opened again once the budget is spent is closed at once. Whether the prompt
    already opened the tag (templates that start the reply inside `<think>`) is read from the
    prompt's ids. `budget` None: nothing is forced, the reasoning tokens are only counted (`thought`).

    The Constraint protocol, with `allowed_mask()` None while every token is allowed."""

    def __init__(self, budget, open_ids, close_ids, prompt_ids, vocab_size):
        self.budget = None if budget is None else int(budget)
        self._open, self._close, self._vocab = list(open_ids), list(close_ids), vocab_size
        self._ids = list(prompt_ids)
        self.thinking = _last(self._ids, self._open) > _last(self._ids, self._close)
        self.opened = self.thinking              # a think block was open at some point of the reply
        self.thought, self._forcing = 0, None      # reasoning tokens so far; next index into close_ids when forcing
        self._no_open = None                       # the mask without the (one-token) open tag, made on first use
        self._spent_check()

    @property
    def spent(self):
        return self.budget is not None and self.thought >= self.budget

    def _spent_check(self):
        if self.thinking and self._forcing is None and self.spent:
            self._forcing = 0

    def allowed_mask(self):
        if self._forcing is not None:
            mask = np.zeros(self._vocab, dtype=bool)
            mask[self._close[self._forcing]] = True
            return mask
        if self.budget is not None and len(self._open) == 1 and (self.thinking or self.spent):
            if self._no_open is None:
                self._no_open = np.ones(self._vocab, dtype=bool)
                self._no_open[self._open[0]] = False
            return self._no_open
        return None

    def advance(self, token):
        self._ids.append(int(token))
        if self._forcing is not None:
            if token == self._close[self._forcing]:
                self._forcing += 1
                if self._forcing == len(self._close):
                    self._forcing, self.thinking = None, False
            else:                   # NOTE(within): a grammar kept the tag from closing here; it goes on
                self._forcing = 0
                self.thought += 1
        elif self.thinking:
            if self._ids[-len(self._close):] == self._close:
                self.thinking = False
            else:
                self.thought += 1
        elif self._ids[-len(self._open):] == self._open:
            self.thinking = self.opened = True
        self._spent_check()

    def is_done(self):
        return False


class ThinkThenGrammar:
    """A think budget before a client's grammar (response_format, a forced tool call): the reply may
    open a think block first (a template that opens it in the prompt starts inside one), which the
    budget governs; the grammar takes over once the block is closed, or at once when the reply
    does not open one. So a reasoning model reasons, then answers in the schema.

    NOTE(tokens): the grammar sees only the tokens after the think block; the open tag is offered
    beside the grammar's first tokens (one-token tags)."""

    def __init__(self, budget, grammar):
        self.budget, self.grammar = budget, grammar
        self._started = False       # the grammar has taken over

    @property
    def thought(self):
        return self.budget.thought

    def allowed_mask(self):
        if self._started:
            return self.grammar.allowed_mask()
        if self.budget.thinking:
            return self.budget.allowed_mask()
        mask = self.grammar.allowed_mask().copy()       # the first token: the grammar's, or the open tag
        if len(self.budget._open) == 1 and not self.budget.spent:
            mask[self.budget._open[0]] = True
        return mask

    def advance(self, token):
        if self._started:
            self.grammar.advance(token)
            return
        was = self.budget.thinking
        self.budget.advance(token)
        if was and not self.budget.thinking:
            self._started = True            # the block closed: the grammar starts with the next token
        elif not was and not self.budget.thinking:
            self.grammar.advance(token)     # NOTE(no-think): the reply went straight into the grammar
            self._started = True

    def valid_prefix(self, tokens):
        return self.grammar.valid_prefix(tokens) if self._started else 0

    def is_done(self):
        return self._started and self.grammar.is_done()


def _limits():
    """llguidance's resource limits, its defaults except where a client schema could hold the
    compute thread for seconds: the lexer's build budget (the default lets 10,000 patterned
    properties compile for ~5 s) and the terse errors (the verbose ones dump parser state)."""
    import llguidance
    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, verbose_errors=False)


def _last(ids, seq):
    """The end of the last occurrence of `seq` in `ids`, or -1."""
    n = len(seq)
    for end in range(len(ids), n - 1, -1):
        if ids[end - n:end] == seq:
            return end
    return -1


def _short(message, limit=400):
    message = " ".join(str(message).split())
    return message if len(message) <= limit else message[:limit] + "..."

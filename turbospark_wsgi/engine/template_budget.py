"""A budget for rendering a model's chat template: the template is code from the model file, run on
every chat request, so its work, the sizes of what it builds and its time are bounded.

    env = BoundedEnvironment(...)               # a sandbox whose templates count their work
    with Budget(Limits(chars=..., ops=..., seconds=...)).active():
        text = render(template, context)        # BudgetExceeded past any limit

What is counted, and why that bounds a render:
- every call (functions, methods, macros, filters) and every loop iteration is a step (calls also
  pay for the size of what they read), and the clock is read at each step: a template's only ways
  to repeat work are loops and calls;
- a string, list or number is checked before it is built where one operation could make it large
  (`*`, `+`, `**`, `%`, `~`, `join`, `replace`, `center`, `indent`, format widths, ...) and after
  every call: none may pass `chars` characters or items;
- everything written as output or built by a call or an operator counts against `produced`, so
  many values, each within the size limit, cannot add up to more memory than that.
So a render ends within its steps and seconds, and its memory stays within a small multiple of
`chars`, whatever the template does.

A render that runs past GENTLE_AFTER seconds (real ones take a few milliseconds) gives way: every
GENTLE_EVERY steps it sleeps GENTLE_PAUSE without the GIL, so the engine's thread (which takes the
GIL back after each kernel call) and gevent's hub find it free instead of waiting out the
interpreter's 5 ms switch interval, and other models' streams keep their pace while it runs out
its time.
"""
import contextlib
import contextvars
import functools
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

MAX_SOURCE_CHARS = 1 << 20        # a template's source (real ones: 1-30 KB)
MAX_INT_BITS = 1 << 14            # numbers a template computes (2**16384 is plenty for a chat prompt)
MAX_TOJSON_INDENT = 16
PRODUCED_FACTOR = 8               # everything built, in all: this many times `chars` (+ the input's size)
_COST_SHIFT = 3                   # a call reading n characters or items is 1 + n/8 steps
GENTLE_AFTER = 0.02               # seconds; then a render gives the GIL away
GENTLE_EVERY = 8                  # steps
GENTLE_PAUSE = 0.0002             # seconds without the GIL, every GENTLE_EVERY steps


@dataclass(frozen=True, slots=True)
class Limits:
    chars: int = 1 << 20          # the largest string or list a template may build, and its output
    # PERF(template-ops): real templates (Qwen 2.5, Qwen3, R1) on 101 messages and 20 tools: ~23,000
    # steps, 3 ms; 300,000 steps of the costliest kind (a call a step) take ~0.4 s on this server's CPUs.
    ops: int = 300_000            # steps (calls, loop iterations, output pieces), plus the input's size
    seconds: float = 1.0


class BudgetExceeded(Exception):
    """A render passed one of its limits; the message says which."""


_current = contextvars.ContextVar("template_budget", default=None)


class Budget:
    """One render's remaining steps, characters and time. `input_size` (characters and items of the
    conversation) widens steps and `produced` so that a large conversation is no template's fault."""

    __slots__ = ("limits", "ops", "produced", "deadline", "gentle_at", "_sleep", "_turn")

    def __init__(self, limits=Limits(), input_size=0):
        self.limits = limits
        self.ops = limits.ops + input_size
        self.produced = PRODUCED_FACTOR * (limits.chars + input_size)
        now = time.monotonic()
        self.deadline = now + limits.seconds
        self.gentle_at = now + GENTLE_AFTER
        self._sleep, self._turn = None, 0

    @contextlib.contextmanager
    def active(self):
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    def tick(self, steps=1):
        self.ops -= steps
        if self.ops < 0:
            raise BudgetExceeded(f"it took more than {self.limits.ops:,} steps")
        now = time.monotonic()
        if now > self.gentle_at:
            if now > self.deadline:
                raise BudgetExceeded(f"it ran longer than {self.limits.seconds:g} s")
            self._give_way()

    def _give_way(self):
        if self._sleep is None:
            self._sleep = _native_sleep()
        self._turn += 1
        if self._turn % GENTLE_EVERY == 0:
            self._sleep(GENTLE_PAUSE)

    def fits(self, n, what):
        if n > self.limits.chars:
            raise BudgetExceeded(f"{what} would hold {n:,} characters or items (at most {self.limits.chars:,})")

    def built(self, value):
        """`value`, once its size is within the limits and counted as produced."""
        n = size(value)
        if n:
            self.fits(n, "a value it built")
            self.produced -= n
            if self.produced < 0:
                raise BudgetExceeded(f"it built more than {PRODUCED_FACTOR * self.limits.chars:,} characters in all")
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise BudgetExceeded(f"a number of more than {MAX_INT_BITS:,} bits")
        return value

    def counted(self, iterable):
        """`iterable`'s items, a step each."""
        for item in iterable:
            self.tick()
            yield item

    def listed(self, iterable):
        """`iterable` as a list (a step an item), refused as soon as its items' sizes pass `chars`."""
        if isinstance(iterable, (list, tuple)):
            return iterable
        items, total = [], 0
        for item in self.counted(iterable):
            total += size(item) + 1
            self.fits(total, "a joined string")
            items.append(item)
        return items


def _native_sleep():
    """time.sleep as the OS has it (a render may run on a native thread gevent does not schedule)."""
    if "gevent" in sys.modules:
        from gevent import monkey
        return monkey.get_original("time", "sleep")
    return time.sleep


def current():
    """The active render's budget; a fresh default one where none is active (a template compiling
    folds constant filters then)."""
    budget = _current.get()
    return budget if budget is not None else Budget()


def size(value):
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _int(value):
    return value if isinstance(value, int) else 0


_DIGITS = re.compile(r"\d+")


def check_format(budget, fmt):
    """A format string ('%10000000s', '{:>10000000}') may not ask for a field wider than `chars`."""
    for m in _DIGITS.finditer(fmt):
        if len(m.group()) > 9 or int(m.group()) > budget.limits.chars:
            raise BudgetExceeded(f"a format field {m.group()[:12]} wide")


def _replaced(s, old, new, count=-1):
    hits = (s.count(old) if old else len(s) + 1) if isinstance(old, type(s)) else 0
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, size(new) - size(old))


def _text_estimate(budget, s, name, args, kwargs):
    """The size of what `s.<name>(*args, **kwargs)` (a str or bytes method) would build, where it
    could be much larger than its inputs; 0 where it cannot."""
    arg = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), _int(kwargs.get("width", arg)))
    if name == "expandtabs":
        tab = kwargs.get("tabsize", 8 if arg is None else arg)
        return len(s) + max(_int(tab), 1) * s.count("\t" if isinstance(s, str) else b"\t")
    if name == "replace" and len(args) >= 2:
        return _replaced(s, args[0], args[1], *args[2:3])
    if name == "join" and args:
        items = args[0]
        return sum(size(x) for x in items) + len(s) * max(len(items) - 1, 0)
    if name == "translate" and isinstance(arg, dict):
        return len(s) * max([1] + [size(v) for v in arg.values()])
    if name in ("format", "format_map"):
        check_format(budget, s)
        for value in list(args) + list(kwargs.values()):
            if _int(value) > budget.limits.chars:
                raise BudgetExceeded(f"a format argument of {value:,}")
    return 0


def check_binop(budget, op, left, right):
    """Refuses `left <op> right` before it is computed where the result would pass the limits."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if size(seq) and isinstance(n, int):
                budget.fits(size(seq) * max(n, 0), "a repeated value")
        if isinstance(left, int) and isinstance(right, int) and \
                left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise BudgetExceeded(f"a number of more than {MAX_INT_BITS:,} bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                (right > MAX_INT_BITS or left.bit_length() * right > MAX_INT_BITS):
            raise BudgetExceeded(f"a number of more than {MAX_INT_BITS:,} bits")
    elif op == "+":
        if size(left) and size(right):
            budget.fits(size(left) + size(right), "a joined value")
    elif op == "%" and isinstance(left, (str, bytes)):
        check_format(budget, left if isinstance(left, str) else left.decode("latin-1"))
        for value in right if isinstance(right, tuple) else (right,):
            if _int(value) > budget.limits.chars:
                raise BudgetExceeded(f"a format argument of {value:,}")


# ---- filters ----------------------------------------------------------------------------------------
# The size of what a filter would build, where it could be much larger than its inputs.

def _center(value, width=80):
    return max(size(value), _int(width))


def _indent(s, width=4, first=False, blank=False):
    w = size(width) if isinstance(width, str) else _int(width)
    return size(s) + w * ((s.count("\n") if isinstance(s, str) else 0) + 1)


def _wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    return size(s) * (1 + max(size(wrapstring), 1))


def _replace(s, old, new, count=None):
    return _replaced(s, old, new, -1 if count is None else count) if isinstance(s, str) else 0


def _batch(value, linecount, fill_with=None):
    return size(value) + (_int(linecount) if fill_with is not None else 0)


def _slice(value, slices, fill_with=None):
    return _int(slices)


def _join(value, d="", attribute=None):
    return sum(size(x) or 8 for x in value) + size(d) * max(len(value) - 1, 0)


def _tojson(value, *args, indent=None, **kwargs):
    if _int(indent) > MAX_TOJSON_INDENT:
        raise BudgetExceeded(f"a JSON indent of {indent:,} (at most {MAX_TOJSON_INDENT})")
    return 0


_FILTER_ESTIMATES = {"center": _center, "indent": _indent, "wordwrap": _wordwrap, "replace": _replace,
                     "batch": _batch, "slice": _slice, "join": _join, "tojson": _tojson}


def bounded_filter(name, fn):
    """`fn` (a Jinja filter) counted: a step plus its inputs' sizes, iterator arguments a step an
    item, the estimated result checked before it runs and the real one after."""
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0
    estimate = _FILTER_ESTIMATES.get(name)

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        budget = current()
        passed, args = args[:skip], list(args[skip:])
        for i, arg in enumerate(args):
            if isinstance(arg, Iterator):
                args[i] = budget.listed(arg) if name == "join" and i == 0 else budget.counted(arg)
        budget.tick(1 + (sum(size(a) for a in args) >> _COST_SHIFT))
        if name == "format" and args and isinstance(args[0], str):
            check_format(budget, args[0])
        if name == "sum" and args:      # adding up lists or strings copies the running total each time
            args[0] = budget.listed(args[0])
            budget.tick(len(args[0]) * sum(size(x) for x in args[0]) >> (_COST_SHIFT + 1))
        if estimate is not None:
            try:
                n = estimate(*args, **kwargs)
            except (TypeError, AttributeError):      # not the filter's arguments: the filter says so
                n = 0
            budget.fits(n, f"the '{name}' filter's result")
        return budget.built(fn(*passed, *args, **kwargs))

    return bounded


def _lipsum(n=5, html=True, min=20, max=100):
    raise BudgetExceeded("lipsum is not available to chat templates")


# ---- the environment --------------------------------------------------------------------------------

def _call(method, *args):
    return nodes.Call(nodes.EnvironmentAttribute(method), list(args), [], None, None)


class _CountedTree(NodeTransformer):
    """Every loop's iterable, every `~` and every piece of output through the budget."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = _call("budget_iter", node.iter).set_lineno(node.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return _call("budget_concat", nodes.Tuple(node.nodes, "load")).set_lineno(node.lineno)

    def visit_Output(self, node):
        self.generic_visit(node)
        node.nodes = [_call("budget_out", child).set_lineno(child.lineno) for child in node.nodes]
        return node


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, counting its templates' work against the active Budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options):
        super().__init__(**options)
        self.globals["lipsum"] = _lipsum

    def bound_filters(self):
        """Wraps every filter (call once the filters are all set)."""
        self.filters = {name: bounded_filter(name, fn) for name, fn in self.filters.items()}

    def _parse(self, source, name, filename):
        if len(source) > MAX_SOURCE_CHARS:
            raise BudgetExceeded(f"its source has {len(source):,} characters (at most {MAX_SOURCE_CHARS:,})")
        tree = _CountedTree().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call(self, context, obj, /, *args, **kwargs):
        budget = current()
        target = getattr(obj, "__wrapped__", obj)          # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        budget.tick(1 + ((size(owner) + sum(size(a) for a in args)) >> _COST_SHIFT))
        if isinstance(owner, (str, bytes)):
            name = getattr(target, "__name__", "")
            if name == "join" and args:
                args = (budget.listed(args[0]),) + args[1:]
            try:
                n = _text_estimate(budget, owner, name, args, kwargs)
            except (TypeError, AttributeError):
                n = 0
            budget.fits(n, f"the result of '{name}'")
        return budget.built(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        budget = current()
        budget.tick()
        check_binop(budget, operator, left, right)
        return budget.built(super().call_binop(context, operator, left, right))

    # Called from the rewritten tree (_CountedTree); the sandbox's `call` counts the call itself.

    def budget_iter(self, iterable):
        return current().counted(iterable)

    def budget_concat(self, parts):
        budget = current()
        texts = [str(p) for p in parts]
        n = sum(len(t) for t in texts)
        budget.fits(n, "a joined string")
        return budget.built("".join(texts))

    def budget_out(self, value):
        return current().built(str(value))


def render(template, context):
    """`template` rendered with `context` (a dict) under the active budget, its output counted as it
    is written and refused once it passes `chars`."""
    budget = current()
    out, total = [], 0
    for piece in template.root_render_func(template.new_context(context)):
        total += len(piece)
        budget.fits(total, "the rendered prompt")
        out.append(piece)
    return "".join(out)

"""Chat templates: the model's Jinja template, rendered in a sandbox with the helpers templates expect."""
import functools
import json
import re
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols

from . import template_budget
from .template_budget import BoundedEnvironment, Budget, BudgetExceeded, Limits

# ChatML, used when a model ships no template. Content may be a string or a list of text parts.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma 3's own template (google/gemma-3-*-it tokenizer_config.json), for Gemma 3 files that ship
# none (GGUF conversions of the base models). Gemma has no system role: the template puts a system
# message's text before the first user turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
# ModelConfig.arch -> the template a model of that architecture gets when its files ship none
# (ChatML for the others).
ARCH_TEMPLATES = {"gemma3": GEMMA3_TEMPLATE}


# Names the server sets in the template context, and `self`, Template.render's own first parameter.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "self"})
# Placeholders for client text: U+FDD0, digits (base 30: U+FDD2..U+FDEF), U+FDD1. These are Unicode
# noncharacters; any a client sends is itself swapped for a placeholder, so the mapping is reversible.
_MARKS = re.compile("[\ufdd0-\ufdef]")
_PLACEHOLDER = re.compile("\ufdd0([\ufdd2-\ufdef]+)\ufdd1")
_DIGIT0, _BASE = 0xFDD2, 30


class TemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed to render it; `param` is
    the request field to blame, `code` the error's code (None: a plain invalid request)."""

    code = None
    refused = False     # the template's own `raise_exception`: it does not take this conversation

    def __init__(self, message, param="messages"):
        super().__init__(message)
        self.message = message
        self.param = param


class TemplateRefused(TemplateError):
    refused = True


class TemplateOverBudget(TemplateError):
    """The template passed its render budget (steps, sizes or time): the model file's fault."""

    code = "chat_template_over_budget"


class TemplateUnusable(TemplateError):
    """The model's template failed the probe at load: its chat routes are refused."""

    code = "chat_template_unusable"


class ClientText:
    """Keeps the special-token strings of client text from becoming control tokens.

    `hide` swaps each special-token string in every string of a value (dict keys too) for a
    placeholder, so the template handles it as opaque text; `restore` puts the strings back into the
    rendered prompt and returns their spans, which the tokenizer encodes as plain text.
    """

    def __init__(self, special_tokens=()):
        specials = sorted({t for t in special_tokens if t})
        self._originals = specials + [chr(c) for c in range(0xFDD0, 0xFDF0)]
        self._n_special = len(specials)
        self._swap = {t: _placeholder(i) for i, t in enumerate(self._originals)}
        self._find = re.compile(_trie_pattern(self._originals))

    def hide(self, value):
        """`value` (str, dict, list, tuple, other) with its strings' special-token strings swapped."""
        if isinstance(value, str):
            return self._find.sub(lambda m: self._swap[m.group()], value)
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.hide(v) for v in value]
        return value

    def restore(self, text):
        """(text with every placeholder back to its string, [(start, end)] of the special-token strings)."""
        if not _MARKS.search(text):
            return text, []
        out, spans, size, pos = [], [], 0, 0
        for m in _PLACEHOLDER.finditer(text):
            # NOTE(marks): a mark outside a whole placeholder is what is left of one the template cut.
            before = _MARKS.sub("", text[pos:m.start()])
            index = _placeholder_index(m.group(1))
            original = self._originals[index] if index < len(self._originals) else ""
            size += len(before)
            if index < self._n_special:
                spans.append((size, size + len(original)))
            out += [before, original]
            size, pos = size + len(original), m.end()
        out.append(_MARKS.sub("", text[pos:]))
        return "".join(out), spans


def _trie_pattern(words):
    """A regex for the longest of `words` at a position, shaped as a trie: vocabularies hold thousands
    of special tokens, and a flat alternation would try each of them at every character."""
    trie = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return _branch(trie)


def _branch(node):
    alternatives = []
    for ch, child in node.items():
        if ch:
            while len(child) == 1 and "" not in child:    # a chain without a fork: one literal
                (next_ch, child), = child.items()
                ch += next_ch
            alternatives.append(re.escape(ch) + _branch(child))
    body = "|".join(alternatives)
    if not alternatives or "" not in node:
        return f"(?:{body})" if len(alternatives) > 1 else body
    return f"(?:{body})?"      # a word ends here: the longer ones first, else stop


def _placeholder(index):
    digits = ""
    while True:
        index, digit = divmod(index, _BASE)
        digits = chr(_DIGIT0 + digit) + digits
        if not index:
            return "\ufdd0" + digits + "\ufdd1"


def _placeholder_index(digits):
    index = 0
    for ch in digits:
        index = index * _BASE + ord(ch) - _DIGIT0
    return index


class _GenerationTag(Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it just renders.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise TemplateRefused(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # NOTE(tojson): Jinja's own filter HTML-escapes; templates expect plain json.dumps. ensure_ascii
    # escapes by hand so that client-text placeholders stay whole.
    text = json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    return _NON_ASCII.sub(lambda m: json.dumps(m.group())[1:-1], text) if ensure_ascii else text


_NON_ASCII = re.compile("[^\x00-\x7f\ufdd0-\ufdef]")


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment():
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


@functools.lru_cache(maxsize=32)
def _compile(source):
    try:
        with Budget().active():
            return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from None
    except BudgetExceeded as exc:
        raise TemplateOverBudget(f"chat template refused: {exc}") from None
    except RecursionError:
        raise TemplateOverBudget("chat template does not compile: it nests too deeply") from None


def _plain_messages(messages):
    # NOTE(none-keys): keys set to None (OpenAI's `content: null` beside tool_calls) are dropped, as
    # transformers does: templates test for a missing key, not for None.
    return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]


def _check_kwargs(kwargs):
    taken = sorted(str(k) for k in kwargs if k in _RESERVED or k in _environment().globals)
    if taken:
        raise TemplateError(f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the server sets "
                            f"{'it' if len(taken) == 1 else 'them'}", param="chat_template_kwargs")


class ChatTemplate:
    """A model's chat template, compiled once; `render` turns messages into the prompt text.

    `special_tokens` are the vocabulary's special-token strings: in client values they stay text.
    Every render runs within `limits` (template_budget.Limits: steps, sizes, seconds); `probe()`
    renders sample conversations once, as a load does, and a template that fails it (over budget,
    unsafe, or unable to render a user's message) refuses every later render with TemplateUnusable.
    `name` is the model's, for the messages.
    """

    def __init__(self, source=None, bos_token=None, eos_token=None, special_tokens=(), *,
                 limits=Limits(), name="the model"):
        self.source = source or CHATML_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        self.limits, self.name = limits, name
        self.problem = None         # why the probe refused it; None while usable
        self._template = _compile(self.source)
        self._client = ClientText(special_tokens)

    @classmethod
    def fallback(cls, bos_token=None, eos_token=None, special_tokens=(), **options):
        """The ChatML template, for a model that ships none."""
        return cls(CHATML_TEMPLATE, bos_token, eos_token, special_tokens, **options)

    @classmethod
    def checked(cls, source=None, bos_token=None, eos_token=None, special_tokens=(), **options):
        """A probed ChatTemplate (`problem` says why it is unusable), or one that refuses every render
        with why its source cannot compile (or is not text)."""
        try:
            if source is not None and not isinstance(source, str):
                raise TemplateError(f"the chat template is {type(source).__name__}, not text")
            template = cls(source, bos_token, eos_token, special_tokens, **options)
        except TemplateError as exc:
            template = cls.fallback(bos_token, eos_token, special_tokens, **options)
            template.problem = exc.message
            if isinstance(source, str):
                template.source = source
            return template
        template.probe()
        return template

    def probe(self):
        """Renders the probe conversations (a user's message; with a system message; several turns;
        with tools) under the budget. A template may refuse a conversation it does not support
        (`raise_exception`), except the plain user's message; one over budget, unsafe, or failing
        otherwise sets `problem`. Returns `problem`."""
        for i, (messages, tools) in enumerate(PROBES):
            try:
                self.render_guarded(messages, tools)
            except TemplateOverBudget as exc:
                self.problem = exc.message
            except TemplateError as exc:
                if i == 0 or not exc.refused:
                    self.problem = exc.message
            if self.problem:
                break
        return self.problem

    def render(self, messages, tools=None, add_generation_prompt=True, **kwargs):
        """The prompt text for `messages` (plain dicts). Raises TemplateError on a refusal or failure."""
        return self.render_guarded(messages, tools, add_generation_prompt, kwargs)[0]

    def render_guarded(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None):
        """(prompt text, [(start, end)] spans of the special-token strings that came from `messages`,
        `tools` or `template_kwargs`, for the tokenizer to encode as text). Raises TemplateError."""
        if self.problem is not None:
            raise TemplateUnusable(f"The chat template of {self.name} was refused when it loaded ({self.problem}); "
                                   f"its chat routes are off, /v1/completions still serves it", param="model")
        kwargs = dict(template_kwargs or {})
        _check_kwargs(kwargs)
        try:
            messages, tools, kwargs = self._client.hide([_plain_messages(messages), tools, kwargs])
        except RecursionError:
            raise TemplateError("chat template failed: the request nests too deeply") from None
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "documents": None,
                   **kwargs, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        try:
            with Budget(self.limits, _input_size(context)).active():
                text = self._render(context)
        except TemplateError as exc:     # its message may quote client text
            raise type(exc)(self._client.restore(exc.message)[0], exc.param) from None
        return self._client.restore(text)

    def _render(self, context):
        try:
            return template_budget.render(self._template, context)
        except TemplateError:
            raise
        except BudgetExceeded as exc:
            raise TemplateOverBudget(f"the chat template of {self.name} passed its render budget: {exc}",
                                     param="model") from None
        except RecursionError:
            raise TemplateError("chat template failed: the request or the template nests too deeply") from None
        except jinja2.TemplateError as exc:   # includes SecurityError and UndefinedError
            raise TemplateError(f"chat template failed: {exc.message or type(exc).__name__}") from None
        except Exception as exc:    # noqa: BLE001 - the template is the model file's code: any failure is its own
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def template_limits(max_context):
    """A model's render limits: strings and output up to 64 characters a token of its context (no
    prompt that long fits in the context), at least 1 MiB of them."""
    return Limits(chars=max(1 << 20, 64 * max_context))


def _input_size(value, depth=0):
    """Characters and items in a conversation's strings and containers (what a fair template's work
    grows with)."""
    if isinstance(value, str):
        return len(value)
    if depth > 64:
        return 0
    if isinstance(value, dict):
        return len(value) + sum(_input_size(k, depth + 1) + _input_size(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return len(value) + sum(_input_size(v, depth + 1) for v in value)
    return 1


_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# The load-time probe's conversations: (messages, tools). The first must render.
PROBES = (
    ([{"role": "user", "content": "Hello!"}], None),
    ([{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}], None),
    ([{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
      {"role": "user", "content": "And 3 + 3?"}], None),
    ([{"role": "user", "content": "What is the weather in Paris?"}], [_WEATHER]),
)

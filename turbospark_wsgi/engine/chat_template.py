"""Chat templates: the model's Jinja template, rendered in a sandbox with the helpers templates expect."""
import functools
import json
import re
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    the request field to blame."""

    def __init__(self, message, param="messages"):
        super().__init__(message)
        self.message = message
        self.param = param


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
    raise TemplateError(str(message))


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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


@functools.lru_cache(maxsize=32)
def _compile(source):
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from None


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
    """

    def __init__(self, source=None, bos_token=None, eos_token=None, special_tokens=()):
        self.source = source or CHATML_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = _compile(self.source)
        self._client = ClientText(special_tokens)

    @classmethod
    def fallback(cls, bos_token=None, eos_token=None, special_tokens=()):
        """The ChatML template, for a model that ships none."""
        return cls(CHATML_TEMPLATE, bos_token, eos_token, special_tokens)

    def render(self, messages, tools=None, add_generation_prompt=True, **kwargs):
        """The prompt text for `messages` (plain dicts). Raises TemplateError on a refusal or failure."""
        return self.render_guarded(messages, tools, add_generation_prompt, kwargs)[0]

    def render_guarded(self, messages, tools=None, add_generation_prompt=True, template_kwargs=None):
        """(prompt text, [(start, end)] spans of the special-token strings that came from `messages`,
        `tools` or `template_kwargs`, for the tokenizer to encode as text). Raises TemplateError."""
        kwargs = dict(template_kwargs or {})
        _check_kwargs(kwargs)
        try:
            messages, tools, kwargs = self._client.hide([_plain_messages(messages), tools, kwargs])
        except RecursionError:
            raise TemplateError("chat template failed: the request nests too deeply") from None
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "documents": None,
                   **kwargs, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        try:
            text = self._render(context)
        except TemplateError as exc:     # its message may quote client text
            raise TemplateError(self._client.restore(exc.message)[0], exc.param) from None
        return self._client.restore(text)

    def _render(self, context):
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:   # includes SecurityError and UndefinedError
            raise TemplateError(f"chat template failed: {exc.message or type(exc).__name__}") from None
        except (TypeError, ValueError, KeyError, IndexError) as exc:   # e.g. a message shape it can't take
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        except RecursionError:
            raise TemplateError("chat template failed: the request nests too deeply") from None

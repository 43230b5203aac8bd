"""Chat templates: the model's Jinja template, rendered in a sandbox with the helpers templates expect."""
import functools
import json
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


class TemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed to render it."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message


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
    # NOTE(tojson): Jinja's own filter HTML-escapes; templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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


class ChatTemplate:
    """A model's chat template, compiled once; `render` turns messages into the prompt text."""

    def __init__(self, source=None, bos_token=None, eos_token=None):
        self.source = source or CHATML_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = _compile(self.source)

    @classmethod
    def fallback(cls, bos_token=None, eos_token=None):
        """The ChatML template, for a model that ships none."""
        return cls(CHATML_TEMPLATE, bos_token, eos_token)

    def render(self, messages, tools=None, add_generation_prompt=True, **kwargs):
        """The prompt text for `messages` (plain dicts). Raises TemplateError on a refusal or failure."""
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", "documents": None,
                   **kwargs, "messages": _plain_messages(messages), "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:   # includes SecurityError and UndefinedError
            raise TemplateError(f"chat template failed: {exc.message or type(exc).__name__}") from None
        except (TypeError, ValueError, KeyError, IndexError) as exc:   # e.g. a message shape it can't take
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None

"""Field checkers shared by the API schemas; each refusal is an InvalidRequest naming its param.

One parser per field: /v1/completions, /v1/chat/completions, /v1/messages and /v1/responses read
`model`, `max_tokens`, `n`, the sampling fields, `stop` and `stream_options` here, each API passing
its own bounds (Anthropic's temperature <= 1, its `stop_sequences`) as arguments.
"""
import math
from dataclasses import dataclass

from ...config import EFFORTS, MAX_BUDGET
from ...errors import InvalidRequest
from ...serving.params import Sampling

INT_LIMIT = 2 ** 63           # bigger integers are refused before they reach arithmetic
MAX_TOKENS_LIMIT = 2 ** 31 - 1
TOKEN_ID_LIMIT = 2 ** 31
MAX_CHOICES = 20              # n
MAX_TOP_LOGPROBS = 20         # logprobs (completions), top_logprobs (chat, responses)
MAX_CACHE_SALT = 1024         # characters of a cache_salt


def type_name(value):
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def wrong_type(name, expected, value):
    return InvalidRequest(f"Invalid type for '{name}': expected {expected}, but got {type_name(value)}.",
                          param=name)


def expect_object(doc, name=None):
    if not isinstance(doc, dict):
        where = f"'{name}'" if name else "The request body"
        raise InvalidRequest(f"{where} must be a JSON object, got {type_name(doc)}", param=name)
    return doc


def opt_str(doc, name, default=None, max_len=None):
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise wrong_type(name, "a string", value)
    if max_len is not None and len(value) > max_len:
        raise InvalidRequest(f"'{name}' is too long ({len(value)} characters, at most {max_len})", param=name)
    return value


def opt_bool(doc, name, default=False):
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean", value)
    return value


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def opt_int(doc, name, default=None, lo=None, hi=None):
    value = doc.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise wrong_type(name, "an integer", value)
    _check_range(name, value, lo, hi)
    return value


def truncate_prompt_tokens(doc, name="truncate_prompt_tokens"):
    """vLLM's `truncate_prompt_tokens`: None (nothing is cut), -1 (cut to the model's limit) or k >= 1
    (keep the last k tokens); the service checks it against the model's limit."""
    value = opt_int(doc, name, None, lo=-1)
    if value == 0:
        raise InvalidRequest(f"'{name}' must be -1 (the model's limit) or at least 1, got 0", param=name)
    return value


def cache_salt(doc, name="cache_salt"):
    """vLLM's `cache_salt`: only requests with the same salt share cached prompt prefixes ("": none given)."""
    value = opt_str(doc, name, "", max_len=MAX_CACHE_SALT)
    if doc.get(name) is not None and not value:
        raise InvalidRequest(f"'{name}' must be a non-empty string if given", param=name)
    return value


def opt_number(doc, name, default=None, lo=None, hi=None):
    value = doc.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(name, "a number", value)
    if not math.isfinite(value) or abs(value) >= INT_LIMIT:
        raise InvalidRequest(f"'{name}' must be a finite number, got {value!r}", param=name)
    _check_range(name, value, lo, hi)
    return float(value)


def _check_range(name, value, lo, hi):
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            bounds = f"between {lo} and {hi}"
        else:
            bounds = f">= {lo}" if lo is not None else f"<= {hi}"
        raise InvalidRequest(f"'{name}' must be {bounds}, got {value}", param=name)


def stop_strings(doc, name="stop", max_items=16, max_len=1024):
    """`stop`: a string or a list of strings (empty strings dropped) -> tuple."""
    value = doc.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise wrong_type(name, "a string or an array of strings", value)
    if len(items) > max_items:
        raise InvalidRequest(f"'{name}' may hold at most {max_items} strings, got {len(items)}", param=name)
    if any(len(s) > max_len for s in items):
        raise InvalidRequest(f"each '{name}' string may be at most {max_len} characters", param=name)
    return tuple(dict.fromkeys(s for s in items if s))


def seed_value(doc, name="seed"):
    """An integer seed (any 64-bit value, negative ones folded into range) or None."""
    value = opt_int(doc, name, None, -INT_LIMIT, 2 ** 64 - 1)
    return None if value is None else value % 2 ** 64


def logit_bias(doc, name="logit_bias", max_items=1024):
    """{"token id": bias} with biases in [-100, 100] -> {int: float}."""
    value = doc.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise wrong_type(name, "an object mapping token ids to numbers", value)
    if len(value) > max_items:
        raise InvalidRequest(f"'{name}' may hold at most {max_items} entries, got {len(value)}", param=name)
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise InvalidRequest(f"'{name}' keys must be token ids, got {key!r}", param=name)
        out[int(key)] = opt_number({name: bias}, name, 0.0, -100, 100)
    return out


# ---- the fields every generation API shares --------------------------------------------------

@dataclass(frozen=True, slots=True)
class SamplingBounds:
    """What one API accepts of the shared sampling fields."""

    temperature_max: float = 2.0
    top_p_min: float = 0.0
    stop: str = "stop"                    # the field holding the stop strings
    extensions: bool = True               # min_p, penalties, logit_bias, seed, ignore_eos (local-server extensions)


OPENAI = SamplingBounds()
ANTHROPIC = SamplingBounds(temperature_max=1.0, top_p_min=0.0001, stop="stop_sequences", extensions=False)


def sampling(doc, bounds=OPENAI):
    """The sampling fields -> Sampling (the service builds the engine's params from it once the
    token budget is known). top_p 0 is greedy; top_k -1 or 0 is off (vLLM's -1)."""
    temperature = opt_number(doc, "temperature", 1.0, 0, bounds.temperature_max)
    top_p = opt_number(doc, "top_p", 1.0, bounds.top_p_min, 1)
    if top_p == 0:
        top_p, temperature = 1.0, 0.0       # NOTE(top_p): keeping no mass means keeping the top token
    top_k = max(opt_int(doc, "top_k", 0, lo=-1, hi=TOKEN_ID_LIMIT), 0)
    stop = stop_strings(doc, bounds.stop)
    speculative = opt_bool(doc, "speculative", True)      # our extension, on every route: the output is the same
    if not bounds.extensions:
        return Sampling(temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, speculative=speculative)
    return Sampling(
        temperature=temperature, top_p=top_p, top_k=top_k, speculative=speculative,
        min_p=opt_number(doc, "min_p", 0.0, 0, 1), repetition_penalty=repetition_penalty(doc),
        presence_penalty=opt_number(doc, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=opt_number(doc, "frequency_penalty", 0.0, -2, 2),
        logit_bias=logit_bias(doc), seed=seed_value(doc), stop=stop,
        ignore_eos=opt_bool(doc, "ignore_eos", False))


def repetition_penalty(doc, name="repetition_penalty"):
    """A penalty in (0, 10]: 1 is off (vLLM's bounds, with an upper one)."""
    value = opt_number(doc, name, 1.0, 0, 10)
    if value <= 0:
        raise InvalidRequest(f"'{name}' must be greater than 0", param=name)
    return value


def model_name(doc):
    """`model`: None (the default model) or a non-empty name."""
    name = opt_str(doc, "model", None, max_len=4096)
    if name is not None and not name.strip():
        raise InvalidRequest("'model' must not be empty", param="model")
    return name


def max_tokens(doc, name="max_tokens", lo=1, default=None):
    """A token budget in [lo, 2^31 - 1], or `default` when absent."""
    return opt_int(doc, name, default, lo=lo, hi=MAX_TOKENS_LIMIT)


def choice_count(doc, name="n"):
    return opt_int(doc, name, 1, lo=1, hi=MAX_CHOICES)


def include_usage(doc, stream):
    """`stream_options.include_usage`; stream_options without `stream` is a 400, as OpenAI answers it."""
    options = doc.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    expect_object(options, "stream_options")
    return opt_bool(options, "include_usage", False)


def anthropic_error_body(exc):
    """Anthropic's error envelope for an ApiError."""
    return {"type": "error", "error": {"type": exc.anthropic_type, "message": exc.message}}


def reasoning_effort(value, param):
    """OpenAI's reasoning effort (`reasoning_effort`, `reasoning.effort`), or None when absent."""
    if value is not None and (not isinstance(value, str) or value not in EFFORTS):
        raise InvalidRequest(f"'{param}' must be one of {', '.join(EFFORTS)}.", param=param)
    return value


def effort_kwargs(effort):
    """What the template reads of an effort. NOTE(reasoning): Qwen3-style templates read
    enable_thinking, gpt-oss-style ones reasoning_effort."""
    if effort is None:
        return {}
    return {"enable_thinking": effort != "none", "reasoning_effort": effort}


def token_budget(doc, key):
    """vLLM's `thinking_token_budget`: reasoning tokens 0 to 2^31 - 1 (0: the think block closes at once)."""
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BUDGET:
        raise InvalidRequest(f"'{key}' must be a whole number of tokens from 0 to {MAX_BUDGET}.", param=key)
    return value

"""Field checkers for the chat, messages and responses schemas; each failure names its `param`.
Numbers and booleans are common.py's checks, so every API refuses the same values; the fields the
generation APIs share (sampling, stop, model, max_tokens, n) are parsed by common.py alone."""
from ...errors import InvalidRequest
from . import common


def fail(param, message):
    raise InvalidRequest(message, param=param)


def require(doc, key, param=None):
    if key not in doc or doc[key] is None:
        fail(param or key, f"Missing required parameter: '{param or key}'.")
    return doc[key]


def number(doc, key, lo=None, hi=None, default=None, integer=False):
    """An optional number (or integer) in [lo, hi]: common.opt_number / opt_int, which also refuse
    non-finite and out-of-range values."""
    if integer:
        return common.opt_int(doc, key, default, lo, hi)
    return common.opt_number(doc, key, default, lo, hi)


def integer(doc, key, lo=None, hi=None, default=None):
    return number(doc, key, lo, hi, default, integer=True)


def boolean(doc, key, default=False):
    return common.opt_bool(doc, key, default)


def typed(value, kind, param, what):
    if not isinstance(value, kind):
        fail(param, f"'{param}' must be {what}.")
    return value

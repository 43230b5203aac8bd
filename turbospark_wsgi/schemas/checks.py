"""Field checkers for the chat and messages schemas; each failure names its `param`. Numbers, booleans
and logit_bias are common.py's checks, so every API refuses the same values."""
from ..errors import InvalidRequest
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


def stop_list(doc, key, max_items=16):
    value = doc.get(key)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > max_items:
        fail(key, f"'{key}' must be a string or a list of at most {max_items} strings.")
    for item in items:
        if not isinstance(item, str) or not item:
            fail(key, f"'{key}' entries must be non-empty strings.")
    return tuple(items)


def logit_bias(doc, key="logit_bias"):
    return common.logit_bias(doc, key)

"""Field checkers for the chat and messages schemas; each failure names its `param`."""
from ..errors import InvalidRequest

_MISSING = object()


def fail(param, message):
    raise InvalidRequest(message, param=param)


def require(doc, key, param=None):
    if key not in doc or doc[key] is None:
        fail(param or key, f"Missing required parameter: '{param or key}'.")
    return doc[key]


def number(doc, key, lo=None, hi=None, default=None, integer=False):
    value = doc.get(key)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        fail(key, f"'{key}' must be {kind}, got {type(value).__name__}.")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        fail(key, f"'{key}' must be between {lo} and {hi}, got {value}.")
    return value


def integer(doc, key, lo=None, hi=None, default=None):
    return number(doc, key, lo, hi, default, integer=True)


def boolean(doc, key, default=False):
    value = doc.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        fail(key, f"'{key}' must be a boolean.")
    return value


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
    value = doc.get(key)
    if value is None:
        return {}
    typed(value, dict, key, "an object mapping token ids to biases")
    out = {}
    for token, bias in value.items():
        if not str(token).isdigit() or isinstance(bias, bool) or not isinstance(bias, (int, float)):
            fail(key, f"'{key}' maps token ids (digits) to numbers.")
        if not -100 <= bias <= 100:
            fail(key, f"'{key}' biases must be between -100 and 100.")
        out[int(token)] = float(bias)
    return out

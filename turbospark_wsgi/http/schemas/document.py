"""Whole-document checks on a decoded JSON body, before any field is read: no lone UTF-16
surrogate in any string or key, and no nesting deeper than MAX_DEPTH. Each refusal is a 400
whose `param` is the JSON path of the offending value, e.g. "messages[0].content".

Why: a lone surrogate ("\\ud800" in JSON) decodes to a Python str that cannot be encoded as
UTF-8, so the tokenizer, the chat template or the response encoder fails on it far from here;
deep nesting makes recursive code (templates, json.dumps, schema compilers) fail the same way.
"""
import json
import re

from ...errors import InvalidRequest

MAX_DEPTH = 64                  # the body itself is level 1
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_KEY_SHOWN = 64                 # characters of a key quoted in a path


def check_document(doc, at=""):
    """`doc` unchanged, or InvalidRequest naming the first offending path (prefixed by `at`)."""
    _walk(doc, at, surrogates=True)
    return doc


def check_body_text(text, doc):
    """check_document for a body decoded from `text`; strings are scanned only when the text
    holds a surrogate escape, the one way a lone surrogate gets into decoded JSON."""
    _walk(doc, "", surrogates=_SURROGATE_ESCAPE.search(text) is not None)
    return doc


def _walk(doc, at, surrogates):
    # NOTE(iterative): an explicit stack, so the walk itself never recurses.
    stack = [(doc, 1, None)]            # (value, depth, trail); trail = (parent trail, key) or None
    while stack:
        value, depth, trail = stack.pop()
        if isinstance(value, dict):
            _check_depth(depth, trail, at)
            for key, item in value.items():
                if surrogates and _has_surrogate(key):
                    _refuse_surrogate((trail, key), at, "a key")
                _visit(stack, item, depth, (trail, key), surrogates, at)
        elif isinstance(value, list):
            _check_depth(depth, trail, at)
            for i, item in enumerate(value):
                _visit(stack, item, depth, (trail, i), surrogates, at)
        elif surrogates and isinstance(value, str) and _has_surrogate(value):
            _refuse_surrogate(trail, at, "a string")


def _visit(stack, item, depth, trail, surrogates, at):
    if isinstance(item, (dict, list)):
        stack.append((item, depth + 1, trail))
    elif surrogates and isinstance(item, str) and _has_surrogate(item):
        _refuse_surrogate(trail, at, "a string")


def _check_depth(depth, trail, at):
    if depth > MAX_DEPTH:
        path = json_path(trail, at)
        raise InvalidRequest(f"'{path or 'body'}' is nested too deeply: the limit is {MAX_DEPTH} levels",
                             param=path or None)


def _has_surrogate(text):
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _refuse_surrogate(trail, at, what):
    path = json_path(trail, at)
    raise InvalidRequest(f"'{path}' holds {what} with a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                         f"escape), which is not valid Unicode text", param=path or None)


def json_path(trail, at=""):
    """'messages[0].content' for the trail (((None, 'messages'), 0), 'content')."""
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    path = at
    for key in reversed(keys):
        path += f"[{key}]" if isinstance(key, int) else (f".{_shown(key)}" if path else _shown(key))
    return path


def _shown(key):
    """A key as a path segment: surrogates escaped (the path goes into the error body), long keys cut."""
    key = key if len(key) <= _KEY_SHOWN else key[:_KEY_SHOWN] + "..."
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def encodable_value(value):
    """A decoded JSON value with any lone surrogate in its strings replaced ('?'), so that a body
    holding it always encodes; for JSON the server itself decodes, such as model output."""
    text = json.dumps(value, ensure_ascii=False)
    if not _has_surrogate(text):
        return value
    return json.loads(text.encode("utf-8", "replace").decode("utf-8"))

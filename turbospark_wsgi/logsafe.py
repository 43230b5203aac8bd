"""Log lines that request data cannot forge: control characters are written as escapes."""
import logging
import re

# C0 and C1 controls, DEL, the Unicode line and paragraph separators (some viewers break lines
# there) and lone surrogates (a handler cannot encode them, and logs its own traceback instead).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text):
    """`text` with each unsafe character as `\\n`, `\\r`, `\\t`, `\\xNN` or `\\uNNNN`; one line always."""
    text = str(text)
    if _UNSAFE.search(text) is None:
        return text
    return _UNSAFE.sub(_escape_one, text)


def _escape_one(match):
    ch = match.group()
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class EscapeFilter(logging.Filter):
    """Escapes each record's message once, whatever the logger; tracebacks keep their lines.

    Put it on handlers (it sees every record they write) and on loggers whose handlers are added
    later (gunicorn's access log).
    """

    def filter(self, record):
        if getattr(record, "escaped", False):
            return True
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            return True         # NOTE(format): a broken format is the handler's to report, as before
        record.msg, record.args, record.escaped = escape(message), (), True
        return True

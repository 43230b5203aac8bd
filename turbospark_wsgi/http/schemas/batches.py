"""The Batch API's bodies: a batch's creation, list queries, the batch input file's lines, the
Batch object and the output lines, in OpenAI's shapes (the official SDK's types parse them).

    req = parse_batch(body)                       # InvalidRequest naming the param
    lines, fatal = parse_input(data, endpoint, most)    # each line checked; fatal: OpenAI's `errors`
    output_line(custom_id, status, request_id, body)    # one line of the output or error file
"""
import json
import re
import secrets
import time
from dataclasses import dataclass, field

from ...errors import InvalidRequest

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
PURPOSES = ("batch", "user_data")
WINDOW = re.compile(r"([1-9][0-9]{0,5})(s|m|h)\Z")
WINDOW_SECONDS = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW = 7 * 24 * 3600
METADATA_KEYS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
CUSTOM_ID = 512          # characters of a line's custom_id


@dataclass(slots=True)
class BatchRequest:
    input_file_id: str
    endpoint: str
    window: str
    seconds: int
    metadata: dict = field(default_factory=dict)


def parse_batch(body):
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object")
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                  "output_expires_after"})
    if unknown:
        raise InvalidRequest(f"Unknown parameter: '{unknown[0]}'", param=unknown[0], code="unknown_parameter")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or not file_id:
        raise InvalidRequest("'input_file_id' is required: the id of a file uploaded with purpose 'batch'",
                             param="input_file_id")
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window", "24h")
    match = WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * WINDOW_SECONDS[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW:
        raise InvalidRequest("'completion_window' must be a duration such as '24h' (or '30m', '90s'), at most "
                             "168h", param="completion_window")
    return BatchRequest(file_id, endpoint, window, seconds, parse_metadata(body.get("metadata")))


def parse_metadata(metadata):
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object of strings", param="metadata")
    if len(metadata) > METADATA_KEYS:
        raise InvalidRequest(f"'metadata' holds at most {METADATA_KEYS} keys", param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY or not isinstance(value, str) or len(value) > METADATA_VALUE:
            raise InvalidRequest(f"'metadata' keys are strings of at most {METADATA_KEY} characters and its values "
                                 f"strings of at most {METADATA_VALUE}", param="metadata")
    return dict(metadata)


def parse_limit(raw, default, most):
    """A list query's `limit` (1 to `most`)."""
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {most}", param="limit")
    return int(raw)


def page(items, after, limit):
    """OpenAI's list page: the `limit` items after the one whose id is `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


@dataclass(slots=True)
class Line:
    index: int                  # 0-based among the file's requests (blank lines skipped)
    custom_id: str | None
    body: dict | None
    problem: tuple | None       # (code, message) of a line that cannot be sent: it goes to the error file


def parse_input(data, endpoint, most):
    """The requests of a batch input file: ([Line], None), or ([], OpenAI's `errors` entries) when
    the file as a whole cannot run (not UTF-8, no requests, over `most` of them). A line that is not
    a request of the batch's endpoint (bad JSON, no custom_id, a repeated one, another url, a stream)
    is a Line with its problem; each body's own checks are the route's, when the line runs."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [_error("invalid_file", f"The file is not UTF-8 (byte {e.start})")]
    rows = [(n, row) for n, row in enumerate(text.split("\n"), 1) if row.strip()]
    if not rows:
        return [], [_error("empty_file", "The file holds no requests")]
    if len(rows) > most:
        return [], [_error("too_many_requests", f"The file holds {len(rows)} requests; a batch holds at most "
                                                f"{most} (TURBOSPARK_BATCH_MAX_LINES)")]
    lines, seen = [], set()
    for n, row in rows:
        try:
            doc = json.loads(row)
        except ValueError as e:
            lines.append(Line(len(lines), None, None, ("invalid_json_line", f"Line {n} is not JSON: {str(e)[:200]}")))
            continue
        custom_id = doc.get("custom_id") if isinstance(doc, dict) else None
        custom_id = custom_id if isinstance(custom_id, str) else None
        problem = _line_problem(doc, endpoint, seen)
        if problem is None:
            seen.add(custom_id)
        lines.append(Line(len(lines), custom_id, None if problem else doc["body"],
                          (problem[0], f"Line {n}: {problem[1]}") if problem else None))
    return lines, None


def _line_problem(doc, endpoint, seen):
    if not isinstance(doc, dict):
        return "invalid_request", "a line must be a JSON object with custom_id, method, url and body"
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > CUSTOM_ID:
        return "missing_custom_id", f"'custom_id' must be a string of 1 to {CUSTOM_ID} characters"
    if custom_id in seen:
        return "duplicate_custom_id", f"custom_id {custom_id[:80]!r} is used by an earlier line"
    if doc.get("method", "POST") != "POST":
        return "invalid_method", "'method' must be POST"
    if doc.get("url") != endpoint:
        return "mismatched_endpoint", f"'url' must be the batch's endpoint, {endpoint}"
    if not isinstance(doc.get("body"), dict):
        return "invalid_request", "'body' must be a JSON object"
    if doc["body"].get("stream"):
        return "invalid_request", "'stream' is not available in a batch"
    return None


def _error(code, message, line=None, param=None):
    return {"code": code, "message": message, "param": param, "line": line}


def new_batch(req, now=None):
    """A Batch object as created: `validating`, no counts yet."""
    now = int(now or time.time())
    return {"id": "batch_" + secrets.token_hex(12), "object": "batch", "endpoint": req.endpoint, "errors": None,
            "input_file_id": req.input_file_id, "completion_window": req.window, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + req.seconds, "finalizing_at": None, "completed_at": None, "failed_at": None,
            "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": req.metadata or None,
            "model": None, "usage": None}


def output_line(custom_id, status, request_id, body):
    """A line of the output file (status 2xx) or the error file (any other)."""
    return json.dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body},
                       "error": None}, ensure_ascii=False, separators=(",", ":"))


def failed_line(custom_id, code, message):
    """A line of the error file for a request that could not be sent at all."""
    return json.dumps({"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, ensure_ascii=False, separators=(",", ":"))


def usage_of(lines):
    """The Batch object's `usage`, summed over output lines (their bodies' usage, any shape)."""
    total = {"input": 0, "output": 0, "cached": 0, "reasoning": 0}
    for raw in lines:
        usage = ((json.loads(raw).get("response") or {}).get("body") or {}).get("usage") or {}
        total["input"] += usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        total["output"] += usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        total["cached"] += details.get("cached_tokens", 0) or 0
        out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
        total["reasoning"] += out_details.get("reasoning_tokens", 0) or 0
    return {"input_tokens": total["input"], "input_tokens_details": {"cached_tokens": total["cached"]},
            "output_tokens": total["output"], "output_tokens_details": {"reasoning_tokens": total["reasoning"]},
            "total_tokens": total["input"] + total["output"]}

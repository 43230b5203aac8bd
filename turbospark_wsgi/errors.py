"""The ApiError hierarchy: status, type, param and code for every refusal. No falcon here."""
import math


class ApiError(Exception):
    status = 500
    type = "server_error"
    anthropic_type = "api_error"
    code = None

    def __init__(self, message, *, param=None, code=None, headers=None):
        message = encodable(message)
        super().__init__(message)
        self.message = message
        self.param = encodable(param) if param is not None else None
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})


def encodable(text):
    """`text` as a str that always encodes as UTF-8: error messages quote client text, and a lone
    surrogate in it would make the error body itself fail to encode (an empty 500)."""
    text = str(text)
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    anthropic_type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    anthropic_type = "not_found_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"
    anthropic_type = "request_too_large"
    code = "request_too_large"


class UnsupportedMediaType(ApiError):
    status = 415
    type = "invalid_request_error"
    anthropic_type = "invalid_request_error"
    code = "unsupported_media_type"


class Unavailable(ApiError):
    """503 with Retry-After: the server cannot take this request now, but will soon."""

    status = 503
    type = "server_error"

    def __init__(self, message, *, retry_after=1, **kw):
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(int(retry_after)))


class Overloaded(Unavailable):
    """The lock queue is full or the wait timed out: 503 with Retry-After."""

    anthropic_type = "overloaded_error"
    code = "server_overloaded"


class RateLimited(ApiError):
    """This client is over one of its limits (TURBOSPARK_LIMITS_FILE): 429 with Retry-After.

    `type` names the limit as OpenAI's bodies do ("requests" | "tokens"; "concurrency" is ours;
    "insufficient_quota" for the daily quota, with that code)."""

    status = 429
    type = "requests"
    anthropic_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message, *, type="requests", retry_after=1.0, **kw):
        super().__init__(message, **kw)
        self.type = type
        if type == "insufficient_quota":
            self.code = type
        self.headers.setdefault("Retry-After", str(max(1, math.ceil(retry_after))))
        # NOTE(sdk): the openai and anthropic SDKs read retry-after-ms first, to the millisecond
        self.headers.setdefault("retry-after-ms", str(max(1, math.ceil(retry_after * 1000))))


class StoreUnavailable(Unavailable):
    """A shared store (the response store in Redis) cannot be reached: the message names it. Never
    a silent fallback to this process's memory."""

    anthropic_type = "api_error"
    code = "store_unavailable"


class NotReady(ApiError):
    status = 503
    type = "server_error"
    anthropic_type = "overloaded_error"
    code = "model_not_ready"


class EngineError(ApiError):
    """A real fault inside generation; the message shown to clients stays generic."""

    status = 500
    type = "server_error"
    anthropic_type = "api_error"


class ModelLoadError(ApiError):
    """An installed model could not be loaded; the message names the model and the problem."""

    status = 500
    type = "server_error"
    anthropic_type = "api_error"
    code = "model_load_failed"

"""POST /v1/embeddings: the request body in, the OpenAI list of embeddings out.

    {"input": "text" | ["text", ...] | [id, ...] | [[id, ...], ...], "model"?,
     "encoding_format"?: "float" | "base64", "dimensions"?, "user"?, "truncate_prompt_tokens"?}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...] | "base64"}],
        "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

base64 is the little-endian float32 bytes of each vector, as the OpenAI SDK decodes it.
"""
import base64
import struct

from ...errors import InvalidRequest
from ...serving.service import EmbeddingRequest
from .common import (TOKEN_ID_LIMIT, expect_object, is_int, model_name, opt_int, opt_str,
                     truncate_prompt_tokens, type_name)

ENCODING_FORMATS = ("float", "base64")
_INPUT_SHAPES = "a string, an array of strings, an array of token ids or an array of token-id arrays"


def parse_embeddings(doc, max_inputs):
    """-> (EmbeddingRequest, encoding_format). `max_inputs`: TURBOSPARK_MAX_EMBEDDING_INPUTS."""
    expect_object(doc)
    model = model_name(doc)
    fmt = opt_str(doc, "encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise InvalidRequest(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, got {fmt!r}",
                             param="encoding_format")
    dimensions = opt_int(doc, "dimensions", None, lo=1, hi=TOKEN_ID_LIMIT)
    opt_str(doc, "user", None, max_len=4096)
    texts, ids = _inputs(doc.get("input"), max_inputs)
    return EmbeddingRequest(model=model, texts=texts, ids=ids, dimensions=dimensions,
                            truncate=truncate_prompt_tokens(doc)), fmt


def _inputs(value, max_inputs):
    """(texts, None) or (None, token-id lists) from `input`, every item checked."""
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("'input' must not be an empty string", param="input")
        return [value], None
    if not isinstance(value, list):
        raise InvalidRequest(f"'input' must be {_INPUT_SHAPES}, got {type_name(value)}", param="input")
    if not value:
        raise InvalidRequest("'input' must not be an empty array", param="input")
    if all(is_int(t) for t in value):
        return None, [_token_ids(value, "input")]
    if len(value) > max_inputs:
        raise InvalidRequest(f"'input' holds {len(value)} items; this server embeds at most {max_inputs} per "
                             f"request (TURBOSPARK_MAX_EMBEDDING_INPUTS)", param="input")
    if all(isinstance(t, str) for t in value):
        empty = next((i for i, t in enumerate(value) if not t), None)
        if empty is not None:
            raise InvalidRequest(f"input[{empty}] is an empty string", param="input")
        return list(value), None
    if all(isinstance(t, list) for t in value):
        return None, [_token_ids(t, f"input[{i}]") for i, t in enumerate(value)]
    bad = next((i for i, t in enumerate(value) if type(t) is not type(value[0])
                or not isinstance(t, (str, int, list)) or isinstance(t, bool)), 0)
    raise InvalidRequest(f"'input' must be {_INPUT_SHAPES}; input[{bad}] is {type_name(value[bad])}",
                         param="input")


def _token_ids(ids, where):
    if not ids:
        raise InvalidRequest(f"{where} holds no token ids", param="input")
    if not all(is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in ids):
        raise InvalidRequest(f"{where} must hold only non-negative integer token ids", param="input")
    return list(ids)


def embeddings_body(result, fmt):
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, fmt)}
            for i, v in enumerate(result.vectors)]
    return {"object": "list", "data": data, "model": result.model,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}


def _encoded(vector, fmt):
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector

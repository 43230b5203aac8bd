"""OpenAI wire format: /v1/completions requests and responses, plus the helpers every OpenAI
route shares (ids, usage, error envelope, model objects). The fields the generation APIs share are
common.py's."""
import secrets
import time
from dataclasses import dataclass

from ...errors import InvalidRequest
from ...serving.generation import ChoiceResult, Finished, KeepAlive, TextDelta
from ...serving.service import GenerationRequest
from .. import sse
from .common import (MAX_TOP_LOGPROBS, TOKEN_ID_LIMIT, cache_salt, choice_count, expect_object, include_usage,
                     is_int, max_tokens as token_budget, model_name, opt_bool, opt_int, sampling,
                     truncate_prompt_tokens, type_name)

DEGRADATION_HEADER = "x-anyllm-degradation"
MAX_BEST_OF = 20
MAX_PROMPTS = 16                # prompts in one /v1/completions request (TURBOSPARK_MAX_PROMPTS)

# NOTE(degradations): fields /v1/completions accepts but does not honour, each with the test that
# decides whether a request used it. Every standard field is honoured now; the header mechanism stays.
COMPLETION_DEGRADATIONS = ()


@dataclass(slots=True)
class ResponseMeta:
    id: str
    created: int
    model: str
    include_usage: bool = False
    prompt_filters: list | None = None      # (rule id, action) of the input guardrails that redacted


def new_id(prefix="cmpl-"):
    return prefix + secrets.token_hex(12)


def response_meta(prefix, model, include_usage=False):
    return ResponseMeta(new_id(prefix), int(time.time()), model, include_usage)


# ---- requests -------------------------------------------------------------------------------

def parse_completion(doc, max_prompts=MAX_PROMPTS):
    """A /v1/completions body -> (GenerationRequest, [degraded field names])."""
    expect_object(doc)
    if doc.get("suffix") is not None:
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    n, best_of = choice_counts(doc)
    echo = opt_bool(doc, "echo", False)
    max_tokens = token_budget(doc, lo=0, default=16)
    if max_tokens == 0 and not echo:
        # NOTE(echo): max_tokens 0 with echo means "score the prompt only" (lm-eval loglikelihood)
        raise InvalidRequest("max_tokens must be greater than 0 (0 is allowed only with echo)", param="max_tokens")
    sampling_fields = sampling(doc)
    logprobs = opt_int(doc, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    prompts = _prompts(doc, max_prompts)
    one = prompts[0] if len(prompts) == 1 else None
    stream = opt_bool(doc, "stream", False)
    req = GenerationRequest(model=model_name(doc), prompt=one if isinstance(one, str) else None,
                            prompt_ids=one if isinstance(one, list) else None,
                            prompts=prompts if one is None else None,
                            add_special=add_special(doc), max_tokens=max_tokens, sampling=sampling_fields,
                            stream=stream, include_usage=include_usage(doc, stream),
                            echo=echo, logprobs=logprobs, n=n, best_of=best_of,
                            truncate_prompt_tokens=truncate_prompt_tokens(doc), cache_salt=cache_salt(doc))
    return req, completion_degradations(doc)


def choice_counts(doc):
    """(n, best_of or None): best_of generates that many and returns the n most likely."""
    n = choice_count(doc)
    best_of = opt_int(doc, "best_of", None, lo=1, hi=MAX_BEST_OF)
    if best_of is not None and best_of < n:
        raise InvalidRequest(f"best_of must be greater than or equal to n, got best_of {best_of} and n {n}",
                             param="best_of")
    return n, best_of


def completion_degradations(doc):
    return [name for name, used in COMPLETION_DEGRADATIONS if used(doc)]


def add_special(doc):
    """Whether raw text gets the model's special tokens (its BOS, where the model wants one): vLLM's
    `add_special_tokens` or llama.cpp's `add_special`, default true; the two may not disagree."""
    vllm, llama = opt_bool(doc, "add_special_tokens", None), opt_bool(doc, "add_special", None)
    if vllm is not None and llama is not None and vllm != llama:
        raise InvalidRequest("'add_special_tokens' and 'add_special' disagree; give one of them",
                             param="add_special_tokens")
    return next((v for v in (vllm, llama) if v is not None), True)


_PROMPT_SHAPES = "a string, an array of token ids, an array of strings or an array of arrays of token ids"


def _prompts(doc, limit):
    """The request's prompts, one or more, each text or a list of token ids (all of one kind)."""
    value = doc.get("prompt")
    if value is None:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise InvalidRequest(f"'prompt' must be {_PROMPT_SHAPES}, got {type_name(value)}", param="prompt")
    if value and all(is_int(t) for t in value):
        return [_token_ids(value, "prompt")]
    if not value:
        raise InvalidRequest("'prompt' is an empty array", param="prompt")
    if len(value) > limit:
        raise InvalidRequest(f"'prompt' holds {len(value)} prompts; this server takes at most {limit} per "
                             f"request (TURBOSPARK_MAX_PROMPTS)", param="prompt")
    text = isinstance(value[0], str)
    return [_list_item(item, text, f"prompt[{i}]") for i, item in enumerate(value)]


def _list_item(item, text, param):
    if text and isinstance(item, str):
        return item
    if not text and isinstance(item, list) and all(is_int(t) for t in item):
        return _token_ids(item, param)
    kind = "a string" if text else "an array of token ids"
    raise InvalidRequest(f"'{param}' must be {kind}, got {type_name(item)} (a prompt list holds strings or "
                         f"arrays of token ids, all of one kind)", param=param)


def _token_ids(ids, param):
    if not ids:
        raise InvalidRequest(f"'{param}' holds an empty array of token ids", param=param)
    if any(not 0 <= t < TOKEN_ID_LIMIT for t in ids):
        raise InvalidRequest(f"'{param}' token ids must be non-negative integers", param=param)
    return list(ids)


# ---- responses ------------------------------------------------------------------------------

def usage_body(usage):
    """`usage`; with `completion_tokens_details`: OpenAI's predicted-output counts where speculative
    decoding proposed tokens (accepted ones were kept, rejected ones computed and dropped), and
    `reasoning_tokens` where the reply thought."""
    body = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}
    details = {}
    if usage.proposed_tokens:
        details = {"accepted_prediction_tokens": usage.accepted_tokens,
                   "rejected_prediction_tokens": usage.proposed_tokens - usage.accepted_tokens}
    if usage.reasoning_tokens:
        details["reasoning_tokens"] = usage.reasoning_tokens
    if details:
        body["completion_tokens_details"] = details
    return body


def finish_reason(reason):
    return reason if reason in ("length", "content_filter") else "stop"


def filter_results(fired):
    """What guardrail rules did, [(rule id, action)], in Azure OpenAI's `content_filter_results`
    shape: each rule is a custom blocklist, filtered when it blocked or redacted text."""
    return {"custom_blocklists": {"filtered": bool(fired),
                                  "details": [{"id": rule, "filtered": True, "action": action}
                                              for rule, action in fired]}}


def prompt_filter_results(fired):
    return [{"prompt_index": 0, "content_filter_results": filter_results(fired)}]


def completion_body(meta, choices, finished):
    """The non-streaming body for [ChoiceResult] and the last Finished (whose usage is the total)."""
    if isinstance(choices, str):
        choices = [ChoiceResult(0, choices, None, finished)]
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [_filtered({"text": c.text, "index": c.index,
                                   "logprobs": legacy_logprobs(c.logprobs) if c.logprobs is not None else None,
                                   "finish_reason": finish_reason(c.finished.reason)}, c.finished.guardrails)
                        for c in choices],
            "usage": usage_body(finished.usage),
            **({"prompt_filter_results": prompt_filter_results(meta.prompt_filters)} if meta.prompt_filters else {})}


def _filtered(choice, fired):
    if fired:
        choice["content_filter_results"] = filter_results(fired)
    return choice


def legacy_logprobs(entries, offset=0):
    """[TokenLogprob] -> the completions logprobs object; text_offset counts from `offset`."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += e.text_len
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {t: lp for t, _, lp in e.top} for e in entries],
            "text_offset": offsets}


def completion_chunk(meta, text, reason=None, index=0, logprobs=None):
    return {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model,
            "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": reason}]}


def completion_stream(events, meta):
    """Service events -> SSE frames: a chunk per delta (each choice's with its index), a finish
    chunk per choice, optional usage, [DONE]. A cancelled run ends without either."""
    offsets = {}                # choice index -> characters sent so far (for text_offset)
    for event in events:
        if isinstance(event, TextDelta):
            start = offsets.get(event.index, 0)
            logprobs = None if event.logprobs is None else legacy_logprobs(event.logprobs, start)
            offsets[event.index] = start + len(event.text)
            yield sse.data_event(completion_chunk(meta, event.text, None, event.index, logprobs))
        elif isinstance(event, Finished):
            chunk = completion_chunk(meta, "", finish_reason(event.reason), event.index)
            _filtered(chunk["choices"][0], event.guardrails)
            yield sse.data_event(chunk)
            if event.last:
                if meta.include_usage:
                    yield sse.data_event(usage_chunk(meta, "text_completion", event.usage))
                yield sse.DONE
        elif isinstance(event, KeepAlive):
            yield sse.KEEPALIVE


def usage_chunk(meta, obj, usage):
    """stream_options.include_usage: one trailing chunk with no choices."""
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "choices": [], "usage": usage_body(usage)}


def error_body(exc):
    """OpenAI's error envelope for an ApiError."""
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}


def error_event(exc):
    """A mid-stream failure as a framed `event: error` (no [DONE] follows)."""
    return sse.named_event("error", error_body(exc))


def model_object(info, owned_by="turbospark"):
    return {"id": info.id, "object": "model", "created": info.created, "owned_by": owned_by}

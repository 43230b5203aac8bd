"""POST /v1/chat/completions: the request body checked and turned into a ChatRequest."""
from dataclasses import dataclass, field

from ..engine import SamplingParams
from ..service import GenerationRequest
from . import checks
from .chat_messages import parse_messages, parse_tool_choice, parse_tools
from .checks import fail

REASONING_FORMATS = ("auto", "parsed", "deepseek", "none")


@dataclass(slots=True)
class ChatRequest:
    """What a chat request asks for, before any model is resolved."""

    messages: list                        # template dicts (see chat_messages.parse_messages)
    params: SamplingParams
    model: str | None = None
    max_tokens: int | None = None         # None: up to the end of the context
    tools: list | None = None             # OpenAI tool dicts; None when no tools (or tool_choice 'none')
    tool_choice: str = "none"             # 'none' | 'auto' | 'required' | a function name
    parallel_tool_calls: bool = True
    stream: bool = False
    include_usage: bool = False
    reasoning: bool = True                # split <think> out of the content
    template_kwargs: dict = field(default_factory=dict)


def parse_chat(doc):
    """The JSON body of a chat request -> ChatRequest; raises InvalidRequest naming the param."""
    checks.typed(doc, dict, "body", "a JSON object")
    messages = parse_messages(checks.require(doc, "messages"))
    tools = parse_tools(doc.get("tools"))
    choice = parse_tool_choice(doc.get("tool_choice"), tools)
    _refuse_unsupported(doc)
    stream = checks.boolean(doc, "stream")
    return ChatRequest(
        messages=messages, params=sampling_params(doc), model=_model(doc),
        max_tokens=_max_tokens(doc), tools=tools if choice != "none" else None, tool_choice=choice,
        parallel_tool_calls=checks.boolean(doc, "parallel_tool_calls", True), stream=stream,
        include_usage=_include_usage(doc, stream), reasoning=_reasoning(doc),
        template_kwargs=_template_kwargs(doc))


def sampling_params(doc):
    temperature = checks.number(doc, "temperature", 0, 2, 1.0)
    top_p = checks.number(doc, "top_p", 0, 1, 1.0)
    if top_p == 0:   # NOTE(sampling): top_p 0 keeps only the best token: that is argmax
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        max_new_tokens=0, temperature=float(temperature), top_p=float(top_p),
        top_k=checks.integer(doc, "top_k", 0, None, 0),
        min_p=float(checks.number(doc, "min_p", 0, 1, 0.0)),
        repetition_penalty=float(checks.number(doc, "repetition_penalty", 0.01, 10, 1.0)),
        presence_penalty=float(checks.number(doc, "presence_penalty", -2, 2, 0.0)),
        frequency_penalty=float(checks.number(doc, "frequency_penalty", -2, 2, 0.0)),
        logit_bias=checks.logit_bias(doc), seed=checks.integer(doc, "seed"),
        stop=checks.stop_list(doc, "stop"))


def _model(doc):
    model = doc.get("model")
    return checks.typed(model, str, "model", "a string") if model is not None else None


def _max_tokens(doc):
    # NOTE(openai): max_completion_tokens is the current name; max_tokens the deprecated alias.
    for key in ("max_completion_tokens", "max_tokens"):
        value = checks.integer(doc, key, 1, None)
        if value is not None:
            return value
    return None


def _refuse_unsupported(doc):
    n = checks.integer(doc, "n", 1, None, 1)
    if n > 1:
        fail("n", "n > 1 is not supported yet: request one choice at a time.")
    fmt = doc.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("json_object", "json_schema"):
            fail("response_format", f"response_format '{kind}' is not supported yet: output cannot be constrained.")
        if kind != "text":
            fail("response_format", "'response_format.type' must be 'text', 'json_object' or 'json_schema'.")
    if checks.boolean(doc, "logprobs"):
        fail("logprobs", "logprobs are not supported yet on /v1/chat/completions.")
    if doc.get("top_logprobs") is not None:
        fail("top_logprobs", "'top_logprobs' requires 'logprobs': true.")


def _include_usage(doc, stream):
    options = doc.get("stream_options")
    if options is None:
        return False
    if not stream:
        fail("stream_options", "'stream_options' is only allowed when 'stream' is true.")
    checks.typed(options, dict, "stream_options", "an object")
    return checks.boolean(options, "include_usage")


def _reasoning(doc):
    fmt = doc.get("reasoning_format", "auto")
    if fmt not in REASONING_FORMATS:
        fail("reasoning_format", f"'reasoning_format' must be one of {', '.join(REASONING_FORMATS)}.")
    return fmt != "none"


def _template_kwargs(doc):
    kwargs = doc.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    return dict(checks.typed(kwargs, dict, "chat_template_kwargs", "an object"))


def generation_request(chat, plan):
    """The service's GenerationRequest for a parsed chat (or messages) request and its OutputPlan."""
    return GenerationRequest(
        model=chat.model, messages=plan.messages, tools=plan.tools, template_kwargs=chat.template_kwargs,
        max_tokens=chat.max_tokens, params=chat.params, stream=chat.stream,
        include_usage=getattr(chat, "include_usage", False), assistant_prefix=plan.assistant_prefix,
        prompt_param="messages")

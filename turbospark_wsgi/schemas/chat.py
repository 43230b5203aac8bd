"""POST /v1/chat/completions: the request body checked and turned into a GenerationRequest."""
from ..engine import SamplingParams
from ..service import GenerationRequest
from . import checks
from .chat_grammar import response_format_grammar
from .chat_messages import parse_messages, parse_tool_choice, parse_tools
from .checks import fail
from .tool_prompt import ChatPart

REASONING_FORMATS = ("auto", "parsed", "deepseek", "none")
MAX_CHOICES = 20
SEED_LIMIT = 2 ** 64


def parse_chat(doc):
    """The JSON body of a chat request -> GenerationRequest with a ChatPart; raises InvalidRequest
    naming the param. Everything here needs no model."""
    checks.typed(doc, dict, "body", "a JSON object")
    messages = parse_messages(checks.require(doc, "messages"))
    tools = parse_tools(doc.get("tools"))
    choice = parse_tool_choice(doc.get("tool_choice"), tools)
    stream = checks.boolean(doc, "stream")
    n, logprobs = checks.integer(doc, "n", 1, MAX_CHOICES, 1), _logprobs(doc)
    grammar = response_format_grammar(doc.get("response_format"))
    params, model, max_tokens = sampling_params(doc), _model(doc), _max_tokens(doc)
    chat = ChatPart(messages, tools=tools if choice != "none" else None, tool_choice=choice,
                    parallel_tool_calls=checks.boolean(doc, "parallel_tool_calls", True), grammar=grammar)
    include_usage = _include_usage(doc, stream)
    chat.reasoning, chat.template_kwargs = _reasoning(doc), _template_kwargs(doc)
    return GenerationRequest(model=model, chat=chat, max_tokens=max_tokens, params=params, stream=stream,
                             include_usage=include_usage, n=n, logprobs=logprobs, prompt_param="messages")


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
        logit_bias=checks.logit_bias(doc), seed=_seed(doc),
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


def _seed(doc):
    seed = checks.integer(doc, "seed", -SEED_LIMIT // 2, SEED_LIMIT - 1)
    return None if seed is None else seed % SEED_LIMIT     # negative seeds folded into range


def _logprobs(doc):
    top = checks.integer(doc, "top_logprobs", 0, 20)
    if not checks.boolean(doc, "logprobs"):
        if top is not None:
            fail("top_logprobs", "'top_logprobs' requires 'logprobs': true.")
        return None
    return top or 0


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

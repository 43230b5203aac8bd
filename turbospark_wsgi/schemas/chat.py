"""POST /v1/chat/completions: the request body checked and turned into a ChatRequest."""
from dataclasses import dataclass, field

from ..engine import SamplingParams
from ..service import GenerationRequest
from . import checks
from .chat_grammar import response_format_grammar, tool_call_grammar
from .chat_messages import parse_messages, parse_tool_choice, parse_tools
from .checks import fail

REASONING_FORMATS = ("auto", "parsed", "deepseek", "none")
MAX_CHOICES = 20
SEED_LIMIT = 2 ** 64


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
    n: int = 1
    logprobs: int | None = None           # None: no logprobs; N: with the top N alternatives
    grammar: dict | None = None           # response_format as a grammar spec


def parse_chat(doc):
    """The JSON body of a chat request -> ChatRequest; raises InvalidRequest naming the param."""
    checks.typed(doc, dict, "body", "a JSON object")
    messages = parse_messages(checks.require(doc, "messages"))
    tools = parse_tools(doc.get("tools"))
    choice = parse_tool_choice(doc.get("tool_choice"), tools)
    stream = checks.boolean(doc, "stream")
    return ChatRequest(
        n=checks.integer(doc, "n", 1, MAX_CHOICES, 1), logprobs=_logprobs(doc),
        grammar=response_format_grammar(doc.get("response_format")),
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


def generation_request(chat, plan):
    """The service's GenerationRequest for a parsed chat (or messages) request and its OutputPlan."""
    tool_grammar = tool_call_grammar(plan.tool_family, chat.tool_choice, chat.tools) if plan.assistant_prefix else None
    return GenerationRequest(
        model=chat.model, messages=plan.messages, tools=plan.tools, template_kwargs=chat.template_kwargs,
        max_tokens=chat.max_tokens, params=chat.params, stream=chat.stream,
        include_usage=getattr(chat, "include_usage", False), assistant_prefix=plan.assistant_prefix,
        prompt_param="messages", n=getattr(chat, "n", 1), logprobs=getattr(chat, "logprobs", None),
        grammar=tool_grammar or getattr(chat, "grammar", None),
        grammar_param="tools" if tool_grammar else "response_format",   # the schemas the grammar is built from
        thinking_budget=getattr(chat, "thinking_budget", None))

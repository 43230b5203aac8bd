"""POST /v1/chat/completions: the request body checked and turned into a GenerationRequest."""
from ...serving.chat_plan import ChatPart
from ...serving.service import GenerationRequest
from . import checks, common
from .chat_grammar import response_format_grammar
from .chat_messages import parse_messages, parse_tool_choice, parse_tools
from .checks import fail

REASONING_FORMATS = ("auto", "parsed", "deepseek", "none")


def parse_chat(doc):
    """The JSON body of a chat request -> GenerationRequest with a ChatPart; raises InvalidRequest
    naming the param. Everything here needs no model."""
    checks.typed(doc, dict, "body", "a JSON object")
    messages = parse_messages(checks.require(doc, "messages"))
    tools = parse_tools(doc.get("tools"))
    choice = parse_tool_choice(doc.get("tool_choice"), tools)
    stream = checks.boolean(doc, "stream")
    n, logprobs = common.choice_count(doc), _logprobs(doc)
    grammar = response_format_grammar(doc.get("response_format"))
    sampling, model, max_tokens = common.sampling(doc), common.model_name(doc), _max_tokens(doc)
    effort = common.reasoning_effort(doc.get("reasoning_effort"), "reasoning_effort")
    chat = ChatPart(messages, tools=tools if choice != "none" else None, tool_choice=choice,
                    parallel_tool_calls=checks.boolean(doc, "parallel_tool_calls", True), reasoning=_reasoning(doc),
                    template_kwargs={**common.effort_kwargs(effort), **_template_kwargs(doc)}, grammar=grammar,
                    thinking_budget=common.token_budget(doc, "thinking_token_budget"), reasoning_effort=effort)
    return GenerationRequest(model=model, chat=chat, max_tokens=max_tokens, sampling=sampling, stream=stream,
                             include_usage=common.include_usage(doc, stream), n=n, logprobs=logprobs,
                             prompt_param="messages", truncate_prompt_tokens=common.truncate_prompt_tokens(doc),
                             cache_salt=common.cache_salt(doc))


def _max_tokens(doc):
    # NOTE(openai): max_completion_tokens is the current name; max_tokens the deprecated alias.
    for key in ("max_completion_tokens", "max_tokens"):
        value = common.max_tokens(doc, key)
        if value is not None:
            return value
    return None


def _logprobs(doc):
    top = checks.integer(doc, "top_logprobs", 0, common.MAX_TOP_LOGPROBS)
    if not checks.boolean(doc, "logprobs"):
        if top is not None:
            fail("top_logprobs", "'top_logprobs' requires 'logprobs': true.")
        return None
    return top or 0


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

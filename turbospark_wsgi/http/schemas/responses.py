"""POST /v1/responses (OpenAI Responses API): the request body checked and turned into a
ResponsesRequest, whose `generation(history)` is the service's GenerationRequest with a ChatPart.

Every check here needs no model, so it runs before one is resolved.
"""
from dataclasses import dataclass, field

from ...serving.chat_plan import ChatPart
from ...serving.params import Sampling
from ...serving.service import GenerationRequest
from . import checks, common
from .chat_grammar import json_grammar
from .chat_messages import function_spec
from .checks import fail
from .json_schema import check_schema
from .responses_input import parse_input, with_tool_names

SUMMARIES = ("auto", "concise", "detailed")
VERBOSITIES = ("low", "medium", "high")
MAX_METADATA = 16           # OpenAI's limits: 16 pairs, keys of 64 characters, values of 512
_UNSUPPORTED = {            # fields whose presence asks for something this server does not do
    "conversation": "conversations are not supported; use 'previous_response_id' or send the whole input",
    "prompt": "stored prompt templates are not supported; send 'instructions' and 'input'",
}


@dataclass(slots=True)
class ResponsesRequest:
    """What a Responses request asks for; `generation(history)` once the stored history is known."""

    input_messages: list                  # this request's input as template dicts
    sampling: Sampling
    echo: dict                            # request fields every Response object repeats
    instructions: str | None = None
    model: str | None = None
    max_tokens: int | None = None         # max_output_tokens; None: up to the end of the context
    tools: list | None = None             # chat-shaped tool dicts, as templates take them
    tool_choice: str = "none"             # 'none' | 'auto' | 'required' | a function name
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: bool = True                # split <think> out as reasoning items
    template_kwargs: dict = field(default_factory=dict)
    grammar: dict | None = None           # text.format as a grammar spec
    cache_salt: str = ""                  # vLLM's: only the same salt shares cached prompt prefixes
    effort: str | None = None             # reasoning.effort: the server's budget for it

    def generation(self, history):
        """The service's GenerationRequest for this request after `history` (stored template dicts)."""
        chat = ChatPart(conversation(self, history), tools=self.tools, tool_choice=self.tool_choice,
                        parallel_tool_calls=self.parallel_tool_calls, reasoning=self.reasoning,
                        template_kwargs=self.template_kwargs, grammar=self.grammar, grammar_param="text.format",
                        reasoning_effort=self.effort)
        return GenerationRequest(model=self.model, chat=chat, max_tokens=self.max_tokens, sampling=self.sampling,
                                 stream=self.stream, prompt_param="input", cache_salt=self.cache_salt)


def parse_responses(doc):
    """The JSON body -> ResponsesRequest; raises InvalidRequest naming the param."""
    checks.typed(doc, dict, "body", "a JSON object")
    _refuse_unsupported(doc)
    instructions = _optional_str(doc, "instructions")
    input_messages = parse_input(checks.require(doc, "input"))
    tools, tools_echo = _tools(doc.get("tools"))
    choice, tools = _tool_choice(doc.get("tool_choice"), tools)
    text_format, grammar = _text_format(doc.get("text"))
    effort, summary = _reasoning(doc.get("reasoning"))
    max_tokens = common.max_tokens(doc, "max_output_tokens")
    parallel = checks.boolean(doc, "parallel_tool_calls", True)
    store = checks.boolean(doc, "store", True)
    sampling = common.sampling(doc)
    echo = {
        "instructions": instructions, "max_output_tokens": max_tokens,
        "max_tool_calls": checks.integer(doc, "max_tool_calls", 1, None), "metadata": _metadata(doc.get("metadata")),
        "parallel_tool_calls": parallel, "previous_response_id": _previous(doc),
        "reasoning": {"effort": effort, "summary": summary}, "service_tier": "default", "store": store,
        "temperature": _echo_number(doc, "temperature"), "top_p": _echo_number(doc, "top_p"),
        "text": {"format": text_format, "verbosity": _verbosity(doc.get("text"))},
        "tool_choice": _choice_echo(choice), "tools": tools_echo,
        "top_logprobs": checks.integer(doc, "top_logprobs", 0, common.MAX_TOP_LOGPROBS), "truncation": "disabled",
        "user": _optional_str(doc, "user"), "safety_identifier": _optional_str(doc, "safety_identifier"),
        "prompt_cache_key": _optional_str(doc, "prompt_cache_key")}
    return ResponsesRequest(
        input_messages=input_messages, sampling=sampling, echo=echo, instructions=instructions,
        model=common.model_name(doc), max_tokens=max_tokens, tools=tools if choice != "none" else None,
        tool_choice=choice, parallel_tool_calls=parallel, stream=_stream(doc), store=store,
        previous_response_id=echo["previous_response_id"], grammar=grammar,
        template_kwargs=common.effort_kwargs(effort), cache_salt=common.cache_salt(doc), effort=effort)


def conversation(request, history):
    """The whole conversation for the template: this request's instructions (a previous response's
    are not carried over, as OpenAI does), the stored history, then the new input."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    return with_tool_names(system + [dict(m) for m in history] + request.input_messages)


def _refuse_unsupported(doc):
    for key, why in _UNSUPPORTED.items():
        if doc.get(key) is not None:
            fail(key, f"'{key}': {why}.")
    if checks.boolean(doc, "background"):
        fail("background", "'background': background responses are not supported; stream instead.")
    truncation = doc.get("truncation")
    if truncation not in (None, "disabled"):
        fail("truncation", "'truncation' must be 'disabled': the input is never cut to fit the context.")
    include = doc.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            fail("include", "'include' must be an array of strings.")
        if "message.output_text.logprobs" in include:
            fail("include", "'message.output_text.logprobs' is not supported on /v1/responses; "
                            "use /v1/chat/completions with 'logprobs'.")
    if doc.get("stream_options") is not None:
        checks.typed(doc["stream_options"], dict, "stream_options", "an object")
        checks.boolean(doc["stream_options"], "include_obfuscation")


def _stream(doc):
    stream = checks.boolean(doc, "stream")
    if doc.get("stream_options") is not None and not stream:
        fail("stream_options", "'stream_options' is only allowed when 'stream' is true.")
    return stream


def _optional_str(doc, key):
    value = doc.get(key)
    return checks.typed(value, str, key, "a string") if value is not None else None


def _echo_number(doc, key):
    return checks.number(doc, key, None, None, 1.0)


def _previous(doc):
    value = _optional_str(doc, "previous_response_id")
    if value is not None and not value:
        fail("previous_response_id", "'previous_response_id' must not be empty.")
    return value


def _metadata(value):
    if value is None:
        return None
    checks.typed(value, dict, "metadata", "an object of string values")
    if len(value) > MAX_METADATA:
        fail("metadata", f"'metadata' may hold at most {MAX_METADATA} pairs, got {len(value)}.")
    for key, item in value.items():
        if len(key) > 64:
            fail("metadata", "'metadata' keys may be at most 64 characters.")
        if not isinstance(item, str) or len(item) > 512:
            fail(f"metadata.{key}", f"'metadata.{key}' must be a string of at most 512 characters.")
    return dict(value)


def _tools(value):
    """`tools` -> (chat-shaped tool dicts or None, the tools as a Response echoes them)."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        fail("tools", "'tools' must be an array.")
    tools, echo = [], []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        checks.typed(tool, dict, param, "an object")
        if tool.get("type") != "function":
            fail(f"{param}.type", f"'{param}.type' must be 'function': built-in tools are not supported.")
        spec = function_spec(tool, param)
        strict = tool.get("strict")
        if strict is not None:
            checks.typed(strict, bool, f"{param}.strict", "a boolean")
        tools.append({"type": "function", "function": spec})
        echo.append({"type": "function", "name": spec["name"], "description": spec.get("description"),
                     "parameters": spec.get("parameters"), "strict": strict})
    return tools or None, echo


def _tool_choice(value, tools):
    """(choice, tools): 'none' | 'auto' | 'required' | a function name; allowed_tools narrows `tools`."""
    if value is None:
        return ("auto" if tools else "none"), tools
    if isinstance(value, str) and value in ("none", "auto", "required"):
        choice = value
    elif isinstance(value, dict) and value.get("type") == "function":
        choice = checks.typed(value.get("name"), str, "tool_choice.name", "a function name")
    elif isinstance(value, dict) and value.get("type") == "allowed_tools":
        choice, tools = _allowed_tools(value, tools)
    else:
        fail("tool_choice", "'tool_choice' must be 'none', 'auto', 'required', {\"type\": \"function\", "
                            "\"name\": ...} or {\"type\": \"allowed_tools\", ...}: built-in tools are not supported.")
    declared = [t["function"]["name"] for t in tools or ()]
    if choice != "none" and choice != "auto" and not declared:
        fail("tool_choice", "'tool_choice' requires 'tools'.")
    if choice not in ("none", "auto", "required") and choice not in declared:
        fail("tool_choice", f"'tool_choice' names '{choice}', which is not among 'tools'.")
    return choice, tools


def _allowed_tools(value, tools):
    mode = value.get("mode", "auto")
    if mode not in ("auto", "required"):
        fail("tool_choice.mode", "'tool_choice.mode' must be 'auto' or 'required'.")
    allowed = value.get("tools")
    if not isinstance(allowed, list):
        fail("tool_choice.tools", "'tool_choice.tools' must be an array of {\"type\": \"function\", \"name\": ...}.")
    names = set()
    for i, tool in enumerate(allowed):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            fail(f"tool_choice.tools[{i}]",
                 f"'tool_choice.tools[{i}]' must be {{\"type\": \"function\", \"name\": ...}}.")
        names.add(tool["name"])
    kept = [t for t in tools or () if t["function"]["name"] in names]
    return mode, kept or None


def _choice_echo(choice):
    if choice in ("none", "auto", "required"):
        return choice
    return {"type": "function", "name": choice}


def _text_format(text):
    """`text.format` -> (the format as a Response echoes it, a grammar spec or None)."""
    if text is None:
        return {"type": "text"}, None
    checks.typed(text, dict, "text", "an object")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}, None
    if kind == "json_object":
        return {"type": "json_object"}, json_grammar({"type": "object"})
    if kind != "json_schema":
        fail("text.format.type", "'text.format.type' must be 'text', 'json_object' or 'json_schema'.")
    name = fmt.get("name")
    if not isinstance(name, str) or not name:
        fail("text.format.name", "'text.format.name' must be a non-empty string.")
    schema = fmt.get("schema")
    checks.typed(schema, dict, "text.format.schema", "a JSON Schema object")
    check_schema(schema, "text.format.schema")
    description = fmt.get("description")
    if description is not None:
        checks.typed(description, str, "text.format.description", "a string")
    strict = fmt.get("strict")
    if strict is not None:
        checks.typed(strict, bool, "text.format.strict", "a boolean")
    echo = {"type": "json_schema", "name": name, "schema": schema, "strict": strict, "description": description}
    return echo, json_grammar(schema)


def _verbosity(text):
    value = text.get("verbosity") if isinstance(text, dict) else None
    if value is not None and (not isinstance(value, str) or value not in VERBOSITIES):
        fail("text.verbosity", f"'text.verbosity' must be one of {', '.join(VERBOSITIES)}.")
    return value or "medium"


def _reasoning(value):
    """(effort, summary) from `reasoning`; both None when absent."""
    if value is None:
        return None, None
    checks.typed(value, dict, "reasoning", "an object")
    effort = common.reasoning_effort(value.get("effort"), "reasoning.effort")
    summary = value.get("summary", value.get("generate_summary"))
    if summary is not None and (not isinstance(summary, str) or summary not in SUMMARIES):
        fail("reasoning.summary", f"'reasoning.summary' must be one of {', '.join(SUMMARIES)}.")
    return effort, summary



"""The chat part of a GenerationRequest, and how its tools and reasoning meet a model's template:
family, fallback, forced prefix and grammar, planned once the model is leased. The plan is plain
data: the HTTP side reads the reply through a parser it builds from the plan's fields.

    chat = ChatPart(messages, tools=..., tool_choice=...)     # checked by the schemas, no model needed
    plan = plan_output(template_source, chat)                 # the service, once the model is leased
"""
import json
from dataclasses import dataclass, field

_FALLBACK_SYSTEM = (
    "You may call one or more functions to assist with the user query. The available functions are "
    "listed in <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a JSON "
    "object inside <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass(slots=True)
class ChatPart:
    """The chat half of a GenerationRequest (chat, messages, responses, tokenize): what the model's
    template renders and how the reply is read. Everything in it was checked without a model."""

    messages: list                        # template dicts (see chat_messages.parse_messages)
    tools: list | None = None             # OpenAI tool dicts; None when no tools (or tool_choice 'none')
    tool_choice: str = "none"             # 'none' | 'auto' | 'required' | a function name
    parallel_tool_calls: bool = True
    reasoning: bool = True                # split <think> out of the content
    template_kwargs: dict = field(default_factory=dict)
    thinking_budget: int | None = None    # reasoning tokens before the think tag is closed (no grammar)
    reasoning_effort: str | None = None   # OpenAI's effort: its budget is the server's (TURBOSPARK_REASONING_BUDGETS)
    grammar: dict | None = None           # the response format as a grammar spec
    grammar_param: str = "response_format"  # the request field that grammar came from


@dataclass(slots=True)
class OutputPlan:
    """What the prompt gets and how the output is parsed for one chat request."""

    messages: list
    tools: list | None                    # passed to the template (None when the template can't take them)
    tool_family: str | None               # detect_family's name; None: no tool calls parsed
    in_reasoning: bool                    # the generation prompt already opened <think>
    assistant_prefix: str = ""            # generated-text prefix forcing a tool call ('' when not forced)
    reasoning: bool = True                # split <think> out of the content
    grammar: dict | None = None           # the grammar the output must follow (a forced call's, else the format's)
    grammar_param: str = "response_format"  # the request field blamed when the grammar cannot compile


def detect_family(template_text):
    """The tool-call family a chat template speaks; Hermes when the template says nothing."""
    text = template_text or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text or "[AVAILABLE_TOOLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "tools" in text):
        return "llama3_json"
    return "hermes"


def prompt_opens_reasoning(source):
    """Whether the template's generation prompt ends inside an open <think> (DeepSeek-R1 style)."""
    tail = source[source.rfind("add_generation_prompt"):] if "add_generation_prompt" in source else ""
    return "<think>" in tail and "</think>" not in tail


def plan_output(source, chat):
    """An OutputPlan for a template source and a ChatPart."""
    source = source or ""
    in_reasoning = chat.reasoning and prompt_opens_reasoning(source)
    messages, tools = chat.messages, chat.tools
    if not tools:
        return OutputPlan(messages, None, None, in_reasoning, reasoning=chat.reasoning, grammar=chat.grammar,
                          grammar_param=chat.grammar_param)
    family = detect_family(source)
    if "tools" not in source:
        # NOTE(tools): a template that never renders `tools` gets them in a Hermes-style system turn,
        # and the tool turns of the history written as Hermes text, instead of losing them silently.
        messages, tools, family = _fallback_messages(messages, tools), None, "hermes"
    prefix = forced_prefix(family, chat.tool_choice)
    if prefix:      # NOTE(grammar): the schemas the forced call's grammar is built from are the tools'
        grammar, param = tool_call_grammar(family, chat.tool_choice, chat.tools), "tools"
    else:
        grammar, param = chat.grammar, chat.grammar_param
    return OutputPlan(messages, tools, family, in_reasoning, prefix, chat.reasoning, grammar, param)


def forced_prefix(family, tool_choice):
    """The start of a tool call written for the model when tool_choice is 'required' or a name."""
    if tool_choice in ("auto", "none"):
        return ""
    named = tool_choice != "required"
    name = json.dumps(tool_choice)
    if family == "llama3_json":
        return f'{{"name": {name}, "parameters": ' if named else '{"name": '
    if family == "mistral":
        return f'[TOOL_CALLS][{{"name": {name}, "arguments": ' if named else "[TOOL_CALLS]"
    return f'<tool_call>\n{{"name": {name}, "arguments": ' if named else "<tool_call>\n"


# NOTE(whitespace): one fixed style (", " and ": ", no newlines) keeps a small model from wandering
# into endless whitespace, which flexible JSON whitespace allows.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def styled(schema):
    """A JSON schema as a grammar in JSON_STYLE."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def tool_call_grammar(family, tool_choice, tools):
    """The rest of a forced call after its prefix (see forced_prefix); None unless forced."""
    if tool_choice in ("auto", "none") or not tools:
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if tool_choice != "required":
        schemas = {tool_choice: schemas[tool_choice]}
    rules, alternatives = [], []
    for k, (name, schema) in enumerate(schemas.items()):
        rules.append(f"args{k}: %json {json.dumps(styled(schema))}")
        alternatives.append(_call_rule(family, tool_choice == "required", name, f"args{k}"))
    lark = "start: " + " | ".join(alternatives) + "\n" + "\n".join(rules) + "\n"
    return {"grammars": [{"lark_grammar": lark}]}


def _call_rule(family, required, name, args):
    q = json.dumps
    if family == "llama3_json":
        head, tail = (q(q(name) + ", \"parameters\": ") if required else None), q("}")
    elif family == "mistral":
        head = q("[{\"name\": " + q(name) + ", \"arguments\": ") if required else None
        tail = q("}]")
    else:
        head = q("{\"name\": " + q(name) + ", \"arguments\": ") if required else None
        tail = q("}\n</tool_call>")
    return " ".join(p for p in (head, args, tail) if p)


def _fallback_messages(messages, tools):
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = _FALLBACK_SYSTEM.format(tools=listing)
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = out[0]["content"] + "\n\n" + system
    else:
        out.insert(0, {"role": "system", "content": system})
    return [_hermes_turn(m) for m in out]


def _hermes_turn(msg):
    if msg["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
    if msg["role"] == "assistant" and msg.get("tool_calls"):
        calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                        ensure_ascii=False) + "\n</tool_call>"
                          for c in msg["tool_calls"])
        text = (msg["content"] + "\n" if msg["content"] else "") + calls
        return {k: v for k, v in {**msg, "content": text}.items() if k != "tool_calls"}
    return msg

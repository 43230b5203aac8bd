import datetime
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

from turbospark_wsgi.engine.chat_template import CHATML_TEMPLATE, GEMMA3_TEMPLATE, ChatTemplate, TemplateError
from turbospark_wsgi.engine.gguf import read_metadata
from turbospark_wsgi.engine.tokenizer import Tokenizer

MODELS = os.path.expanduser(os.environ.get("TURBOSPARK_MODELS", "~/.cache/turbospark/models"))
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The models' own templates, each file naming where it comes from.
TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
QWEN25_TEMPLATE = (TEMPLATES / "qwen2.5-instruct.jinja").read_text(encoding="utf-8")
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
R1_QWEN_TEMPLATE = (TEMPLATES / "deepseek-r1-distill-qwen.jinja").read_text(encoding="utf-8")

# Written from the public structure of Llama-3.1-Instruct's template (date header, JSON tool
# definitions in the first user turn, one tool call per assistant turn, ipython results).
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject("equalto", "code_interpreter") | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Städte, 東京"}},
                   "required": ["city"]}}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, how can I help?"},
     {"role": "user", "content": "Tell me a joke about 猫 😀"}],
    [{"role": "system", "content": "Sys"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c\n\nd"}],
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
]


def hf_tokenizer_with(template, bos="<|begin_of_text|>", eos="<|eot_id|>"):
    transformers = pytest.importorskip("transformers")
    backend = Backend(models.WordLevel({"<unk>": 0, bos: 1, eos: 2}, unk_token="<unk>"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tok.chat_template = template
    return tok


def hf_render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.fixture(scope="module")
def smol_pair():
    path = os.path.join(MODELS, SMOL_FILE)
    if not os.path.exists(path):
        pytest.skip(f"default model not found at {path}")
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.from_gguf_metadata(read_metadata(path))
    hf = transformers.AutoTokenizer.from_pretrained(MODELS, gguf_file=SMOL_FILE)
    return ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token), hf


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smol_template_matches_transformers(smol_pair, messages, add_generation_prompt):
    ours, hf = smol_pair
    expected = hf_render(hf, messages, add_generation_prompt=add_generation_prompt)
    assert ours.render(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS + [TOOL_CONVERSATION])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_qwen25_template_matches_transformers(messages, tools):
    hf = hf_tokenizer_with(QWEN25_TEMPLATE, bos="<|endoftext|>", eos="<|im_end|>")
    ours = ChatTemplate(QWEN25_TEMPLATE, eos_token="<|im_end|>")
    assert ours.render(messages, tools=tools) == hf_render(hf, messages, tools=tools, add_generation_prompt=True)


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
QWEN3_CONVERSATIONS = [
    # an earlier answer's thinking is dropped from the history, the last one's kept
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add them"}],
    # a multi-step tool turn: thinking, two parallel calls with content, results grouped in one user turn
    [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris and Oslo?"},
     {"role": "assistant", "content": "Checking both.", "reasoning_content": "two cities",
      "tool_calls": [CALL, {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
     {"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": '{"temp": 3}'}],
    [{"role": "user", "content": "<tool_response>\nnot a tool turn\n</tool_response>"}],
]


# NOTE: the server sends a call-only assistant turn's content as "" (Qwen3's template tests it as text)
@pytest.mark.parametrize("messages", CONVERSATIONS + QWEN3_CONVERSATIONS + [
    [{**m, "content": m["content"] or ""} for m in TOOL_CONVERSATION]])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_template_matches_transformers(messages, tools, kwargs, add_generation_prompt):
    hf = hf_tokenizer_with(QWEN3_TEMPLATE, bos="<|endoftext|>", eos="<|im_end|>")
    ours = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    expected = hf_render(hf, messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs) == expected


def test_qwen3_enable_thinking_false_closes_an_empty_think_block():
    ours = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>")
    hi = [{"role": "user", "content": "Hi"}]
    assert ours.render(hi) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.render(hi, enable_thinking=False) == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                                                      "<think>\n\n</think>\n\n")


@pytest.mark.parametrize("messages", CONVERSATIONS + [QWEN3_CONVERSATIONS[0]])
def test_r1_distill_qwen_template_matches_transformers(messages):
    bos, eos = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
    hf = hf_tokenizer_with(R1_QWEN_TEMPLATE, bos=bos, eos=eos)
    ours = ChatTemplate(R1_QWEN_TEMPLATE, bos, eos)
    rendered = ours.render(messages)
    assert rendered == hf_render(hf, messages, add_generation_prompt=True)
    assert rendered.startswith(bos) and rendered.endswith("<\uff5cAssistant\uff5c>") and "add" not in rendered


@pytest.mark.parametrize("messages", CONVERSATIONS + [TOOL_CONVERSATION])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
@pytest.mark.parametrize("extra", [{}, {"tools_in_user_message": False, "date_string": "01 Jan 2025"}])
def test_llama31_template_matches_transformers(messages, tools, extra):
    hf = hf_tokenizer_with(LLAMA31_TEMPLATE)
    ours = ChatTemplate(LLAMA31_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>")
    expected = hf_render(hf, messages, tools=tools, add_generation_prompt=True, **extra)
    assert ours.render(messages, tools=tools, **extra) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS + [[{"role": "user", "content": [
    {"type": "text", "text": "  part one "}, {"type": "text", "text": "two"}]}]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma3_template_matches_transformers(messages, add_generation_prompt):
    """Gemma 3's template (the fallback for Gemma 3 files without one): no system role, the system
    text opens the first user turn; the assistant is "model"."""
    hf = hf_tokenizer_with(GEMMA3_TEMPLATE, bos="<bos>", eos="<eos>")
    ours = ChatTemplate(GEMMA3_TEMPLATE, "<bos>", "<eos>")
    expected = hf_render(hf, messages, add_generation_prompt=add_generation_prompt)
    assert ours.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_gemma3_template_renders_system_into_the_first_turn_and_refuses_two_users():
    ours = ChatTemplate(GEMMA3_TEMPLATE, "<bos>", "<eos>")
    assert ours.render(CONVERSATIONS[1]) == ("<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n"
                                             "<start_of_turn>model\n")
    with pytest.raises(TemplateError, match="alternate"):
        ours.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_raise_exception_becomes_template_error():
    tmpl = ChatTemplate(LLAMA31_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>")
    bad = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]}]
    with pytest.raises(TemplateError, match="single tool-calls") as info:
        tmpl.render(bad)
    assert isinstance(info.value, ValueError) and "single tool-calls" in info.value.message


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% set x = messages.append(1) %}{{ x }}",
])
def test_sandbox_blocks_escapes(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_sandbox_hides_dunder_attributes():
    assert ChatTemplate("{{ ''.__class__ }}|{{ messages.__len__ }}").render([]) == "|"


def test_fallback_chatml():
    tmpl = ChatTemplate(None)
    assert tmpl.source == CHATML_TEMPLATE == ChatTemplate.fallback("<s>").source
    messages = [{"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tmpl.render(messages) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    assert tmpl.render(messages[:1], add_generation_prompt=False) == "<|im_start|>system\nS<|im_end|>\n"


def test_helpers_and_kwargs():
    source = ("{{ bos_token }}|{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y-%m-%d') }}"
              "|{% if enable_thinking %}think{% endif %}|{% generation %}gen{% endgeneration %}"
              "|{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}")
    out = ChatTemplate(source, bos_token="<s>").render(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        tools=[{"name": "é<>&"}], enable_thinking=True)
    today = datetime.datetime.now().strftime("%Y-%m-%d")
    assert out == f'<s>|[{{"name": "é<>&"}}]|[\n  {{\n    "name": "é<>&"\n  }}\n]|{today}|think|gen|user'


def test_none_valued_keys_are_dropped():
    tmpl = ChatTemplate("{% for m in messages %}{{ 'content' in m }}{% endfor %}")
    assert tmpl.render([{"role": "assistant", "content": None}, {"role": "user", "content": ""}]) == "FalseTrue"


def test_syntax_error_is_a_template_error():
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_undefined_misuse_is_a_template_error():
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])

"""A chat template is code from the model file: every class of hostile template (long loops, huge
strings, deep or wide recursion through macros, huge output, Python internals, the environment)
ends in a TemplateError within 2 s, and real templates render as before within their budget."""
import time
from pathlib import Path

import pytest

from turbospark_wsgi.engine import template_budget as tb
from turbospark_wsgi.engine.chat_template import (CHATML_TEMPLATE, PROBES, ChatTemplate, TemplateError,
                                                  TemplateOverBudget, TemplateUnusable, template_limits)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
USER = [{"role": "user", "content": "hi"}]
NS = "{% set ns = namespace(s='x', n=3) %}"

# (template, the TemplateError class it must end in): one per way a template can spend work or memory
HOSTILE = {
    "nested range loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           TemplateOverBudget),
    "nested loops over a list": ("{% set l = range(100000)|list %}{% for i in l %}{% for j in l %}{{ '' }}"
                                 "{% endfor %}{% endfor %}", TemplateOverBudget),
    "string doubling with ~": (NS + "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                               TemplateOverBudget),
    "string doubling with +": (NS + "{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                               TemplateOverBudget),
    "doubling in a set block": (NS + "{% for i in range(64) %}{% set x %}{{ ns.s }}{{ ns.s }}{% endset %}"
                                "{% set ns.s = x %}{% endfor %}", TemplateOverBudget),
    "string times a huge number": ("{{ 'x' * 10000000000 }}", TemplateOverBudget),
    "list times a huge number": ("{{ ([1] * 10000000000)|length }}", TemplateOverBudget),
    "center method": ("{{ 'x'.center(10000000000) }}", TemplateOverBudget),
    "center filter": ("{{ 'x'|center(10000000000) }}", TemplateOverBudget),
    "indent filter": ("{{ ('a\n' * 100000)|indent(100000) }}", TemplateOverBudget),
    "percent format width": ("{{ '%1000000000s' % 'x' }}", TemplateOverBudget),
    "format method width": ("{{ '{:>1000000000}'.format('x') }}", TemplateOverBudget),
    "format filter width": ("{{ '%1000000000s'|format('x') }}", TemplateOverBudget),
    "replace with an empty needle": ("{{ ('x' * 100000).replace('', 'yyyyyyyyyy') }}", TemplateOverBudget),
    "replace filter doubling": ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(30) %}"
                                "{% set ns.s = ns.s|replace('x', 'xx') %}{% endfor %}", TemplateOverBudget),
    "join of shared strings": ("{% set s = 'x' * 100000 %}{{ ([s] * 1000)|join }}", TemplateOverBudget),
    "join method": ("{% set s = 'x' * 100000 %}{{ ''.join([s] * 1000) }}", TemplateOverBudget),
    "join of a lazy map": ("{% set s = 'x' * 100000 %}{{ ([s] * 1000)|map('upper')|join }}", TemplateOverBudget),
    "expandtabs": ("{{ ('\t' * 100000).expandtabs(100000) }}", TemplateOverBudget),
    "translate": ("{{ ('a' * 100000).translate({97: 'b' * 100000}) }}", TemplateOverBudget),
    "wordwrap": ("{{ ('a ' * 50000)|wordwrap(1, wrapstring='z' * 10000) }}", TemplateOverBudget),
    "tojson indent": ("{{ (range(10000)|list)|tojson(indent=100000) }}", TemplateOverBudget),
    "slice into a billion": ("{{ [1, 2]|slice(1000000000)|list|length }}", TemplateOverBudget),
    "batch filled to a billion": ("{{ [1]|batch(1000000000, 'x')|list|length }}", TemplateOverBudget),
    "sum of lists": ("{{ ([[1] * 1000] * 1000)|sum(start=[])|length }}", TemplateOverBudget),
    "many splits": ("{% set s = ',' * 1000000 %}{% for i in range(1000) %}{% set x = s.split(',') %}{% endfor %}",
                    TemplateOverBudget),
    "huge numbers": (NS + "{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", TemplateOverBudget),
    "huge power": ("{{ 3 ** 100000000 }}", TemplateOverBudget),
    "lipsum": ("{{ lipsum(1000000) }}", TemplateOverBudget),
    "huge output": ("{% for i in range(100000) %}{% for j in range(100) %}" + "x" * 100 + "{% endfor %}{% endfor %}",
                    TemplateOverBudget),
    "deep macro recursion": ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", TemplateError),
    "wide macro recursion": ("{% macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}"
                             "{{ m(40) }}", TemplateOverBudget),
    "substring search in a loop": ("{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{% if 'y' in s %}"
                                   "{% endif %}{% endfor %}", TemplateOverBudget),
    "python internals": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", TemplateError),
    "function globals": ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", TemplateError),
    "the environment": ("{{ self._TemplateReference__context.environment }}", TemplateError),
    "the context's environment": ("{{ joiner.__init__.__globals__ }}{{ namespace.__init__.__globals__ }}",
                                  TemplateError),
    "mutating the conversation": ("{% set x = messages.append(1) %}{{ x }}", TemplateError),
    "an include": ("{% include '/etc/passwd' %}", TemplateError),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_a_template_error_within_two_seconds(name):
    source, error = HOSTILE[name]
    started = time.monotonic()
    with pytest.raises(error) as info:
        ChatTemplate(source, name="model 'evil'").render(USER)
    assert time.monotonic() - started < 2.0       # the budget's 1 s, plus slack for a loaded machine
    assert info.value.message and len(info.value.message) < 400
    if error is TemplateOverBudget:
        assert "model 'evil'" in info.value.message and info.value.code == "chat_template_over_budget"


@pytest.mark.parametrize("name", ["nested range loops", "wide macro recursion", "huge output"])
def test_a_long_render_stops_at_its_step_budget_when_time_is_no_limit(name):
    limits = tb.Limits(ops=50_000, seconds=600)
    with pytest.raises(TemplateOverBudget, match="steps|characters"):
        ChatTemplate(HOSTILE[name][0], limits=limits).render(USER)


def test_the_time_limit_ends_a_render_whose_steps_are_left():
    limits = tb.Limits(ops=10**12, seconds=0.2)
    started = time.monotonic()
    with pytest.raises(TemplateOverBudget, match="longer than 0.2 s"):
        ChatTemplate(HOSTILE["nested range loops"][0], limits=limits).render(USER)
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.jinja")), ids=lambda p: p.stem)
def test_real_templates_render_a_large_conversation_well_within_budget(path):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 10,
              "parameters": {"type": "object", "properties": {f"a{j}": {"type": "string"} for j in range(5)}}}}
             for i in range(20)]
    messages = [{"role": "system", "content": "rules " * 100}]
    for _ in range(50):
        messages += [{"role": "user", "content": "question " * 200}, {"role": "assistant", "content": "answer " * 200}]
    messages.append({"role": "user", "content": "last"})
    tight = tb.Limits(ops=tb.Limits().ops // 4, chars=1 << 20)     # a quarter of the steps still suffices
    assert ChatTemplate(path.read_text(), "<s>", "</s>", limits=tight).render(messages, tools=tools)


def test_a_conversation_larger_than_the_limit_is_refused_as_such():
    big = [{"role": "user", "content": "x" * (1 << 20)}]
    with pytest.raises(TemplateOverBudget, match="characters"):
        ChatTemplate(CHATML_TEMPLATE).render(big)
    assert ChatTemplate(CHATML_TEMPLATE, limits=template_limits(32768)).render(big)


def test_limits_follow_the_context():
    assert template_limits(1024).chars == 1 << 20
    assert template_limits(131072).chars == 64 * 131072


def test_a_budget_is_per_render():
    # NOTE(pace): short of GENTLE_AFTER's 20 ms, so that a loaded machine's pauses are no part of it
    template = ChatTemplate("{% for i in range(1500) %}{{ i }}{% endfor %}", limits=tb.Limits(ops=4_000))
    for _ in range(5):       # each render has its own steps
        assert template.render(USER).endswith("1499")


def test_a_huge_template_source_is_refused():
    with pytest.raises(TemplateOverBudget, match="source"):
        ChatTemplate("x" * (tb.MAX_SOURCE_CHARS + 1))


def test_constant_folding_at_compile_time_is_bounded_too():
    # Jinja evaluates filters of constants while compiling; that must not build the value either
    started = time.monotonic()
    with pytest.raises(TemplateOverBudget):
        ChatTemplate("{{ 'x'|center(10000000000) }}").render(USER)
    assert time.monotonic() - started < 2.0


# ---- the load-time probe --------------------------------------------------------------------------

def test_the_probe_passes_real_templates():
    for path in sorted(FIXTURES.glob("*.jinja")):
        assert ChatTemplate.checked(path.read_text(), "<s>", "</s>").problem is None, path.name
    assert ChatTemplate.checked(None).problem is None


def test_a_template_over_budget_on_the_probe_refuses_every_render():
    template = ChatTemplate.checked(HOSTILE["nested range loops"][0], name="model 'evil'")
    assert "passed its render budget" in template.problem
    with pytest.raises(TemplateUnusable) as info:
        template.render(USER)
    assert info.value.code == "chat_template_unusable" and info.value.param == "model"
    assert "model 'evil'" in info.value.message and "/v1/completions" in info.value.message


def test_a_template_that_cannot_render_a_user_message_is_unusable():
    assert "chat template failed" in ChatTemplate.checked("{{ messages[0]['content'] + 1 }}").problem
    assert ChatTemplate.checked("{{ raise_exception('no') }}").problem == "no"


def test_a_template_that_refuses_some_probes_on_purpose_stays_usable():
    # e.g. a template without a system role: raise_exception on that probe is its rule, not a fault
    source = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
              "{% endif %}" + CHATML_TEMPLATE)
    template = ChatTemplate.checked(source)
    assert template.problem is None
    assert template.render(USER).startswith("<|im_start|>user")


def test_a_template_that_does_not_compile_is_unusable_not_a_load_failure():
    template = ChatTemplate.checked("{% for %}", name="model 'broken'")
    assert "does not compile" in template.problem and template.source == "{% for %}"
    with pytest.raises(TemplateUnusable):
        template.render(USER)


def test_an_unsafe_template_fails_the_probe():
    assert "unsafe" in ChatTemplate.checked(HOSTILE["python internals"][0]).problem


def test_probe_conversations_cover_system_turns_and_tools():
    roles = [{m["role"] for m in messages} for messages, _ in PROBES]
    assert roles[0] == {"user"} and any("system" in r for r in roles) and any("assistant" in r for r in roles)
    assert any(tools for _, tools in PROBES)

"""Generated chat templates and messages in the sandbox: every rendering returns text within the
output bound or raises a one-line `ChatTemplateError` — nothing else escapes (no other exception,
no Python object reached through dunder attributes), and the work stays bounded.

Templates are put together from the constructs that hostile or broken templates use: big ranges,
nested loops, recursion through macros, repetition and concatenation that doubles, powers,
format widths, filters with huge arguments, `namespace` and `dict`, attribute walks towards
CPython's internals, and syntax errors — around the parts real templates have."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings, strategies as st

from clover_jax.text import chat_templates
from clover_jax.text.chat_templates import render_chat_template
from clover_jax.text.errors import ChatTemplateError

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True)
NUMBER = st.sampled_from(["0", "1", "3", "-1", "64", "10**6", "10**9", "10**12", "2**62", "messages|length"])
VALUE = st.sampled_from(["'x'", "'ab' * 3", "[1, 2]", "messages", "m", "m.content", "m.role", "ns.s", "tools",
                         "none", "{}", "dict(a=1)", "range(3)", "1.5", "true"])
EXPRESSION = st.one_of(
    VALUE, NUMBER,
    st.builds("{} * {}".format, VALUE, NUMBER), st.builds("{} ~ {}".format, VALUE, VALUE),
    st.builds("{} ** {}".format, NUMBER, NUMBER), st.builds("'%0{}d' % 1".format, NUMBER),
    st.builds("{} | center({})".format, VALUE, NUMBER), st.builds("{} | join".format, VALUE),
    st.builds("{} | tojson(indent={})".format, VALUE, NUMBER), st.builds("({}).ljust({})".format, VALUE, NUMBER),
    st.builds("{}.{}".format, VALUE, st.sampled_from(["__class__", "__class__.__mro__", "__init__.__globals__",
                                                      "__subclasses__()", "items()", "keys()", "upper()"])),
    st.builds("{}[{}]".format, VALUE, NUMBER), st.builds("{} / {}".format, NUMBER, NUMBER),
)
STATEMENT = st.deferred(lambda: st.one_of(
    st.builds("{{{{ {} }}}}".format, EXPRESSION),
    st.builds("{{% for i in range({}) %}}{}{{% endfor %}}".format, NUMBER, BODY),
    st.builds("{{% for m in messages %}}{}{{% endfor %}}".format, BODY),
    st.builds("{{% if {} %}}{}{{% else %}}{}{{% endif %}}".format, EXPRESSION, BODY, BODY),
    st.builds("{{% set ns.s = ns.s ~ {} %}}".format, EXPRESSION),
    st.builds("{{% set ns.s = ns.s + ns.s %}}".format),
    st.builds("{{% set x = {} %}}{{{{ x }}}}".format, EXPRESSION),
    st.just("{{ f(3) }}"), st.just("{{ raise_exception('refused') }}"), st.just("{% for %}"), st.just("{{ }"),
    st.just("{{ ns.__dict__ }}"), st.just("{% set ns._x = 1 %}"), st.just("{{ cycler }}"),
    st.text(alphabet="ab{}%#<>", max_size=6),
))
BODY = st.lists(STATEMENT, max_size=3).map("".join)
TEMPLATE = st.builds(
    "{{% set ns = namespace(s='s') %}}{{% macro f(n) %}}{{% if n > 0 %}}{{{{ f(n - 1) }}}}{}{{% endif %}}"
    "{{% endmacro %}}{}".format, BODY, BODY)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": st.text(max_size=10)}), min_size=1, max_size=3)


@pytest.fixture(scope="module")
def monkeypatch_steps():
    """Small bounds, so that a runaway template hits one in milliseconds rather than seconds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_templates, "MAX_TEMPLATE_STEPS", 20_000)
        patch.setattr(chat_templates, "MAX_TEMPLATE_CHARS", 1 << 20)
        yield


@SETTINGS
@given(template=TEMPLATE, messages=MESSAGES)
def test_any_template_renders_within_bounds_or_fails_in_one_line(monkeypatch_steps, template, messages):
    started = time.perf_counter()
    try:
        rendered = render_chat_template(template, messages, add_generation_prompt=True, tools=[])
    except ChatTemplateError as error:
        assert str(error) and "\n" not in str(error), repr(str(error))
    else:
        assert len(rendered) <= chat_templates.MAX_TEMPLATE_CHARS
        # the walks towards CPython's internals reach nothing (jinja's own globals, such as `cycler`,
        # print as they do in transformers)
        leaks = ("<class 'object'>", "<class 'type'>", "<built-in", "<module", "<function", "<bound method",
                 "<class 'str'>", "<class 'dict'>", "<class 'list'>", "<class 'jinja2.runtime")
        assert not any(leak in rendered for leak in leaks), rendered
    assert time.perf_counter() - started < 20

"""Chat templates that fail or never end: each is one ChatTemplateError with the template's own message, or a
refusal past the time and size budgets, in well under the time the template would have taken."""
from __future__ import annotations

import re
import threading
import time

import pytest

pytest.importorskip("jinja2")
from attnkit.pretrained.chat_template import (  # noqa: E402
    TEMPLATE_CHARS,
    ChatTemplateError,
    compile_chat_template,
    render_chat_template,
)

MESSAGES = [{"role": "user", "content": "hi"}]
DOUBLE = "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s }}"


def render(source, seconds=5.0):
    return render_chat_template(compile_chat_template(source), seconds=seconds, messages=MESSAGES,
                                add_generation_prompt=True)


@pytest.mark.parametrize("source, message", [
    ("{{ raise_exception('roles must alternate') }}", "chat template refused the conversation: roles must alternate"),
    ("{% for m in messages %}{{ m.content }", "chat template has a syntax error on line 1: unexpected '}'"),
    ("{{ tools_list.name }}", "chat template failed: 'tools_list' is undefined"),
    ("{% for i in range(10**6) %}{% endfor %}", "Range too big. The sandbox blocks ranges larger than MAX_RANGE"),
    ("{{ messages.__class__.__subclasses__() }}", "attribute '__class__' of 'list' object is unsafe"),
])
def test_a_failing_template_is_one_error_with_its_own_message(source, message):
    with pytest.raises(ChatTemplateError) as info:
        render(source)
    assert message in str(info.value)


@pytest.mark.parametrize("source, what", [
    (DOUBLE.replace("OP", "+"), "a sum of strings or lists"),
    (DOUBLE.replace("OP", "~"), "a '~' concatenation"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s|replace('a', 'aa') %}"
     "{% endfor %}", "the result of the filter 'replace'"),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s * 2 %}{% endfor %}",
     "a repeated string or list"),
    ("{{ 'a' * 10**10 }}", "a repeated string or list"),
    ("{{ 'a'|center(10**10) }}", "a number given to the filter 'center' (10000000000)"),
    ("{{ 'a'.ljust(10**10) }}", "a number given to ljust (10000000000)"),
    ("{% set piece = 'x' * 400 %}{% for i in range(100000) %}{{ piece }}{% endfor %}", "the rendered text"),
])
def test_a_template_that_grows_without_end_is_refused_past_the_size_budget(source, what):
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=re.escape(what) + f".* larger than the budget of {TEMPLATE_CHARS:,}"):
        render(source)
    assert time.perf_counter() - start < 30


def test_a_template_that_loops_without_end_is_refused_past_the_time_budget():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 1e10 steps
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="rendering took longer than the budget of 0.3 s"):
        render(source, seconds=0.3)
    assert time.perf_counter() - start < 10


def test_a_template_within_budget_renders_and_leaves_no_pending_interrupt():
    """Templates that finish just before their deadline must not be interrupted afterwards."""
    threads_before = threading.active_count()
    source = ("{% for m in messages %}<{{ m.role }}>{{ m.content ~ '!' }}{% endfor %}{{ 'x' * 3 }}"
              "{{ messages|tojson }}{{ '%s-%d' % ('a', 3) }}{{ 'b'|center(5) }}")
    for seconds in (0.001, 0.003, 0.01):
        for _ in range(20):
            try:
                assert render(source, seconds=seconds) == '<user>hi!xxx[{"role": "user", "content": "hi"}]a-3  b  '
            except ChatTemplateError as exc:  # the deadline came first: refused, never a stray exception
                assert "took longer" in str(exc)
        time.sleep(0.05)  # a late timer would fire here
    deadline = time.monotonic() + 5  # each render's timer thread is cancelled and ends on its own
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads_before

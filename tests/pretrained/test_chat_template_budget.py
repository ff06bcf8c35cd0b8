"""Chat templates that fail, never end or build too much: each is one ChatTemplateError with the template's own
message, or a refusal past the time, text, memory or integer budget, in well under the time and memory the
template would have taken, whether the work would have been done while compiling or while rendering.

Templates that would hang or fill memory on a sandbox without these budgets run in a child process with an
address-space limit and a deadline, so that such a sandbox fails the test instead of taking the machine."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("jinja2")
import attnkit  # noqa: E402
from attnkit.pretrained import chat_template  # noqa: E402
from attnkit.pretrained.chat_template import (  # noqa: E402
    TEMPLATE_BYTES,
    TEMPLATE_CHARS,
    TEMPLATE_INT_BITS,
    ChatTemplateError,
    _deadline,
    _OverTime,
    compile_chat_template,
    render_chat_template,
)

SRC = Path(attnkit.__file__).resolve().parents[1]  # the children import the attnkit this test imported
MESSAGES = [{"role": "user", "content": "hi"}]
DOUBLE = "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s }}"
TEXT_BUDGET = f"larger than the budget of {TEMPLATE_CHARS:,} characters"
MEMORY_BUDGET = f"past the budget of {TEMPLATE_BYTES:,} bytes"
INT_BUDGET = f"wider than the budget of {TEMPLATE_INT_BITS:,} bits"


def render(source, seconds=5.0):
    return render_chat_template(compile_chat_template(source), seconds=seconds, messages=MESSAGES,
                                add_generation_prompt=True)


CHILD = r"""
import json, resource, sys, time, tracemalloc
from attnkit.pretrained.chat_template import ChatTemplateError, compile_chat_template, render_chat_template
pages = int(open("/proc/self/statm").read().split()[0])
limit = pages * resource.getpagesize() + 2**30  # 1 GiB more than this process has mapped
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for source in json.loads(sys.stdin.read()):
    tracemalloc.start()
    start = time.perf_counter()
    result = {}
    try:
        template = compile_chat_template(source)
        result["compiled"] = time.perf_counter() - start
        result["rendered"] = len(render_chat_template(template, messages=[{"role": "user", "content": "hi"}]))
    except ChatTemplateError as exc:
        result["error"] = str(exc)
    except BaseException as exc:
        result["other"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    result["seconds"] = time.perf_counter() - start
    result["peak"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps(result), flush=True)
"""


def child_env() -> dict:
    """The environment of a child process that imports the attnkit this test imported."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))


def run_in_child(sources: list[str], timeout: float = 120) -> list[dict]:
    """Compile and render each source in a child process (1 GiB of address space to spare): per source, the
    error or the rendered length, the seconds taken and the peak memory traced."""
    proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(sources), capture_output=True, text=True,
                          timeout=timeout, env=child_env())
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(sources), proc.stderr[-2000:]
    return results


# -- one error for every way a template fails ------------------------------------------------------------
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


@pytest.mark.parametrize("source, message", [
    # while rendering
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "chat template failed: it nests too deeply"),
    ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "chat template failed: it nests too deeply"),
    ("{% set ns = namespace(x=1) %}{% for i in range(5000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}",
     "chat template failed: it nests too deeply"),
    ("{% include 'other.jinja' %}", "chat template failed: TypeError: no loader for this environment specified"),
    ("{{ '%c' % 10**7 }}", "chat template failed: OverflowError: %c arg not in range"),
    ("{{ 'x'.encode('no-such-codec') }}", "chat template failed: LookupError: unknown encoding: no-such-codec"),
    ("{{ '{0}{1}'.format('a') }}", "chat template failed: IndexError: "),
    ("{{ raise_exception('line one\nline two') }}", "chat template refused the conversation: line one line two"),
    # while compiling
    ("{{ " + "9" * 5000 + " }}", "chat template cannot be compiled: ValueError: Exceeds the limit (4300 digits)"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "chat template cannot be compiled: it nests too deeply"),
    ("x" * (2**20 + 1), "chat template is 1,048,577 characters, longer than the budget of 1,048,576"),
])
def test_every_error_a_template_raises_is_one_line_of_chat_template_error(source, message):
    """What jinja2 or Python raises compiling or rendering a template is the template's error (not attnkit's
    "internal error"): one line, the exception's type and message, no chained traceback."""
    with pytest.raises(ChatTemplateError) as info:
        render(source)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert info.value.__cause__ is None and (info.value.__context__ is None or info.value.__suppress_context__)


# -- time ------------------------------------------------------------------------------------------------
def test_a_template_that_loops_without_end_is_refused_past_the_time_budget():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 1e10 steps
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="rendering took longer than the budget of 0.3 s"):
        render(source, seconds=0.3)
    assert time.perf_counter() - start < 10


# An interrupt that lands inside a gc callback (hypothesis installs one once its tests have run) is printed and
# dropped by CPython: pytest reports that as an unraisable exception, which is the deadline working as designed.
LOST_INTERRUPTS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@LOST_INTERRUPTS
def test_compiling_is_held_to_the_time_budget():
    """A template whose compiling outlasts its budget is refused, as one whose rendering does."""
    source = "".join(f"{{% macro m{i}(x) %}}{{{{ x ~ {i} }}}}{{% endmacro %}}" for i in range(300))  # ~0.3 s
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="compiling took longer than the budget of 0.001 s"):
        compile_chat_template(source, seconds=0.001)
    assert time.perf_counter() - start < 10
    assert compile_chat_template(source) is not None  # with the default budget it compiles


def test_an_interrupt_dropped_where_python_ignores_exceptions_is_sent_again():
    """CPython prints and drops an exception raised inside a gc callback or a ``__del__``; the deadline's
    interrupts are dropped here for 0.1 s (as there), and a later one must still end the work that follows."""
    dropped = 0
    with pytest.raises(_OverTime):
        with _deadline(0.02):
            end = time.perf_counter() + 0.1
            while time.perf_counter() < end:
                try:
                    while time.perf_counter() < end:
                        pass
                except _OverTime:
                    dropped += 1
            for _ in range(10**9):  # some seconds of work: an interrupt must end it
                pass
    assert dropped >= 1


def test_a_template_runs_on_a_thread_of_its_own():
    """The deadline's interrupts are aimed at the template's thread: never the caller's."""
    seen = []
    template = compile_chat_template("{{ where() }}{{ messages|length }}")
    assert render_chat_template(template, messages=MESSAGES, where=lambda: seen.append(threading.get_ident()) or "") \
        == "1"
    assert seen and seen[0] != threading.get_ident()


@LOST_INTERRUPTS
@pytest.mark.parametrize("step", ["render", "compile"])
def test_interrupts_that_keep_coming_as_the_work_unwinds_never_reach_the_caller(step, monkeypatch):
    """Interrupts sent again every 0.1 ms land while the over-time work unwinds, and some in the deadline's own
    exit before it stops its timer: on the caller's thread those escaped and kept coming. Whatever the caller runs
    next must see none."""
    monkeypatch.setattr(chat_template, "_INTERRUPT_AGAIN", 1e-4)
    # Interrupts this fast also land in the template thread's gc callbacks and in the hook CPython calls to report
    # the one it dropped there (pytest's hook, formatting it, is interrupted in turn): dropped on that thread by
    # design, so not reported here.
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    macros = "".join(f"{{% macro m{i}(x) %}}{{{{ x ~ {i} }}}}{{% endmacro %}}" for i in range(300))
    template = compile_chat_template(endless)
    stray = 0
    for _ in range(20):
        with pytest.raises(ChatTemplateError, match="took longer than the budget"):
            if step == "render":
                render_chat_template(template, seconds=0.002, messages=MESSAGES)
            else:
                compile_chat_template(macros, seconds=0.002)
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            try:
                while time.perf_counter() < end:
                    pass
            except _OverTime:
                stray += 1
    assert stray == 0


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


AFTER_A_DEADLINE = r"""
import sys
from attnkit.pretrained.chat_template import ChatTemplateError, compile_chat_template, render_chat_template
source, seconds, compile_only = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "compile"
try:
    template = compile_chat_template(source, seconds=seconds)
    if not compile_only:
        render_chat_template(template, seconds=seconds, messages=[{"role": "user", "content": "hi"}])
except ChatTemplateError:
    pass
def python_function():
    return 1


calls = []
sys.setprofile(lambda frame, event, arg: calls.append(event))
python_function()
sys.setprofile(None)
print("profiled", len(calls))
"""


@pytest.mark.parametrize("source, seconds, step", [
    ("{{ messages|length }}", 5.0, "render"),  # finishes well before its deadline
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", 0.05, "render"),
    ("".join(f"{{% macro m{i}(x) %}}{{{{ x ~ {i} }}}}{{% endmacro %}}" for i in range(300)), 0.001, "compile"),
])
def test_the_deadline_leaves_the_interpreter_as_it_found_it(source, seconds, step):
    """Clearing an interrupt by setting NULL left CPython's eval breaker raised for good: the next profiled call
    never got past its first instruction. A child process, so that a hang fails the test."""
    proc = subprocess.run([sys.executable, "-c", AFTER_A_DEADLINE, source, str(seconds), step], capture_output=True,
                          text=True, timeout=60, env=child_env())
    assert proc.stdout.split() == ["profiled", "3"], proc.stderr[-2000:]  # call, return; setprofile's c_call


# -- text: no value longer than TEMPLATE_CHARS -----------------------------------------------------------
@pytest.mark.parametrize("source, what, budget", [
    (DOUBLE.replace("OP", "+"), "a sum of strings or lists", TEXT_BUDGET),
    (DOUBLE.replace("OP", "~"), "a '~' concatenation", TEXT_BUDGET),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s|replace('a', 'aa') %}"
     "{% endfor %}", "the result of the filter 'replace'", TEXT_BUDGET),
    ("{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s * 2 %}{% endfor %}",
     "a repeated string or list", MEMORY_BUDGET),
    ("{{ 'a' * 10**10 }}", "a repeated string or list", TEXT_BUDGET),
    ("{{ 'a'|center(10**10) }}", "a number given to the filter 'center' (10000000000)", TEXT_BUDGET),
    ("{{ 'a'.ljust(10**10) }}", "a number given to ljust (10000000000)", TEXT_BUDGET),
    ("{% set piece = 'x' * 400 %}{% for i in range(100000) %}{{ piece }}{% endfor %}", "the rendered text",
     TEXT_BUDGET),
])
def test_a_template_that_grows_without_end_is_refused_past_the_size_budget(source, what, budget):
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=re.escape(what) + ".* " + re.escape(budget)):
        render(source)
    assert time.perf_counter() - start < 30


# One operation whose result would be gigabytes, from operands of a few bytes: each must be refused from the
# operands, before anything is built (so the peak memory stays far below the result).
ONE_OPERATION = {
    "a '%' width": ("{{ '%0999999999d' % 1 }}", "a '%' formatting"),
    "a '%' precision": ("{{ '%.999999999f' % 1.0 }}", "a '%' formatting"),
    "a '%' key used many times": ("{{ ('%(a)s' * 1000) % {'a': 'x' * 1000000} }}", "a '%' formatting"),
    "a format width": ("{{ '{:999999999}'.format(1) }}", "the result of format"),
    "a format_map field used many times": ("{{ ('{a}' * 1000).format_map({'a': 'x' * 1000000}) }}",
                                           "the result of format_map"),
    "translate": ("{{ ('a' * 100000).translate({97: 'x' * 100000}) }}", "the result of translate"),
    "expandtabs": ("{{ ('\t' * 1000000).expandtabs(1000) }}", "the result of expandtabs"),
    "replace of the empty string": ("{{ ('x' * 10**7).replace('', 'y' * 100) }}", "the result of replace"),
    "lipsum": ("{{ lipsum(30000000) }}", "lipsum's text"),
    "strftime_now": ("{{ strftime_now('%c' * 10000000) }}", "strftime_now's text"),
    "wordwrap": ("{{ ('x' * 100000)|wordwrap(1, wrapstring='y' * 100000) }}", "the result of the filter 'wordwrap'"),
    "indent by a string": ("{{ ('x\n' * 100000)|indent('y' * 100000) }}", "the result of the filter 'indent'"),
    "urlize": ("{{ ('a.co ' * 100000)|urlize(target='t' * 100000) }}", "the result of the filter 'urlize'"),
    "tojson with a wide indent": ("{% set ns = namespace(x=1) %}{% for i in range(200) %}{% set ns.x = [ns.x] %}"
                                  "{% endfor %}{{ ns.x|tojson(indent=100000) }}", "the result of the filter 'tojson'"),
    "a list of one long string repeated": ("{% set l = ['x' * 1000000] * 1000 %}{{ l }}", "an expression's text"),
    "join of one long string repeated": ("{% set l = ['x' * 1000000] * 1000 %}{{ l|join }}",
                                         "the result of the filter 'join'"),
    "a list that shares itself, written out": ("{% set ns = namespace(x='x') %}{% for i in range(80) %}"
                                               "{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
                                               "an expression's text"),
    "a list that shares itself, as JSON": ("{% set ns = namespace(x='x') %}{% for i in range(80) %}"
                                           "{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x|tojson }}",
                                           "the result of the filter 'tojson'"),
    "a macro's text from a loop of plain text": ("{% macro m() %}{% for i in range(100000) %}" + "x" * 10000
                                                 + "{% endfor %}{% endmacro %}{{ m() }}",
                                                 "the text of a macro or block"),
    "a block that doubles": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set t %}{{ ns.s }}"
                             "{{ ns.s }}{% endset %}{% set ns.s = t %}{% endfor %}", "the text of a macro or block"),
    "a filter block": ("{% filter upper %}{% for i in range(100000) %}" + "x" * 10000 + "{% endfor %}"
                       "{% endfilter %}", "the text of a macro or block"),
}


@pytest.fixture(scope="module")
def one_operation_results():
    return dict(zip(ONE_OPERATION, run_in_child([source for source, _ in ONE_OPERATION.values()])))


@pytest.mark.parametrize("case", list(ONE_OPERATION))
def test_a_result_too_long_is_refused_before_it_is_built(one_operation_results, case):
    result = one_operation_results[case]
    assert "error" in result, result
    assert ONE_OPERATION[case][1] in result["error"] and TEXT_BUDGET in result["error"]
    assert result["seconds"] < 5 and result["peak"] < 2**27  # the results would have been 1 GB and more


# -- memory: everything a render builds, added up --------------------------------------------------------
MANY_VALUES = {
    "kept by a loop": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = ns.l + ['x' * 2**22] %}"
                      "{% endfor %}{{ ns.l|length }}",
    "made by a filter": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                        "{% set ns.l = ns.l + ['x'|center(2**22)] %}{% endfor %}{{ ns.l|length }}",
    "made by a method": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                        "{% set ns.l = ns.l + ['1'.zfill(2**22)] %}{% endfor %}{{ ns.l|length }}",
    "pieces of split": "{{ ('ab ' * 10000000).split()|length }}",
    "characters of a list": "{{ ('\u00e9' * 30000000)|list|length }}",
    "rows of batch": "{{ [1]|batch(30000000, 'x')|list|length }}",
    "rows read from a lazy filter": "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
                                    "{% set ns.l = ns.l + ([1]|batch(1000000, 'x')|list) %}{% endfor %}",
}


@pytest.fixture(scope="module")
def many_values_results():
    return dict(zip(MANY_VALUES, run_in_child(list(MANY_VALUES.values()))))


@pytest.mark.parametrize("case", list(MANY_VALUES))
def test_many_values_each_within_the_text_budget_are_refused_past_the_memory_budget(many_values_results, case):
    """Each value is far below TEMPLATE_CHARS; together they would be gigabytes. The peak memory stays within
    the memory budget (plus the one value being built)."""
    result = many_values_results[case]
    assert "error" in result, result
    assert "bytes" in result["error"] and f"budget of {TEMPLATE_BYTES:,} bytes" in result["error"]
    assert result["seconds"] < 10 and result["peak"] < TEMPLATE_BYTES + 2**25


# -- integers --------------------------------------------------------------------------------------------
POWERS = {
    "constants, which jinja2 would fold while compiling": "{{ 9 ** (9 ** 9) }}",
    "variables, while rendering": "{% set x = 9 %}{{ x ** (x ** x) }}",
    "a macro's default argument": "{% macro m(x=2 ** (10 ** 9)) %}{{ x }}{% endmacro %}{{ m() }}",
    "a product of products": "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
                             "{% endfor %}{{ ns.x > 0 }}",
}


@pytest.fixture(scope="module")
def power_results():
    return dict(zip(POWERS, run_in_child(list(POWERS.values()), timeout=60)))


@pytest.mark.parametrize("case", list(POWERS))
def test_a_huge_integer_is_refused_before_it_is_computed(power_results, case):
    """``**`` and ``*`` run in C, out of reach of the time budget: a result wider than TEMPLATE_INT_BITS is
    refused from the operands' widths. Compiling evaluates nothing (constant folding is off)."""
    result = power_results[case]
    assert "error" in result, result
    assert "bits" in result["error"] and INT_BUDGET in result["error"]
    assert result["compiled"] < 2 and result["seconds"] < 5


def test_compiling_evaluates_nothing_of_the_template(monkeypatch):
    """jinja2 folds constant expressions while compiling, out of reach of every check; with folding off, no
    operator, filter or call of the template runs until it renders (and then each goes through its check)."""
    from attnkit.pretrained import template_budget

    seen = []

    def spy(name):
        check = getattr(template_budget, name)

        def checked(*args):
            seen.append(name)
            return check(*args)
        return checked

    for name in ("check_binop", "check_filter", "check_call"):
        monkeypatch.setattr(template_budget, name, spy(name))
    source = "{{ ('ab'|center(6))|length }} {{ 2 ** 10 }} {{ 'a'.upper() }} {{ [1, 2, 3]|batch(2)|list }}"
    template = compile_chat_template(source)
    assert seen == []
    assert render_chat_template(template, messages=[]) == "6 1024 A [[1, 2], [3]]"
    assert {"check_binop", "check_filter", "check_call"} <= set(seen)


def test_integers_within_the_budget_still_compute():
    assert render("{{ 2 ** 100 }} {{ (3 ** 50) * (7 ** 40) % 1000 }} {{ 10 // 3 }} {{ -5 + 2 }}") == \
        f"{2 ** 100} {(3 ** 50) * (7 ** 40) % 1000} 3 -3"

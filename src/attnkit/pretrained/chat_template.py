"""Chat templates rendered as ``transformers`` renders them, inside a sandbox with a time and a size budget.

A chat template is code that arrives with a model folder, so it runs in jinja2's immutable sandbox (no
attribute starting with ``_``, no mutation of the data it is given), configured as ``transformers`` configures
it: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not
escape HTML, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``.

The sandbox alone stops a template from escaping, not from running for ever or filling memory. Budgets bound
that, for compiling a template as for rendering it, and a template past any of them is refused with
:class:`ChatTemplateError`:

- **time**: :data:`TEMPLATE_SECONDS` (5 s) to compile a template, and again to render each conversation; real
  templates take milliseconds. The template runs on a thread of its own, interrupted where Python code next runs
  (CPython's asynchronous exceptions; on other interpreters there is no time budget), so the other budgets keep
  every single operation that runs in C short; no interrupt ever reaches the caller's thread.
- **text, memory and numbers** (:mod:`.template_budget`): no value longer than :data:`TEMPLATE_CHARS` (2**25)
  characters, at most :data:`TEMPLATE_BYTES` (2**27) bytes of values created per render, no integer wider than
  :data:`TEMPLATE_INT_BITS` (2**14) bits. Every binary operator (``+ - * / // % **``), every call, filter,
  slice, ``~``, output and join of a macro's or block's text goes through a check that refuses the operation
  from its operands, before it runs, when its result would be past a budget.
- **source**: at most :data:`TEMPLATE_SOURCE_CHARS` (2**20) characters of template.

Compiling runs nothing of the template: jinja2's constant folding is off (it would evaluate ``9 ** (9 ** 9)``
while compiling, out of every check) and outputs are finalized at render time.

Every error of the template itself (its ``raise_exception``, a syntax error, an undefined name, the sandbox's
range limit, a macro that recurses without end, a literal Python cannot read) is a :class:`ChatTemplateError`
(a ``ValueError``) of one line that shows the template's own message.
"""
from __future__ import annotations

import ctypes
import json
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import datetime
from functools import update_wrapper
from typing import Any

from . import template_budget as tb
from ._extra import import_extra
from .template_budget import TEMPLATE_BYTES, TEMPLATE_CHARS, TEMPLATE_INT_BITS

__all__ = ["ChatTemplateError", "compile_chat_template", "render_chat_template", "TEMPLATE_SECONDS",
           "TEMPLATE_CHARS", "TEMPLATE_BYTES", "TEMPLATE_INT_BITS", "TEMPLATE_SOURCE_CHARS"]

TEMPLATE_SECONDS = 5.0
TEMPLATE_SOURCE_CHARS = 2**20
_JINJA_MIN = (3, 1, 6)  # older jinja2 releases have known sandbox escapes (templates are untrusted code)
_MESSAGE_CHARS = 500  # a template's own message is shown up to this length


class ChatTemplateError(ValueError):
    """A chat template that failed, or went past its time or size budget, for this conversation."""


class _OverTime(BaseException):
    """Raised inside the template's thread when the time budget is spent. A BaseException, so that no
    ``except Exception`` on the way (jinja2 has some) can swallow it; it never escapes this module."""


def _shown(message: Any) -> str:
    text = " ".join(str(message).split()) or "(no message)"
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS] + "..."


def _template_error(exc: BaseException, jinja2: Any, seconds: float, compiling: bool) -> ChatTemplateError:
    """The one-line :class:`ChatTemplateError` of anything a template raised while compiling or rendering."""
    if isinstance(exc, ChatTemplateError):
        return exc
    if isinstance(exc, _OverTime):
        doing = "compiling" if compiling else "rendering"
        hint = "" if compiling else " (a loop without end?)"
        return ChatTemplateError(f"chat template: {doing} took longer than the budget of {seconds:g} s; refusing "
                                 f"it{hint}")
    if isinstance(exc, tb.OverBudget):
        return ChatTemplateError(str(exc))
    if isinstance(exc, jinja2.exceptions.TemplateSyntaxError):
        return ChatTemplateError(f"chat template has a syntax error on line {exc.lineno}: {_shown(exc.message)}")
    if isinstance(exc, jinja2.exceptions.TemplateError):
        kind = "refused the conversation" if type(exc) is jinja2.exceptions.TemplateError else "failed"
        return ChatTemplateError(f"chat template {kind}: {_shown(exc.message or type(exc).__name__)}")
    stage = "cannot be compiled" if compiling else "failed"
    if isinstance(exc, RecursionError):
        return ChatTemplateError(f"chat template {stage}: it nests too deeply (a macro that calls itself without "
                                 f"end, or a value nested hundreds of levels deep)")
    if isinstance(exc, OverflowError) and "Range too big" in str(exc):  # the sandbox's range limit
        return ChatTemplateError(f"chat template failed: {_shown(exc)}")
    return ChatTemplateError(f"chat template {stage}: {type(exc).__name__}: {_shown(exc)}")


def _jinja2() -> Any:
    jinja2 = import_extra("jinja2", "render chat templates")
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < _JINJA_MIN:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older releases have sandbox escapes), found "
                          f"{jinja2.__version__}")
    return jinja2


def compile_chat_template(source: str, seconds: float = TEMPLATE_SECONDS) -> Any:
    """Compile a chat template's source in the sandbox, within the time and size budgets (see the module's
    documentation).

    Raises
    ------
    ChatTemplateError
        The source is longer than :data:`TEMPLATE_SOURCE_CHARS`, has a syntax error (its message and line), or
        anything else jinja2 or Python raised compiling it, or compiling went past a budget.
    ImportError
        jinja2 is missing or older than 3.1.6.
    """
    jinja2 = _jinja2()
    if not isinstance(source, str):
        raise TypeError(f"a chat template must be a str, got {type(source).__name__}")
    if len(source) > TEMPLATE_SOURCE_CHARS:
        raise ChatTemplateError(f"chat template is {len(source):,} characters, longer than the budget of "
                                f"{TEMPLATE_SOURCE_CHARS:,}; a chat template is a page of jinja")
    env = _budgeted_environment()
    env.globals.update(_template_globals(jinja2))
    def compile_it() -> Any:
        with tb.active(tb.Budget()):
            return env.from_string(source)

    try:
        return _run_within(seconds, compile_it)
    except (Exception, _OverTime) as exc:  # noqa: BLE001 - whatever the template makes jinja2 or Python raise
        raise _template_error(exc, jinja2, seconds, compiling=True) from None


def _template_globals(jinja2: Any) -> dict[str, Any]:
    """What transformers gives every chat template: ``raise_exception``, ``strftime_now``, ``dict`` and a
    ``namespace`` that refuses underscore names (the last three held to the size budget)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(format: str) -> str:
        tb.too_long(16 * len(str(format)), "strftime_now's text")  # no directive writes more than 16 per 2
        return datetime.now().strftime(format)

    def entries(args: tuple, kwargs: dict) -> None:
        # a dict entry takes about 100 bytes (hash, key and value pointers, the table's spare room)
        count = len(kwargs) + sum(len(a) if hasattr(a, "__len__") else 1 for a in args)
        tb.budget().afford(100 * count, "a dict")

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no reaching CPython internals through it)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            entries(args, kwargs)
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys`` without exposing the ``dict`` type itself."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            entries(args, kwargs)
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            entries(args[:1], {})
            return dict.fromkeys(*args, **kwargs)

    return {"raise_exception": raise_exception, "strftime_now": strftime_now, "dict": TemplateDict(),
            "namespace": TemplateNamespace}


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _checked(value: Any, what: str) -> Any:
    """A call's or filter's result held to the budgets; an iterator is counted item by item as it is read."""
    if isinstance(value, Iterator) and not isinstance(value, (str, bytes)):
        return tb.checked_iterator(value, what)
    return tb.check_result(value, what, rows=True)


def _finalize(context: Any, value: Any) -> str:
    """What ``{{ value }}`` writes (``str(value)``, as jinja2 writes it), its text checked before it is made.
    Taking the context keeps jinja2 from finalizing constant outputs while compiling."""
    if type(value) is str:
        tb.budget().spend(8, "the text written so far")  # the pointer the output buffer keeps
        return value
    tb.too_long(tb.text_size(value), "an expression's text")
    return tb.check_result(str(value), "an expression's text")


def _budgeted_environment() -> Any:
    """jinja2's immutable sandbox as transformers configures it, with every operation it runs held to the
    budgets of :mod:`.template_budget` and constant folding off."""
    jinja2 = import_extra("jinja2", "render chat templates")
    ext = import_extra("jinja2.ext", "render chat templates")
    sandbox = import_extra("jinja2.sandbox", "render chat templates")
    compiler = import_extra("jinja2.compiler", "render chat templates")
    # optimized=False: no constant folding, so nothing of the template runs while it compiles
    env = _budgeted_sandbox(sandbox.ImmutableSandboxedEnvironment, compiler.CodeGenerator)(
        trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols], optimized=False,
        finalize=jinja2.pass_context(_finalize))
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(name, function) for name, function in env.filters.items()}
    return env


def _budgeted_sandbox(immutable_sandbox: type, code_generator: type) -> type:
    """The sandbox class whose binary operators, calls, ``str.format``, slices, ``~`` and text joins go through
    the checks of :mod:`.template_budget`."""

    class BudgetedCode(code_generator):
        """``a ~ b`` compiles to a checked join (jinja2 joins it directly, out of the sandbox's reach)."""

        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetedSandbox(immutable_sandbox):
        code_generator_class = BudgetedCode
        intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            tb.check_binop(operator, left, right)
            return tb.check_result(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

        def checked_concat(self, parts: tuple) -> str:
            tb.too_long(sum(tb.text_size(p) for p in parts), "a '~' concatenation")
            return tb.check_result("".join(str(p) for p in parts), "a '~' concatenation")

        def concat(self, pieces: Any) -> str:
            """Joins the text of a macro, a ``{% set %}`` block, a filter block or ``super()``."""
            pieces = pieces if isinstance(pieces, list) else list(pieces)
            tb.too_long(sum(tb.text_size(p) for p in pieces), "the text of a macro or block")
            return tb.check_result("".join(pieces), "the text of a macro or block")

        def getitem(self, obj: Any, argument: Any) -> Any:
            value = super().getitem(obj, argument)
            return tb.check_result(value, "a slice") if isinstance(argument, slice) else value

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            formatter = super().wrap_str_format(value)
            if formatter is None:
                return None
            text, is_map = value.__self__, value.__name__ == "format_map"

            def checked(*args: Any, **kwargs: Any) -> str:
                mapping = args[0] if is_map and args else kwargs
                tb.too_long(tb.format_size(text, () if is_map else args, mapping), f"the result of {value.__name__}")
                return tb.check_result(formatter(*args, **kwargs), f"the result of {value.__name__}")

            return update_wrapper(checked, value)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            what = getattr(__obj, "__name__", "a call")
            args = tb.check_call(__obj, args, kwargs)
            result = immutable_sandbox.call(__self, __context, __obj, *args, **kwargs)
            return _checked(result, f"the result of {what}")

    return BudgetedSandbox


def _budgeted_filter(name: str, function: Callable) -> Callable:
    """``function`` (a jinja2 filter) held to the budgets: refused from its input and arguments before it runs
    when its result would be past one, and its result counted."""
    passed = 1 if hasattr(function, "jinja_pass_arg") else 0  # the context or environment jinja2 passes first

    def checked(*args: Any, **kwargs: Any) -> Any:
        head, value, rest = args[:passed], args[passed], args[passed + 1:]
        value = tb.check_filter(name, value, rest, kwargs)
        return _checked(function(*head, value, *rest, **kwargs), f"the result of the filter {name!r}")

    if passed:  # keep jinja2's mark (pass the context, environment, ...)
        checked.jinja_pass_arg = function.jinja_pass_arg
    return checked


def render_chat_template(template: Any, seconds: float = TEMPLATE_SECONDS, **variables: Any) -> str:
    """Render a compiled chat template with ``variables``, within the time and size budgets.

    Parameters
    ----------
    template
        From :func:`compile_chat_template`.
    seconds : float
        The time budget.
    **variables
        The template's variables (``messages``, ``add_generation_prompt``, the special tokens, ...).

    Returns
    -------
    str
        The rendered text.

    Raises
    ------
    ChatTemplateError
        The template raised (its own message: ``raise_exception``, an undefined name, the sandbox's range
        limit, a security error, a recursion without end, anything else it made jinja2 or Python raise) or went
        past a budget.
    """
    jinja2 = _jinja2()
    def render_it() -> str:
        with tb.active(tb.Budget()) as spent:
            pieces, size = [], 0
            for piece in template.generate(**variables):
                size += len(piece)
                tb.too_long(size, "the rendered text")
                spent.spend(8, "the rendered text")
                pieces.append(piece)
            return tb.check_result("".join(pieces), "the rendered text")

    try:
        return _run_within(seconds, render_it)
    except (Exception, _OverTime) as exc:  # noqa: BLE001 - whatever the template makes jinja2 or Python raise
        raise _template_error(exc, jinja2, seconds, compiling=False) from None


_INTERRUPT_AGAIN = 0.01  # seconds between a deadline's interrupts, until one is raised where it is seen


def _run_within(seconds: float, work: Callable[[], Any]) -> Any:
    """``work()`` run on a thread of its own under a :class:`_deadline` of ``seconds``: its result, or what it
    raised raised here.

    The deadline's interrupts go to that thread alone. Under load, the work's exception can take longer to unwind
    than the deadline waits before interrupting again, and an interrupt that lands at the start of the deadline's
    own exit, before it has stopped its timer, escapes the block and leaves the timer running; on the caller's
    thread that would interrupt whatever the caller did next. On a thread of its own it can only end that thread,
    and the caller, which no interrupt reaches, stops the timer for good once the thread is over.
    """
    outcome: list[tuple[bool, Any]] = []
    deadlines: list[_deadline] = []

    def run() -> None:
        try:
            try:
                deadline = _deadline(seconds)
                deadlines.append(deadline)
                with deadline:
                    result = work()
                outcome.append((True, result))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
                outcome.append((False, exc))
        except _OverTime:  # a late interrupt: the outcome (if any) is recorded; end the thread quietly
            pass

    worker = threading.Thread(target=run, name="attnkit-chat-template", daemon=True)
    worker.start()
    worker.join()
    for deadline in deadlines:
        deadline.stop()
    if not outcome:  # an interrupt ended the thread before it could record how the work went
        raise _OverTime()
    finished, value = outcome[0]
    if finished:
        return value
    raise value


class _deadline:  # noqa: N801 - used as a context manager
    """Interrupt this thread with :class:`_OverTime` after ``seconds`` (CPython; elsewhere a no-op).

    A timer thread sets an asynchronous exception on this thread, and again every ``_INTERRUPT_AGAIN`` seconds
    (one raised inside a gc callback or a ``__del__`` is printed and dropped by CPython, and the block would run
    on). Leaving the block (normally or not) cancels the timer under the same lock; an interrupt set but not yet
    raised is then let through inside ``__exit__`` and dropped there, so it can never surface after the block. It
    is never cleared by setting ``NULL``: CPython keeps its eval-breaker flag raised after that, for good, and a
    profiled or traced call then never gets past its first instruction (the process hangs in ``sys.setprofile``).
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.done = False
        self.fired = False
        self.thread = threading.get_ident()
        self.setter = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
        if sys.implementation.name != "cpython":
            self.setter = None
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    def _expire(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                self.setter(ctypes.c_ulong(self.thread), ctypes.py_object(_OverTime))
                # raised where CPython ignores exceptions (a gc callback, a __del__), an interrupt is lost: the
                # next one follows until the block ends
                self.timer = threading.Timer(_INTERRUPT_AGAIN, self._expire)
                self.timer.daemon = True
                self.timer.start()

    def __enter__(self) -> _deadline:
        if self.setter is not None:
            self.timer.start()
        return self

    def stop(self) -> None:
        """Stop the timer for good (no interrupt is set after this returns)."""
        with self.lock:
            self.done = True
            self.timer.cancel()

    def __exit__(self, kind: type | None, *exc: Any) -> None:
        self.stop()
        if self.fired:
            # Set, and not raised yet (the block ended inside C code, or a repeat came after the one that ended
            # it): a loop's backward jump is where CPython delivers it, so it arrives, and is dropped, here.
            try:
                for _ in range(1 << 20):
                    pass
            except _OverTime:
                pass

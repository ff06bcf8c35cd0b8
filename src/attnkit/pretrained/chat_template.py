"""Chat templates rendered as ``transformers`` renders them, inside a sandbox with a time and a size budget.

A chat template is code that arrives with a model folder, so it runs in jinja2's immutable sandbox (no
attribute starting with ``_``, no mutation of the data it is given), configured as ``transformers`` configures
it: ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not
escape HTML, and the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``.

The sandbox alone stops a template from escaping, not from running for ever or filling memory (nested loops
over ``range(100000)``, a string doubled in a loop). Two budgets bound that, and a template past either is
refused with :class:`ChatTemplateError`:

- **time**: :data:`TEMPLATE_SECONDS` (5 s) of rendering per conversation; real templates take milliseconds.
  The rendering thread is interrupted where the template's Python code next checks for pending exceptions
  (CPython's asynchronous exceptions; on other interpreters there is no time budget).
- **size**: :data:`TEMPLATE_CHARS` (2**25, about 33 million characters) for any string or list the template
  builds with ``+``, ``*``, ``~`` or ``%``, any filter or method result, any integer argument of a filter or
  method (a width such as ``center(10**10)``), and the rendered text; a model's whole context is a few
  hundred thousand characters of text.

Every error of the template itself (its ``raise_exception``, a syntax error, an undefined name, the sandbox's
range limit) is a :class:`ChatTemplateError` (a ``ValueError``) that shows the template's own message.
"""
from __future__ import annotations

import ctypes
import json
import sys
import threading
from collections.abc import Callable, Sized
from datetime import datetime
from typing import Any

from ._extra import import_extra

__all__ = ["ChatTemplateError", "compile_chat_template", "render_chat_template", "TEMPLATE_SECONDS",
           "TEMPLATE_CHARS"]

TEMPLATE_SECONDS = 5.0
TEMPLATE_CHARS = 2**25
_JINJA_MIN = (3, 1, 6)  # older jinja2 releases have known sandbox escapes (templates are untrusted code)


class ChatTemplateError(ValueError):
    """A chat template that failed, or went past its time or size budget, for this conversation."""


class _OverBudget(Exception):
    """Raised inside the rendering thread when the time budget is spent (never escapes this module)."""


def _too_large(what: str) -> ChatTemplateError:
    return ChatTemplateError(f"chat template: {what} is larger than the budget of {TEMPLATE_CHARS:,} characters; "
                             "refusing to render it")


def _check_size(value: Any, what: str) -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > TEMPLATE_CHARS:
        raise _too_large(what)
    return value


def _check_arguments(args: tuple, kwargs: dict, what: str) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > TEMPLATE_CHARS:
            raise _too_large(f"an argument of {what} ({value})")


def _length(value: Any) -> int:
    return len(value) if isinstance(value, Sized) and not isinstance(value, dict) else len(str(value))


def compile_chat_template(source: str) -> Any:
    """Compile a chat template's source in the sandbox (see the module's documentation).

    Raises
    ------
    ChatTemplateError
        The source has a syntax error (its message and line).
    ImportError
        jinja2 is missing or older than 3.1.6.
    """
    jinja2 = import_extra("jinja2", "render chat templates")
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < _JINJA_MIN:
        raise ImportError(f"chat templates need jinja2>=3.1.6 (older releases have sandbox escapes), found "
                          f"{jinja2.__version__}")
    env = _budgeted_environment()
    env.globals.update(_template_globals(jinja2))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template has a syntax error on line {exc.lineno}: {exc.message}") from None


def _template_globals(jinja2: Any) -> dict[str, Any]:
    """What transformers gives every chat template: ``raise_exception``, ``strftime_now``, ``dict`` and a
    ``namespace`` that refuses underscore names."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no reaching CPython internals through it)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
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
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    return {"raise_exception": raise_exception, "strftime_now": strftime_now, "dict": TemplateDict(),
            "namespace": TemplateNamespace}


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want the plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _budgeted_environment() -> Any:
    """jinja2's immutable sandbox as transformers configures it, whose sequence operators, calls and filters
    keep within the size budget."""
    ext = import_extra("jinja2.ext", "render chat templates")
    sandbox = import_extra("jinja2.sandbox", "render chat templates")
    compiler = import_extra("jinja2.compiler", "render chat templates")

    class BudgetedCode(compiler.CodeGenerator):
        """``a ~ b`` compiles to a checked join (jinja2 joins it directly, out of the sandbox's reach)."""

        def visit_Concat(self, node: Any, frame: Any) -> None:
            self.write("environment.checked_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetedSandbox(sandbox.ImmutableSandboxedEnvironment):
        code_generator_class = BudgetedCode
        intercepted_binops = frozenset(("+", "*", "%"))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > TEMPLATE_CHARS:
                    raise _too_large("a sum of strings or lists")
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                            len(seq) * max(times, 0) > TEMPLATE_CHARS:
                        raise _too_large("a repeated string or list")
            return _check_size(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

        def checked_concat(self, parts: tuple) -> str:
            if sum(_length(p) for p in parts) > TEMPLATE_CHARS:
                raise _too_large("a '~' concatenation")
            return "".join(str(p) for p in parts)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            what = getattr(__obj, "__name__", "a call")
            _check_arguments(args, kwargs, what)
            return _check_size(sandbox.ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args,
                                                                          **kwargs), f"the result of {what}")

    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _budgeted_filter(name, function) for name, function in env.filters.items()}
    return env


def _budgeted_filter(name: str, function: Callable) -> Callable:
    """``function`` (a jinja2 filter) with its integer arguments and its result held to the size budget."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[1:], kwargs, f"the filter {name!r}")
        return _check_size(function(*args, **kwargs), f"the result of the filter {name!r}")

    if hasattr(function, "jinja_pass_arg"):  # keep jinja2's mark (pass the context, environment, ...)
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
        limit, a security error) or went past a budget.
    """
    jinja2 = import_extra("jinja2", "render chat templates")
    try:
        with _deadline(seconds):
            pieces, size = [], 0
            for piece in template.generate(**variables):
                size += len(piece)
                if size > TEMPLATE_CHARS:
                    raise _too_large("the rendered text")
                pieces.append(piece)
            return "".join(pieces)
    except _OverBudget:
        raise ChatTemplateError(f"chat template: rendering took longer than the budget of {seconds:g} s; "
                                "refusing it (a loop without end?)") from None
    except jinja2.exceptions.TemplateError as exc:
        kind = "refused the conversation" if type(exc) is jinja2.exceptions.TemplateError else "failed"
        raise ChatTemplateError(f"chat template {kind}: {exc.message or type(exc).__name__}") from None
    except OverflowError as exc:  # the sandbox's range limit
        raise ChatTemplateError(f"chat template failed: {exc}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
        if isinstance(exc, ChatTemplateError):
            raise
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


class _deadline:  # noqa: N801 - used as a context manager
    """Interrupt this thread with :class:`_OverBudget` after ``seconds`` (CPython; elsewhere a no-op).

    A timer thread sets an asynchronous exception on the rendering thread. Leaving the block (normally or
    not) cancels the timer and, under the same lock, clears an exception set but not yet raised, so that it
    can never surface after the block.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.done = False
        self.thread = threading.get_ident()
        self.setter = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
        if sys.implementation.name != "cpython":
            self.setter = None
        self.timer = threading.Timer(seconds, self._expire)
        self.timer.daemon = True

    def _expire(self) -> None:
        with self.lock:
            if not self.done:
                self.setter(ctypes.c_ulong(self.thread), ctypes.py_object(_OverBudget))

    def __enter__(self) -> _deadline:
        if self.setter is not None:
            self.timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        with self.lock:
            self.done = True
            self.timer.cancel()
            if self.setter is not None:
                self.setter(ctypes.c_ulong(self.thread), None)  # clears one set but not yet raised

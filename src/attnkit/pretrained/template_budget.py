"""What a chat template may build: the size of each value, the memory of all of them, and the width of numbers.

A chat template is untrusted code, and jinja2's sandbox bounds what it may reach, not what it may build. This
module bounds that, for every operation the sandbox lets a template run (:mod:`.chat_template` routes each one
here: every binary operator, every call and filter, ``~``, slicing, output, and the joins of macro and block
text):

- **text**: no value may be longer than :data:`TEMPLATE_CHARS` characters when written out (a string's length;
  for a list or dict, the length of its ``repr`` or JSON, every item counted where it appears, so a list holding
  one long string a million times is as long as its text). Checked *before* the value is built, from an
  estimate of the result (an upper bound computed from the operands, never by building it).
- **memory**: the values one render creates add up to at most :data:`TEMPLATE_BYTES` bytes, each counted when it
  is created (freed or not), so a loop that keeps many values each within the text limit is refused too.
- **numbers**: no integer a template computes is wider than :data:`TEMPLATE_INT_BITS` bits; ``a ** b`` is
  refused from the operands' sizes before anything is computed (a single ``**`` on large integers runs in C for
  hours, out of reach of the time budget).

The running total lives in a :class:`Budget` made for one render (or one compile) and found through a context
variable, so renders in different threads count separately. Going past a limit raises :class:`OverBudget`,
which :mod:`.chat_template` turns into its ``ChatTemplateError``; it derives from neither ``ValueError`` nor
``TypeError`` so that no filter's own error handling (``int``, ``float``, attribute lookups) can swallow it.
"""
from __future__ import annotations

import contextvars
import re
import string
import sys
from collections.abc import Callable, Iterator, Mapping, MappingView, Sized
from contextlib import contextmanager
from typing import Any

__all__ = ["TEMPLATE_CHARS", "TEMPLATE_BYTES", "TEMPLATE_INT_BITS", "OverBudget", "Budget", "budget", "text_size",
           "check_binop", "check_call", "check_filter", "checked_iterator"]

TEMPLATE_CHARS = 2**25
TEMPLATE_BYTES = 2**27
TEMPLATE_INT_BITS = 2**14

_POINTER = 8  # bytes one item of a list, tuple or buffer holds
_STR_OBJECT = sys.getsizeof("")  # a str object's header
_ESCAPE_ASCII = 6  # repr and JSON write an ASCII character in at most 6 ("\u001f")
_ESCAPE_OTHER = 12  # ... and any other in at most 12 (a surrogate pair, "\ud83d\ude00")


class OverBudget(Exception):  # noqa: N818 - the name says what happened, as jinja2's SecurityError does
    """A chat template went past its text, memory or integer budget (the message says which and where)."""


class Budget:
    """The memory one render (or compile) of a template has created so far, in bytes."""

    def __init__(self) -> None:
        self.spent = 0

    def spend(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` of newly created values; :class:`OverBudget` past :data:`TEMPLATE_BYTES`."""
        self.spent += max(int(nbytes), 0)
        if self.spent > TEMPLATE_BYTES:
            raise OverBudget(f"chat template: {what} brings what the template has built to more than the budget "
                             f"of {TEMPLATE_BYTES:,} bytes; refusing to render it")

    def afford(self, nbytes: int, what: str) -> None:
        """Refuse, before running it, an operation whose result would take ``nbytes`` past the budget."""
        if self.spent + nbytes > TEMPLATE_BYTES:
            raise OverBudget(f"chat template: {what} would take about {nbytes:,} bytes, past the budget of "
                             f"{TEMPLATE_BYTES:,} bytes for what a template builds; refusing to render it")


_CURRENT: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def budget() -> Budget:
    """The budget of the render running in this context (a fresh one outside any render: each operation is then
    still held to the text and integer limits, and to the memory limit on its own)."""
    current = _CURRENT.get()
    return Budget() if current is None else current


@contextmanager
def active(new: Budget) -> Iterator[Budget]:
    """Make ``new`` the budget of this context for the duration of the block."""
    token = _CURRENT.set(new)
    try:
        yield new
    finally:
        _CURRENT.reset(token)


def too_long(chars: int, what: str) -> None:
    """:class:`OverBudget` when a value of ``chars`` characters is past :data:`TEMPLATE_CHARS`."""
    if chars > TEMPLATE_CHARS:
        raise OverBudget(f"chat template: {what} would be about {chars:,} characters, larger than the budget of "
                         f"{TEMPLATE_CHARS:,} characters; refusing to render it")


def _too_wide(bits: int, what: str) -> OverBudget:
    return OverBudget(f"chat template: {what} would be an integer of {bits:,} bits or more, wider than the budget "
                      f"of {TEMPLATE_INT_BITS:,} bits; refusing to compute it")


# -- sizes -----------------------------------------------------------------------------------------------
def _str_text(s: str | bytes, nested: bool) -> int:
    if not nested:
        return len(s)
    ascii_only = s.isascii() if isinstance(s, str) else True
    return (_ESCAPE_ASCII if ascii_only else _ESCAPE_OTHER) * len(s) + 3  # quotes and a b prefix


def _namespace_attrs(value: Any) -> dict | None:
    try:
        attrs = object.__getattribute__(value, "_Namespace__attrs")
    except AttributeError:
        return None
    return attrs if isinstance(attrs, dict) else None


def _flat_text(items: list | tuple) -> int | None:
    """:func:`text_size` of a list of only strings or only numbers, at C speed (None for any other list)."""
    kinds = set(map(type, items))
    if kinds <= {str}:
        escape = _ESCAPE_ASCII if all(map(str.isascii, items)) else _ESCAPE_OTHER
        return 16 + escape * sum(map(len, items)) + 5 * len(items)
    if kinds <= {int, bool, float, type(None)}:
        widest = max((v.bit_length() for v in items if type(v) is int), default=0)
        return 16 + (max(widest // 3 + 2, 24) + 2) * len(items)
    return None


def text_size(value: Any, nested: bool = False, _memo: dict | None = None) -> int:
    """An upper bound on the length of ``str(value)``, of its ``repr`` and of its JSON.

    Strings count their characters (inside a container, as many as their escapes can take); containers count
    every item where it appears, each shared item again, in time linear in the number of distinct objects.
    """
    if isinstance(value, (str, bytes)):
        return _str_text(value, nested)
    if value is None or isinstance(value, (bool, float)):
        return 24
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    memo = {} if _memo is None else _memo
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = 16  # a cycle (a namespace that holds itself) prints as "{...}"
    flat = _flat_text(value) if isinstance(value, (list, tuple)) else None
    attrs = _namespace_attrs(value)
    if flat is not None:
        size = flat
    elif attrs is not None:
        size = 16 + text_size(attrs, True, memo)
    elif isinstance(value, Mapping):
        size = 2 + sum(text_size(k, True, memo) + text_size(v, True, memo) + 4 for k, v in value.items())
    elif isinstance(value, (list, tuple, set, frozenset, MappingView)):
        size = 16 + sum(text_size(item, True, memo) + 2 for item in value)
    else:  # jinja2's own objects, functions, ranges, iterators: a short repr
        size = 256
    memo[key] = size
    return size


def _shape(value: Any, _memo: dict | None = None) -> tuple[int, int]:
    """(number of values, depth of nesting) of a container as its JSON writes it (each shared item again), for
    the indentation JSON and pprint add; in time linear in the number of distinct objects."""
    if isinstance(value, Mapping):
        items = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return 1, 0
    memo = {} if _memo is None else _memo
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = (1, 0)  # a cycle
    count, deepest = 1, 0
    for item in items:
        n, d = _shape(item, memo)
        count, deepest = count + n, max(deepest, d + 1)
    memo[key] = (count, deepest)
    return count, deepest


def created_bytes(value: Any, rows: bool = False) -> int:
    """The memory a newly created ``value`` takes: its own size and, with ``rows``, for a list or tuple its
    immediate items that are lists or tuples (the rows ``batch``, ``dictsort`` and ``groupby`` make; an
    operator's result shares its items)."""
    size = sys.getsizeof(value)
    if rows and type(value) in (list, tuple):
        size += sum(sys.getsizeof(item) for item in value if type(item) in (list, tuple))
    return size


def _length(value: Any) -> int:
    return len(value) if isinstance(value, Sized) else text_size(value)


# -- operators -------------------------------------------------------------------------------------------
def _int(value: Any) -> bool:
    return isinstance(value, int)


def _check_power(base: Any, exponent: Any) -> None:
    if not (_int(base) and _int(exponent)) or exponent < 0 or abs(base) <= 1:
        return  # floats overflow at once; 0, 1 and -1 stay small
    bits = (abs(base).bit_length() - 1) * exponent  # the result has at least this many bits
    if bits > TEMPLATE_INT_BITS:
        raise _too_wide(bits, f"{base!r:.40} ** {exponent!r:.40}")


def _check_times(left: Any, right: Any) -> None:
    if _int(left) and _int(right):
        bits = left.bit_length() + right.bit_length()
        if bits > 2 * TEMPLATE_INT_BITS:
            raise _too_wide(bits, "a product")
        return
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, list, tuple)) and _int(times):
            # a list's items are shared, not copied: its text is checked where it is written out
            n = max(times, 0)
            too_long(len(seq) * n, "a repeated string or list")
            budget().afford(len(seq) * n * (_POINTER if isinstance(seq, (list, tuple)) else 1),
                            "a repeated string or list")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` before it runs when its result would be past a budget."""
    if operator == "**":
        _check_power(left, right)
    elif operator == "*":
        _check_times(left, right)
    elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        too_long(len(left) + len(right), "a sum of strings or lists")
    elif operator == "%" and isinstance(left, (str, bytes)):
        fmt = left if isinstance(left, str) else left.decode("latin-1")
        too_long(printf_size(fmt, right), "a '%' formatting")


def check_result(value: Any, what: str, rows: bool = False) -> Any:
    """Hold a newly created ``value`` to the budgets (its length, its width if an integer) and count its memory
    (see :func:`created_bytes` for ``rows``)."""
    if _int(value) and value.bit_length() > TEMPLATE_INT_BITS:
        raise _too_wide(value.bit_length(), what)
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > TEMPLATE_CHARS:
        too_long(len(value), what)
    budget().spend(created_bytes(value, rows), what)
    return value


# -- formatting ------------------------------------------------------------------------------------------
_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])")


def _widest(args: Any) -> tuple[int, list]:
    """The longest text of the values ``args`` offers a format (a tuple's items, a mapping's values, or itself),
    and the list of them."""
    if isinstance(args, Mapping):
        values = list(args.values())
    elif isinstance(args, (tuple, list)):
        values = list(args)
    else:
        values = [args]
    return max((text_size(v, True) for v in values), default=0), values


def printf_size(fmt: str, args: Any) -> int:
    """An upper bound on the length of ``fmt % args``: the format, plus for each conversion the longest argument
    and its width or precision (a ``*`` width is an argument, already held to :data:`TEMPLATE_CHARS`)."""
    widest, values = _widest(args)
    numbers = [v for v in values if _int(v)]
    star = max((abs(v) for v in numbers), default=0)
    size = len(fmt)
    for match in _PRINTF.finditer(fmt):
        width, precision = (star if g == "*" else int(g or 0) for g in match.groups()[:2])
        size += widest + width + precision
    return size


def format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """An upper bound on the length of ``fmt.format(*args, **kwargs)`` (each replacement field, with any nested
    fields of its specification, the longest argument plus the numbers of its specification)."""
    widest = max(_widest(args)[0], _widest(kwargs)[0])
    size = len(fmt)
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return size  # str.format raises the same error
    for _, name, spec, _ in fields:
        if name is not None:
            numbers = [int(n) for n in re.findall(r"\d+", spec or "")]
            size += widest * (1 + (spec or "").count("{")) + sum(numbers)
    return size


# -- calls: str methods ----------------------------------------------------------------------------------
def _case(s: str, args: tuple, kwargs: dict) -> int:
    return len(s) if s.isascii() else 3 * len(s)  # "ß".upper() is "SS"; no character grows by more than 3


def _width(s: str, args: tuple, kwargs: dict) -> int:
    width = args[0] if args else kwargs.get("width", 0)
    return max(len(s), width if _int(width) else 0)


def _expandtabs(s: str | bytes, args: tuple, kwargs: dict) -> int:
    size = args[0] if args else kwargs.get("tabsize", 8)
    return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * max(size if _int(size) else 8, 0)


def replace_size(s: str | bytes, old: Any, new: Any, count: Any = -1) -> int:
    """An upper bound on the length of ``s.replace(old, new, count)`` (a string or bytes)."""
    if not (isinstance(old, type(s)) and isinstance(new, type(s))):
        return len(s)  # replace raises
    hits = len(s) + 1 if old == "" else s.count(old)
    if _int(count) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _replace(s: str, args: tuple, kwargs: dict) -> int:
    return replace_size(s, *args[:3], **{k: v for k, v in kwargs.items() if k == "count"})


def _translate(s: str, args: tuple, kwargs: dict) -> int:
    table = args[0] if args else {}
    longest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, Mapping) \
        else 1
    return len(s) * max(longest, 1)


def _join(sep: str, args: tuple, kwargs: dict) -> int:
    items = args[0] if args else ()
    return sum(_length(item) for item in items) + len(sep) * max(len(items) - 1, 0)


# Methods whose result is one string, with an upper bound on its length.
_STR_TEXT: dict[str, Callable[[str, tuple, dict], int]] = {
    "upper": _case, "lower": _case, "title": _case, "capitalize": _case, "swapcase": _case, "casefold": _case,
    "center": _width, "ljust": _width, "rjust": _width, "zfill": _width, "expandtabs": _expandtabs,
    "replace": _replace, "translate": _translate, "join": _join,
}
_SPLITS = {"split", "rsplit", "splitlines", "partition", "rpartition"}


def _pieces(s: str | bytes, name: str, args: tuple, kwargs: dict) -> int:
    if name in ("partition", "rpartition"):
        return 3
    sep = args[0] if args else kwargs.get("sep")
    pieces = s.count(sep) + 1 if isinstance(sep, type(s)) and sep else len(s) // 2 + 1
    limit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
    return min(pieces, limit + 1) if _int(limit) and limit >= 0 else pieces


def _check_str_method(s: str | bytes, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a string method whose result would be past a budget; returns the arguments (``join``'s iterable
    read into a list, so that its items can be measured and then joined)."""
    if name == "join" and args and not isinstance(args[0], (list, tuple)):
        args = (list(args[0]), *args[1:])
        budget().spend(_POINTER * len(args[0]), "the items given to join")
    if name in _STR_TEXT:
        chars = _STR_TEXT[name](s, args, kwargs)
        too_long(chars, f"the result of {name}")
        budget().afford(chars * (1 if s.isascii() else 4), f"the result of {name}")
    elif name in _SPLITS:
        pieces = _pieces(s, name, args, kwargs)
        budget().afford(pieces * (_POINTER + _STR_OBJECT) + len(s) * (1 if s.isascii() else 4),
                        f"the pieces of {name}")
    elif name == "encode":
        budget().afford(4 * len(s), "the result of encode")
    return args


def check_call(obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Refuse a call (a method, a macro, a global) whose result would be past a budget, before it runs; returns
    the arguments to call it with."""
    what = getattr(obj, "__name__", "a call")
    for value in (*args, *kwargs.values()):
        if _int(value) and not isinstance(value, bool) and abs(value) > TEMPLATE_CHARS:
            too_long(abs(value), f"a number given to {what} ({value})")
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, (str, bytes)) and isinstance(what, str):
        return _check_str_method(owner, what, args, kwargs)
    if what == "generate_lorem_ipsum":  # lipsum(n=5, html=True, min=20, max=100): words of up to 15 letters
        n, _, _, most = (*args, *(None,) * 4)[:4]
        paragraphs = n if _int(n) else kwargs.get("n", 5)
        most = most if _int(most) else kwargs.get("max", 100)
        too_long(paragraphs * (most * 16 + 16), "lipsum's text")
    return args


# -- calls: filters --------------------------------------------------------------------------------------
def _s(value: Any) -> int:
    return text_size(value)


def _indent_size(value: Any, width: Any = 4, *rest: Any, **kwargs: Any) -> int:
    text = str(value) if isinstance(value, str) else ""
    prefix = len(width) if isinstance(width, str) else max(width, 0) if _int(width) else 4
    return _s(value) + (text.count("\n") + 1) * prefix


def _wordwrap_size(value: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                   *rest: Any, **kwargs: Any) -> int:
    wrap = kwargs.get("wrapstring", wrapstring)
    n = _s(value)
    return n + (n + 1) * max(len(wrap) if isinstance(wrap, str) else 1, 1)


def _truncate_size(value: Any, length: Any = 255, killwords: Any = False, end: Any = "...", *rest: Any,
                   **kwargs: Any) -> int:
    end = kwargs.get("end", end)
    return _s(value) + (len(end) if isinstance(end, str) else 0)


def _urlize_size(value: Any, trim_url_limit: Any = None, nofollow: Any = False, target: Any = None,
                 rel: Any = None, *rest: Any, **kwargs: Any) -> int:
    target, rel = kwargs.get("target", target), kwargs.get("rel", rel)
    extra = sum(len(x) for x in (target, rel) if isinstance(x, str)) + 64
    n = _s(value)
    return 12 * n + (n // 2 + 1) * extra  # at most one link per two characters, each escaped and wrapped


def _json_size(value: Any, ensure_ascii: Any = False, indent: Any = None, separators: Any = None,
               *rest: Any, **kwargs: Any) -> int:
    indent, separators = kwargs.get("indent", indent), kwargs.get("separators", separators)
    step = len(indent) if isinstance(indent, str) else max(indent, 0) if _int(indent) else 0
    parts = separators if isinstance(separators, (list, tuple)) else ()
    gap = sum(len(p) for p in parts if isinstance(p, str))
    nodes, depth = _shape(value)
    return text_size(value, True) + nodes * (step * (depth + 1) + gap + 2)


def _pprint_size(value: Any, *rest: Any, **kwargs: Any) -> int:
    nodes, depth = _shape(value)
    return text_size(value, True) + nodes * (depth + 2)


def _sum_size(value: Any, attribute: Any = None, start: Any = 0, *rest: Any, **kwargs: Any) -> int:
    start = kwargs.get("start", start)
    if not isinstance(start, (list, tuple)):
        return 0  # numbers; strings raise in sum()
    total = len(start) + sum(len(v) for v in value if isinstance(v, (list, tuple)))
    too_long(total, "the result of the filter 'sum'")
    budget().afford(_POINTER * total * max(len(value), 1) // 2, "the lists the filter 'sum' builds")
    return 0


def _batch_size(value: Any, linecount: Any = 1, fill_with: Any = None, *rest: Any, **kwargs: Any) -> int:
    budget().afford(_POINTER * (max(linecount, 0) if _int(linecount) else 0), "the rows of the filter 'batch'")
    return 0


def _slice_size(value: Any, slices: Any = 1, *rest: Any, **kwargs: Any) -> int:
    budget().afford(64 * (max(slices, 0) if _int(slices) else 0), "the columns of the filter 'slice'")
    return 0


def _list_size(value: Any, *rest: Any, **kwargs: Any) -> int:
    if isinstance(value, str):
        budget().afford(len(value) * (_POINTER if value.isascii() else _POINTER + 80), "the characters of a list")
    elif isinstance(value, Sized):
        budget().afford(_POINTER * len(value), "a list")
    return 0


def _center_size(value: Any, width: Any = 80, *rest: Any, **kwargs: Any) -> int:
    width = kwargs.get("width", width)
    return max(_s(value), width if _int(width) else 0)


def _replace_filter_size(value: Any, old: Any = "", new: Any = "", count: Any = None, *rest: Any,
                         **kwargs: Any) -> int:
    count = kwargs.get("count", count)
    return replace_size(value, old, new, -1 if count is None else count) if isinstance(value, str) else _s(value)


def _format_filter_size(value: Any, *args: Any, **kwargs: Any) -> int:
    return printf_size(value, kwargs or args) if isinstance(value, str) else _s(value)


def _join_filter_size(value: Any, d: Any = "", *rest: Any, **kwargs: Any) -> int:
    sep = kwargs.get("d", d)
    return sum(_s(item) for item in value) + (len(sep) if isinstance(sep, str) else 0) * max(len(value) - 1, 0)


def _times(factor: int) -> Callable[..., int]:
    def size(value: Any, *rest: Any, **kwargs: Any) -> int:
        return factor * _s(value)
    return size


# Filters whose result can be larger than their input, with an upper bound on the length of its text (the
# factors: HTML escapes take 5 characters, URL escapes 12 per character, a case change up to 3).
_FILTER_TEXT: dict[str, Callable[..., int]] = {
    "center": _center_size, "indent": _indent_size, "wordwrap": _wordwrap_size, "truncate": _truncate_size,
    "urlize": _urlize_size, "replace": _replace_filter_size, "format": _format_filter_size,
    "join": _join_filter_size, "tojson": _json_size, "pprint": _pprint_size, "string": _times(1),
    "xmlattr": _times(6), "escape": _times(5), "e": _times(5), "forceescape": _times(5), "urlencode": _times(12),
    "upper": _times(3), "lower": _times(3), "title": _times(3), "capitalize": _times(3),
    "sum": _sum_size, "batch": _batch_size, "slice": _slice_size, "list": _list_size,
}
_MATERIALIZE = {"join", "sum"}  # filters whose input is measured item by item, so it is read into a list first


def check_filter(name: str, value: Any, args: tuple, kwargs: dict) -> Any:
    """Refuse the filter ``name`` on ``value`` before it runs when its result would be past a budget; returns
    the value to run it on (an iterator read into a list where the items must be measured)."""
    for arg in (*args, *kwargs.values()):
        if _int(arg) and not isinstance(arg, bool) and abs(arg) > TEMPLATE_CHARS:
            too_long(abs(arg), f"a number given to the filter {name!r} ({arg})")
    if name in _MATERIALIZE and not isinstance(value, (list, tuple, str)):
        value = list(value)
        budget().spend(_POINTER * len(value), f"the items given to the filter {name!r}")
    estimate = _FILTER_TEXT.get(name)
    if estimate is not None:
        chars = estimate(value, *args, **kwargs)
        too_long(chars, f"the result of the filter {name!r}")
        budget().afford(chars, f"the result of the filter {name!r}")
    return value


def checked_iterator(items: Iterator, what: str) -> Iterator:
    """``items`` with each item counted as it comes (a pointer, and a fresh list or tuple's own size), so that a
    list built from a lazy filter (``batch``, ``slice``, ``map``, ``items``) is held to the memory budget."""
    for item in items:
        budget().spend(_POINTER + (sys.getsizeof(item) if type(item) in (list, tuple) else 0), what)
        yield item

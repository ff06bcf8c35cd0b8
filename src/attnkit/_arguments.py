"""Command-line arguments shared by ``attnkit``'s commands and the torchrun trainer: the parser that raises
instead of exiting, the error it raises, the argument types, and the escaping of untrusted text quoted back.

It sits at the bottom of the package so that both the CLI (at the top) and :mod:`attnkit.torch.train` (below
it) use one definition.
"""
from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

__all__ = ["UsageError", "Parser", "printable", "bounded_int", "positive_int", "non_negative_int", "positive_float",
           "non_negative_float"]

_SHOWN_CHARS = 40  # longest piece of user text quoted back in a message
_INTEGER = re.compile("[+-]?[0-9]+")

# C0/C1 control characters, DEL, lone surrogates and the bidirectional overrides ("Trojan source"):
# a terminal would act on them, so text from files and arguments shows them as escapes.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


class UsageError(Exception):
    """A bad command line or input file: :func:`run_command` prints ``"<prog>: error: <message>"`` and returns 2."""

    def __init__(self, message: str, prog: str = "attnkit") -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise :class:`UsageError` instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message, self.prog)



# -- untrusted text --------------------------------------------------------------------------------------
def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: Any, limit: int | None = None) -> str:
    """``text`` with control characters, lone surrogates and bidi overrides escaped (``\\x1b``, ``\\u202e``).

    Parameters
    ----------
    text : any
        Converted with ``str``.
    limit : int, optional
        Cut to this many characters (before escaping), marking the cut with ``...``.

    Examples
    --------
    >>> printable("red\\x1b[31m")
    'red\\\\x1b[31m'
    >>> printable("a" * 50, limit=5)
    'aaaaa...'
    """
    text = str(text)
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    return _UNSAFE.sub(_escape, text)


# -- argument types --------------------------------------------------------------------------------------
def bounded_int(low: int, high: int, what: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (``what`` names it in messages).

    Examples
    --------
    >>> bounded_int(1, 10)("7")
    7
    """
    what = what or ("a positive integer" if low == 1 else "a non-negative integer" if low == 0 else "an integer")

    def parse(text: str) -> int:
        text = text.strip()
        if not _INTEGER.fullmatch(text):
            raise argparse.ArgumentTypeError(f"must be {what}, got {printable(repr(text), _SHOWN_CHARS)}")
        if len(text.lstrip("+-0")) > 30:  # absurdly long: refused before int() reads it
            text = text.lstrip("+")
            problem = f"must be {what}" if text.startswith("-") else f"must be at most {high}"
            raise argparse.ArgumentTypeError(f"{problem}, got a {len(text.lstrip('-'))}-digit number")
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    parse.__name__ = what  # argparse names the type in "invalid <name> value" messages
    return parse


positive_int = bounded_int(1, 2**31 - 1)
non_negative_int = bounded_int(0, 2**31 - 1)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number at or above zero."""
    try:
        value = float(text)
    except ValueError:
        shown = printable(repr(text), _SHOWN_CHARS)
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {shown}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {printable(text, _SHOWN_CHARS)}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above zero."""
    try:
        value = float(text)
    except ValueError:
        shown = printable(repr(text), _SHOWN_CHARS)
        raise argparse.ArgumentTypeError(f"must be a positive number, got {shown}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {printable(text, _SHOWN_CHARS)}")
    return value

"""Progress on a terminal, for the waits of more than a moment: one line on stderr that rewrites itself.

Every long step (loading weights tensor by tensor, a prefill layer by layer, a beam search step by step, the
patching and attribution functions, the explain page) draws its progress through :func:`progress`. The line is
drawn by ``tqdm`` when it is installed (the ``viz`` extra), else by a plain line of attnkit's own
(``loading weights: 41% 55.3M/135M B 2.1 s``, rewritten in place at most five times a second); it is
cleared when the step ends, so that only the results stay on the screen.

Whether it shows (each function's ``progress=`` argument, the command line's ``--quiet``):

- ``None`` (auto): only when stderr is a terminal, so nothing goes into pipes, files or a notebook's captured
  stream;
- ``True``: always, to stderr;
- ``False``: never (``--quiet``).

One line at a time: a step started while another one's line shows, in the same thread (activation patching
inside the explain page), shows as that line's detail (``explain 3/9 [patching z 12/30]``) instead of a
second line.
"""
from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["Progress", "progress", "check_progress", "wanted"]

_REFRESH = 0.2  # seconds between two drawings of the plain line
_active = threading.local()  # .lines: the Progress objects drawing in this thread, outermost first


def check_progress(value: Any, name: str = "progress") -> bool | None:
    """``value`` as a ``progress=`` argument: None, True or False (``TypeError`` naming ``name`` otherwise).

    Examples
    --------
    >>> check_progress(None), check_progress(False)
    (None, False)
    >>> check_progress("yes")
    Traceback (most recent call last):
    TypeError: progress must be None (on a terminal), True or False, got 'yes'
    """
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"{name} must be None (on a terminal), True or False, got {value!r}")


def wanted(value: bool | None, stream: TextIO | None = None) -> bool:
    """Whether a ``progress=`` argument shows: ``value`` itself, or for None whether ``stream`` (default
    stderr) is a terminal."""
    value = check_progress(value)
    if value is not None:
        return value
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """One step's progress line; a context manager that clears the line when the step ends, however it ends.

    Parameters
    ----------
    total : int or None
        How many units the step has (None: unknown, the line counts without a percentage).
    desc : str
        What the step is ("loading weights").
    unit : str, default "step"
        What a unit is; with ``scale`` large counts are written with k, M, G.
    enabled : bool or None
        The ``progress=`` argument (see :func:`wanted`).
    scale : bool, default False
        Write counts as 55.3M rather than 55312896.
    """

    def __init__(self, total: int | None, desc: str, *, unit: str = "step", enabled: bool | None = None,
                 scale: bool = False) -> None:
        self.total, self.desc, self.unit, self.scale = total, desc, unit, scale
        self.count = 0
        self.detail: str | None = None
        self.enabled = wanted(enabled)
        self._bar: Any = None
        self._outer: Progress | None = None
        self._stream: TextIO | None = None
        self._start = self._drawn = time.monotonic()
        self._width = 0
        self._closed = not self.enabled
        if not self.enabled:
            return
        lines = _lines()
        if lines:  # another step's line shows: this one becomes its detail
            self._outer = lines[-1]
            self._outer.set_detail(self._text_short())
        else:
            self._stream = sys.stderr
            tqdm = _tqdm()
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, file=self._stream,
                                 leave=False, dynamic_ncols=True, mininterval=_REFRESH)
            else:
                self._draw(force=True)
        lines.append(self)

    def update(self, n: int = 1) -> None:
        """``n`` more units are done."""
        self.count += n
        if self._closed:
            return
        if self._outer is not None:
            self._outer.set_detail(self._text_short())
        elif self._bar is not None:
            self._bar.update(n)
        else:
            self._draw()

    def set_desc(self, desc: str) -> None:
        """Name what the step does now ("patching z")."""
        if self._closed:
            return
        self.desc = desc
        if self._outer is not None:
            self._outer.set_detail(self._text_short())
        elif self._bar is not None:
            self._bar.set_description_str(desc)
        else:
            self._draw(force=True)

    def set_detail(self, detail: str | None) -> None:
        """What an inner step is doing, shown after the counts (None: nothing)."""
        if self._closed:
            return
        self.detail = detail
        if self._bar is not None:
            self._bar.set_postfix_str(detail or "")
        elif self._outer is None:
            self._draw()

    def close(self) -> None:
        """Clear the line (an inner step clears its detail from the outer line)."""
        if self._closed:
            return
        self._closed = True
        lines = _lines()
        if self in lines:
            lines.remove(self)
        if self._outer is not None:
            self._outer.set_detail(None)
        elif self._bar is not None:
            self._bar.close()
        elif self._stream is not None and self._width:
            self._write("\r" + " " * self._width + "\r")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the plain line (without tqdm) ------------------------------------------------------------------
    def _number(self, value: float) -> str:
        if not self.scale:
            return str(int(value))
        for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if value >= size:
                return f"{value / size:.3g}{suffix}"
        return str(int(value))

    def _text_short(self) -> str:
        total = "" if self.total is None else f"/{self._number(self.total)}"
        return f"{self.desc} {self._number(self.count)}{total}"

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < _REFRESH and self.count != self.total:
            return
        self._drawn = now
        percent = "" if not self.total else f" {100 * self.count / self.total:3.0f}%"
        total = "" if self.total is None else f"/{self._number(self.total)}"
        detail = f" [{self.detail}]" if self.detail else ""
        units = self.unit if self.unit == "B" else self.unit + "s"
        text = f"{self.desc}:{percent} {self._number(self.count)}{total} {units} {now - self._start:.1f} s{detail}"
        columns = shutil.get_terminal_size((80, 24)).columns
        text = text[:max(10, columns - 1)]  # a line that wraps cannot be rewritten in place
        self._write("\r" + text + " " * max(0, self._width - len(text)))
        self._width = max(self._width, len(text))

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # the terminal went away: the step goes on without its line
            self._closed = True


def _lines() -> list[Progress]:
    lines = getattr(_active, "lines", None)
    if lines is None:
        lines = _active.lines = []
    return lines


def progress(total: int | None, desc: str, *, unit: str = "step", enabled: bool | None = None,
             scale: bool = False) -> Progress:
    """A progress line for one step (see :class:`Progress`); use it as a context manager.

    Examples
    --------
    >>> with progress(3, "counting", enabled=False) as line:
    ...     for _ in range(3):
    ...         line.update()
    >>> line.count
    3
    """
    return Progress(total, desc, unit=unit, enabled=enabled, scale=scale)

r'''What ``attnkit chat`` reads at its prompt: one message, which may span several lines.

* A line ending in ``\`` continues on the next line: the backslash is dropped, the line break kept.
* A line starting with ``"""`` opens a block that ends at the next line ending with ``"""``. The quotes are
  dropped, and so are the lines they stand on alone; ``"""one line"""`` is a block of one line. A block is
  always a message, never a command, so it can start with ``/``.

Continuation lines are read at the prompt ``... ``. Ctrl-C there drops the unfinished message and returns to
the prompt; end of input there drops it too and ends the session (a message cut short is not sent).

Where stdin is a terminal and Python has ``readline``, lines are read through it: the arrow keys and the
usual Emacs keys edit the line, up and down recall the lines typed earlier in this session, Tab completes a
command. The history lives in memory and is never written to disk. Bracketed paste is turned off, so a
pasted text of several lines is read as the lines it holds (paste it inside a ``"""`` block to send it as one
message).
'''
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["Typed", "MessageReader", "BLOCK", "PROMPT", "MORE"]

PROMPT = "> "
MORE = "... "
BLOCK = '"""'


@dataclass(frozen=True)
class Typed:
    """One message as typed: its text and whether it came as a ``\"\"\"`` block (then never a command)."""

    text: str
    block: bool = False
    lines: int = 1


class MessageReader:
    """Reads messages from ``src``, prompting on ``out`` when ``interactive``.

    Parameters
    ----------
    src, out : text streams
        Where lines come from and where prompts go.
    interactive : bool
        Show prompts (``src`` is a terminal).
    say : callable
        Called with a sentence about input that was dropped (end of input inside a message).
    commands : sequence of str
        The chat commands, for Tab completion.

    Examples
    --------
    >>> import io
    >>> reader = MessageReader(io.StringIO('one \\\\\\ntwo\\n\"\"\"\\n/not a command\\n\"\"\"\\n'), io.StringIO(),
    ...                        interactive=False, say=print)
    >>> reader.read(), reader.read()
    (Typed(text='one \\ntwo', block=False, lines=2), Typed(text='/not a command', block=True, lines=3))
    >>> reader.read() is None
    True
    """

    def __init__(self, src: TextIO, out: TextIO, interactive: bool, say: Callable[[str], None],
                 commands: Sequence[str] = ()) -> None:
        self.src, self.out, self.interactive, self.say = src, out, interactive, say
        self.readline = _line_editor(src, out, commands) if interactive else None

    @property
    def editing(self) -> bool:
        """Whether lines are read through ``readline`` (line editing and history)."""
        return self.readline is not None

    def _line(self, prompt: str) -> str | None:
        """One line without its line break, or None at end of input; Ctrl-C propagates."""
        if self.readline is not None:
            try:
                with _signals_noticed():
                    return input(prompt)
            except EOFError:
                self.out.write("\n")
                return None
        if self.interactive:
            self.out.write(prompt)
            self.out.flush()
        line = self.src.readline()
        return line[:-1] if line.endswith("\n") else (line or None)

    def read(self) -> Typed | None:
        """The next message, or None at the end of the session (end of input, or Ctrl-C at the prompt).

        A message dropped at a continuation prompt (Ctrl-C) comes back as an empty message, which the chat
        ignores."""
        try:  # the prompt too: Ctrl-C as soon as it shows may arrive before the read begins
            first = self._line(PROMPT)
        except KeyboardInterrupt:
            self.out.write("\n")
            return None
        if first is None:
            return None
        try:
            return self._rest(first)
        except KeyboardInterrupt:
            self.out.write("\n(message dropped)\n")
            self.out.flush()
            return Typed("")

    def _rest(self, first: str) -> Typed | None:
        lines = [first]
        if _bare(first).startswith(BLOCK):
            lines[0] = first.lstrip()[len(BLOCK):]
            if len(_bare(first)) >= 2 * len(BLOCK) and _bare(first).endswith(BLOCK):
                return Typed(_bare(first)[len(BLOCK):-len(BLOCK)], block=True)
            while not (len(lines) > 1 and _bare(lines[-1]).endswith(BLOCK)):
                line = self._line(MORE)
                if line is None:
                    return self._cut_short(f'inside a {BLOCK} block')
                lines.append(line)
            count = len(lines)
            lines[-1] = _bare(lines[-1])[:-len(BLOCK)]
            if not lines[-1]:  # the quotes alone on the closing line, as on the opening one: no empty line
                lines.pop()
            if lines and not lines[0].strip():
                lines.pop(0)
            return Typed("\n".join(lines), block=True, lines=count)
        while _bare(lines[-1]).endswith("\\"):
            lines[-1] = _bare(lines[-1])[:-1]
            line = self._line(MORE)
            if line is None:
                return self._cut_short("after a line ending in \\")
            lines.append(line)
        return Typed("\n".join(lines), lines=len(lines))

    def _cut_short(self, where: str) -> None:
        self.say(f"end of input {where}: that message was not sent")
        return None


def _bare(line: str) -> str:
    """The line without trailing whitespace (a carriage return from a Windows file, spaces after a quote)."""
    return line.rstrip()


def _line_editor(src: TextIO, out: TextIO, commands: Sequence[str]) -> Any:
    """The ``readline`` module, set up for the chat, when ``src`` and ``out`` are the process's terminal and
    Python has it; else None (``input()`` only edits lines on ``sys.stdin`` and ``sys.stdout``)."""
    if src is not sys.stdin or out is not sys.stdout or not src.isatty() or not out.isatty():
        return None
    try:
        import readline
    except ImportError:  # Python built without it (some Windows and minimal builds)
        return None
    # Determinism over convenience: with bracketed paste on, a paste of several lines would arrive as one line
    # holding line breaks, and readline would write escape sequences around every prompt.
    readline.parse_and_bind("set enable-bracketed-paste off")
    readline.set_completer_delims(" \t\n")
    names = sorted(commands)

    def complete(text: str, state: int) -> str | None:
        found = [name + " " for name in names if name.startswith(text)] if text.startswith("/") else []
        return found[state] if state < len(found) else None

    readline.set_completer(complete)
    readline.parse_and_bind("tab: complete")
    readline.set_auto_history(True)
    return readline


@contextmanager
def _signals_noticed(interval: float = 0.1) -> Iterator[None]:
    """While ``readline`` waits for a key, end its wait every ``interval`` seconds, so that a Ctrl-C is noticed.

    Python's ``readline`` runs signal handlers only when a signal interrupts its wait for input (a
    ``select``); a Ctrl-C that arrives after the prompt is drawn but before that wait begins would be held
    until the next key. A no-op ``SIGALRM`` every ``interval`` seconds ends each wait, and Python then runs
    the pending Ctrl-C. The alarm restarts every other interrupted system call, and its previous handler is
    put back when the line is read. Only on the main thread (where signal handlers run) of a Unix process.
    """
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.siginterrupt(signal.SIGALRM, False)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)

"""How fast ``attnkit chat`` and ``attnkit generate`` answered, measured and shown as llama.cpp and ollama show it.

A reply has two phases. The prompt's pass reads every prompt token at once and gives the first new token; each
token after the first is one decode step (one position through the model, reading the cache). Their rates
differ by one or two orders of magnitude, so they are shown apart, as llama.cpp's ``prompt eval`` and ``eval``
lines and ollama's ``prompt eval rate`` and ``eval rate`` show them::

    load 0.84 s, prompt 19 tokens at 412.3 tokens/s, generated 32 tokens at 38.1 tokens/s, total 0.86 s

``prompt N tokens at R tokens/s``: the prompt tokens its pass read over the time from the start of that pass to
the first new token; ``(C cached)`` after N counts the prompt's first tokens that the cache already held (a chat's
earlier turns, a ``--prompt-cache`` file), which the pass did not read again. ``generated N tokens at R
tokens/s``: every new token; the rate is that of the decode steps, the tokens after the first over the time from
the first new token to the last (as llama.cpp's eval rate counts its runs).
A rate that was not measured (no new token, or one) is left out with its ``at``. ``load`` is the time the model
and tokenizer took to load; ``total`` the prompt's pass and the decode steps.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Speed", "Stopwatch"]

T = TypeVar("T")


@dataclass(frozen=True)
class Speed:
    """Counts and times of one reply, or the sum of several.

    Attributes
    ----------
    prompt_tokens : int
        Tokens read by the prompt's pass.
    prompt_seconds : float
        From the start of the prompt's pass to the first new token (0 when none came).
    new_tokens : int
        Tokens generated.
    decode_steps : int
        Tokens generated after the first of each reply (one decode step each).
    decode_seconds : float
        From the first new token to the last, summed over replies.
    replies : int
        Replies counted.
    cached_tokens : int
        Prompt tokens not read because the cache held them from an earlier turn.
    """

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    new_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    replies: int = 0
    cached_tokens: int = 0

    def __add__(self, other: Speed) -> Speed:
        return Speed(self.prompt_tokens + other.prompt_tokens, self.prompt_seconds + other.prompt_seconds,
                     self.new_tokens + other.new_tokens, self.decode_steps + other.decode_steps,
                     self.decode_seconds + other.decode_seconds, self.replies + other.replies,
                     self.cached_tokens + other.cached_tokens)

    def line(self, load_seconds: float) -> str:
        """One line: load time, prompt tokens and their rate, generated tokens and their rate, total time.

        Examples
        --------
        >>> Speed(19, 0.05, 32, 31, 0.8, 1).line(0.84)
        'load 0.84 s, prompt 19 tokens at 380.0 tokens/s, generated 32 tokens at 38.8 tokens/s, total 0.85 s'
        >>> Speed(19, 0.0, 0, 0, 0.0, 1).line(0.84)
        'load 0.84 s, prompt 19 tokens, generated 0 tokens, total 0.00 s'
        >>> Speed(4, 0.01, 2, 1, 0.02, 1, cached_tokens=120).line(0.84)
        'load 0.84 s, prompt 4 tokens (120 cached) at 400.0 tokens/s, generated 2 tokens at 50.0 tokens/s, total 0.03 s'
        """
        prompt = _rate(self.prompt_tokens, self.prompt_seconds if self.new_tokens else 0.0)
        generated = _rate(self.decode_steps, self.decode_seconds)
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (f"load {load_seconds:.2f} s, prompt {_tokens(self.prompt_tokens)}{cached}{prompt}, generated "
                f"{_tokens(self.new_tokens)}{generated}, total {self.prompt_seconds + self.decode_seconds:.2f} s")


def _tokens(count: int) -> str:
    return f"{count} token{'s' if count != 1 else ''}"


def _rate(count: int, seconds: float) -> str:
    return f" at {count / seconds:.1f} tokens/s" if count > 0 and seconds > 0 else ""


class Stopwatch:
    """Times a stream of new tokens: :meth:`watch` passes the stream's items through, noting when each came.

    Create it just before the stream's first item is asked for (a generator's prompt pass runs then).

    Examples
    --------
    >>> watch = Stopwatch(prompt_tokens=5)
    >>> list(watch.watch(iter([7, 8, 9])))
    [7, 8, 9]
    >>> speed = watch.speed()
    >>> speed.prompt_tokens, speed.new_tokens, speed.decode_steps, speed.replies
    (5, 3, 2, 1)
    """

    def __init__(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0

    def watch(self, items: Iterable[T]) -> Iterator[T]:
        for item in items:
            now = time.perf_counter()
            self.first = now if self.first is None else self.first
            self.last = now
            self.count += 1
            yield item

    def speed(self) -> Speed:
        """What was measured so far (a stream cut short counts the tokens it gave)."""
        if self.first is None or self.last is None:
            return Speed(prompt_tokens=self.prompt_tokens, prompt_seconds=time.perf_counter() - self.start, replies=1,
                         cached_tokens=self.cached_tokens)
        return Speed(self.prompt_tokens, self.first - self.start, self.count, self.count - 1, self.last - self.first, 1,
                     self.cached_tokens)

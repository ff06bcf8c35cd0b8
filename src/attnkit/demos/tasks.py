"""Synthetic sequence-to-sequence tagging tasks that need attention, generated in-process from a seed.

Each task maps a sequence of ``seq_len`` digits (tokens ``0 .. num_digits - 1``) to a target sequence of the
same length, one target digit per position, so a per-token classifier (an encoder plus a linear head, e.g.
:class:`attnkit.models.TokenTagger`) can learn it. None can be solved position by position: every target
depends on other positions, which only attention can bring in.

- ``"sort"``: the targets are the inputs sorted ascending (target ``i`` is the ``i``-th smallest input; the
  model must compare every pair of tokens).
- ``"reverse"``: target ``i`` is input ``L - 1 - i`` (a fixed, purely positional routing).
- ``"copy_offset"``: target ``i`` is input ``(i - offset) mod L`` (a cyclic shift by ``offset`` positions).

Inputs are i.i.d. uniform digits. Dimension letters: B ``batch_size``, L ``seq_len``.
"""
from __future__ import annotations

import numpy as np

from .._validation import check_positive_int
from ..init import as_generator

__all__ = ["TASKS", "make_batch", "token_names"]

TASKS = ("sort", "reverse", "copy_offset")


def make_batch(task: str, batch_size: int, seq_len: int, num_digits: int = 10,
               rng: np.random.Generator | int | None = None, *, offset: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Draw a batch of one task.

    Parameters
    ----------
    task : {"sort", "reverse", "copy_offset"}
    batch_size : int
    seq_len : int
    num_digits : int, default 10
        Vocabulary size (tokens are ``0 .. num_digits - 1``); also the number of target classes.
    rng : numpy.random.Generator or int, optional
        Source of the digits (a seed gives a reproducible batch; pass one Generator to draw successive batches).
    offset : int, default 1
        Shift of ``"copy_offset"`` (ignored by the other tasks).

    Returns
    -------
    inputs : ndarray of int64, shape (B, L)
    targets : ndarray of int64, shape (B, L)

    Examples
    --------
    >>> x, y = make_batch("sort", 2, 5, rng=0)
    >>> x
    array([[8, 6, 5, 2, 3],
           [0, 0, 0, 1, 8]])
    >>> y
    array([[2, 3, 5, 6, 8],
           [0, 0, 0, 1, 8]])
    >>> make_batch("reverse", 1, 4, rng=0)[1]
    array([[2, 5, 6, 8]])
    >>> make_batch("copy_offset", 1, 4, rng=0, offset=1)
    (array([[8, 6, 5, 2]]), array([[2, 8, 6, 5]]))
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    batch_size = check_positive_int(batch_size, "batch_size")
    seq_len = check_positive_int(seq_len, "seq_len")
    num_digits = check_positive_int(num_digits, "num_digits")
    gen = as_generator(rng)
    inputs = gen.integers(0, num_digits, size=(batch_size, seq_len), dtype=np.int64)  # (B, L)
    if task == "sort":
        targets = np.sort(inputs, axis=1)  # (B, L)
    elif task == "reverse":
        targets = inputs[:, ::-1].copy()  # (B, L)
    else:
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise TypeError(f"offset must be an integer, got {type(offset).__name__}")
        targets = np.roll(inputs, int(offset), axis=1)  # (B, L)
    return inputs, targets


def token_names(num_digits: int = 10) -> list[str]:
    """Display names of the tokens (and classes) ``0 .. num_digits - 1``, e.g. for plot axes.

    Examples
    --------
    >>> token_names(4)
    ['0', '1', '2', '3']
    """
    return [str(i) for i in range(check_positive_int(num_digits, "num_digits"))]

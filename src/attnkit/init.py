"""Initial weights of every layer, and the one way a seed becomes a random generator.

Every constructor that takes ``rng`` passes it through :func:`as_generator` once and hands the generator to
the initialisers here, so a seeded model is reproducible end to end and sub-layers built from one generator
draw different weights.

Dimension letters: In ``fan_in`` (rows: the features a weight reads), Out ``fan_out`` (columns: the features it
writes). attnkit stores weights for ``x @ W``, so a weight is (In, Out), the transpose of ``torch.nn.Linear``.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["as_generator", "xavier_uniform", "uniform_fan_in", "normal", "empty_init", "empty_init_dtype",
           "empty_init_placeholders", "uninitialised", "is_placeholder"]

_STATE = threading.local()  # one setting per thread: a loader in one thread leaves models built elsewhere alone


@contextlib.contextmanager
def empty_init(dtype: Any = np.float32, *, placeholders: bool = False) -> Iterator[None]:
    """Build modules with uninitialised parameters of ``dtype``: for loaders that overwrite every weight.

    Inside the block the initialisers here return ``np.empty`` arrays of ``dtype`` and
    :meth:`attnkit.core.Module.register_parameter` allocates each parameter once, in ``dtype``, without
    copying: no random numbers are drawn and no float64 array is made, so building a model costs its
    weights' memory and no more. The parameters hold garbage until the caller fills them (like
    ``torch.nn.utils.skip_init``).

    With ``placeholders=True`` nothing is allocated at all: each parameter is a placeholder of its shape and
    dtype (a read-only view of one element), for a loader that gives some parameters storage of another kind
    (packed weights, :meth:`~attnkit.core.Module.set_parameter`) and then the rest theirs
    (:meth:`~attnkit.core.Module.allocate_parameters`).

    Parameters
    ----------
    dtype : numpy float dtype, default float32
    placeholders : bool, default False

    Examples
    --------
    >>> from attnkit.layers import Projection
    >>> with empty_init(np.float16):
    ...     proj = Projection(1024, 1024, rng=0)
    >>> proj.W.dtype, proj.W.shape
    (dtype('float16'), (1024, 1024))
    """
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    previous = getattr(_STATE, "dtype", None), getattr(_STATE, "placeholders", False)
    _STATE.dtype, _STATE.placeholders = dtype, bool(placeholders)
    try:
        yield
    finally:
        _STATE.dtype, _STATE.placeholders = previous


def empty_init_dtype() -> np.dtype | None:
    """The dtype of an active :func:`empty_init` block in this thread, else None."""
    return getattr(_STATE, "dtype", None)


def empty_init_placeholders() -> bool:
    """Whether an active :func:`empty_init` block in this thread asked for placeholders."""
    return getattr(_STATE, "placeholders", False)


def uninitialised(shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` to be overwritten: ``np.empty``, or in a ``placeholders`` block of
    :func:`empty_init` a placeholder (one element seen at every index, read-only: no memory) when it has more
    than one element."""
    if empty_init_placeholders() and int(np.prod(shape)) > 1:
        return np.broadcast_to(np.empty((), dtype), shape)
    return np.empty(shape, dtype)


def is_placeholder(array: Any) -> bool:
    """Whether ``array`` is a placeholder of :func:`uninitialised` (every stride zero, more than one element:
    never a parameter's own storage)."""
    return isinstance(array, np.ndarray) and array.size > 1 and not any(array.strides)

RandomSource = np.random.Generator | int | None


def as_generator(rng: RandomSource) -> np.random.Generator:
    """``rng`` itself if it is a Generator, else a new Generator seeded with it (``None``: fresh entropy).

    Examples
    --------
    >>> gen = np.random.default_rng(0)
    >>> as_generator(gen) is gen
    True
    >>> float(as_generator(3).uniform()) == float(np.random.default_rng(3).uniform())
    True
    """
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def xavier_uniform(rng: np.random.Generator, fan_in: int, fan_out: int) -> np.ndarray:
    """Glorot-uniform (In, Out) matrix, ``U(-a, a)`` with ``a = sqrt(6 / (In + Out))``.

    Keeps the variance of activations and of gradients about constant across the layer (Glorot & Bengio,
    2010); ``torch.nn.init.xavier_uniform_`` draws from the same distribution.

    Shapes
    ------
    returns (fan_in, fan_out) float64.

    Examples
    --------
    >>> w = xavier_uniform(np.random.default_rng(0), 4, 2)
    >>> w.shape, bool(np.abs(w).max() <= 1.0)
    ((4, 2), True)
    """
    if (empty := empty_init_dtype()) is not None:
        return uninitialised((fan_in, fan_out), empty)
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=(fan_in, fan_out))  # (In, Out)


def uniform_fan_in(rng: np.random.Generator, fan_in: int, shape: tuple[int, ...] | int) -> np.ndarray:
    """``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` of the given shape (torch's default for biases and vectors).

    Examples
    --------
    >>> bool(np.abs(uniform_fan_in(np.random.default_rng(0), 4, 3)).max() <= 0.5)
    True
    """
    if (empty := empty_init_dtype()) is not None:
        return uninitialised(shape, empty)
    limit = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-limit, limit, size=shape)


def normal(rng: np.random.Generator, shape: tuple[int, ...] | int, std: float = 1.0) -> np.ndarray:
    """``N(0, std^2)`` of the given shape (embedding tables: std 1 as torch, 0.02 as BERT and GPT-2).

    Examples
    --------
    >>> normal(np.random.default_rng(0), (16, 8), std=0.02).shape
    (16, 8)
    """
    if (empty := empty_init_dtype()) is not None:
        return uninitialised(shape, empty)
    return rng.normal(0.0, std, size=shape)

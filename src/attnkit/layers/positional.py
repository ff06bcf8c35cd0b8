"""Positional-encoding layers: fixed sinusoids (no parameters) and a learned table.

Both add a (L, D) position table to their (B, L, D) input. Dimension letters: B batch, L sequence length
(at most ``max_length``), D ``d_model``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output, check_ndim, check_positive_int
from ..core.module import Module
from ..init import as_generator
from ..positional import add_positional_encoding, learned_positional_encoding, sinusoidal_encoding

__all__ = ["SinusoidalPositionalEncoding", "LearnedPositionalEmbedding"]


def _check_sequence(x: Any, owner: str, max_length: int, d_model: int) -> np.ndarray:
    x = check_features(x, "x", d_model, owner, "d_model")
    check_ndim(x, "x", ndim=3, expected=f"3-D (batch, seq_len, d_model={d_model})")
    if x.shape[1] > max_length:
        raise ValueError(f"{owner}: sequence length {x.shape[1]} of x {x.shape} exceeds max_length = {max_length}")
    return x


class SinusoidalPositionalEncoding(Module):
    """Add the fixed sinusoidal encodings of :func:`attnkit.positional.sinusoidal_encoding`: ``x + PE[:L]``.

    Parameters
    ----------
    max_length : int
        Longest sequence accepted.
    d_model : int

    Attributes
    ----------
    encodings : ndarray of float64, shape (max_length, D): the table (not a parameter, not in ``state_dict``).

    Shapes
    ------
    x : (B, L, D) -> (B, L, D), in ``x``'s float dtype. ``backward`` returns its input (the map is a shift).

    Examples
    --------
    >>> pe = SinusoidalPositionalEncoding(16, 4)
    >>> y = pe(np.zeros((1, 2, 4)))
    >>> y[0, 1].round(3)
    array([0.841, 0.54 , 0.01 , 1.   ])
    >>> pe.num_parameters()
    0
    """

    def __init__(self, max_length: int, d_model: int) -> None:
        super().__init__()
        self.max_length = check_positive_int(max_length, "max_length")
        self.d_model = check_positive_int(d_model, "d_model")
        self.encodings = sinusoidal_encoding(self.max_length, self.d_model)  # (max_length, D)
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None

    def extra_repr(self) -> str:
        return f"max_length={self.max_length}, d_model={self.d_model}"

    def forward(self, x: Any) -> np.ndarray:
        """Return ``x + encodings[:L]`` (B, L, D)."""
        x = _check_sequence(x, "SinusoidalPositionalEncoding", self.max_length, self.d_model)
        self._shape, self._dtype = x.shape, x.dtype
        return add_positional_encoding(x, self.encodings)  # (B, L, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """The gradient of ``x`` is ``grad_output`` itself (B, L, D)."""
        if self._shape is None:
            raise RuntimeError("SinusoidalPositionalEncoding.backward called before forward")
        return check_grad_output(grad_output, self._shape, self._dtype, "SinusoidalPositionalEncoding")


class LearnedPositionalEmbedding(Module):
    """Add a learned position table: ``x + weight[:L]`` (BERT / GPT-2 style, initialised ``N(0, 0.02^2)``).

    Parameters
    ----------
    max_length : int
        Longest sequence accepted (rows of the table).
    d_model : int
    rng : numpy.random.Generator or int, optional
        Source of the initial table (:func:`attnkit.positional.learned_positional_encoding`).

    Attributes
    ----------
    weight : ndarray, shape (max_length, D); ``grads["weight"]`` the same (rows >= L get nothing).

    Shapes
    ------
    x : (B, L, D) -> (B, L, D), in ``x``'s float dtype.

    Examples
    --------
    >>> pos = LearnedPositionalEmbedding(8, 4, rng=0)
    >>> y = pos(np.zeros((2, 3, 4)))
    >>> np.array_equal(y[1], pos.weight[:3])
    True
    >>> _ = pos.backward(np.ones((2, 3, 4)))
    >>> pos.grads["weight"][:, 0]  # two sequences per position, nothing beyond L = 3
    array([2., 2., 2., 0., 0., 0., 0., 0.])
    """

    def __init__(self, max_length: int, d_model: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.max_length = check_positive_int(max_length, "max_length")
        self.d_model = check_positive_int(d_model, "d_model")
        self.register_parameter("weight", learned_positional_encoding(self.max_length, self.d_model,
                                                                      rng=as_generator(rng)))
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None

    def extra_repr(self) -> str:
        return f"max_length={self.max_length}, d_model={self.d_model}"

    def forward(self, x: Any) -> np.ndarray:
        """Return ``x + weight[:L]`` (B, L, D)."""
        x = _check_sequence(x, "LearnedPositionalEmbedding", self.max_length, self.d_model)
        self._shape, self._dtype = x.shape, x.dtype
        return add_positional_encoding(x, self._parameters["weight"])  # (B, L, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the per-position sums of ``grad_output`` into ``grads["weight"][:L]``; return ``grad_x``."""
        if self._shape is None:
            raise RuntimeError("LearnedPositionalEmbedding.backward called before forward")
        g = check_grad_output(grad_output, self._shape, self._dtype, "LearnedPositionalEmbedding")
        self.grads["weight"][: self._shape[1]] += g.sum(axis=0)  # (L, D)
        return g

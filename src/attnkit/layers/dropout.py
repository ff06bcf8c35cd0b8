"""``Dropout``: zero each activation with probability ``p`` in training mode (inverted scaling).

The keep/drop decisions come from the counter-based hash of :func:`attnkit.kernels.dropout.keep_mask`, fed a
fresh 63-bit seed per call drawn from the layer's own generator: two layers built with the same ``seed`` drop
the same entries call after call, and backward reuses the forward's mask.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_float_array, check_grad_output
from ..core.module import Module
from ..init import as_generator
from ..kernels.dropout import keep_mask

__all__ = ["Dropout"]


class Dropout(Module):
    """Inverted dropout: in training mode ``y = x * keep / (1 - p)``; in eval mode (or ``p = 0``) ``y = x``.

    Parameters
    ----------
    p : float, default 0.1
        Drop probability, in [0, 1).
    seed : int, optional
        Seed of the layer's dropout stream (``None``: fresh entropy).

    Shapes
    ------
    x : any shape (at least 0-D) -> y : same shape and float dtype. With ``p = 0`` or in eval mode the
    input array itself is returned (bitwise identical, not a copy).

    Examples
    --------
    >>> drop = Dropout(0.5, seed=0)
    >>> y = drop(np.ones((2, 4)))
    >>> sorted(set(y.ravel().tolist()))  # kept entries scaled by 1 / (1 - p)
    [0.0, 2.0]
    >>> np.array_equal(drop.backward(np.ones((2, 4))), y)  # the same mask
    True
    >>> drop.eval()(np.ones(3))
    array([1., 1., 1.])
    """

    def __init__(self, p: float = 0.1, *, seed: int | None = None) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)) or not 0.0 <= p < 1.0:
            raise ValueError(f"p must be a probability in [0, 1), got {p!r}")
        self.p = float(p)
        self._rng = as_generator(seed)  # draws one mask seed per forward
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: Any) -> np.ndarray:
        """Drop entries of ``x`` (training mode and ``p > 0`` only); saves the scaled keep-mask."""
        x = as_float_array(x, "x")
        self._shape, self._dtype = x.shape, x.dtype
        if not self.training or self.p == 0.0:
            self.save_for_backward()
            return x
        seed = int(self._rng.integers(2**63))
        rows = int(np.prod(x.shape[:-1], dtype=np.int64)) if x.ndim else 1
        cols = x.shape[-1] if x.ndim else 1
        keep = keep_mask(seed, self.p, (), np.arange(rows), np.arange(cols), rows, cols)  # (N, C)
        keep_scaled = (keep * (1.0 / (1.0 - self.p))).astype(x.dtype).reshape(x.shape)  # (...)
        self.save_for_backward(keep_scaled)
        return x * keep_scaled

    def backward(self, grad_output: Any) -> np.ndarray:
        """Return ``grad_output`` times the forward's scaled keep-mask (the identity when nothing was dropped)."""
        if self._shape is None:
            raise RuntimeError("Dropout.backward called before forward")
        g = check_grad_output(grad_output, self._shape, self._dtype, "Dropout")
        return g if self.saved_tensors is None else g * self.saved_tensors[0]

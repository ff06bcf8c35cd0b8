"""``FeedForward``: the position-wise network ``act(x W1 + b1) W2 + b2`` of the Transformer.

Dimension letters: ``...`` any leading dims, D ``d_model``, F ``d_ff``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, xavier_uniform
from ..kernels import ffn as _ffn
from ..kernels.activations import ACTIVATIONS

__all__ = ["FeedForward"]


class FeedForward(Module):
    """Position-wise feed-forward network ``FFN(x) = act(x @ W1 + b1) @ W2 + b2``.

    Parameters
    ----------
    d_model : int
        Input and output features D.
    d_ff : int, optional
        Hidden features F (default ``4 * d_model``).
    activation : {"relu", "gelu", "gelu_tanh"}, default "relu"
        ``"gelu"`` is the exact ``x * Phi(x)`` (torch's default GELU), ``"gelu_tanh"`` its tanh approximation.
    rng : numpy.random.Generator or int, optional
        Source of the Glorot-uniform initial weights (biases start at zero).

    Attributes
    ----------
    W1 : (D, F), b1 : (F,), W2 : (F, D), b2 : (D,); ``grads`` with the same names.

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> ffn = FeedForward(4, 8, activation="gelu", rng=0)
    >>> y = ffn(np.ones((2, 3, 4)))
    >>> y.shape
    (2, 3, 4)
    >>> ffn.backward(np.ones_like(y)).shape, sorted(ffn.grads)
    ((2, 3, 4), ['W1', 'W2', 'b1', 'b2'])
    """

    def __init__(self, d_model: int, d_ff: int | None = None, activation: str = "relu", *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.d_model = check_positive_int(d_model, "d_model")
        self.d_ff = 4 * self.d_model if d_ff is None else check_positive_int(d_ff, "d_ff")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        gen = as_generator(rng)
        self.register_parameter("W1", xavier_uniform(gen, self.d_model, self.d_ff))
        self.register_parameter("b1", np.zeros(self.d_ff))
        self.register_parameter("W2", xavier_uniform(gen, self.d_ff, self.d_model))
        self.register_parameter("b2", np.zeros(self.d_model))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, activation={self.activation!r}"

    def forward(self, x: Any) -> np.ndarray:
        """Apply the network to every position of ``x`` (..., D); saves what :meth:`backward` needs."""
        x = check_features(x, "x", self.d_model, "FeedForward", "d_model")
        p = self._parameters
        y, pre, hidden = _ffn.feed_forward_forward(x, p["W1"], p["b1"], p["W2"], p["b2"],
                                                   self.activation)  # (..., D), (..., F), (..., F)
        self.save_for_backward(x, pre, hidden)
        return y

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): :meth:`forward`'s kernel on the rows, nothing saved."""
        p = self._parameters
        return _ffn.feed_forward_forward(x, p["W1"], p["b1"], p["W2"], p["b2"], self.activation)[0]  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the gradients of W1, b1, W2, b2 into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("FeedForward.backward called before forward")
        x, pre, hidden = self.saved_tensors
        g = check_grad_output(grad_output, x.shape, x.dtype, "FeedForward")
        p = self._parameters
        grad_x, grads = _ffn.feed_forward_backward(g, x, p["W1"], p["W2"], pre, hidden, self.activation,
                                                   need_weights=self.grads.wanted)
        for name, value in grads.items():
            self.grads.add(name, value)
        return grad_x

"""Position-wise feed-forward network ``act(x W1 + b1) W2 + b2`` and its gradient (unchecked kernels)."""
from __future__ import annotations

from .activations import activation_backward, activation_forward
from .linear import linear, linear_backward

__all__ = ["feed_forward_hidden", "feed_forward_forward", "feed_forward_backward"]


def feed_forward_hidden(x, w1, b1, activation: str = "relu"):
    """The hidden layer: ``(pre (..., F), hidden (..., F))`` with ``pre = x W1 + b1``, ``hidden = act(pre)``."""
    pre = linear(x, w1, b1)  # (..., F)
    return pre, activation_forward(pre, activation)  # (..., F)


def feed_forward_forward(x, w1, b1, w2, b2, activation: str = "relu"):
    """Returns ``(y (..., D), pre (..., F), hidden (..., F))``; pre/hidden are what backward needs."""
    pre, hidden = feed_forward_hidden(x, w1, b1, activation)  # (..., F)
    return linear(hidden, w2, b2), pre, hidden  # (..., D)


def feed_forward_backward(grad_y, x, w1, w2, pre, hidden, activation: str = "relu", need_weights: bool = True):
    """Returns ``grad_x (..., D)`` and ``{'W1', 'b1', 'W2', 'b2'}`` gradients (each None with
    ``need_weights=False``)."""
    grad_hidden, grad_w2, grad_b2 = linear_backward(grad_y, hidden, w2, True, need_weights)  # (..., F)
    grad_pre = activation_backward(grad_hidden, pre, hidden, activation)  # (..., F)
    grad_x, grad_w1, grad_b1 = linear_backward(grad_pre, x, w1, True, need_weights)  # (..., D)
    return grad_x, {"W1": grad_w1, "b1": grad_b1, "W2": grad_w2, "b2": grad_b2}

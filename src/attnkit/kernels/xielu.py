"""xIELU, the activation with two learned slopes of Apertus (Huang and Schlag, 2024, arXiv:2411.13010).

``a_p = softplus(alpha_p)``, ``a_n = beta + softplus(alpha_n)``::

    xielu(x) = a_p x^2 + beta x                           x > 0
             = a_n (expm1(min(x, eps)) - x) + beta x      x <= 0

``alpha_p`` and ``alpha_n`` are the learned slopes; ``beta`` (0.5) and ``eps`` (-1e-6) are transformers' buffers,
read from the checkpoint and differentiated like the slopes. Every argument is a (1,) array; computed in the
input's dtype, as transformers' Python path does.
"""
from __future__ import annotations

import numpy as np

__all__ = ["xielu_forward", "xielu_backward", "softplus"]


def softplus(x: np.ndarray) -> np.ndarray:
    """``log(1 + exp(x))`` without overflow."""
    return np.logaddexp(np.zeros((), x.dtype), x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1 + np.tanh(x / 2)) / 2  # never overflows


def xielu_forward(x: np.ndarray, alpha_p: np.ndarray, alpha_n: np.ndarray, beta: np.ndarray, eps: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """xIELU of ``x`` (...): ``(y (...), negative (...))``, the second ``expm1(min(x, eps)) - x`` (what the
    backward of ``alpha_n`` and ``beta`` reads)."""
    p, n, b, e = (a.astype(x.dtype, copy=False) for a in (alpha_p, alpha_n, beta, eps))  # (1,) each
    negative = np.expm1(np.minimum(x, e)) - x  # (...)
    y = np.where(x > 0, softplus(p) * x * x, (b + softplus(n)) * negative) + b * x  # (...)
    return y, negative


def xielu_backward(grad: np.ndarray, x: np.ndarray, negative: np.ndarray, alpha_p: np.ndarray,
                   alpha_n: np.ndarray, beta: np.ndarray, eps: np.ndarray) -> tuple[np.ndarray, dict]:
    """``(grad_x (...), {"alpha_p", "alpha_n", "beta", "eps": (1,) each})`` of :func:`xielu_forward` for the
    output gradient ``grad`` (...); ``negative`` is the forward's second result."""
    p, n, b, e = (a.astype(x.dtype, copy=False) for a in (alpha_p, alpha_n, beta, eps))  # (1,) each
    a_p, a_n = softplus(p), b + softplus(n)  # (1,) each
    positive = x > 0  # (...)
    below = x < e  # where min(x, eps) is x
    turn = np.exp(np.minimum(x, e))  # (...): d expm1(min(x, eps)) / d min(x, eps)
    slope = np.where(positive, 2 * a_p * x, a_n * (np.where(below, turn, 0) - 1))  # (...)
    grad_x = grad * (slope + b)  # (...)
    g_neg = np.where(positive, 0, grad)  # (...)
    grads = {"alpha_p": np.sum(np.where(positive, grad * x * x, 0)) * _sigmoid(p),  # d softplus(a) / da
             "alpha_n": np.sum(g_neg * negative) * _sigmoid(n),
             "beta": np.sum(g_neg * negative + grad * x).reshape(1),
             # min(x, eps) is eps where eps <= x <= 0
             "eps": np.sum(np.where(below | positive, 0, grad)) * a_n * np.exp(e)}
    return grad_x, {k: np.asarray(v, x.dtype).reshape(1) for k, v in grads.items()}

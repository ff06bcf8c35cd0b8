"""Affine maps ``y = x @ W + b`` over any leading dims, and their gradients (unchecked kernels)."""
from __future__ import annotations

import numpy as np

__all__ = ["linear", "linear_backward"]


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``x @ w (+ b)`` computed in ``x``'s dtype: x (..., In), w (In, Out), b (Out,) -> (..., Out)."""
    y = x @ w.astype(x.dtype, copy=False)  # (..., Out)
    if b is not None:
        y += b.astype(x.dtype, copy=False)
    return y


def linear_backward(grad_y: np.ndarray, x: np.ndarray, w: np.ndarray, need_bias: bool = False):
    """Gradients of :func:`linear`.

    Returns
    -------
    grad_x : (..., In)
    grad_w : (In, Out)
    grad_b : (Out,) or None
    """
    out = w.shape[1]
    grad_x = grad_y @ w.astype(grad_y.dtype, copy=False).T  # (..., In)
    grad_w = x.reshape(-1, x.shape[-1]).T @ grad_y.reshape(-1, out)  # (In, Out)
    grad_b = grad_y.reshape(-1, out).sum(axis=0) if need_bias else None  # (Out,)
    return grad_x, grad_w, grad_b

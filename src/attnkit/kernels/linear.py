"""Affine maps ``y = x @ W + b`` over any leading dims, and their gradients (unchecked kernels)."""
from __future__ import annotations

import numpy as np

__all__ = ["linear", "linear_backward"]


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """``x @ w (+ b)`` computed in ``x``'s dtype: x (..., In), w (In, Out), b (Out,) -> (..., Out)."""
    # Flattened to 2-D: numpy runs (B, L, In) @ (In, Out) as B separate small products otherwise.
    y = (x.reshape(-1, x.shape[-1]) @ w.astype(x.dtype, copy=False)).reshape(*x.shape[:-1], w.shape[1])  # (..., Out)
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
    flat_g = grad_y.reshape(-1, out)  # (N, Out): one BLAS call instead of one per leading row
    grad_x = (flat_g @ w.astype(grad_y.dtype, copy=False).T).reshape(*grad_y.shape[:-1], w.shape[0])  # (..., In)
    grad_w = x.reshape(-1, x.shape[-1]).T @ flat_g  # (In, Out)
    grad_b = flat_g.sum(axis=0) if need_bias else None  # (Out,)
    return grad_x, grad_w, grad_b

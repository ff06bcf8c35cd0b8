"""Layer normalisation over the last axis and its gradient (unchecked kernels)."""
from __future__ import annotations

import numpy as np

__all__ = ["layer_norm_forward", "layer_norm_backward"]


def layer_norm_forward(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float):
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` (biased variance, as torch).

    Returns
    -------
    y : (..., D)
    x_hat : (..., D) normalised input, and rstd : (..., 1) ``1 / sqrt(var + eps)``: what backward needs.
    """
    mean = x.mean(axis=-1, keepdims=True)  # (..., 1)
    centred = x - mean  # (..., D)
    var = np.mean(centred * centred, axis=-1, keepdims=True)  # (..., 1)
    rstd = 1.0 / np.sqrt(var + eps)  # (..., 1)
    x_hat = centred * rstd  # (..., D)
    y = x_hat * gamma.astype(x.dtype, copy=False) + beta.astype(x.dtype, copy=False)  # (..., D)
    return y, x_hat, rstd


def layer_norm_backward(grad_y: np.ndarray, x_hat: np.ndarray, rstd: np.ndarray, gamma: np.ndarray):
    """Gradients of :func:`layer_norm_forward` from its cached ``x_hat`` and ``rstd``.

    Returns
    -------
    grad_x : (..., D), grad_gamma : (D,), grad_beta : (D,)
    """
    d = x_hat.shape[-1]
    flat_g = grad_y.reshape(-1, d)  # (N, D)
    grad_gamma = np.einsum("nd,nd->d", flat_g, x_hat.reshape(-1, d))  # (D,)
    grad_beta = flat_g.sum(axis=0)  # (D,)
    g_hat = grad_y * gamma.astype(grad_y.dtype, copy=False)  # (..., D)
    grad_x = rstd * (g_hat - g_hat.mean(axis=-1, keepdims=True)
                     - x_hat * np.mean(g_hat * x_hat, axis=-1, keepdims=True))  # (..., D)
    return grad_x, grad_gamma, grad_beta

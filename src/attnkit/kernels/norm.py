"""Layer normalisation over the last axis and its gradient (unchecked kernels).

Half-precision inputs (float16) are normalised in float32: their variance overflows float16's range (65504)
as soon as activations pass ~256, and the mean of many float16 values loses digits. The statistics and the
normalised input that backward reads are float32; outputs and input gradients come back in the input's dtype.
"""
from __future__ import annotations

import numpy as np

__all__ = ["layer_norm_forward", "layer_norm_backward", "statistics_dtype"]


def statistics_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype layer-norm statistics are computed in: at least float32."""
    return np.promote_types(dtype, np.float32)


def layer_norm_forward(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float):
    """``gamma * (x - mean) / sqrt(var + eps) + beta`` (biased variance, as torch).

    Returns
    -------
    y : (..., D) in ``x``'s dtype
    x_hat : (..., D) normalised input, and rstd : (..., 1) ``1 / sqrt(var + eps)``: what backward needs,
    both in :func:`statistics_dtype` of ``x``.
    """
    xs = x.astype(statistics_dtype(x.dtype), copy=False)  # (..., D)
    d = xs.shape[-1]
    # every pass after the first writes into the one fresh array it owns (no temporaries of shape (..., D))
    centred = np.subtract(xs, xs.mean(axis=-1, keepdims=True))  # (..., D)
    var = np.einsum("...d,...d->...", centred, centred)[..., None] / centred.dtype.type(d)  # (..., 1)
    rstd = np.sqrt(np.add(var, centred.dtype.type(eps), out=var), out=var)  # (..., 1)
    np.divide(1.0, rstd, out=rstd)
    x_hat = np.multiply(centred, rstd, out=centred)  # (..., D)
    y = np.multiply(x_hat, gamma.astype(xs.dtype, copy=False))  # (..., D)
    np.add(y, beta.astype(xs.dtype, copy=False), out=y)
    return y.astype(x.dtype, copy=False), x_hat, rstd


def layer_norm_backward(grad_y: np.ndarray, x_hat: np.ndarray, rstd: np.ndarray, gamma: np.ndarray):
    """Gradients of :func:`layer_norm_forward` from the ``x_hat`` and ``rstd`` its forward returned.

    Returns
    -------
    grad_x : (..., D) in ``grad_y``'s dtype; grad_gamma : (D,), grad_beta : (D,) in the statistics' dtype.
    """
    d = x_hat.shape[-1]
    g = grad_y.astype(np.promote_types(grad_y.dtype, x_hat.dtype), copy=False)  # (..., D)
    flat_g = g.reshape(-1, d)  # (N, D)
    grad_gamma = np.einsum("nd,nd->d", flat_g, x_hat.reshape(-1, d))  # (D,)
    grad_beta = flat_g.sum(axis=0)  # (D,)
    g_hat = np.multiply(g, gamma.astype(g.dtype, copy=False))  # (..., D)
    mean_g = g_hat.mean(axis=-1, keepdims=True)  # (..., 1)
    mean_gx = np.einsum("...d,...d->...", g_hat, x_hat)[..., None] / g.dtype.type(d)  # (..., 1)
    grad_x = np.subtract(g_hat, mean_g, out=g_hat)  # (..., D) in place: g_hat is not read again
    grad_x -= x_hat * mean_gx
    grad_x *= rstd
    return grad_x.astype(grad_y.dtype, copy=False), grad_gamma, grad_beta

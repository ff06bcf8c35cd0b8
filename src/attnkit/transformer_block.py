"""Layer norm and the feed-forward network as checked functions, and the Transformer encoder block.

The functions validate their arguments and call the same kernels (:mod:`attnkit.kernels.norm`,
:mod:`attnkit.kernels.ffn`) as the :class:`~attnkit.layers.LayerNorm` and :class:`~attnkit.layers.FeedForward`
layers. :class:`TransformerEncoderBlock` (made of those layers) and :func:`stack_encoder_blocks` are
defined in :mod:`attnkit.layers` and re-exported here.

Dimension letters: B batch, L sequence length, D model dim (d_model), F feed-forward hidden dim (d_ff).
"""
from __future__ import annotations

import numpy as np

from ._validation import as_float_array, check_eps, check_ndim, common_float_dtype, returns_input_precision
from .kernels import ffn as _ffn
from .kernels import norm as _norm
from .layers.encoder import stack_encoder_blocks
from .layers.encoder_block import TransformerEncoderBlock

__all__ = ["layer_norm", "layer_norm_backward", "feed_forward", "feed_forward_backward",
           "TransformerEncoderBlock", "stack_encoder_blocks"]


def _check_norm_args(x, gamma, name_x="x"):
    x = as_float_array(x, name_x)
    gamma = as_float_array(gamma, "gamma")
    check_ndim(x, name_x, min_ndim=1, expected="at least 1-D (..., d_model)")
    if gamma.shape != x.shape[-1:]:
        raise ValueError(f"gamma has shape {gamma.shape}, expected (d_model,) = {x.shape[-1:]} for {name_x} of "
                         f"shape {x.shape}")
    return x, gamma


@returns_input_precision
def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Layer normalisation over the last axis: ``gamma * (x - mean) / sqrt(var + eps) + beta``.

    The variance is the biased one (divided by d_model), as in ``torch.nn.LayerNorm``.

    Parameters
    ----------
    x : ndarray, shape (..., d_model)
    gamma : ndarray, shape (d_model,)
        Scale.
    beta : ndarray, shape (d_model,)
        Shift.
    eps : float, default 1e-6

    Returns
    -------
    normalized : ndarray, same shape as ``x``

    Examples
    --------
    >>> layer_norm(np.array([[1.0, 2.0, 3.0]]), np.ones(3), np.zeros(3)).round(4)
    array([[-1.2247,  0.    ,  1.2247]])
    """
    x, gamma = _check_norm_args(x, gamma)
    beta = as_float_array(beta, "beta")
    if beta.shape != gamma.shape:
        raise ValueError(f"beta has shape {beta.shape}, expected (d_model,) = {gamma.shape}")
    dtype = common_float_dtype(x, gamma, beta)
    y, _, _ = _norm.layer_norm_forward(x.astype(dtype, copy=False), gamma, beta, check_eps(eps))
    return y


@returns_input_precision
def layer_norm_backward(grad_output: np.ndarray, x: np.ndarray, gamma: np.ndarray,
                        eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward of :func:`layer_norm`.

    Parameters
    ----------
    grad_output : ndarray, shape (..., d_model)
        Gradient of the loss with respect to the output.
    x : ndarray, shape (..., d_model)
        The forward's input.
    gamma : ndarray, shape (d_model,)
    eps : float, default 1e-6
        The epsilon of the forward.

    Returns
    -------
    grad_x : ndarray, shape of ``x``
    grad_gamma : ndarray, shape (d_model,)
    grad_beta : ndarray, shape (d_model,)
    """
    x, gamma = _check_norm_args(x, gamma)
    grad_output = as_float_array(grad_output, "grad_output")
    if grad_output.shape != x.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, expected the shape of x {x.shape}")
    dtype = common_float_dtype(x, gamma, grad_output)
    x = x.astype(dtype, copy=False)
    _, x_hat, rstd = _norm.layer_norm_forward(x, gamma, np.zeros_like(gamma), check_eps(eps))
    return _norm.layer_norm_backward(grad_output.astype(dtype, copy=False), x_hat, rstd, gamma.astype(dtype))


def _check_ffn_args(x, W1, b1, W2, b2=None):
    x = as_float_array(x, "x")
    check_ndim(x, "x", min_ndim=1, expected="at least 1-D (..., d_model)")
    W1, b1, W2 = as_float_array(W1, "W1"), as_float_array(b1, "b1"), as_float_array(W2, "W2")
    d = x.shape[-1]
    check_ndim(W1, "W1", ndim=2, expected=f"2-D (d_model={d}, d_ff)")
    if W1.shape[0] != d:
        raise ValueError(f"W1 has shape {W1.shape}, expected (d_model={d}, d_ff) for x of shape {x.shape}")
    f = W1.shape[1]
    if b1.shape != (f,):
        raise ValueError(f"b1 has shape {b1.shape}, expected (d_ff,) = {(f,)}")
    if W2.shape != (f, d):
        raise ValueError(f"W2 has shape {W2.shape}, expected (d_ff, d_model) = {(f, d)}")
    arrays = [x, W1, b1, W2]
    if b2 is not None:
        b2 = as_float_array(b2, "b2")
        if b2.shape != (d,):
            raise ValueError(f"b2 has shape {b2.shape}, expected (d_model,) = {(d,)}")
        arrays.append(b2)
    dtype = common_float_dtype(*arrays)
    return tuple(a.astype(dtype, copy=False) for a in arrays)


@returns_input_precision
def feed_forward(x: np.ndarray, W1: np.ndarray, b1: np.ndarray, W2: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """Position-wise feed-forward network: ``ReLU(x @ W1 + b1) @ W2 + b2``.

    Parameters
    ----------
    x : ndarray, shape (batch, seq, d_model) (any leading dims)
    W1 : ndarray, shape (d_model, d_ff)
    b1 : ndarray, shape (d_ff,)
    W2 : ndarray, shape (d_ff, d_model)
    b2 : ndarray, shape (d_model,)

    Returns
    -------
    output : ndarray, shape of ``x``

    Examples
    --------
    >>> feed_forward(np.array([[[1.0, -1.0]]]), np.eye(2), np.zeros(2), np.eye(2), np.ones(2))
    array([[[2., 1.]]])
    """
    x, W1, b1, W2, b2 = _check_ffn_args(x, W1, b1, W2, b2)
    y, _, _ = _ffn.feed_forward_forward(x, W1, b1, W2, b2)
    return y


@returns_input_precision
def feed_forward_backward(grad_output: np.ndarray, x: np.ndarray, W1: np.ndarray, b1: np.ndarray,
                          W2: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Backward of :func:`feed_forward` (recomputes the hidden layer from ``x``; ``b2`` is not needed).

    Parameters
    ----------
    grad_output : ndarray, shape (..., d_model)
    x, W1, b1, W2 : ndarrays
        The forward's inputs.

    Returns
    -------
    grad_x : ndarray, shape of ``x``
    grad_params : dict
        ``{'W1': (d_model, d_ff), 'b1': (d_ff,), 'W2': (d_ff, d_model), 'b2': (d_model,)}``.
    """
    x, W1, b1, W2 = _check_ffn_args(x, W1, b1, W2)
    grad_output = as_float_array(grad_output, "grad_output")
    if grad_output.shape != x.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, expected the shape of x {x.shape}")
    pre, hidden = _ffn.feed_forward_hidden(x, W1, b1)  # (..., F)
    return _ffn.feed_forward_backward(grad_output.astype(x.dtype, copy=False), x, W1, W2, pre, hidden)

"""Scaled dot-product and additive attention as stateless functions, with their backward passes.

Dimension letters: ``...`` any leading batch/head dims (broadcast between the arguments), Lq/Lk query/key
length, D query/key features, Dv value features.

Mask convention (everywhere in attnkit): a boolean array, ``True`` = may attend, ``False`` = masked out,
broadcast against the scores ``(..., Lq, Lk)`` by numpy's rules. Note this is the opposite of a boolean
``attn_mask`` in ``torch.nn.MultiheadAttention`` (where ``True`` = masked) and the same as in
``torch.nn.functional.scaled_dot_product_attention``. A query whose mask allows no key gets all-zero
weights, a zero output and zero gradients, never NaN.

dtype: float32 in gives float32 out, float64 gives float64, integers are promoted to float64; float16 is
computed in float32 and returned as float16; mixed arguments follow the widest (float32/float64 compute in
float64). No argument is modified in place.
"""
from __future__ import annotations

import numpy as np

from ._validation import (
    as_float_array,
    check_mask,
    check_ndim,
    check_qkv,
    common_float_dtype,
    returns_input_precision,
    unbroadcast,
)
from .kernels import reference as _ref

__all__ = [
    "compute_attention_scores",
    "apply_attention_mask",
    "attention_weights",
    "attention_weights_backward",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "additive_attention",
    "additive_attention_backward",
]


def _check_qkv(Q, K, V=None, same_features: bool = True):
    """The functional API's Q, K (and V) checked and in one float dtype, with the score shape (..., Lq, Lk).

    ``same_features=False`` lets Q and K differ in features (additive attention projects each).
    """
    Q, K, V, _ = check_qkv(Q, K, V, names=("Q", "K", "V"), same_features=same_features, same_rank=False)
    lead = np.broadcast_shapes(Q.shape[:-2], K.shape[:-2])  # the scores broadcast Q against K only
    return Q, K, V, lead + (Q.shape[-2], K.shape[-2])


@returns_input_precision
def compute_attention_scores(Q: np.ndarray, K: np.ndarray, scale: bool = True) -> np.ndarray:
    """Compute attention scores between queries and keys: ``Q K^T / sqrt(d_k)``.

    Parameters
    ----------
    Q : ndarray, shape (..., seq_q, d_k)
        Queries.
    K : ndarray, shape (..., seq_k, d_k)
        Keys.
    scale : bool, default True
        Whether to divide by ``sqrt(d_k)``.

    Returns
    -------
    scores : ndarray, shape (..., seq_q, seq_k)

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> Q = rng.standard_normal((2, 4, 64))  # batch=2, seq=4, d_k=64
    >>> K = rng.standard_normal((2, 4, 64))
    >>> scores = compute_attention_scores(Q, K)
    >>> scores.shape
    (2, 4, 4)
    """
    Q, K, _, _ = _check_qkv(Q, K)
    scores = Q @ K.swapaxes(-1, -2)  # (..., Lq, Lk)
    if scale:
        scores = scores * Q.shape[-1] ** -0.5
    return scores.astype(Q.dtype, copy=False)


def apply_attention_mask(scores: np.ndarray, mask: np.ndarray, mask_value: float = -1e9) -> np.ndarray:
    """Replace masked-out scores by ``mask_value``.

    Parameters
    ----------
    scores : ndarray, shape (..., seq_q, seq_k)
    mask : ndarray of bool, broadcastable to ``scores``
        ``True`` = attend, ``False`` = mask out.
    mask_value : float, default -1e9
        Fill value for masked positions. (A row masked everywhere then becomes uniform under a plain
        softmax; :func:`scaled_dot_product_attention` instead gives such rows zero weights.)

    Returns
    -------
    masked_scores : ndarray, same shape and dtype as ``scores`` (a new array)

    Examples
    --------
    >>> apply_attention_mask(np.zeros((1, 3)), np.array([[True, False, True]]))
    array([[ 0.e+00, -1.e+09,  0.e+00]])
    """
    scores = as_float_array(scores, "scores")
    check_ndim(scores, "scores", min_ndim=1)
    mask = check_mask(mask, "mask", scores.shape)
    return np.where(mask, scores, np.asarray(mask_value, dtype=scores.dtype))


@returns_input_precision
def attention_weights(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """Convert scores to attention weights with a numerically stable softmax.

    Parameters
    ----------
    scores : ndarray
        Attention scores (any shape).
    axis : int, default -1
        Axis to normalise over.

    Returns
    -------
    weights : ndarray, same shape as ``scores``, non-negative, summing to 1 along ``axis``

    Examples
    --------
    >>> attention_weights(np.array([1e4, 1e4 - np.log(3.0)])).round(6)
    array([0.75, 0.25])
    """
    scores = as_float_array(scores, "scores")
    axis = _check_axis(axis, scores)
    moved = np.moveaxis(scores, axis, -1)
    return np.moveaxis(_ref.masked_softmax(moved), -1, axis)


@returns_input_precision
def attention_weights_backward(grad_weights: np.ndarray, weights: np.ndarray, axis: int = -1) -> np.ndarray:
    """Backward of :func:`attention_weights`: the gradient of the scores.

    Parameters
    ----------
    grad_weights : ndarray, same shape as ``weights``
        Gradient of the loss with respect to the weights.
    weights : ndarray
        The softmax output of the forward pass.
    axis : int, default -1
        The softmax axis.

    Returns
    -------
    grad_scores : ndarray, same shape as ``weights``
        ``weights * (grad_weights - sum(grad_weights * weights, axis))``.
    """
    grad_weights = as_float_array(grad_weights, "grad_weights")
    weights = as_float_array(weights, "weights")
    if grad_weights.shape != weights.shape:
        raise ValueError(f"grad_weights has shape {grad_weights.shape} but weights has shape {weights.shape}")
    axis = _check_axis(axis, weights)
    g = _ref.softmax_backward(np.moveaxis(grad_weights, axis, -1), np.moveaxis(weights, axis, -1))
    return np.moveaxis(g, -1, axis)


def _check_axis(axis, arr: np.ndarray) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an integer, got {type(axis).__name__}")
    if not -arr.ndim <= axis < arr.ndim:
        raise ValueError(f"axis {axis} is out of range for scores of shape {arr.shape}")
    return int(axis)


@returns_input_precision
def scaled_dot_product_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray,
                                 mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention: ``softmax(Q K^T / sqrt(d_k)) V``.

    Parameters
    ----------
    Q : ndarray, shape (..., seq_q, d_k)
    K : ndarray, shape (..., seq_k, d_k)
    V : ndarray, shape (..., seq_k, d_v)
        Leading dims of Q, K and V broadcast against each other.
    mask : ndarray of bool, broadcastable to (..., seq_q, seq_k), optional
        ``True`` = may attend. A (batch, seq_k) padding mask must be given as (batch, 1, seq_k).

    Returns
    -------
    output : ndarray, shape (..., seq_q, d_v)
    weights : ndarray, shape (..., seq_q, seq_k)
        Rows sum to 1, except rows whose mask allows no key: those are all zero (and so is their output).
        ``seq_k = 0`` is such a case; ``seq_q = 0`` gives empty results.

    Examples
    --------
    >>> Q = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> out, w = scaled_dot_product_attention(Q, Q, np.array([[1.0], [2.0]]), mask=np.tril(np.ones((2, 2), bool)))
    >>> w.round(3)
    array([[1.   , 0.   ],
           [0.33, 0.67]])
    >>> out.round(3)
    array([[1.   ],
           [1.67]])
    """
    Q, K, V, score_shape = _check_qkv(Q, K, V)
    mask = check_mask(mask, "mask", score_shape)
    out, weights, _ = _ref.attention_forward(Q, K, V, mask=mask)
    return out, weights


@returns_input_precision
def scaled_dot_product_attention_backward(grad_output: np.ndarray, Q: np.ndarray, K: np.ndarray,
                                          V: np.ndarray, weights: np.ndarray
                                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward of :func:`scaled_dot_product_attention`.

    The mask needs no repeating: it is implied by ``weights`` (masked entries are exactly zero).

    Parameters
    ----------
    grad_output : ndarray, shape (..., seq_q, d_v)
        Gradient of the loss with respect to the output.
    Q, K, V : ndarrays
        The forward's inputs.
    weights : ndarray, shape (..., seq_q, seq_k)
        The weights the forward returned.

    Returns
    -------
    grad_Q : ndarray, shape of Q
    grad_K : ndarray, shape of K
    grad_V : ndarray, shape of V
    """
    Q, K, V, score_shape = _check_qkv(Q, K, V)
    weights = as_float_array(weights, "weights")
    grad_output = as_float_array(grad_output, "grad_output")
    if weights.shape != score_shape:
        raise ValueError(f"weights has shape {weights.shape}, expected {score_shape} (..., seq_q, seq_k)")
    expected = np.broadcast_shapes(score_shape[:-2], V.shape[:-2]) + (score_shape[-2], V.shape[-1])
    if grad_output.shape != expected:
        raise ValueError(f"grad_output has shape {grad_output.shape}, expected {expected} (..., seq_q, d_v)")
    dtype = common_float_dtype(Q, grad_output)
    live = (weights != 0).any(axis=-2)  # (..., Lk); keys nobody attends to cannot leak NaN
    k = _ref.zero_dead_keys(K, live)  # (..., Lk, D)
    v = _ref.zero_dead_keys(V, live)  # (..., Lk, Dv)
    dq, dk, dv, _ = _ref.attention_backward_arrays(grad_output.astype(dtype, copy=False), Q, k, v,
                                                   weights.astype(dtype, copy=False), Q.shape[-1] ** -0.5)
    return (unbroadcast(dq, Q.shape).astype(dtype, copy=False), unbroadcast(dk, K.shape).astype(dtype, copy=False),
            unbroadcast(dv, V.shape).astype(dtype, copy=False))


def _check_additive(Q, K, V, W_q, W_k, v):
    Q, K, V, score_shape = _check_qkv(Q, K, V, same_features=False)
    W_q = as_float_array(W_q, "W_q")
    W_k = as_float_array(W_k, "W_k")
    v = as_float_array(v, "v")
    check_ndim(W_q, "W_q", ndim=2, expected="2-D (d_q, d_attn)")
    check_ndim(W_k, "W_k", ndim=2, expected="2-D (d_k, d_attn)")
    check_ndim(v, "v", ndim=1, expected="1-D (d_attn,)")
    if W_q.shape[0] != Q.shape[-1]:
        raise ValueError(f"W_q has {W_q.shape[0]} rows but Q has {Q.shape[-1]} features "
                         f"(Q: {Q.shape}, W_q: {W_q.shape}); expected W_q of shape ({Q.shape[-1]}, d_attn)")
    if W_k.shape[0] != K.shape[-1]:
        raise ValueError(f"W_k has {W_k.shape[0]} rows but K has {K.shape[-1]} features "
                         f"(K: {K.shape}, W_k: {W_k.shape}); expected W_k of shape ({K.shape[-1]}, d_attn)")
    if not (W_q.shape[1] == W_k.shape[1] == v.shape[0]):
        raise ValueError(f"W_q, W_k and v must share d_attn, got W_q: {W_q.shape}, W_k: {W_k.shape}, v: {v.shape}")
    dtype = common_float_dtype(Q, W_q, W_k, v)
    cast = [a.astype(dtype, copy=False) for a in (Q, K, V, W_q, W_k, v)]
    return (*cast, score_shape)


@returns_input_precision
def additive_attention(Q: np.ndarray, K: np.ndarray, V: np.ndarray, W_q: np.ndarray, W_k: np.ndarray,
                       v: np.ndarray, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Bahdanau-style additive attention: ``score(q, k) = v^T tanh(q W_q + k W_k)`` (no scaling).

    Parameters
    ----------
    Q : ndarray, shape (..., seq_q, d_q)
    K : ndarray, shape (..., seq_k, d_k)
    V : ndarray, shape (..., seq_k, d_v)
    W_q : ndarray, shape (d_q, d_attn)
    W_k : ndarray, shape (d_k, d_attn)
    v : ndarray, shape (d_attn,)
    mask : ndarray of bool, broadcastable to (..., seq_q, seq_k), optional
        ``True`` = may attend.

    Returns
    -------
    output : ndarray, shape (..., seq_q, d_v)
    weights : ndarray, shape (..., seq_q, seq_k)

    Notes
    -----
    Memory is ``O(seq_q * seq_k * d_attn)``: every query-key pair gets its own tanh features.

    Examples
    --------
    >>> Q, K = np.ones((1, 2, 3)), np.ones((1, 4, 5))
    >>> out, w = additive_attention(Q, K, np.arange(4.0).reshape(1, 4, 1), np.ones((3, 6)), np.ones((5, 6)), np.ones(6))
    >>> w
    array([[[0.25, 0.25, 0.25, 0.25],
            [0.25, 0.25, 0.25, 0.25]]])
    >>> out[..., 0]
    array([[1.5, 1.5]])
    """
    Q, K, V, W_q, W_k, v, score_shape = _check_additive(Q, K, V, W_q, W_k, v)
    mask = check_mask(mask, "mask", score_shape)
    out, weights, _ = _ref.additive_forward(Q, K, V, W_q, W_k, v, mask)
    return out, weights


@returns_input_precision
def additive_attention_backward(grad_output: np.ndarray, Q: np.ndarray, K: np.ndarray, V: np.ndarray,
                                W_q: np.ndarray, W_k: np.ndarray, v: np.ndarray, weights: np.ndarray
                                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Backward of :func:`additive_attention`.

    This stateless form recomputes the ``(..., seq_q, seq_k, d_attn)`` tanh features from its inputs;
    :class:`attnkit.attention.AdditiveAttention` saves them instead.

    Parameters
    ----------
    grad_output : ndarray, shape (..., seq_q, d_v)
    Q, K, V, W_q, W_k, v : ndarrays
        The forward's inputs.
    weights : ndarray, shape (..., seq_q, seq_k)
        The weights the forward returned (the mask is implied by them).

    Returns
    -------
    grad_Q, grad_K, grad_V : ndarrays shaped like Q, K, V
    grad_params : dict
        ``{'W_q': (d_q, d_attn), 'W_k': (d_k, d_attn), 'v': (d_attn,)}``.
    """
    Q, K, V, W_q, W_k, v, score_shape = _check_additive(Q, K, V, W_q, W_k, v)
    weights = as_float_array(weights, "weights").astype(Q.dtype, copy=False)
    grad_output = as_float_array(grad_output, "grad_output").astype(Q.dtype, copy=False)
    if weights.shape != score_shape:
        raise ValueError(f"weights has shape {weights.shape}, expected {score_shape} (..., seq_q, seq_k)")
    expected = np.broadcast_shapes(score_shape[:-2], V.shape[:-2]) + (score_shape[-2], V.shape[-1])
    if grad_output.shape != expected:
        raise ValueError(f"grad_output has shape {grad_output.shape}, expected {expected} (..., seq_q, d_v)")
    live = (weights != 0).any(axis=-2)  # (..., Lk)
    k_live = _ref.zero_dead_keys(K, live)  # (..., Lk, Dk)
    hidden = np.tanh((Q @ W_q)[..., :, None, :] + (k_live @ W_k)[..., None, :, :])  # (..., Lq, Lk, A)
    dq, dk, dv, dw_q, dw_k, dw_v = _ref.additive_backward(grad_output, Q, K, V, W_q, W_k, v, weights, hidden)
    return dq, dk, dv, {"W_q": dw_q, "W_k": dw_k, "v": dw_v}

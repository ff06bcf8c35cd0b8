"""Multi-head attention as stateless functions, and the :class:`MultiHeadAttention` layer (re-exported).

Dimension letters: B batch, Lq/Lk query/key length, D model dim (d_model), H heads, Dh = D // H.
Projections are applied as ``x @ W`` with ``W`` of shape (D, D); head i uses columns ``i*Dh:(i+1)*Dh``.
Masks are boolean, ``True`` = may attend, broadcast against the (B, H, Lq, Lk) scores: (Lq, Lk), (Lk,)
or 4-D such as (B, 1, 1, Lk) for padding. 3-D masks are refused because (B, Lq, Lk) would silently be
read as (H, Lq, Lk).
"""
from __future__ import annotations

import numpy as np

from ._validation import (
    as_float_array,
    check_head_size,
    check_mha_mask,
    check_ndim,
    check_positive_int,
    common_float_dtype,
    returns_input_precision,
)
from .attention.multi_head_attention import MultiHeadAttention
from .kernels import heads as _heads
from .kernels import reference as _ref
from .kernels.linear import linear, linear_backward

__all__ = ["split_heads", "merge_heads", "multi_head_attention_forward", "multi_head_attention_backward",
           "MultiHeadAttention"]


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """Split the last dimension into heads.

    Parameters
    ----------
    x : ndarray, shape (batch, seq, d_model)
    num_heads : int
        Must divide ``d_model``.

    Returns
    -------
    split : ndarray, shape (batch, num_heads, seq, d_k), ``d_k = d_model // num_heads`` (a view when possible)

    Examples
    --------
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 512))  # batch=2, seq=10, d_model=512
    >>> split = split_heads(x, num_heads=8)
    >>> split.shape  # 512/8 = 64
    (2, 8, 10, 64)
    """
    x = as_float_array(x, "x")
    check_ndim(x, "x", ndim=3, expected="3-D (batch, seq, d_model)")
    num_heads = check_positive_int(num_heads, "num_heads")
    check_head_size(x.shape[-1], num_heads, f"d_model of x {x.shape}")
    return _heads.split_heads(x, num_heads)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """Merge heads back into one feature dimension (inverse of :func:`split_heads`).

    Parameters
    ----------
    x : ndarray, shape (batch, num_heads, seq, d_k)

    Returns
    -------
    merged : ndarray, shape (batch, seq, num_heads * d_k)

    Examples
    --------
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 512))
    >>> np.array_equal(merge_heads(split_heads(x, 8)), x)
    True
    """
    x = as_float_array(x, "x")
    check_ndim(x, "x", ndim=4, expected="4-D (batch, num_heads, seq, d_k)")
    return _heads.merge_heads(x)


@returns_input_precision
def multi_head_attention_forward(Q: np.ndarray, K: np.ndarray, V: np.ndarray, W_Q: np.ndarray, W_K: np.ndarray,
                                 W_V: np.ndarray, W_O: np.ndarray, num_heads: int,
                                 mask: np.ndarray | None = None) -> tuple[np.ndarray, dict]:
    """Multi-head attention forward pass: ``Concat(head_1..head_H) W_O``.

    ``head_i = Attention(Q W_Q^i, K W_K^i, V W_V^i)``.

    Parameters
    ----------
    Q : ndarray, shape (batch, seq_q, d_model)
    K : ndarray, shape (batch, seq_k, d_model)
    V : ndarray, shape (batch, seq_k, d_model)
    W_Q, W_K, W_V, W_O : ndarray, shape (d_model, d_model)
    num_heads : int
        Must divide d_model.
    mask : ndarray of bool, optional
        ``True`` = may attend; (seq_q, seq_k), (seq_k,) or 4-D broadcastable to (batch, heads, seq_q, seq_k).

    Returns
    -------
    output : ndarray, shape (batch, seq_q, d_model)
    cache : dict
        What :func:`multi_head_attention_backward` needs; ``cache['weights']`` holds the per-head
        attention weights (batch, num_heads, seq_q, seq_k).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(2, 5, 8))
    >>> W = [rng.normal(size=(8, 8)) for _ in range(4)]
    >>> out, cache = multi_head_attention_forward(x, x, x, *W, num_heads=2)
    >>> out.shape, cache["weights"].shape
    ((2, 5, 8), (2, 2, 5, 5))
    """
    num_heads = check_positive_int(num_heads, "num_heads")
    arrays = {}
    for name, x, want in (("Q", Q, "(batch, seq_q, d_model)"), ("K", K, "(batch, seq_k, d_model)"),
                          ("V", V, "(batch, seq_k, d_model)")):
        arrays[name] = as_float_array(x, name)
        check_ndim(arrays[name], name, ndim=3, expected=f"3-D {want}")
    Q, K, V = arrays["Q"], arrays["K"], arrays["V"]
    d_model = Q.shape[-1]
    check_head_size(d_model, num_heads, f"d_model of Q {Q.shape}")
    for name, x in (("K", K), ("V", V)):
        if x.shape[-1] != d_model or x.shape[0] != Q.shape[0]:
            raise ValueError(f"{name} has shape {x.shape}, expected (batch={Q.shape[0]}, seq_k, d_model={d_model}) "
                             f"to match Q: {Q.shape}")
    if K.shape[1] != V.shape[1]:
        raise ValueError(f"K has length {K.shape[1]} but V has length {V.shape[1]} (K: {K.shape}, V: {V.shape})")
    weights_in = {}
    for name, w in (("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V), ("W_O", W_O)):
        weights_in[name] = as_float_array(w, name)
        if weights_in[name].shape != (d_model, d_model):
            raise ValueError(f"{name} has shape {weights_in[name].shape}, expected (d_model, d_model) = "
                             f"{(d_model, d_model)}")
    dtype = common_float_dtype(Q, K, V, *weights_in.values())
    Q, K, V = (a.astype(dtype, copy=False) for a in (Q, K, V))
    W = {n: w.astype(dtype, copy=False) for n, w in weights_in.items()}
    mask = check_mha_mask(mask, "mask", Q.shape[0], num_heads, Q.shape[1], K.shape[1])

    q = _heads.split_heads(linear(Q, W["W_Q"]), num_heads)  # (B, H, Lq, Dh)
    k = _heads.split_heads(linear(K, W["W_K"]), num_heads)  # (B, H, Lk, Dh)
    v = _heads.split_heads(linear(V, W["W_V"]), num_heads)  # (B, H, Lk, Dh)
    heads, weights, ctx = _ref.attention_forward(q, k, v, mask=mask)  # (B, H, Lq, Dh), (B, H, Lq, Lk)
    merged = _heads.merge_heads(heads)  # (B, Lq, D)
    output = linear(merged, W["W_O"])  # (B, Lq, D)
    cache = {"Q": Q, "K": K, "V": V, **W, "num_heads": num_heads, "merged": merged, "weights": weights,
             "attention": ctx}
    return output, cache


@returns_input_precision
def multi_head_attention_backward(grad_output: np.ndarray, cache: dict
                                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """Multi-head attention backward pass.

    Parameters
    ----------
    grad_output : ndarray, shape (batch, seq_q, d_model)
        Gradient of the loss with respect to the forward's output.
    cache : dict
        The cache :func:`multi_head_attention_forward` returned.

    Returns
    -------
    grad_Q : ndarray, shape (batch, seq_q, d_model)
    grad_K : ndarray, shape (batch, seq_k, d_model)
    grad_V : ndarray, shape (batch, seq_k, d_model)
    grad_params : dict
        Gradients for ``'W_Q', 'W_K', 'W_V', 'W_O'``, each (d_model, d_model).
    """
    if not isinstance(cache, dict) or "attention" not in cache:
        raise TypeError("cache must be the dict returned by multi_head_attention_forward")
    grad_output = as_float_array(grad_output, "grad_output")
    merged = cache["merged"]
    if grad_output.shape != merged.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, expected the output shape {merged.shape}")
    g = grad_output.astype(merged.dtype, copy=False)
    h = cache["num_heads"]
    grads = {}
    d_merged, grads["W_O"], _ = linear_backward(g, merged, cache["W_O"])  # (B, Lq, D)
    dq, dk, dv, _ = _ref.attention_backward(_heads.split_heads(d_merged, h), cache["attention"])  # (B, H, L, Dh)
    grad_Q, grads["W_Q"], _ = linear_backward(_heads.merge_heads(dq), cache["Q"], cache["W_Q"])  # (B, Lq, D)
    grad_K, grads["W_K"], _ = linear_backward(_heads.merge_heads(dk), cache["K"], cache["W_K"])  # (B, Lk, D)
    grad_V, grads["W_V"], _ = linear_backward(_heads.merge_heads(dv), cache["V"], cache["W_V"])  # (B, Lk, D)
    return grad_Q, grad_K, grad_V, grads

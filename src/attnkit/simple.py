"""Attention on plain ``(L, d)`` matrices given as nested lists or arrays: one sequence, no batch.

``scaled_dot_product_attention(query, key, value)`` and ``multi_head_attention(query, key, value, num_heads)``
take 2-D inputs (one sequence, no batch) and return the same kind they were given: nested lists of Python
floats for lists (computed in float64), an ndarray for ndarrays (in their float dtype). No masks, no learned
weights: the multi-head version splits the features into heads with identity projections, so it is the
concatenation of per-head scaled dot-product attention on feature slices (each head scaled by
``1 / sqrt(d / num_heads)``).

Dimension letters: Lq/Lk query/key length, D query/key features, Dv value features, H heads.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._validation import as_float_array, check_head_size, check_ndim, check_positive_int, common_float_dtype
from .attention_core import scaled_dot_product_attention as _sdpa
from .kernels import heads as _heads
from .kernels import reference as _ref

__all__ = ["scaled_dot_product_attention", "multi_head_attention"]


def _as_matrices(query: Any, key: Any, value: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Check three (L, d) matrices; returns them in a common float dtype and whether to answer with lists."""
    as_list = not any(isinstance(x, np.ndarray) for x in (query, key, value))
    arrays = []
    for name, x in (("query", query), ("key", key), ("value", value)):
        try:
            arr = as_float_array(x, name)
        except ValueError:  # ragged nested lists
            raise ValueError(f"{name} must be a rectangular (seq_len, features) matrix; its rows differ in "
                             f"length") from None
        check_ndim(arr, name, ndim=2, expected="2-D (seq_len, features)")
        arrays.append(arr)
    q, k, v = arrays
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"query has {q.shape[1]} features but key has {k.shape[1]}; they must match "
                         f"(query: {q.shape}, key: {k.shape})")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"key has {k.shape[0]} rows but value has {v.shape[0]}; they must match "
                         f"(key: {k.shape}, value: {v.shape})")
    dtype = np.float64 if as_list else common_float_dtype(q, k, v)
    return q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), as_list


def scaled_dot_product_attention(query: Any, key: Any, value: Any) -> Any:
    """``softmax(query key^T / sqrt(D)) value`` for one sequence.

    Parameters
    ----------
    query : nested list or ndarray, shape (Lq, D)
    key : nested list or ndarray, shape (Lk, D)
    value : nested list or ndarray, shape (Lk, Dv)

    Returns
    -------
    output : shape (Lq, Dv)
        A nested list of floats if no argument was an ndarray, else an ndarray in the inputs' float dtype.

    Examples
    --------
    >>> scaled_dot_product_attention([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0], [3.0]])
    [[1.66048]]
    >>> scaled_dot_product_attention(np.eye(2, dtype=np.float32), np.eye(2), np.ones((2, 3))).dtype
    dtype('float64')
    """
    q, k, v, as_list = _as_matrices(query, key, value)
    out, _ = _sdpa(q, k, v)  # (Lq, Dv)
    return out.tolist() if as_list else out


def multi_head_attention(query: Any, key: Any, value: Any, num_heads: int) -> Any:
    """Multi-head attention with identity projections: heads are slices of the feature axis.

    Head ``h`` attends with features ``h*D/H:(h+1)*D/H`` of query and key and returns features
    ``h*Dv/H:(h+1)*Dv/H`` of value; the outputs are concatenated in head order. With ``num_heads=1`` this is
    :func:`scaled_dot_product_attention`.

    Parameters
    ----------
    query : nested list or ndarray, shape (Lq, D)
    key : nested list or ndarray, shape (Lk, D)
    value : nested list or ndarray, shape (Lk, Dv)
    num_heads : int
        H; must divide both D and Dv.

    Returns
    -------
    output : shape (Lq, Dv), a nested list of floats or an ndarray, as for :func:`scaled_dot_product_attention`.

    Examples
    --------
    >>> q = [[1.0, 0.0, 0.0, 5.0]]
    >>> k = [[1.0, 0.0, 0.0, 5.0], [0.0, 1.0, 0.0, 0.0]]
    >>> v = [[1.0, 10.0], [3.0, 30.0]]
    >>> out = multi_head_attention(q, k, v, num_heads=2)
    >>> [round(x, 4) for x in out[0]]  # head 0 sees features 0-1, head 1 features 2-3
    [1.6605, 10.0]
    """
    q, k, v, as_list = _as_matrices(query, key, value)
    num_heads = check_positive_int(num_heads, "num_heads")
    for name, d in (("query/key", q.shape[1]), ("value", v.shape[1])):
        check_head_size(d, num_heads, f"the {name} features (query: {q.shape}, key: {k.shape}, value: {v.shape})")
    qh = _heads.split_heads(q, num_heads)  # (H, Lq, D/H)
    kh = _heads.split_heads(k, num_heads)  # (H, Lk, D/H)
    vh = _heads.split_heads(v, num_heads)  # (H, Lk, Dv/H)
    heads, _, _ = _ref.attention_forward(qh, kh, vh)  # (H, Lq, Dv/H)
    out = _heads.merge_heads(heads)  # (Lq, Dv)
    return out.tolist() if as_list else out

"""Attention rollout (Abnar and Zuidema, 2020): how much each output position draws on each input token
once the attention of every layer is composed.

Shapes: N layers, H heads, L tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _as_weights(weights: Any) -> np.ndarray:
    """(N, H, L, L) floats from an array or a list of per-layer arrays (H, L, L) or (1, H, L, L)."""
    if isinstance(weights, (list, tuple)):
        layers = [np.asarray(w) for w in weights]
        layers = [w[0] if w.ndim == 4 and w.shape[0] == 1 else w for w in layers]
        if not layers or len({w.shape for w in layers}) != 1:
            raise ValueError(f"weights must be per-layer arrays of one shape (H, L, L), got shapes "
                             f"{[w.shape for w in layers]}")
        arr = np.stack(layers)
    else:
        arr = np.asarray(weights)
    if arr.ndim != 4 or arr.shape[-1] != arr.shape[-2] or arr.dtype.kind != "f":
        raise ValueError(f"weights must be float attention weights (layers, heads, L, L), got shape {arr.shape} "
                         f"and dtype {arr.dtype}")
    return arr


def mixed_attention(arr: np.ndarray, residual: bool) -> np.ndarray:
    """Per layer ``mean over heads``, with ``residual`` ``0.5 * A + 0.5 * I``, rows renormalised (rows that are
    all zero stay zero): (N, H, L, L) -> (N, L, L), what rollout and flow compose."""
    mixed = arr.mean(axis=1)  # (N, L, L)
    if residual:
        mixed = 0.5 * mixed + 0.5 * np.eye(arr.shape[-1], dtype=arr.dtype)  # (N, L, L)
    totals = mixed.sum(axis=-1, keepdims=True)  # (N, L, 1)
    return np.divide(mixed, totals, out=np.zeros_like(mixed), where=totals > 0)  # (N, L, L)


def attention_rollout(weights: Any, residual: bool = True) -> np.ndarray:
    """Attention rollout over the layers.

    Per layer ``A_l = mean over heads`` of the weights; with ``residual`` (the paper's choice, accounting for
    the skip connection) ``A_l = 0.5 * A_l + 0.5 * I``; rows are renormalised to sum to one (rows that are
    all zero stay zero); the result is ``R = A_last @ ... @ A_first``. ``R[i, j]`` is the share of output
    position ``i`` that traces back to input token ``j``.

    Parameters
    ----------
    weights : array_like (N, H, L, L), or a list of N arrays (H, L, L) or (1, H, L, L)
        Attention weights of one sequence, layer by layer, rows = queries (as returned by
        ``CausalLM.forward(..., output_attentions=True)``).
    residual : bool, default True
        Add the identity for the residual connection.

    Returns
    -------
    ndarray (L, L), in the weights' dtype.

    Examples
    --------
    >>> w = np.tril(np.ones((3, 3)))
    >>> w = np.broadcast_to(w / w.sum(-1, keepdims=True), (2, 1, 3, 3))  # 2 layers, 1 head, uniform causal
    >>> r = attention_rollout(w)
    >>> r.shape, np.allclose(r.sum(-1), 1), float(r[0, 0])
    ((3, 3), True, 1.0)
    """
    arr = _as_weights(weights)
    mixed = mixed_attention(arr, residual)  # (N, L, L)
    rollout = mixed[0]  # (L, L)
    for layer in mixed[1:]:
        rollout = layer @ rollout  # (L, L)
    return rollout.astype(arr.dtype, copy=False)

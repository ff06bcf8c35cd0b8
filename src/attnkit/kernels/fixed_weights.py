"""Attention with given weights: ``out = weights @ v`` when a hook replaced the softmax's weights.

The weights are then a constant, so backward gives the values their gradient and the queries and keys none.
Each key/value head is read by its G query heads (grouped-query attention; G = 1 for multi-head attention).

Shapes: B batch, Hq query heads, Hkv key/value heads, G = Hq / Hkv, L queries, S keys, Dh head width.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["FixedWeights", "fixed_weights_backward", "fixed_weights_forward"]


class FixedWeights(NamedTuple):
    """What :func:`fixed_weights_backward` needs."""

    weights: np.ndarray  # (B, Hkv, G, L, S)
    v: np.ndarray  # (B, Hkv, S, Dh)
    q_shape: tuple


def fixed_weights_forward(weights: np.ndarray, v: np.ndarray, q_shape: tuple) -> tuple[np.ndarray, FixedWeights]:
    """``(out (B, Hq, L, Dh), ctx)`` of ``weights`` (B, Hq, L, S) applied to ``v`` (B, Hkv, S, Dh)."""
    b, hq, length, seq_k = weights.shape
    hkv = v.shape[1]
    grouped = weights.reshape(b, hkv, hq // hkv, length, seq_k)  # (B, Hkv, G, L, S)
    out = grouped @ v[:, :, None]  # (B, Hkv, G, L, Dh)
    return out.reshape(b, hq, length, v.shape[-1]), FixedWeights(grouped, v, tuple(q_shape))


def fixed_weights_backward(grad_out: np.ndarray, ctx: FixedWeights):
    """``(dq, dk, dv)``: zeros for the queries and keys (the weights did not come from them), and
    ``weights^T @ grad_out`` summed over each key/value head's group for the values."""
    b, hkv, group, length, _ = ctx.weights.shape
    g = grad_out.reshape(b, hkv, group, length, -1)  # (B, Hkv, G, L, Dh)
    dv = (ctx.weights.swapaxes(-1, -2) @ g).sum(axis=2)  # (B, Hkv, S, Dh)
    return np.zeros(ctx.q_shape, grad_out.dtype), np.zeros_like(ctx.v), dv.astype(grad_out.dtype, copy=False)

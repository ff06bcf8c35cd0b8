"""The textbook attention, straight NumPy: the baseline the benchmark calls "naive".

``softmax(Q K^T / sqrt(d)) V`` with the full ``(B, H, L, L)`` score matrix and the usual backward through
the stored weights. No masking beyond causal, no dropout, no bias: what one writes from the paper.
(The scale is a Python float so that float32 stays float32; a NumPy float64 scalar would upcast.)

Dimension letters: B batch, H heads, Lq/Lk query/key length, D key features, Dv value features.

Examples
--------
>>> q = k = v = np.ones((1, 1, 3, 2), np.float32)
>>> out, cache = naive_forward(q, k, v, causal=True)
>>> out.shape, out.dtype
((1, 1, 3, 2), dtype('float32'))
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["naive_forward", "naive_backward"]


def naive_forward(q, k, v, causal=False):
    """``softmax(q k^T / sqrt(D)) v`` with the whole score matrix; returns ``out`` and what the backward needs.

    Shapes: q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, Dv) -> out (B, H, Lq, Dv); causal is
    bottom-right aligned (query i sees key j iff j <= i + Lk - Lq).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.swapaxes(-1, -2)) * scale  # (B, H, Lq, Lk)
    if causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.tril(np.ones((lq, lk), bool), lk - lq), s, -np.inf)  # (B, H, Lq, Lk)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)  # (B, H, Lq, Lk)
    return p @ v, (q, k, v, p, scale)  # (B, H, Lq, Dv)


def naive_backward(grad_out, cache):
    """Gradients of :func:`naive_forward` with respect to q, k, v (shapes as theirs) from ``grad_out``
    (B, H, Lq, Dv)."""
    q, k, v, p, scale = cache
    dv = p.swapaxes(-1, -2) @ grad_out  # (B, H, Lk, Dv)
    dp = grad_out @ v.swapaxes(-1, -2)  # (B, H, Lq, Lk)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))  # (B, H, Lq, Lk)
    dq = (ds @ k) * scale  # (B, H, Lq, D)
    dk = (ds.swapaxes(-1, -2) @ q) * scale  # (B, H, Lk, D)
    return dq, dk, dv

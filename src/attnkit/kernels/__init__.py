"""Attention compute kernels (no parameters, no input checking).

Two implementations behind one interface:

* :mod:`~attnkit.kernels.reference` materialises the ``Lq x Lk`` scores; it is used whenever the
  attention weights are asked for, and it is the yardstick the other is tested against;
* :mod:`~attnkit.kernels.tiled` (FlashAttention-style online softmax, recomputing backward, threads) never
  allocates anything of size ``Lq x Lk``; it is used whenever the weights are not needed.

:func:`attention_forward` picks one by ``need_weights``; :func:`attention_backward` follows the context
the forward returned. Both accept the same masks, causal flag, biases (arrays or :class:`ScoreBias`) and
counter-based dropout, and agree within floating-point rounding.
"""
from __future__ import annotations

import numpy as np

from . import reference, tiled
from .bias import ScoreBias
from .reference import causal_mask, masked_softmax

__all__ = ["ScoreBias", "attention_forward", "attention_backward", "causal_mask", "masked_softmax",
           "reference", "tiled"]


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                      causal: bool = False, scale: float | None = None,
                      bias: np.ndarray | ScoreBias | None = None, dropout_p: float = 0.0,
                      dropout_seed: int | None = None, need_weights: bool = True, window: int | None = None):
    """Softmax attention ``dropout(softmax(scale * q k^T + bias, masked)) v`` by the fitting kernel.

    Shapes
    ------
    q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv); mask bool broadcastable to (..., Lq, Lk), ``True`` =
    may attend; bias an array broadcastable to (..., Lq, Lk) or a :class:`ScoreBias`. Leading dims
    broadcast: grouped-query attention is q (B, Hkv, G, Lq, D) with k, v (B, Hkv, 1, Lk, D), and the
    key/value gradients come back in k's and v's own shapes (summed over the group).

    ``window=W`` (requires ``causal=True``, W >= 1): query i, at bottom-right-aligned position
    ``i' = i + Lk - Lq``, attends key j iff ``i' - W < j <= i'`` (W keys, itself included).

    Returns
    -------
    out : (..., Lq, Dv)
    weights : (..., Lq, Lk) softmax weights before dropout (reference kernel), or None (tiled kernel)
    ctx : the context :func:`attention_backward` needs
    """
    kwargs = dict(mask=mask, causal=causal, scale=scale, bias=bias, dropout_p=dropout_p, dropout_seed=dropout_seed,
                  window=window)
    if need_weights:
        return reference.attention_forward(q, k, v, **kwargs)
    out, _, ctx = tiled.flash_attention_forward(q, k, v, **kwargs)
    return out, None, ctx


def attention_backward(grad_out: np.ndarray, ctx):
    """Gradients ``(dq, dk, dv, dbias)`` of :func:`attention_forward`, by the kernel that ran the forward."""
    if isinstance(ctx, tiled.FlashContext):
        return tiled.flash_attention_backward(grad_out, ctx)
    return reference.attention_backward(grad_out, ctx)

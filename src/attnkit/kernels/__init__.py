"""Attention compute kernels (no parameters, no input checking).

Two implementations behind one interface:

* :mod:`~attnkit.kernels.reference` materialises the ``Lq x Lk`` scores; it is used whenever the
  attention weights are asked for, and it is the yardstick the other is tested against;
* :mod:`~attnkit.kernels.tiled` (FlashAttention-style online softmax, recomputing backward, threads) never
  allocates anything of size ``Lq x Lk``; it is used whenever the weights are not needed.

:func:`attention_forward` runs the one named by ``kernel`` (see :mod:`~attnkit.kernels.registry`, the one place
a kernel is chosen and ``"auto"`` is defined); :func:`attention_backward` follows the context the forward
returned. Both accept the same masks, causal flag, array biases, score modifiers (``score_mod``, see
:mod:`attnkit.flex`) and counter-based dropout, and agree within floating-point rounding.
"""
from __future__ import annotations

import numpy as np

from . import reference, tiled
from ._threads import (
    free_cores,
    get_adaptive_threads,
    get_num_threads,
    num_threads,
    set_adaptive_threads,
    set_num_threads,
)
from .reference import causal_mask, masked_softmax
from .registry import ATTENTION_KERNELS, kernel_for_context, resolve_kernel

__all__ = ["ATTENTION_KERNELS", "attention_forward", "set_num_threads", "get_num_threads",
           "num_threads", "set_adaptive_threads", "get_adaptive_threads", "free_cores", "attention_backward",
           "causal_mask", "masked_softmax",
           "reference", "tiled"]


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                      causal: bool = False, scale: float | None = None,
                      bias: np.ndarray | None = None, dropout_p: float = 0.0,
                      dropout_seed: int | None = None, need_weights: bool = True, window: int | None = None,
                      score_mod=None, kernel: str = "auto"):
    """Softmax attention ``dropout(softmax(scale * q k^T + bias, masked)) v`` by the named kernel.

    ``kernel``: ``"auto"`` (the default) or a name in :data:`ATTENTION_KERNELS`, resolved by
    :func:`~attnkit.kernels.registry.resolve_kernel` (``"tiled"`` with ``need_weights=True`` is a
    ``ValueError``: it never forms the weights).

    Shapes
    ------
    q (..., Lq, D), k (..., Lk, D), v (..., Lk, Dv); mask bool broadcastable to (..., Lq, Lk), ``True`` =
    may attend; bias an array broadcastable to (..., Lq, Lk); ``score_mod`` a score modifier on the scores
    seen as (B, H, Lq, Lk) (:class:`attnkit.flex.ScoreMod`, needs two or more leading dims). Leading dims
    broadcast: grouped-query attention is q (B, Hkv, G, Lq, D) with k, v (B, Hkv, 1, Lk, D), and the
    key/value gradients come back in k's and v's own shapes (summed over the group).

    ``window=W`` (requires ``causal=True``, W >= 1): query i, at bottom-right-aligned position
    ``i' = i + Lk - Lq``, attends key j iff ``i' - W < j <= i'`` (W keys, itself included).

    Returns
    -------
    out : (..., Lq, Dv)
    weights : (..., Lq, Lk) softmax weights before dropout with ``need_weights``, else None
    ctx : the context :func:`attention_backward` needs
    """
    kwargs = dict(mask=mask, causal=causal, scale=scale, bias=bias, dropout_p=dropout_p, dropout_seed=dropout_seed,
                  window=window, score_mod=score_mod)
    out, weights, ctx = resolve_kernel(kernel, need_weights=need_weights, seq_q=q.shape[-2]).forward(q, k, v, **kwargs)
    return out, (weights if need_weights else None), ctx  # the weights only when asked for, whichever kernel ran


def attention_backward(grad_out: np.ndarray, ctx):
    """Gradients ``(dq, dk, dv, dbias)`` of :func:`attention_forward`, by the kernel that ran the forward."""
    return kernel_for_context(ctx).backward(grad_out, ctx)

"""``BaseAttention``: the interface every attention head implements.

A head maps per-head queries, keys and values to outputs and weights. ``MultiHeadAttention`` projects its
inputs, splits them into heads and calls any ``BaseAttention`` with the heads folded into the batch
dims, so a new attention mechanism plugs in by implementing two methods.

Shapes
------
q : (..., Lq, Dk)   k : (..., Lk, Dk)   v : (..., Lk, Dv)   with ``...`` = (B, H) under MultiHeadAttention
mask : bool, broadcastable to (..., Lq, Lk), ``True`` = may attend
output : (..., Lq, Dv)   weights : (..., Lq, Lk) or None
"""
from __future__ import annotations

import numpy as np

from ..kernels.reference import combine_causal
from .module import Module

__all__ = ["BaseAttention"]


class BaseAttention(Module):
    """Abstract attention head.

    Subclasses implement :meth:`forward` (saving what backward needs with ``save_for_backward``) and
    :meth:`backward` (returning the input gradients and adding their own parameters' gradients into
    ``self.grads``).

    Examples
    --------
    A head with cosine-similarity scores, using the reference kernel for the softmax and its gradient:

    >>> from attnkit.kernels import reference as ref
    >>> class CosineAttention(BaseAttention):
    ...     def forward(self, q, k, v, mask=None, *, is_causal=False, need_weights=True):
    ...         nq = q / np.linalg.norm(q, axis=-1, keepdims=True)
    ...         nk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    ...         out, w, ctx = ref.attention_forward(nq, nk, v, mask=mask, causal=is_causal, scale=5.0)
    ...         self.save_for_backward(ctx, q, k, nq, nk)
    ...         return out, w
    ...     def backward(self, grad_output):
    ...         ctx, q, k, nq, nk = self.saved_tensors
    ...         dnq, dnk, dv, _ = ref.attention_backward(grad_output, ctx)
    ...         def unit_grad(x, n, d):  # gradient through x -> x / |x|
    ...             return (d - n * (d * n).sum(-1, keepdims=True)) / np.linalg.norm(x, axis=-1, keepdims=True)
    ...         return unit_grad(q, nq, dnq), unit_grad(k, nk, dnk), dv
    >>> out, w = CosineAttention()(np.ones((1, 2, 3)), np.ones((1, 4, 3)), np.ones((1, 4, 5)))
    >>> out.shape, w.shape
    ((1, 2, 5), (1, 2, 4))
    """

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                is_causal: bool = False, need_weights: bool = True):
        """Attend: returns ``(output (..., Lq, Dv), weights (..., Lq, Lk) or None)``.

        ``is_causal`` adds the bottom-right-aligned causal mask; with ``need_weights=False`` a head may
        skip materialising the weights (and return ``None`` for them).
        """
        raise NotImplementedError

    def backward(self, grad_output: np.ndarray):
        """Given d(loss)/d(output) of the last forward, return ``(grad_q, grad_k, grad_v)``."""
        raise NotImplementedError

    @staticmethod
    def combine_masks(mask: np.ndarray | None, is_causal: bool, seq_q: int, seq_k: int) -> np.ndarray | None:
        """``mask`` AND the bottom-right-aligned causal mask (when ``is_causal``); ``None`` if neither."""
        return combine_causal(mask, is_causal, seq_q, seq_k)

"""``ScaledDotProductAttention``: the Transformer's attention head, ``softmax(q k^T / sqrt(d)) v``.

It runs through :func:`attnkit.flex.flex_attention`, the one attention front door: its leading dims become
flex's (B, H) (the last leading dim is the heads, the others the batch), its boolean mask a
:func:`~attnkit.flex.boolean_mask`, ``is_causal`` the bottom-right causal mask, and a subclass's bias a score
modifier. The kernel is chosen by :func:`attnkit.kernels.registry.resolve_kernel` (``"auto"``).

Dimension letters: ``...`` the leading dims (folded into B' = their product but the last, H' = the last),
Lq/Lk query/key length, D query/key features, Dv value features.
"""
from __future__ import annotations

import math

import numpy as np

from .._validation import (
    as_bool_mask,
    as_float_array,
    check_mask,
    check_qkv,
    check_scale,
    returns_input_precision,
    unbroadcast,
)
from ..core.base_attention import BaseAttention
from ..flex.attention import flex_attention, flex_attention_backward
from ..flex.masks import and_masks, boolean_mask, causal_lower_right, create_block_mask
from ..init import as_generator

__all__ = ["ScaledDotProductAttention"]


class ScaledDotProductAttention(BaseAttention):
    """Scaled dot-product attention head with optional dropout on the weights.

    Parameters
    ----------
    dropout : float, default 0.0
        Probability of zeroing a weight after the softmax, in training mode only (inverted scaling:
        kept weights are divided by ``1 - dropout``). Backward uses the same dropped entries.
    scale : float, optional
        Score multiplier, of magnitude at most 65504 (``check_scale``); default ``1 / sqrt(Dk)``.
    is_causal : bool, default False
        Always apply the bottom-right-aligned causal mask (query i sees keys ``j <= i + Lk - Lq``).
    seed : int, optional
        Seed of the dropout stream; the same seed gives the same dropped entries call after call.

    Shapes
    ------
    q (..., Lq, Dk), k (..., Lk, Dk), v (..., Lk, Dv), mask bool broadcastable to (..., Lq, Lk) with
    ``True`` = may attend; returns output (..., Lq, Dv) and the weights (..., Lq, Lk) *before* dropout.
    Rows that may attend to no key get zero weights and zero output.

    Examples
    --------
    >>> head = ScaledDotProductAttention(is_causal=True)
    >>> out, w = head(np.eye(3)[None], np.eye(3)[None], np.arange(3.0).reshape(1, 3, 1))
    >>> w[0, 0], out.shape
    (array([1., 0., 0.]), (1, 3, 1))
    """

    def __init__(self, dropout: float = 0.0, scale: float | None = None, is_causal: bool = False,
                 seed: int | None = None) -> None:
        super().__init__()
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        self.scale = None if scale is None else check_scale(scale)
        self.is_causal = bool(is_causal)
        self._rng = as_generator(seed)  # draws one dropout seed per forward

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, scale={self.scale}, is_causal={self.is_causal}"

    @returns_input_precision
    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                is_causal: bool = False, need_weights: bool = True):
        """Attend; see the class docstring for shapes. Saves the kernel context for :meth:`backward`.

        With ``need_weights=False`` the weights come back as ``None`` and, from two queries on, the tiled kernel
        runs (no ``Lq x Lk`` array is allocated).
        """
        q, k, v, lead, mask = self._check_inputs(q, k, v, mask)
        return self._attend(q, k, v, mask, is_causal, None, need_weights)

    def _check_inputs(self, q, k, v, mask):
        """Checked ``(q, k, v, lead, mask)``: a common float dtype, d_q == d_k, a boolean broadcastable mask."""
        q, k, v, lead = check_qkv(q, k, v, type(self).__name__, same_features=True)
        mask = check_mask(as_bool_mask(mask, "mask"), "mask", lead + (q.shape[-2], k.shape[-2]),
                          "(..., seq_q, seq_k) scores")
        return q, k, v, lead, mask

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, is_causal: bool,
                score_mod, need_weights: bool):
        """Run flex attention on checked inputs (subclasses add their bias as ``score_mod``) and save its
        context for backward: ``(output (..., Lq, Dv), weights (..., Lq, Lk) or None)``."""
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        folded = (math.prod(lead[:-1]), lead[-1] if lead else 1)  # (B', H')
        q4, k4, v4 = (_fold(x, lead, folded) for x in (q, k, v))  # (B', H', L, D) each
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        p = self.dropout if self.training else 0.0
        seed = int(self._rng.integers(2**63)) if p > 0 else None
        block_mask = _block_mask(mask, self.is_causal or is_causal, lead, folded, seq_q, seq_k)
        out, ctx = flex_attention(q4, k4, v4, score_mod, block_mask, scale=self.scale, need_weights=need_weights,
                                  dropout_p=p, dropout_seed=seed)  # (B', H', Lq, Dv)
        self.save_for_backward(ctx, lead, q.shape, k.shape, v.shape)
        # The kernel's context may hold the output (tiled) for backward: the caller gets copies, so editing them
        # cannot change the gradients.
        out = out.reshape(lead + out.shape[-2:]).copy()  # (..., Lq, Dv)
        weights = None if not need_weights else ctx.weights.reshape(lead + (seq_q, seq_k)).copy()  # (..., Lq, Lk)
        return out, weights

    @returns_input_precision
    def backward(self, grad_output: np.ndarray):
        """Return ``(grad_q, grad_k, grad_v)`` for the last forward (a bias's parameters get theirs too)."""
        if self.saved_tensors is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        ctx, lead, q_shape, k_shape, v_shape = self.saved_tensors
        out_shape = lead + (q_shape[-2], v_shape[-1])
        g = as_float_array(grad_output, "grad_output")
        if g.shape != out_shape:
            raise ValueError(f"grad_output has shape {g.shape}, expected the output shape {out_shape}")
        g = np.ascontiguousarray(g.astype(ctx.dtype, copy=False).reshape(ctx.out_shape))  # (B', H', Lq, Dv)
        dq, dk, dv = flex_attention_backward(g, ctx)[:3]  # (B', H', L, D) each
        return tuple(unbroadcast(d.reshape(lead + d.shape[-2:]), shape)
                     for d, shape in ((dq, q_shape), (dk, k_shape), (dv, v_shape)))


def _fold(x: np.ndarray, lead: tuple[int, ...], folded: tuple[int, int]) -> np.ndarray:
    """(..., L, D) broadcast to the common leading dims and seen as (B', H', L, D) (a view when it can be)."""
    return np.broadcast_to(x, lead + x.shape[-2:]).reshape(folded + x.shape[-2:])


def _block_mask(mask: np.ndarray | None, causal: bool, lead: tuple[int, ...], folded: tuple[int, int],
                seq_q: int, seq_k: int):
    """The head's boolean mask (broadcastable to (..., Lq, Lk)) and causal flag as a flex block mask over
    (B', H', Lq, Lk), or None when nothing is masked (or there is nothing to mask)."""
    if seq_q == 0 or seq_k == 0 or (mask is None and not causal):
        return None
    parts = [causal_lower_right(seq_q, seq_k)] if causal else []
    batch = heads = None  # the block mask's B and H: None broadcasts over that axis
    if mask is not None:
        m = mask.reshape((1,) * (len(lead) + 2 - mask.ndim) + mask.shape)  # (..., Lq|1, Lk|1), every lead dim
        if lead and m.shape[-3] > 1:
            heads = folded[1]
        if any(n != 1 for n in m.shape[:-3]):  # the batch dims vary: fold them (a view where it can be)
            m = np.broadcast_to(m, lead[:-1] + m.shape[-3:])
            batch = folded[0]
        m = m.reshape((batch or 1, heads or 1) + m.shape[-2:])  # (B'|1, H'|1, Lq|1, Lk|1)
        parts.append(boolean_mask(m))
    described = parts[0] if len(parts) == 1 else and_masks(*parts)
    return create_block_mask(described, batch, heads, seq_q, seq_k)

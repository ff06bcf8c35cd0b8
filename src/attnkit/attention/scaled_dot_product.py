"""``ScaledDotProductAttention``: the Transformer's attention head, ``softmax(q k^T / sqrt(d)) v``."""
from __future__ import annotations

import numpy as np

from .. import kernels as _kernels
from .._validation import as_bool_mask, as_float_array, check_mask, check_qkv, returns_input_precision
from ..core.base_attention import BaseAttention
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
        Score multiplier; default ``1 / sqrt(Dk)``.
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
        if scale is not None and not np.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale!r}")
        self.dropout = float(dropout)
        self.scale = None if scale is None else float(scale)
        self.is_causal = bool(is_causal)
        self._rng = as_generator(seed)  # draws one dropout seed per forward

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, scale={self.scale}, is_causal={self.is_causal}"

    @returns_input_precision
    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                is_causal: bool = False, need_weights: bool = True):
        """Attend; see the class docstring for shapes. Saves the kernel context for :meth:`backward`.

        With ``need_weights=False`` the tiled kernel runs (no ``Lq x Lk`` array is allocated) and the
        weights come back as ``None``.
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
                bias, need_weights: bool):
        """Run the kernel on checked inputs (subclasses add their ``bias`` here) and save its context for backward."""
        p = self.dropout if self.training else 0.0
        seed = int(self._rng.integers(2**63)) if p > 0 else None
        out, weights, ctx = _kernels.attention_forward(
            q, k, v, mask=mask, causal=self.is_causal or is_causal, scale=self.scale, bias=bias, dropout_p=p,
            dropout_seed=seed, need_weights=need_weights)  # (..., Lq, Dv), (..., Lq, Lk) or None
        self.save_for_backward(ctx, out.shape)
        # The kernel's context holds the weights (reference) or the output (tiled) for backward: the caller
        # gets copies, so editing them cannot change the gradients.
        return out.copy(), (None if weights is None else weights.copy())

    @returns_input_precision
    def backward(self, grad_output: np.ndarray):
        """Return ``(grad_q, grad_k, grad_v)`` for the last forward (a bias's parameters get theirs too)."""
        if self.saved_tensors is None:
            raise RuntimeError(f"{type(self).__name__}.backward called before forward")
        ctx, out_shape = self.saved_tensors
        g = as_float_array(grad_output, "grad_output")
        if g.shape != out_shape:
            raise ValueError(f"grad_output has shape {g.shape}, expected the output shape {out_shape}")
        dq, dk, dv, _ = _kernels.attention_backward(g.astype(ctx.q.dtype, copy=False), ctx)
        return dq, dk, dv

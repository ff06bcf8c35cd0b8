"""``ScaledDotProductAttention``: the Transformer's attention head, ``softmax(q k^T / sqrt(d)) v``."""
from __future__ import annotations

import numpy as np

from ..core.base_attention import BaseAttention
from ..kernels import reference as _ref

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
        self._rng = np.random.default_rng(seed)
        self._ctx = None

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, scale={self.scale}, is_causal={self.is_causal}"

    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                is_causal: bool = False, need_weights: bool = True):
        """Attend; see the class docstring for shapes. Caches the kernel context for :meth:`backward`."""
        p = self.dropout if self.training else 0.0
        seed = int(self._rng.integers(2**63)) if p > 0 else None
        out, weights, self._ctx = _ref.attention_forward(
            q, k, v, mask=mask, causal=self.is_causal or is_causal, scale=self.scale, dropout_p=p,
            dropout_seed=seed)
        return out, (weights if need_weights else None)

    def backward(self, grad_output: np.ndarray):
        """Return ``(grad_q, grad_k, grad_v)`` for the last forward."""
        if self._ctx is None:
            raise RuntimeError("backward called before forward")
        dq, dk, dv, _ = _ref.attention_backward(grad_output, self._ctx)
        return dq, dk, dv

"""``CausalAttention``: scaled dot-product attention that never looks at future keys."""
from __future__ import annotations

import numpy as np

from .._validation import returns_input_precision
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["CausalAttention"]


class CausalAttention(ScaledDotProductAttention):
    """Scaled dot-product attention with the causal mask always on (for decoders / language models).

    The causal mask is bottom-right aligned: query i may attend key j iff ``j <= i + Lk - Lq``, so with a
    key/value cache (Lq < Lk) the query block ends at the last key. It is combined (AND) with any mask
    given to :meth:`forward`; ``is_causal`` passed to :meth:`forward` changes nothing.

    Parameters
    ----------
    dropout : float, default 0.0
        Dropout on the weights after the softmax, training mode only (inverted scaling).
    scale : float, optional
        Score multiplier; default ``1 / sqrt(Dk)``.
    seed : int, optional
        Seed of the dropout stream.

    Shapes
    ------
    q (..., Lq, Dk), k (..., Lk, Dk), v (..., Lk, Dv); mask bool broadcastable to (..., Lq, Lk), ``True`` =
    may attend. Returns output (..., Lq, Dv) and weights (..., Lq, Lk) (before dropout), in the inputs'
    dtype. Under ``MultiHeadAttention`` ``...`` is (B, H).

    Examples
    --------
    >>> head = CausalAttention()
    >>> x = np.ones((1, 3, 2))
    >>> out, w = head(x[:, :2], x, x)  # Lq = 2 < Lk = 3: query 0 sees keys 0 and 1
    >>> w
    array([[[0.5       , 0.5       , 0.        ],
            [0.33333333, 0.33333333, 0.33333333]]])
    """

    def __init__(self, dropout: float = 0.0, scale: float | None = None, seed: int | None = None) -> None:
        super().__init__(dropout=dropout, scale=scale, is_causal=True, seed=seed)

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, scale={self.scale}"

    @returns_input_precision
    def forward(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None = None, *,
                is_causal: bool = False, need_weights: bool = True):
        """Attend with the causal mask (AND ``mask``); see the class docstring for shapes."""
        return super().forward(q, k, v, mask, is_causal=True, need_weights=need_weights)

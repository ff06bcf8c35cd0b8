"""``Attention``: scaled dot-product attention that reads padding masks of shape (B, Lk), 0/1 masks and a future mask.

Dimension letters: B batch, Lq/Lk query/key length, Dq/Dk query/key features (Dq == Dk required), Dv value
features, ``...`` any leading dims (e.g. (B, H) under ``MultiHeadAttention``).

"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._aliases import alias_property
from .._validation import as_bool_mask, check_mask, check_qkv, returns_input_precision
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["Attention"]


class Attention(ScaledDotProductAttention):
    """Attention ``softmax(q k^T * scale) v`` with custom and future masks, for self- and cross-attention.

    A :class:`ScaledDotProductAttention` (hence a ``BaseAttention``, usable as the head of
    ``MultiHeadAttention``) that also reads 3-D inputs' masks by shape: (B, Lk) and (B, 1, Lk) key padding,
    (B, Lq, Lk) per query and key, as booleans or 0/1 integers.

    Parameters
    ----------
    dropout : float, default 0.0
        Dropout on the attention weights after the softmax, training mode only (inverted scaling).
    future_mask : bool, default False
        Always combine the mask with the future (causal) mask, bottom-right aligned: query i sees key j iff
        ``j <= i + Lk - Lq`` (the query block ends at the last key, as in incremental decoding). The
        per-call ``is_causal=True`` does the same for one call.
    scale : float, optional
        Score multiplier; default ``1 / sqrt(Dk)``.
    seed : int, optional
        Seed of the dropout stream.

    Shapes
    ------
    q : (B, Lq, Dq), k : (B, Lk, Dk), v : (B, Lk, Dv); more generally (..., L, D) with leading dims that
        broadcast. ``Dq`` must equal ``Dk``: a dot product needs equal sizes, so a mismatch raises a
        ``ValueError`` rather than adding a hidden projection (use :class:`AdditiveAttention`, whose
        learnable ``W_q``/``W_k`` take different sizes, or project q or k first).
    mask : boolean, or integer 0/1 (this module only), ``True``/1 = may attend, ``False``/0 = masked (the
        opposite of ``torch.nn.MultiheadAttention``'s boolean masks; the same as
        ``torch.nn.functional.scaled_dot_product_attention``). For 3-D inputs, the shapes are read as:

        - ``(B, Lk)``: key padding. A 2-D mask is **always** read as ``(B, Lk)``, even when ``B == Lq``
          would also let it pass as ``(Lq, Lk)``; any other 2-D shape is refused. Give a mask shared by
          the batch as ``mask[None]`` of shape (1, Lq, Lk), and a per-query mask as ``(B, Lq, 1)``.
        - ``(B, 1, Lk)``: key padding, broadcast over queries.
        - ``(B, Lq, Lk)``: a mask per query and key (a 1 may stand for any dim, e.g. (1, Lq, Lk)).

        For inputs of any other rank (e.g. (B, H, L, Dh) heads inside ``MultiHeadAttention``) the mask
        broadcasts against the scores (..., Lq, Lk) by numpy's rules, without enlarging them.
    output : (B, Lq, Dv) (generally (..., Lq, Dv)), in the inputs' common float dtype.
    weights : (B, Lq, Lk), the softmax before dropout. A query whose mask allows no key gets zero
        weights and a zero output (torch gives NaN there).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 5, 6))
    >>> attn = Attention(future_mask=True)
    >>> pad = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])  # (B, Lk), 0 = padding
    >>> out, w = attn(q, k, v, mask=pad)
    >>> out.shape, w.shape
    ((2, 3, 6), (2, 3, 5))
    >>> w[0] > 0  # query i sees keys j <= i + Lk - Lq = i + 2, minus the padded key 4
    array([[ True,  True,  True, False, False],
           [ True,  True,  True,  True, False],
           [ True,  True,  True,  True, False]])
    >>> grad_q, grad_k, grad_v = attn.backward(np.ones_like(out))
    >>> grad_k.shape
    (2, 5, 4)
    """

    def __init__(self, dropout: float = 0.0, future_mask: bool = False, scale: float | None = None,
                 seed: int | None = None) -> None:
        super().__init__(dropout=dropout, scale=scale, is_causal=future_mask, seed=seed)

    future_mask = alias_property("Attention", "future_mask")

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, future_mask={self.is_causal}, scale={self.scale}"

    @returns_input_precision
    def forward(self, q: Any, k: Any, v: Any, mask: Any = None, *, is_causal: bool = False,
                need_weights: bool = True):
        """Attend; returns ``(output (B, Lq, Dv), weights (B, Lq, Lk) or None)``. See the class docstring."""
        q, k, v, lead = check_qkv(q, k, v, "Attention")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(f"Attention: q has {q.shape[-1]} features but k has {k.shape[-1]} (q: {q.shape}, "
                             f"k: {k.shape}); dot-product attention needs d_q == d_k: project one of them or "
                             f"use AdditiveAttention")
        mask = self._read_mask(as_bool_mask(mask, "mask", allow_int=True), q, k, lead)
        return self._attend(q, k, v, mask, is_causal, None, need_weights)

    @staticmethod
    def _read_mask(mask: np.ndarray | None, q: np.ndarray, k: np.ndarray, lead: tuple[int, ...]):
        """(B, Lk), (B, 1, Lk) or (B, Lq, Lk) for 3-D inputs; plain broadcasting against (..., Lq, Lk) otherwise."""
        if mask is None:
            return None
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        if q.ndim != 3:
            return check_mask(mask, "mask", lead + (seq_q, seq_k), "(..., seq_q, seq_k) scores")
        batch = lead[0]
        if mask.ndim == 2:
            if mask.shape != (batch, seq_k):
                raise ValueError(
                    f"mask of shape {mask.shape}: a 2-D mask is read as a (batch, seq_k) = {(batch, seq_k)} key "
                    f"padding mask; give a (seq_q, seq_k) mask as mask[None] (1, seq_q, seq_k) and a "
                    f"per-query mask as (batch, seq_q, 1)")
            return mask[:, None, :]  # (B, 1, Lk)
        if mask.ndim == 3:
            return check_mask(mask, "mask", (batch, seq_q, seq_k), "(batch, seq_q, seq_k) scores")
        raise ValueError(f"mask of shape {mask.shape} for 3-D inputs must be (batch, seq_k), (batch, 1, seq_k) "
                         f"or (batch, seq_q, seq_k) = {(batch, seq_q, seq_k)}")

"""``Attention``: the seed-004 scaled dot-product module, with its mask shapes and a future mask.

Dimension letters: B batch, Lq/Lk query/key length, Dq/Dk query/key features (Dq == Dk required), Dv value
features, ``...`` any leading dims (e.g. (B, H) under ``MultiHeadAttention``).

This file also holds :func:`check_qkv` and :func:`as_bool_mask`, the input checks the parametrised heads of
this package (additive, learned-bias, physics-guided) share.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_float_array, check_mask, common_float_dtype
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["Attention", "check_qkv", "as_bool_mask"]


def check_qkv(q: Any, k: Any, v: Any, owner: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...]]:
    """Convert and check the ``(q, k, v)`` of an attention head.

    Converts to floating arrays of one common dtype (ints become float64; the caller's arrays are never
    modified) and checks the ranks, that keys and values have the same length and that the leading dims
    broadcast. Feature sizes are the caller's business (dot-product and additive heads differ).

    Parameters
    ----------
    q, k, v : array_like, shapes (..., Lq, Dq), (..., Lk, Dk), (..., Lk, Dv)
    owner : str
        Name of the calling head, used in error messages.

    Returns
    -------
    q, k, v : ndarrays of the common float dtype
    lead : tuple of int
        The broadcast leading shape ``...`` of the scores (..., Lq, Lk).

    Raises
    ------
    TypeError
        Non-numeric input.
    ValueError
        Fewer than 2 dims, different ranks, Lk of k and v differ, leading dims that do not broadcast.
    """
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{owner}: {name} must be at least 2-D (..., seq, features), got shape {x.shape}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"{owner}: q, k and v must have the same number of dimensions, got shapes "
                         f"q: {q.shape}, k: {k.shape}, v: {v.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{owner}: k has length {k.shape[-2]} but v has length {v.shape[-2]} "
                         f"(k: {k.shape}, v: {v.shape})")
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(f"{owner}: the leading (batch/head) dims of q, k and v do not broadcast "
                         f"(q: {q.shape}, k: {k.shape}, v: {v.shape})") from None
    dtype = common_float_dtype(q, k, v)
    q, k, v = (x.astype(dtype, copy=False) for x in (q, k, v))
    return q, k, v, tuple(lead)


def as_bool_mask(mask: Any, name: str = "mask", allow_int: bool = False) -> np.ndarray | None:
    """``mask`` as a boolean array (``True`` = may attend); ``None`` passes through.

    With ``allow_int`` an integer array of 0s and 1s is accepted too (1 = may attend, 0 = masked), as seed
    004 writes masks; any other value, and floating masks (easily confused with additive biases), are refused.
    """
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype == np.bool_:
        return m
    if allow_int and m.dtype.kind in "iu":
        if not np.all((m == 0) | (m == 1)):
            raise ValueError(f"{name} holds integers other than 0 and 1 (shape {m.shape}); 1 = may attend, "
                             f"0 = masked")
        return m.astype(bool)
    accepted = "boolean or a 0/1 integer array" if allow_int else "boolean"
    raise TypeError(f"{name} must be {accepted} (True = may attend), got dtype {m.dtype} with shape {m.shape}")


class Attention(ScaledDotProductAttention):
    """Seed-004 attention: ``softmax(q k^T * scale) v`` with custom and future masks.

    A :class:`ScaledDotProductAttention` (hence a ``BaseAttention``, usable as the head of
    ``MultiHeadAttention``) that also checks its inputs and reads the seed-004 mask shapes.

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
        ``torch.nn.functional.scaled_dot_product_attention``). For 3-D inputs, the seed-004 shapes:

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
        self._out_shape: tuple[int, ...] | None = None

    @property
    def future_mask(self) -> bool:
        """Whether the future (causal) mask is always applied (the ``is_causal`` attribute)."""
        return self.is_causal

    def extra_repr(self) -> str:
        return f"dropout={self.dropout}, future_mask={self.is_causal}, scale={self.scale}"

    def forward(self, q: Any, k: Any, v: Any, mask: Any = None, *, is_causal: bool = False,
                need_weights: bool = True):
        """Attend; returns ``(output (B, Lq, Dv), weights (B, Lq, Lk) or None)``. See the class docstring."""
        q, k, v, lead = check_qkv(q, k, v, "Attention")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(f"Attention: q has {q.shape[-1]} features but k has {k.shape[-1]} (q: {q.shape}, "
                             f"k: {k.shape}); dot-product attention needs d_q == d_k: project one of them or "
                             f"use AdditiveAttention")
        mask = self._read_mask(as_bool_mask(mask, "mask", allow_int=True), q, k, lead)
        out, weights = super().forward(q, k, v, mask, is_causal=is_causal, need_weights=need_weights)
        self._out_shape = out.shape
        return out, weights

    def backward(self, grad_output: Any):
        """Return ``(grad_q, grad_k, grad_v)``, shaped like the last forward's q, k, v."""
        if self._out_shape is None:
            raise RuntimeError("Attention.backward called before forward")
        g = as_float_array(grad_output, "grad_output")
        if g.shape != self._out_shape:
            raise ValueError(f"grad_output has shape {g.shape}, expected the output shape {self._out_shape}")
        return super().backward(g.astype(self._ctx.q.dtype, copy=False))

    @staticmethod
    def _read_mask(mask: np.ndarray | None, q: np.ndarray, k: np.ndarray, lead: tuple[int, ...]):
        """Seed-004 reading for 3-D inputs, plain broadcasting against (..., Lq, Lk) otherwise."""
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

"""The reference kernel of flex attention: the whole modified, masked score matrix, its softmax and its gradient.

``out = softmax([mod(scale * q k^T) masked, sink]) v`` where ``sink`` is an optional per-head logit that
joins every row's softmax and carries no value. Dimension letters: B batch, H query heads, Hkv key/value
heads (grouped-query attention: each serves G = H / Hkv query heads, which read it without a copy: the G
query rows of a key/value head are stacked into one (G*Lq)-row product), Lq/Lk lengths, D/Dv features.

``score_mod`` has ``forward(s, b, h, q_idx, kv_idx)`` and ``backward(g, s, b, h, q_idx, kv_idx)``;
``mask`` is a boolean array broadcastable to (B, H, Lq, Lk) (``True`` = may attend). This kernel forms the
weights; the tiled kernel (:mod:`attnkit.kernels.tiled`) takes the same description tile by tile.

A NaN or inf in K or V at a key a query may not see never reaches that query: masked probabilities are
exactly 0, and ``0 * NaN`` is kept at 0 (forward and backward).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._masked_product import nonfinite_rows, zero_safe_matmul

__all__ = ["FlexContext", "flex_forward", "flex_backward", "score_index", "checked_scores"]


@dataclasses.dataclass
class FlexContext:
    """What the backward needs: inputs, output, log-sum-exp (B, H, Lq), weights and the description."""

    q: np.ndarray  # (B, H, Lq, D)
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    out: np.ndarray  # (B, H, Lq, Dv)
    lse: np.ndarray  # (B, H, Lq), -inf for a row with nothing to attend to
    weights: np.ndarray  # (B, H, Lq, Lk)
    scale: float
    score_mod: object
    mask: np.ndarray | None
    sinks: np.ndarray | None


def _stack(x: np.ndarray, kv_heads: int) -> np.ndarray:
    """(B, H, T, F) -> (B, Hkv, G*T, F): each key/value head's G query heads as one block of rows."""
    b, h, t, f = x.shape
    group = h // kv_heads if kv_heads else 1  # no heads (H = Hkv = 0): nothing to stack
    return x.reshape(b, kv_heads, group * t, f)


def _unstack(x: np.ndarray, heads: int, rows: int) -> np.ndarray:
    """(B, Hkv, G*T, F) -> (B, H, T, F) with T = ``rows``, the inverse of :func:`_stack`."""
    return x.reshape(x.shape[0], heads, rows, x.shape[-1])


def score_index(batch: int, heads: int, q0: int, q1: int, k0: int, k1: int):
    """``(b, h, q_idx, kv_idx)`` of the score tile ``[q0:q1, k0:k1]``: integer arrays broadcastable against
    (B, H, Tq, Tk), what score and mask modifiers are called with."""
    return (np.arange(batch).reshape(-1, 1, 1, 1), np.arange(heads).reshape(1, -1, 1, 1),
            np.arange(q0, q1).reshape(1, 1, -1, 1), np.arange(k0, k1).reshape(1, 1, 1, -1))


def checked_scores(result, shape: tuple[int, ...], name: str = "score_mod") -> np.ndarray:
    """What a score modifier's forward (or backward, ``name`` ``"score_mod.backward"``) returned, as an array,
    checked to be real numbers of the scores' ``shape`` (B, H, Tq, Tk).

    Both kernels call modifiers on arrays of that shape and read the result back element for element: a
    result of another shape (a transposed tile, a scalar, a row) would otherwise be broadcast or reshaped
    into scores it does not describe.

    Raises
    ------
    TypeError
        If the result is not real numbers (None, strings, booleans, complex).
    ValueError
        If its shape is not ``shape``, naming both.
    """
    arr = np.asarray(result)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must return real numbers, got {type(result).__name__} of dtype {arr.dtype}")
    if arr.shape != tuple(shape):
        got = f"{arr.shape} (a scalar)" if arr.ndim == 0 else f"{arr.shape}"
        raise ValueError(f"{name} returned shape {got} for scores of shape {tuple(shape)}: it must return "
                         "an array of the shape of the scores it was given")
    return arr


def _masked_bad(bad: np.ndarray | None, mask) -> bool:
    """True when a masked entry meets a key row with a NaN or inf (``bad`` (Lk,) or None)."""
    return mask is not None and bad is not None and bool(bad.any())


def _scores(q, k, scale, score_mod, mask):
    """Modified, masked scores (B, H, Lq, Lk), the raw scaled scores (the modifier's input) and the keep mask."""
    B, H, Lq = q.shape[:3]
    raw = _unstack(_stack(q, k.shape[1]) @ k.swapaxes(-1, -2), H, Lq)  # (B, H, Lq, Lk)
    raw *= raw.dtype.type(scale)
    s = raw
    if score_mod is not None:
        # the modifier's dtype may be wider than the scores' (a float64 parameter): compute in the scores'
        s = checked_scores(score_mod.forward(raw, *score_index(B, H, 0, Lq, 0, k.shape[2])), raw.shape)
        s = s.astype(raw.dtype, copy=False)
    keep = None if mask is None else np.broadcast_to(mask, s.shape)  # (B, H, Lq, Lk)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    elif s is raw and score_mod is not None:
        s = s.copy()  # the modifier's backward reads the raw scores
    return s, raw, keep


def flex_forward(q, k, v, *, scale, score_mod=None, mask=None, sinks=None):
    """Forward pass; returns ``(out (B, H, Lq, Dv), lse (B, H, Lq), weights (B, H, Lq, Lk), ctx)``.

    A row with nothing to attend to (and no sink) gets zero weights, a zero output and ``lse = -inf``; a row
    whose scores hold a NaN stays NaN, as in the other kernels.
    """
    H = q.shape[1]
    dtype = q.dtype
    s, _, keep = _scores(q, k, scale, score_mod, mask)  # (B, H, Lq, Lk)
    m = s.max(axis=-1, initial=-np.inf)  # (B, H, Lq); no key (Lk = 0): -inf, as a fully masked row
    sink = None if sinks is None else sinks.astype(dtype).reshape(1, H, 1)  # (1, H, 1)
    if sink is not None:
        m = np.maximum(m, sink)
    safe = np.where(np.isfinite(m), m, 0)  # (B, H, Lq)
    p = np.exp(s - safe[..., None])  # (B, H, Lq, Lk)
    denom = p.sum(axis=-1)  # (B, H, Lq)
    if sink is not None:
        denom = denom + np.exp(sink - safe)
    live = denom != 0  # a row that saw a NaN has a NaN sum: it stays NaN
    weights = p / np.where(live, denom, 1)[..., None]  # (B, H, Lq, Lk)
    weights[~live] = 0
    product = zero_safe_matmul if _masked_bad(nonfinite_rows(v), keep) else np.matmul
    out = _unstack(product(_stack(weights, v.shape[1]), v), H, q.shape[2])  # (B, H, Lq, Dv)
    lse = np.where(live, safe + np.log(np.where(live, denom, 1)), -np.inf).astype(dtype)  # (B, H, Lq)
    ctx = FlexContext(q, k, v, out, lse, weights, scale, score_mod, keep, sinks)
    return out.copy(), lse, weights.copy(), ctx


def flex_backward(grad_out, ctx: FlexContext):
    """Returns ``(dq, dk, dv, dsinks or None)``; modifier parameter gradients go into ``score_mod.grads``."""
    q, k, v, p = ctx.q, ctx.k, ctx.v, ctx.weights
    B, H, Lq, _ = q.shape
    hkv, Lk = k.shape[1], k.shape[2]
    grad_out = grad_out.astype(q.dtype, copy=False)
    delta = (grad_out * ctx.out).sum(axis=-1)  # (B, H, Lq)
    keep = ctx.mask
    g_stacked = _stack(grad_out, hkv)  # (B, Hkv, G*Lq, Dv)
    dv = _stack(p, hkv).swapaxes(-1, -2) @ g_stacked  # (B, Hkv, Lk, Dv): summed over each group
    ds = p * (_unstack(g_stacked @ v.swapaxes(-1, -2), H, Lq) - delta[..., None])  # (B, H, Lq, Lk)
    bad_k, bad_v = nonfinite_rows(k), nonfinite_rows(v)  # (Lk,) or None each
    if _masked_bad(bad_v, keep):
        ds = np.where(keep, ds, 0)  # masked: p = 0, but g . v is NaN where v is
    if ctx.score_mod is not None:
        _, raw, _ = _scores(q, k, ctx.scale, None, None)  # (B, H, Lq, Lk)
        if _masked_bad(bad_k, keep):
            raw = np.where(keep, raw, 0)  # a modifier's gradient must not read masked NaN scores
        ds = checked_scores(ctx.score_mod.backward(ds, raw, *score_index(B, H, 0, Lq, 0, Lk)), ds.shape,
                            "score_mod.backward")
        if keep is not None:
            ds = np.where(keep, ds, 0)
    ds = ds * ctx.scale
    product = zero_safe_matmul if _masked_bad(bad_k, keep) else np.matmul
    ds_stacked = _stack(ds, hkv)  # (B, Hkv, G*Lq, Lk)
    dq = _unstack(product(ds_stacked, k), H, Lq)  # (B, H, Lq, D)
    dk = ds_stacked.swapaxes(-1, -2) @ _stack(q, hkv)  # (B, Hkv, Lk, D)
    dsinks = None
    if ctx.sinks is not None:
        lse = np.where(np.isneginf(ctx.lse), np.inf, ctx.lse)  # (B, H, Lq)
        p_sink = np.exp(ctx.sinks.astype(q.dtype).reshape(1, H, 1) - lse)  # (B, H, Lq)
        dsinks = -(p_sink * delta).sum(axis=(0, 2))  # (H,)
    return dq, dk, dv, dsinks

"""Reference attention kernels: the full ``Lq x Lk`` score matrix, materialised.

These are the unchecked compute functions behind the public API (callers validate first). They are the
path used whenever attention weights are asked for, and the yardstick the tiled kernel is tested against.

Dimension letters: ``...`` leading batch/head dims (broadcast between q, k and v), Lq/Lk query/key
length, D query/key features, Dv value features. Masks are boolean, ``True`` = may attend.

Grouped-query attention is broadcasting: q ``(B, Hkv, G, Lq, D)`` against k/v ``(B, Hkv, 1, Lk, D)``; the
size-1 group axis of k/v is never expanded in memory, and their gradients are summed over the group.
A sliding window ``W`` (with causal masking) lets query i, at bottom-right-aligned position
``i' = i + Lk - Lq``, attend key j iff ``i' - W < j <= i'``: W keys, itself included.

Masked softmax semantics: entries whose mask is False get weight exactly 0; a row whose mask allows no
key gets all-zero weights, hence zero output and zero gradient, never NaN. A row is "fully masked"
because of the mask, never because of its values: finite logits of -1e5 still get a proper softmax.
A NaN or inf at a key a query may not see never reaches that query (``0 * NaN`` is kept at 0 where a
weight is masked), forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._validation import check_positive_int, unbroadcast
from ._masked_product import nonfinite_rows, zero_safe_matmul
from .dropout import keep_mask
from .flex import checked_scores, score_index

__all__ = [
    "causal_mask",
    "window_mask",
    "combine_causal",
    "masked_softmax",
    "softmax_backward",
    "live_keys",
    "zero_dead_keys",
    "AttentionContext",
    "attention_forward",
    "attention_backward",
    "attention_backward_arrays",
    "additive_forward",
    "additive_backward",
]


def causal_mask(seq_q: int, seq_k: int) -> np.ndarray:
    """Bottom-right-aligned causal mask ``(Lq, Lk)``: query i may attend key j iff ``j <= i + Lk - Lq``.

    With ``Lq == Lk`` this is the usual lower-triangular mask; with ``Lq < Lk`` the query block ends at the
    last key, as in incremental decoding with a key/value cache.
    """
    q = np.arange(seq_q)[:, None]  # (Lq, 1)
    k = np.arange(seq_k)[None, :]  # (1, Lk)
    return k <= q + (seq_k - seq_q)  # (Lq, Lk)


def window_mask(seq_q: int, seq_k: int, window: int) -> np.ndarray:
    """Bottom-right-aligned sliding-window causal mask ``(Lq, Lk)``.

    Query i, at position ``i' = i + Lk - Lq``, may attend key j iff ``i' - window < j <= i'``.

    >>> window_mask(4, 4, 2).astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    pos = np.arange(seq_q)[:, None] + (seq_k - seq_q)  # (Lq, 1)
    k = np.arange(seq_k)[None, :]  # (1, Lk)
    return (k <= pos) & (k > pos - window)  # (Lq, Lk)


def masked_softmax(scores: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Stable softmax over the last axis with masked entries at exactly zero.

    Parameters
    ----------
    scores : ndarray, shape (..., Lq, Lk)
    mask : ndarray of bool broadcastable to ``scores``, optional

    Returns
    -------
    ndarray, shape (..., Lq, Lk)
        Rows sum to 1 where at least one key is allowed, and are all zero where none is.
    """
    if scores.shape[-1] == 0:
        return np.zeros_like(scores)
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)  # (..., Lq, Lk)
    row_max = scores.max(axis=-1, keepdims=True)  # (..., Lq, 1)
    if mask is not None:
        # A row with no allowed key has max -inf; any finite shift keeps exp() at 0 there instead of NaN.
        row_max = np.where(np.isneginf(row_max), 0.0, row_max)
    e = scores - row_max  # (..., Lq, Lk), a fresh array: exp and the division work in it
    np.exp(e, out=e)
    denom = e.sum(axis=-1, keepdims=True)  # (..., Lq, 1)
    if mask is not None:
        denom = np.where(denom == 0, 1.0, denom)
    e /= denom
    return e


def softmax_backward(grad_weights: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Gradient of the scores from the gradient of ``weights = softmax(scores)`` (last axis).

    ``dS = W * (dW - sum(dW * W))``: rows of zero weights (fully masked) get zero gradient.
    """
    inner = (grad_weights * weights).sum(axis=-1, keepdims=True)  # (..., Lq, 1)
    return weights * (grad_weights - inner)  # (..., Lq, Lk)


def live_keys(mask: np.ndarray | None, key_shape: tuple[int, ...] | None = None) -> np.ndarray | None:
    """(..., Lk) bool: keys at least one query may attend to (``None`` without a mask).

    With ``key_shape`` (the shape of k, ``(..., Lk, D)``), leading axes along which k broadcasts (the
    group axis of grouped-query attention) are reduced too: a shared key is live if any query of any
    group member sees it, so zeroing dead keys never expands k to the queries' leading shape.
    """
    if mask is None:
        return None
    live = np.atleast_2d(mask).any(axis=-2)  # (..., Lk)
    if key_shape is None:
        return live
    lead = tuple(key_shape[:-2])
    extra = live.ndim - 1 - len(lead)
    if extra > 0:
        live = live.any(axis=tuple(range(extra)))  # (*lead', Lk)
    axes = tuple(i for i, n in enumerate(lead[len(lead) - (live.ndim - 1):])
                 if n == 1 and live.shape[i] != 1)
    return live.any(axis=axes, keepdims=True) if axes else live  # (..., Lk)


def zero_dead_keys(x: np.ndarray, live: np.ndarray | None) -> np.ndarray:
    """Zero the key/value rows no query may attend to, so garbage (NaN, Inf) in padding cannot leak.

    ``live`` has shape (..., Lk); ``x`` has shape (..., Lk, F). Exact for finite inputs: a dead row has
    zero weight everywhere, so it contributes nothing to outputs or gradients either way.
    """
    if live is None or live.all():
        return x
    return np.where(live[..., None], x, 0)  # (..., Lk, F)


@dataclass
class AttentionContext:
    """What :func:`attention_backward` needs from the reference forward, and nothing else."""

    q: np.ndarray  # (..., Lq, D)
    k: np.ndarray  # (..., Lk, D), dead keys zeroed
    v: np.ndarray  # (..., Lk, Dv), dead keys zeroed
    weights: np.ndarray  # (..., Lq, Lk), before dropout
    scale: float
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    keep_scaled: np.ndarray | None = None  # (..., Lq, Lk) keep / (1 - p), or None without dropout
    bias: np.ndarray | None = None
    score_mod: object = None
    raw: np.ndarray | None = None  # (..., Lq, Lk) the score modifier's input scores (only with a modifier)
    mask: np.ndarray | None = None  # broadcastable to (..., Lq, Lk) (only with a modifier)


def combine_causal(mask: np.ndarray | None, causal: bool, seq_q: int, seq_k: int,
                   window: int | None = None) -> np.ndarray | None:
    """``mask`` AND the bottom-right-aligned causal (or sliding-window) mask; ``None`` if neither.

    ``window`` (only with ``causal``) keeps the last ``window`` keys up to each query's position.
    """
    if window is not None and not causal:
        raise ValueError(f"window={window} requires causal=True")
    if window is not None:
        window = check_positive_int(window, "window")
    if causal and seq_q == 1 and seq_k >= 1 and (window is None or window >= seq_k):
        return mask  # one query at the last position sees every key (a decoding step): nothing to mask
    if causal:
        c = causal_mask(seq_q, seq_k) if window is None else window_mask(seq_q, seq_k, window)  # (Lq, Lk)
        return c if mask is None else (mask & c)
    return mask


def _as_heads(scores: np.ndarray) -> np.ndarray:
    """(B, ..., Lq, Lk) scores as (B, H, Lq, Lk), the shape score modifiers see (a view)."""
    if scores.ndim < 4:
        raise ValueError(f"a score modifier needs (B, H, Lq, Lk) scores (batch and head dims), got shape "
                         f"{scores.shape}")
    return scores.reshape(scores.shape[0], -1, *scores.shape[-2:])


def _modified(score_mod, scores: np.ndarray) -> np.ndarray:
    """``score_mod`` on the whole (..., Lq, Lk) score matrix, in the scores' shape and dtype."""
    heads = _as_heads(scores)  # (B, H, Lq, Lk)
    changed = checked_scores(score_mod.forward(heads, *score_index(*heads.shape[:2], 0, heads.shape[2], 0,
                                                                    heads.shape[3])), heads.shape)
    return changed.reshape(scores.shape).astype(scores.dtype, copy=False)  # (..., Lq, Lk)


def _modifier_backward(ctx: AttentionContext, ds: np.ndarray) -> np.ndarray:
    """The score gradient through the score modifier (its parameters get theirs); masked entries stay 0."""
    heads = _as_heads(ds)  # (B, H, Lq, Lk)
    index = score_index(*heads.shape[:2], 0, heads.shape[2], 0, heads.shape[3])
    grad = checked_scores(ctx.score_mod.backward(heads, _as_heads(ctx.raw), *index), heads.shape,
                          "score_mod.backward").reshape(ds.shape)  # (..., Lq, Lk)
    return grad if ctx.mask is None else np.where(ctx.mask, grad, 0)


def attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                      causal: bool = False, scale: float | None = None,
                      bias: np.ndarray | None = None, dropout_p: float = 0.0,
                      dropout_seed: int | None = None, window: int | None = None,
                      score_mod=None) -> tuple[np.ndarray, np.ndarray, AttentionContext]:
    """Softmax attention with the score matrix materialised.

    Parameters
    ----------
    q : ndarray, shape (..., Lq, D)
    k : ndarray, shape (..., Lk, D)
        Leading dims broadcast against q's: grouped-query attention passes q ``(B, Hkv, G, Lq, D)`` and
        k ``(B, Hkv, 1, Lk, D)``.
    v : ndarray, shape (..., Lk, Dv)
    mask : ndarray of bool, broadcastable to (..., Lq, Lk), optional
        ``True`` = may attend.
    causal : bool
        Combine with the bottom-right-aligned causal mask.
    scale : float, optional
        Multiplier of ``q @ k.T``; default ``1 / sqrt(D)``.
    bias : ndarray broadcastable to (..., Lq, Lk), optional
        Added to the scaled scores before masking.
    dropout_p : float
        Probability of dropping a weight after the softmax (inverted scaling); 0 disables dropout.
    dropout_seed : int, optional
        Seed of the counter-based dropout mask (required when ``dropout_p > 0``).
    window : int, optional
        Sliding window (requires ``causal``): query i at position ``i' = i + Lk - Lq`` attends key j iff
        ``i' - window < j <= i'``.
    score_mod : ScoreMod, optional
        ``forward(s, b, h, q_idx, kv_idx)`` and ``backward(g, s, b, h, q_idx, kv_idx)`` (see
        :mod:`attnkit.flex`) on the (biased) scores seen as (B, H, Lq, Lk): at least two leading dims, the
        first the batch, the rest the heads (``(B, Hkv, G)`` are ``H = Hkv * G`` heads).

    Returns
    -------
    out : ndarray, shape (..., Lq, Dv)
    weights : ndarray, shape (..., Lq, Lk)
        Softmax weights before dropout (the caller's own copy: editing it does not change gradients).
    ctx : AttentionContext

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((1, 2, 3, 5, 4))  # (B, Hkv, G, Lq, D): three query heads per key head
    >>> k, v = rng.standard_normal((2, 1, 2, 1, 5, 4))  # (B, Hkv, 1, Lk, D)
    >>> out, w, ctx = attention_forward(q, k, v, causal=True, window=2)
    >>> out.shape, int((w[0, 0, 0] > 0).sum(axis=-1).max())
    ((1, 2, 3, 5, 4), 2)
    """
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)  # a Python float keeps float32 float32
    mask = combine_causal(mask, causal, seq_q, seq_k, window)
    k_safe = zero_dead_keys(k, live_keys(mask, k.shape))  # (..., Lk, D)
    v_safe = zero_dead_keys(v, live_keys(mask, v.shape))  # (..., Lk, Dv)
    scores = (q @ k_safe.swapaxes(-1, -2)) * scale  # (..., Lq, Lk)
    if bias is not None:
        scores = scores + bias  # (..., Lq, Lk)
    scores = scores.astype(q.dtype, copy=False)
    raw = None
    if score_mod is not None:
        raw, scores = scores, _modified(score_mod, scores)  # (..., Lq, Lk) each
    weights = masked_softmax(scores, mask)  # (..., Lq, Lk)
    keep_scaled = None
    if dropout_p > 0.0:
        if dropout_seed is None:
            raise ValueError("dropout_seed is required when dropout_p > 0")
        keep = keep_mask(dropout_seed, dropout_p, weights.shape[:-2], np.arange(seq_q), np.arange(seq_k),
                         seq_q, seq_k)  # (..., Lq, Lk)
        keep_scaled = (keep * (1.0 / (1.0 - dropout_p))).astype(weights.dtype)
        dropped = weights * keep_scaled  # (..., Lq, Lk)
    else:
        dropped = weights
    if mask is not None and nonfinite_rows(v_safe) is not None:
        # a NaN or inf value a masked query may not see must not reach it through 0 * NaN
        out = zero_safe_matmul(dropped, v_safe)  # (..., Lq, Dv)
    else:
        out = dropped @ v_safe  # (..., Lq, Dv)
    ctx = AttentionContext(q=q, k=k_safe, v=v_safe, weights=weights, scale=scale, q_shape=q.shape,
                           k_shape=k.shape, v_shape=v.shape, keep_scaled=keep_scaled, bias=bias,
                           score_mod=score_mod, raw=raw, mask=None if score_mod is None else mask)
    return out, weights.copy(), ctx  # a copy: the caller may edit its weights, the backward reads ctx's


def attention_backward_arrays(grad_out: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                              weights: np.ndarray, scale: float, keep_scaled: np.ndarray | None = None):
    """Backward of ``out = dropout(softmax(scale * q @ k.T + bias)) @ v`` from materialised weights.

    Returns
    -------
    dq : (..., Lq, D), dk : (..., Lk, D), dv : (..., Lk, Dv), ds : (..., Lq, Lk)
        ``ds`` is the gradient of the (biased) scores, i.e. of any additive bias. Leading dims are the
        broadcast ones; reduce with :func:`attnkit._validation.unbroadcast`.
    """
    dv, ds = _value_and_score_grads(grad_out, v, weights, keep_scaled)
    dq, dk = _query_key_grads(ds, q, k, scale)
    return dq, dk, dv, ds


def _value_and_score_grads(grad_out, v, weights, keep_scaled):
    """``dv`` (..., Lk, Dv) and the gradient ``ds`` (..., Lq, Lk) of the scores the softmax read."""
    dropped = weights if keep_scaled is None else weights * keep_scaled  # (..., Lq, Lk)
    dv = dropped.swapaxes(-1, -2) @ grad_out  # (..., Lk, Dv)
    dw = grad_out @ v.swapaxes(-1, -2)  # (..., Lq, Lk)
    if keep_scaled is not None:
        dw = dw * keep_scaled
    if nonfinite_rows(v) is not None:
        # exact: a zero weight's dW never counts, and a masked entry must not turn 0 * NaN into NaN
        dw = np.where(weights != 0, dw, 0)  # (..., Lq, Lk)
    return dv, softmax_backward(dw, weights)  # (..., Lk, Dv), (..., Lq, Lk)


def _query_key_grads(ds, q, k, scale):
    """``dq`` (..., Lq, D) and ``dk`` (..., Lk, D) from the gradient of the scaled scores."""
    dq = (zero_safe_matmul(ds, k) if nonfinite_rows(k) is not None else ds @ k) * scale  # (..., Lq, D)
    dk = (ds.swapaxes(-1, -2) @ q) * scale  # (..., Lk, D)
    return dq, dk


def attention_backward(grad_out: np.ndarray, ctx: AttentionContext):
    """Gradients of :func:`attention_forward`'s output.

    Returns
    -------
    dq, dk, dv : ndarrays shaped like the forward's q, k, v
    dbias : ndarray shaped like an array ``bias``, else None (a score modifier adds into its own ``grads``)
    """
    dv, ds = _value_and_score_grads(grad_out, ctx.v, ctx.weights, ctx.keep_scaled)
    if ctx.score_mod is not None:
        ds = _modifier_backward(ctx, ds)  # (..., Lq, Lk): the gradient of the modifier's input
    dq, dk = _query_key_grads(ds, ctx.q, ctx.k, ctx.scale)
    dbias = None if ctx.bias is None else unbroadcast(ds, np.shape(ctx.bias))
    return unbroadcast(dq, ctx.q_shape), unbroadcast(dk, ctx.k_shape), unbroadcast(dv, ctx.v_shape), dbias


def additive_forward(q, k, v, w_q, w_k, w_v, mask=None):
    """Bahdanau attention: ``score(q_i, k_j) = w_v . tanh(q_i @ w_q + k_j @ w_k)``.

    Shapes: q (..., Lq, Dq), k (..., Lk, Dk), v (..., Lk, Dv), w_q (Dq, A), w_k (Dk, A), w_v (A,).

    Returns
    -------
    out : (..., Lq, Dv), weights : (..., Lq, Lk), hidden : (..., Lq, Lk, A) the tanh features backward needs
    """
    live = live_keys(mask)  # (..., Lk)
    v_safe = zero_dead_keys(v, live)  # (..., Lk, Dv)
    k_safe = zero_dead_keys(k, live)  # (..., Lk, Dk)
    hq = q @ w_q  # (..., Lq, A)
    hk = k_safe @ w_k  # (..., Lk, A)
    hidden = np.tanh(hq[..., :, None, :] + hk[..., None, :, :])  # (..., Lq, Lk, A)
    scores = hidden @ w_v  # (..., Lq, Lk)
    weights = masked_softmax(scores, mask)  # (..., Lq, Lk)
    if mask is not None and nonfinite_rows(v_safe) is not None:
        return zero_safe_matmul(weights, v_safe), weights, hidden  # (..., Lq, Dv); 0 * NaN stays 0
    return weights @ v_safe, weights, hidden  # (..., Lq, Dv)


def additive_backward(grad_out, q, k, v, w_q, w_k, w_v, weights, hidden):
    """Gradients of :func:`additive_forward` given its weights and tanh features.

    Returns
    -------
    dq, dk, dv (shaped like q, k, v), dw_q (Dq, A), dw_k (Dk, A), dw_v (A,)
    """
    live = (weights != 0).any(axis=-2)  # (..., Lk); dead keys carry no weight
    v_safe = zero_dead_keys(v, live)  # (..., Lk, Dv)
    k_safe = zero_dead_keys(k, live)  # (..., Lk, Dk)
    dv = unbroadcast(weights.swapaxes(-1, -2) @ grad_out, v.shape)  # (..., Lk, Dv)
    dw = grad_out @ v_safe.swapaxes(-1, -2)  # (..., Lq, Lk)
    if nonfinite_rows(v_safe) is not None:
        dw = np.where(weights != 0, dw, 0)  # exact: a zero weight's dW never counts, and 0 * NaN must not
    ds = softmax_backward(dw, weights)  # (..., Lq, Lk)
    dw_v = np.einsum("...qka,...qk->...a", hidden, ds).reshape(-1, hidden.shape[-1]).sum(axis=0)  # (A,)
    dpre = ds[..., None] * w_v * (1.0 - hidden * hidden)  # (..., Lq, Lk, A)
    if nonfinite_rows(k_safe) is not None:
        # a masked pair's tanh feature is NaN where its key is: its zero score gradient must stay zero
        dpre = np.where((weights != 0)[..., None], dpre, 0)  # (..., Lq, Lk, A)
    dhq = dpre.sum(axis=-2)  # (..., Lq, A), broadcast leading dims
    dhk = dpre.sum(axis=-3)  # (..., Lk, A)
    q_b = np.broadcast_to(q, dhq.shape[:-1] + q.shape[-1:])  # (..., Lq, Dq)
    k_b = np.broadcast_to(k_safe, dhk.shape[:-1] + k.shape[-1:])  # (..., Lk, Dk)
    dw_q = q_b.reshape(-1, q.shape[-1]).T @ dhq.reshape(-1, dhq.shape[-1])  # (Dq, A)
    dw_k = k_b.reshape(-1, k.shape[-1]).T @ dhk.reshape(-1, dhk.shape[-1])  # (Dk, A)
    dq = unbroadcast(dhq @ w_q.T, q.shape)  # (..., Lq, Dq)
    dk = unbroadcast(dhk @ w_k.T, k.shape)  # (..., Lk, Dk)
    return dq, dk, dv, dw_q, dw_k, dw_v

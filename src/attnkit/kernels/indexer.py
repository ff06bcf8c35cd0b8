"""DeepSeek Sparse Attention's lightning indexer: its scores, the top-k selection and its training loss
(unchecked kernels).

Dimension letters: B batch, L queries, S keys, Hi the indexer's heads, Di their width.

The indexer scores query t against key s with a few small ReLU heads, weighted per query and summed::

    I[b, t, s] = sum_h w[b, t, h] * relu(scale * q[b, t, h] . k[b, s])

(one key per token shared by every head, as multi-query attention). Each query then keeps the ``top_k`` keys
of highest score among those it may see; attention runs over those only. The selection is discrete: no
gradient flows through it. The indexer learns from its own loss, the KL divergence from the main
attention's distribution (summed over heads, renormalised over the keys considered) to the softmax of its
scores (DeepSeek-V3.2's paper, eq. 3 and 4).
"""
from __future__ import annotations

from functools import partial

import numpy as np

from ._threads import get_num_threads, run_tasks

__all__ = ["index_scores", "index_scores_backward", "top_k_indices", "top_k_selection", "gathered_attention",
           "indexer_kl", "indexer_kl_backward"]


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float32 at least (``transformers`` scores in float32 whatever the model's dtype), float64 stays."""
    return np.promote_types(dtype, np.float32)


def index_scores(q: np.ndarray, k: np.ndarray, w: np.ndarray, scale: float) -> np.ndarray:
    """``I = sum_h w_h relu(scale q_h . k)``: (B, L, S) in at least float32.

    q (B, L, Hi, Di), k (B, S, Di), w (B, L, Hi).
    """
    dtype = _compute_dtype(np.result_type(q, k, w))
    q, k, w = (a.astype(dtype, copy=False) for a in (q, k, w))
    s = _head_scores(q, k, scale)  # (B, L, Hi, S)
    np.maximum(s, 0, out=s)
    s *= w[..., None]
    return s.sum(axis=2)  # (B, L, S)


def _head_scores(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """``scale q_h . k`` for every query head and key, (B, L, Hi, S): one product of (L*Hi, Di) by (Di, S) per
    batch row (a matmul broadcast over L would be L small products)."""
    b, length, heads, width = q.shape
    s = q.reshape(b, length * heads, width) @ k.swapaxes(-1, -2)  # (B, L*Hi, S)
    s *= q.dtype.type(scale)
    return s.reshape(b, length, heads, -1)  # (B, L, Hi, S)


def index_scores_backward(grad: np.ndarray, q: np.ndarray, k: np.ndarray, w: np.ndarray, scale: float):
    """Gradients of :func:`index_scores`: ``(dq, dk, dw)`` shaped as q, k, w, in the scores' dtype.

    The per-head scores (B, L, Hi, S) are recomputed (one product) rather than kept by the forward: they are
    Hi times the size of the index scores, and the forward runs on every inference step.
    """
    dtype = _compute_dtype(np.result_type(q, k, w, grad))
    q, k, w, grad = (a.astype(dtype, copy=False) for a in (q, k, w, grad))
    s = _head_scores(q, k, scale)  # (B, L, Hi, S)
    b, length, heads, width = q.shape
    r = np.maximum(s, 0)  # (B, L, Hi, S)
    dw = np.einsum("blhs,bls->blh", r, grad, optimize=True)  # (B, L, Hi)
    ds = np.multiply(w[..., None], grad[:, :, None, :], out=r)  # (B, L, Hi, S), r's memory: not read again
    ds *= s > 0
    ds *= dtype.type(scale)
    ds = ds.reshape(b, length * heads, -1)  # (B, L*Hi, S)
    dq = (ds @ k).reshape(q.shape)  # (B, L, Hi, Di)
    dk = ds.swapaxes(-1, -2) @ q.reshape(b, length * heads, width)  # (B, S, Di)
    return dq, dk, dw


def top_k_indices(scores: np.ndarray, allowed: np.ndarray, top_k: int):
    """The ``min(top_k, S)`` best-scored allowed keys of each query: ``(indices, valid)``, both (B, L, K), in no
    particular order; ``valid`` is False where a query has fewer allowed keys than K (its index is then some
    other key, to be ignored)."""
    allowed = np.broadcast_to(allowed, scores.shape)
    ranked = np.where(allowed, scores, -np.inf)  # (B, L, S)
    if top_k >= scores.shape[-1]:
        best = np.broadcast_to(np.arange(scores.shape[-1]), scores.shape)  # (B, L, S)
    else:
        best = np.argpartition(-ranked, top_k - 1, axis=-1)[..., :top_k]  # (B, L, K)
    return best, np.take_along_axis(allowed, best, axis=-1)  # (B, L, K) each


def gathered_attention(q: np.ndarray, kv: np.ndarray, indices: np.ndarray, valid: np.ndarray, scale: float,
                       value_dim: int, block: int = 128) -> np.ndarray:
    """Attention of each query over its own K keys only, gathered (inference: no backward).

    q (B, H, L, Dk) against one key/value head shared by the H query heads, ``kv`` (B, S, Dk) whose first
    ``value_dim`` features are the values (latent attention's absorbed form: keys ``[c, k_r]``, values ``c``);
    ``indices``/``valid`` (B, L, K) from :func:`top_k_indices`. Costs L*K instead of L*S products; a query with no
    valid key gets zeros. Blocks of ``block`` queries (which bound the gathered keys to block * K rows) run on
    attnkit's threads. Returns (B, H, L, value_dim) in q's dtype (float16 computed in float32).
    """
    dtype = q.dtype
    compute = _compute_dtype(np.result_type(q, kv))
    q, kv = q.astype(compute, copy=False), kv.astype(compute, copy=False)
    b, heads, length, _ = q.shape
    out = np.zeros((b, length, heads, value_dim), dtype=compute)  # (B, L, H, Dv)
    blocks = [(q0, min(length, q0 + block)) for q0 in range(0, length, block)]
    run_tasks(blocks, partial(_gathered_block, q, kv, indices, valid, scale, out), get_num_threads())
    return out.transpose(0, 2, 1, 3).astype(dtype, copy=False)  # (B, H, L, Dv)


def _gathered_block(q, kv, indices, valid, scale: float, out: np.ndarray, rows_of_block: tuple[int, int],
                    worker: int) -> None:
    """Queries ``q0:q1`` of :func:`gathered_attention`, written into ``out`` (B, L, H, Dv) (by any worker)."""
    q0, q1 = rows_of_block
    rows = np.arange(q.shape[0])[:, None, None]  # (B, 1, 1)
    keys = kv[rows, indices[:, q0:q1]]  # (B, l, K, Dk)
    s = q[:, :, q0:q1].transpose(0, 2, 1, 3) @ keys.swapaxes(-1, -2)  # (B, l, H, K)
    s *= q.dtype.type(scale)
    s = np.where(valid[:, q0:q1, None, :], s, -np.inf)  # (B, l, H, K)
    top = s.max(axis=-1, keepdims=True)  # (B, l, H, 1)
    alive = np.isfinite(top)
    p = np.exp(s - np.where(alive, top, 0))  # (B, l, H, K)
    p /= np.where(alive, p.sum(axis=-1, keepdims=True), 1)
    out[:, q0:q1] = p @ keys[..., :out.shape[-1]]  # (B, l, H, Dv)


def top_k_selection(scores: np.ndarray, allowed: np.ndarray, top_k: int) -> np.ndarray:
    """The keys each query keeps: the ``top_k`` highest scores among its ``allowed`` keys, (B, L, S) bool.

    A query with at most ``top_k`` allowed keys keeps all of them (``top_k >= S``: the selection is
    ``allowed`` itself, and attention is dense). Equal scores at the boundary are broken by position as
    :func:`numpy.argpartition` breaks them (``torch.topk`` breaks them its own way: a tie is the one place
    the two may choose differently).

    scores (B, L, S) real; allowed bool broadcastable to (B, L, S).
    """
    allowed = np.broadcast_to(allowed, scores.shape)
    if top_k >= scores.shape[-1]:
        return allowed.copy()
    best, _ = top_k_indices(scores, allowed, top_k)  # (B, L, top_k)
    chosen = np.zeros(scores.shape, dtype=bool)  # (B, L, S)
    np.put_along_axis(chosen, best, True, axis=-1)
    chosen &= allowed
    return chosen


def _normalised_target(target: np.ndarray, support: np.ndarray) -> np.ndarray:
    """``target`` (B, L, S) kept on ``support`` and L1-normalised per row; an empty row stays zero."""
    p = np.where(support, target, 0)  # (B, L, S)
    total = p.sum(axis=-1, keepdims=True)  # (B, L, 1)
    return np.divide(p, total, out=np.zeros_like(p), where=total > 0)  # (B, L, S)


def _log_softmax(scores: np.ndarray, support: np.ndarray) -> np.ndarray:
    """Log-softmax of ``scores`` over ``support`` per row (-inf off it; an empty row is all -inf)."""
    masked = np.where(support, scores, -np.inf)  # (B, L, S)
    top = masked.max(axis=-1, keepdims=True)  # (B, L, 1)
    top = np.where(np.isfinite(top), top, 0)
    with np.errstate(divide="ignore"):
        lse = np.log(np.exp(masked - top).sum(axis=-1, keepdims=True)) + top  # (B, L, 1)
    return masked - np.where(np.isfinite(lse), lse, 0)  # (B, L, S): an empty row stays -inf, not NaN


def indexer_kl(scores: np.ndarray, target: np.ndarray, support: np.ndarray) -> float:
    """``sum_{b,t} KL(p_t || softmax(I_t))`` over each row's ``support`` (B, L, S) bool.

    ``p_t`` is ``target`` (B, L, S), non-negative (the main attention's weights summed over heads), kept on the
    support and normalised to sum to one; a row whose support is empty or whose target there is zero adds 0.
    """
    dtype = _compute_dtype(np.result_type(scores, target))
    p = _normalised_target(target.astype(dtype, copy=False), support)  # (B, L, S)
    log_q = _log_softmax(scores.astype(dtype, copy=False), support)  # (B, L, S)
    live = p > 0
    with np.errstate(divide="ignore"):
        terms = np.where(live, p * (np.log(np.where(live, p, 1)) - np.where(live, log_q, 0)), 0)  # (B, L, S)
    return float(terms.sum())


def indexer_kl_backward(scores: np.ndarray, target: np.ndarray, support: np.ndarray) -> np.ndarray:
    """Gradient of :func:`indexer_kl` with respect to ``scores``: ``softmax(I_t) - p_t`` on the support of each
    row whose target is not zero, 0 elsewhere; (B, L, S) in the scores' compute dtype."""
    dtype = _compute_dtype(np.result_type(scores, target))
    p = _normalised_target(target.astype(dtype, copy=False), support)  # (B, L, S)
    q = np.exp(_log_softmax(scores.astype(dtype, copy=False), support))  # (B, L, S)
    has_target = p.sum(axis=-1, keepdims=True) > 0  # (B, L, 1)
    return np.where(support & has_target, q - p, 0).astype(dtype, copy=False)  # (B, L, S)

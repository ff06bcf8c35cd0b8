"""Attention with score/mask modifiers and sinks: reference (whole score matrix) and tiled (tile skipping).

``out = softmax([mod(scale * q k^T) masked, sink]) v`` where ``sink`` is an optional per-head logit that
joins every row's softmax and carries no value. Dimension letters: B batch, H query heads, Hkv key/value
heads (grouped-query attention: each serves G = H / Hkv query heads, which read it without a copy: the G
query rows of a key/value head are stacked into one (G*Tq)-row product), Lq/Lk lengths, Tq/Tk tile
lengths, D/Dv features.

``score_mod`` has ``forward(s, b, h, q_idx, kv_idx)`` and ``backward(g, s, b, h, q_idx, kv_idx)``;
``mask_tile(q0, q1, k0, k1)`` returns a boolean array broadcastable to (B, H, Tq, Tk); ``kinds`` (B', H',
nQ, nK) marks tiles empty (0), partial (1) or full (2) and is reduced over (b, h): a tile is skipped when
empty for every (b, h) and left unmasked when full for every (b, h).

A NaN or inf in K or V at a key a query may not see never reaches that query: masked probabilities are
exactly 0, and on masked tiles that hold such a key, ``0 * NaN`` is kept at 0 (forward and backward).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ._masked_product import nonfinite_rows, zero_safe_matmul
from ._threads import check_stop, default_num_threads, run_tasks

__all__ = ["FlexContext", "flex_forward", "flex_backward"]


@dataclasses.dataclass
class FlexContext:
    """What the backward needs: inputs, output, log-sum-exp (B, H, Lq) and the description."""

    q: np.ndarray  # (B, H, Lq, D)
    k: np.ndarray  # (B, Hkv, Lk, D)
    v: np.ndarray  # (B, Hkv, Lk, Dv)
    out: np.ndarray
    lse: np.ndarray
    scale: float
    score_mod: object
    mask_tile: object
    kinds: np.ndarray | None
    block_q: int
    block_k: int
    sinks: np.ndarray | None
    tiled: bool


def _stack(x: np.ndarray, kv_heads: int) -> np.ndarray:
    """(B, H, T, F) -> (B, Hkv, G*T, F): each key/value head's G query heads as one block of rows."""
    b, h, t, f = x.shape
    return x.reshape(b, kv_heads, (h // kv_heads) * t, f)


def _unstack(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, Hkv, G*T, F) -> (B, H, T, F), the inverse of :func:`_stack`."""
    b, _, gt, f = x.shape
    return x.reshape(b, heads, gt * x.shape[1] // heads, f)


def _idx(B, H, q0, q1, k0, k1):
    return (np.arange(B).reshape(B, 1, 1, 1), np.arange(H).reshape(1, H, 1, 1),
            np.arange(q0, q1).reshape(1, 1, -1, 1), np.arange(k0, k1).reshape(1, 1, 1, -1))


def _plan(kinds, nq, nk):
    """Per tile: 0 skip, 1 mask, 2 no mask (kinds reduced over batch and heads)."""
    if kinds is None:
        return np.full((nq, nk), 2, dtype=np.int8)
    flat = kinds.reshape(-1, nq, nk)  # (B'H', nQ, nK)
    return np.where((flat == 0).all(axis=0), 0, np.where((flat == 2).all(axis=0), 2, 1)).astype(np.int8)


def _masked_bad(bad: np.ndarray | None, keep, k0: int, k1: int) -> bool:
    """True when a masked tile holds a key row with a NaN or inf (``bad`` (Lk,) or None)."""
    return keep is not None and bad is not None and bool(bad[k0:k1].any())


def _scores(q, k, scale, score_mod, mask_tile, kind, q0, q1, k0, k1):
    """Modified, masked scores of one tile (B, H, Tq, Tk), the raw scores and the keep mask (or None)."""
    B, H = q.shape[:2]
    raw = _unstack(_stack(q[:, :, q0:q1], k.shape[1]) @ k[:, :, k0:k1].swapaxes(-1, -2), H)  # (B, H, Tq, Tk)
    raw *= raw.dtype.type(scale)
    idx = _idx(B, H, q0, q1, k0, k1)
    s = raw if score_mod is None else score_mod.forward(raw, *idx)
    keep = None
    if kind == 1:
        keep = np.broadcast_to(mask_tile(q0, q1, k0, k1), s.shape)  # (B, H, Tq, Tk)
        s = np.where(keep, s, -np.inf)
    return s, raw, keep, idx


def flex_forward(q, k, v, *, scale, score_mod=None, mask_tile=None, kinds=None, block_q=None, block_k=None,
                 sinks=None, tiled=False, num_threads=None):
    """Forward pass; returns ``(out (B, H, Lq, Dv), lse (B, H, Lq), weights or None, ctx)``.

    The reference path (``tiled=False``) uses one tile covering everything and returns the weights
    (B, H, Lq, Lk); the tiled path visits ``block_q x block_k`` tiles with an online softmax, one band of
    query rows per task over ``num_threads`` threads (default: attnkit's setting). Bands write disjoint rows,
    so the result does not depend on the thread count.
    """
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    bq, bk = (min(block_q or 128, Lq), min(block_k or 128, Lk)) if tiled else (Lq, Lk)
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    plan = _tile_plan(tiled, kinds, mask_tile, nq, nk)
    dtype = q.dtype
    sink = None if sinks is None else sinks.astype(dtype).reshape(1, H, 1)  # (1, H, 1)
    out = np.zeros((B, H, Lq, v.shape[-1]), dtype=dtype)
    lse = np.empty((B, H, Lq), dtype=dtype)
    bad_v = nonfinite_rows(v)  # (Lk,) or None

    def band(i: int, worker: int) -> None:
        q0, q1 = i * bq, min(Lq, (i + 1) * bq)
        m = np.full((B, H, q1 - q0), -np.inf, dtype=dtype) if sink is None else \
            np.broadcast_to(sink, (B, H, q1 - q0)).copy()  # (B, H, Tq)
        denom = np.zeros_like(m) if sink is None else np.ones_like(m)  # (B, H, Tq)
        acc = np.zeros((B, H, q1 - q0, v.shape[-1]), dtype=dtype)  # (B, H, Tq, Dv)
        for j in range(nk):
            if plan[i, j] == 0:
                continue
            check_stop()
            k0, k1 = j * bk, min(Lk, (j + 1) * bk)
            s, _, keep, _ = _scores(q, k, scale, score_mod, mask_tile, plan[i, j], q0, q1, k0, k1)
            if not s.flags.writeable:  # a modifier may return a read-only view
                s = s.copy()
            m_new = np.maximum(m, s.max(axis=-1))  # (B, H, Tq)
            safe = np.where(np.isfinite(m_new), m_new, 0)  # (B, H, Tq)
            s -= safe[..., None]
            p = np.exp(s, out=s)  # (B, H, Tq, Tk), in place: the tile's scores are not needed again
            alpha = np.exp(m - safe)  # (B, H, Tq)
            denom = denom * alpha + p.sum(axis=-1)
            acc *= alpha[..., None]
            product = zero_safe_matmul if _masked_bad(bad_v, keep, k0, k1) else np.matmul
            acc += _unstack(product(_stack(p, v.shape[1]), v[:, :, k0:k1]), H)  # (B, H, Tq, Dv)
            m = m_new
        live = denom != 0  # a row that saw a NaN has a NaN sum: it stays NaN, as in the other kernels
        safe_m = np.where(np.isfinite(m), m, 0)
        out[:, :, q0:q1] = np.where(live[..., None], acc / np.where(live, denom, 1)[..., None], 0)
        lse[:, :, q0:q1] = np.where(live, safe_m + np.log(np.where(live, denom, 1)), -np.inf)

    if nq == 1:  # one band (the reference path, short inputs): BLAS keeps its own threads
        band(0, 0)
    else:  # the largest bands (most tiles to visit) first, for load balance
        order = sorted(range(nq), key=lambda i: -int(np.count_nonzero(plan[i])))
        run_tasks(order, band, num_threads or default_num_threads())
    weights = None
    if not tiled:
        s, _, _, _ = _scores(q, k, scale, score_mod, mask_tile, plan[0, 0] if plan.size else 2, 0, Lq, 0, Lk)
        dead = np.isneginf(lse)  # (B, H, Lq) rows that may attend to nothing
        weights = np.exp(s - np.where(dead, 0, lse)[..., None])  # (B, H, Lq, Lk)
        weights[dead] = 0
    ctx = FlexContext(q, k, v, out, lse, scale, score_mod, mask_tile, kinds, bq, bk, sinks, tiled)
    return out, lse, weights, ctx


def _tile_plan(tiled, kinds, mask_tile, nq, nk):
    if tiled and kinds is not None:
        return _plan(kinds, nq, nk)
    return np.full((nq, nk), 1 if mask_tile is not None else 2, dtype=np.int8)


def flex_backward(grad_out, ctx: FlexContext, num_threads=None):
    """Returns ``(dq, dk, dv, dsinks or None)``; modifier parameter gradients go into ``score_mod.grads``.

    Tasks own key bands (their dk, dv rows are theirs alone); with T tasks, task t takes the key bands
    ``j = t, t + T, ...`` and keeps its own partial dq, and the partials are added in task order, so the bits
    depend on the thread count but not on scheduling. A score modifier that ``accumulates`` (parameters whose
    ``.grads`` every tile adds into) runs on one thread.
    """
    q, k, v = ctx.q, ctx.k, ctx.v
    B, H, Lq, _ = q.shape
    hkv, Lk = k.shape[1], k.shape[2]
    bq, bk = ctx.block_q, ctx.block_k
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    plan = _tile_plan(ctx.tiled, ctx.kinds, ctx.mask_tile, nq, nk)
    grad_out = grad_out.astype(q.dtype, copy=False)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    delta = (grad_out * ctx.out).sum(axis=-1)  # (B, H, Lq)
    lse = np.where(np.isneginf(ctx.lse), np.inf, ctx.lse)  # dead rows: every probability exp(-inf) = 0
    bad_k, bad_v = nonfinite_rows(k), nonfinite_rows(v)  # (Lk,) or None each
    threads = num_threads or default_num_threads()
    if ctx.score_mod is not None and getattr(ctx.score_mod, "accumulates", False):
        threads = 1
    tasks = min(threads, nk)
    partial_dq = [np.zeros_like(q) for _ in range(tasks)]

    def key_bands(t: int, worker: int) -> None:
        dq = partial_dq[t]
        for j in range(t, nk, tasks):
            k0, k1 = j * bk, min(Lk, (j + 1) * bk)
            for i in range(nq):
                if plan[i, j] == 0:
                    continue
                check_stop()
                q0, q1 = i * bq, min(Lq, (i + 1) * bq)
                g_i, d_i, l_i = grad_out[:, :, q0:q1], delta[:, :, q0:q1, None], lse[:, :, q0:q1, None]
                s, raw, keep, idx = _scores(q, k, ctx.scale, ctx.score_mod, ctx.mask_tile, plan[i, j],
                                            q0, q1, k0, k1)
                if ctx.score_mod is not None and np.may_share_memory(s, raw):
                    s = s.copy()  # the modifier's backward reads the raw scores
                s -= l_i
                p = np.exp(s, out=s)  # (B, H, Tq, Tk)
                g_stacked = _stack(g_i, hkv)  # (B, Hkv, G*Tq, Dv)
                dv[:, :, k0:k1] += _stack(p, hkv).swapaxes(-1, -2) @ g_stacked  # (B, Hkv, Tk, Dv): summed over G
                ds = p * (_unstack(g_stacked @ v[:, :, k0:k1].swapaxes(-1, -2), H) - d_i)  # (B, H, Tq, Tk)
                masked_bad_k = _masked_bad(bad_k, keep, k0, k1)
                if _masked_bad(bad_v, keep, k0, k1):
                    ds = np.where(keep, ds, 0)  # masked: p = 0, but g . v is NaN where v is
                if ctx.score_mod is not None:
                    if masked_bad_k:
                        raw = np.where(keep, raw, 0)  # a modifier's gradient must not read masked NaN scores
                    ds = ctx.score_mod.backward(ds, raw, *idx)
                    if keep is not None:
                        ds = np.where(keep, ds, 0)
                ds *= ctx.scale
                product = zero_safe_matmul if masked_bad_k else np.matmul
                ds_stacked = _stack(ds, hkv)  # (B, Hkv, G*Tq, Tk)
                dq[:, :, q0:q1] += _unstack(product(ds_stacked, k[:, :, k0:k1]), H)  # (B, H, Tq, D)
                dk[:, :, k0:k1] += ds_stacked.swapaxes(-1, -2) @ _stack(q[:, :, q0:q1], hkv)  # (B, Hkv, Tk, D)

    if tasks == 1:
        key_bands(0, 0)
    else:
        run_tasks(list(range(tasks)), key_bands, tasks)
    dq = partial_dq[0]
    for more in partial_dq[1:]:
        dq += more
    dsinks = None
    if ctx.sinks is not None:
        p_sink = np.exp(ctx.sinks.astype(q.dtype).reshape(1, H, 1) - lse)  # (B, H, Lq)
        dsinks = -(p_sink * delta).sum(axis=(0, 2))  # (H,)
    return dq, dk, dv, dsinks

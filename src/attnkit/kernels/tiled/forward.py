"""The tiled forward: online softmax over key tiles, one task per (head box, query block), lazy row shifts."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .._masked_product import tile_product, zero_safe_matmul
from .._threads import check_stop, run_tasks
from .plan import (
    _LAZY_SHIFT,
    FlashContext,
    _augment_keys,
    _ForwardData,
    _normalise,
    _Pass,
    _PlanRequest,
    _positive,
    _Scratch,
    _splittable_axes,
    _tile_plan,
    _Tiles,
)


def flash_attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                            causal: bool = False, scale: float | None = None,
                            bias: np.ndarray | None = None, dropout_p: float = 0.0,
                            dropout_seed: int | None = None, block_q: int | None = None,
                            block_k: int | None = None, num_threads: int | None = None,
                            window: int | None = None, score_mod=None, block_mask=None,
                            sinks: np.ndarray | None = None):
    """Tiled softmax attention ``dropout(softmax(scale * q @ k.T + bias, masked)) @ v``.

    Shapes
    ------
    q : (..., Lq, D); k : (..., Lk, D); v : (..., Lk, Dv), leading dims broadcast against each other.
    mask : bool, broadcastable to (..., Lq, Lk); ``True`` = may attend (PyTorch's boolean
        ``attn_mask`` of ``scaled_dot_product_attention`` means the same; ``nn.MultiheadAttention``'s
        boolean masks mean the opposite). Never expanded: it is sliced tile by tile.
    bias : ndarray broadcastable to (..., Lq, Lk).
    Grouped-query attention: q (B, Hkv, G, Lq, D) with k, v (B, Hkv, 1, Lk, D); k and v are never
    repeated over the group.
    Returns ``out`` (..., Lq, Dv), ``lse`` (..., Lq) and the context for the backward.

    Dtype: float32 inputs compute and return float32, float64 compute and return float64 (mixed inputs
    follow NumPy promotion; narrower floats compute in float32 and are cast back).

    Parameters
    ----------
    causal : bool
        Bottom-right-aligned causal mask (query i sees key j iff ``j <= i + Lk - Lq``), combined with mask.
    scale : float, optional
        Multiplier of ``q @ k.T``; default ``1 / sqrt(D)``.
    dropout_p, dropout_seed
        Drop probability after the softmax (inverted scaling) and the seed of the counter-based mask.
    window : int, optional
        Sliding window (requires ``causal``): query i at position ``i' = i + Lk - Lq`` attends key j iff
        ``i' - window < j <= i'``; tiles wholly outside the window are skipped.
    block_q, block_k : int, optional
        Tile lengths; default from :func:`default_blocks` (the machine's L2, or the environment variables
        ``ATTNKIT_TILE_Q`` / ``ATTNKIT_TILE_K``); a ``block_mask``'s own with one.
    score_mod, block_mask, sinks : optional
        The terms of :func:`attnkit.flex.flex_attention`, for leading shapes (B, H) or, grouped-query,
        (B, Hkv, G) with H = Hkv * G. ``score_mod`` has ``forward(s, b, h, q_idx, kv_idx)`` and
        ``backward(grad, s, b, h, q_idx, kv_idx)`` over (B, H, Tq, Tk) tiles of the scaled scores (and an
        ``accumulates`` flag: its backward then runs on one thread); ``block_mask`` has ``kinds``
        (B', H', nQ, nK: 0 empty, skipped; 1 partial, ``tile_mask(q0, q1, k0, k1)`` asked; 2 full),
        ``block_q`` and ``block_k``; ``sinks`` (H,) are per-head logits that join every row's softmax and
        carry no value (``lse`` includes them).
    num_threads : int, optional
        Tile threads, at most 1024 (see :func:`attnkit.set_num_threads`); default: the cores this process may
        run on (CPU affinity). With more than one, BLAS runs single-threaded.

    Returns
    -------
    out : ndarray (..., Lq, Dv)
    lse : ndarray (..., Lq)
        Log-sum-exp of each row's (scaled, biased, masked) scores, before dropout; ``+inf`` for a row
        that may attend to no key, so that ``exp(s - lse)`` is zero there.
    ctx : FlashContext

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    >>> out, lse, ctx = flash_attention_forward(q, k, v, causal=True, block_q=2, block_k=2)
    >>> from attnkit.kernels.reference import attention_forward
    >>> bool(np.allclose(out, attention_forward(q, k, v, causal=True)[0]))
    True
    """
    args = _normalise(q, k, v, mask, bias, dropout_p, dropout_seed, causal, window, num_threads)
    q, k, v, dtype, num_threads = args.q, args.k, args.v, args.dtype, args.num_threads
    seq_q, d = q.shape[-2:]
    seq_k, value_dim = v.shape[-2:]
    extra = [m.shape[:-2] for m in (args.mask, args.bias) if isinstance(m, np.ndarray)]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], *extra)
    drop_lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], *extra)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if block_mask is not None:
        block_q, block_k = block_mask.block_q, block_mask.block_k
    fixed_blocks = (_positive(block_q, "block_q"), _positive(block_k, "block_k"))
    whole = score_mod is not None or block_mask is not None
    plan = _tile_plan(_PlanRequest(
        lead=lead, splittable=_splittable_axes(lead, k.shape, v.shape, args.bias, dropout_p > 0.0, whole),
        seq_q=seq_q, seq_k=seq_k, head_dim=d, value_dim=value_dim, itemsize=dtype.itemsize,
        num_threads=num_threads, split="q", fixed=fixed_blocks, window=args.window, causal=causal))
    tiles = _Tiles(lead, seq_q, seq_k, args.mask, causal, args.bias, plan.block_q, plan.block_k, args.window,
                   score_mod, block_mask)
    k_aug, v_aug, kmax, bad_k, bad_v = _augment_keys(k, v, args.mask, tiles, dtype, num_threads)
    data = _ForwardData(q=q, k_aug=k_aug, v_aug=v_aug, kmax=kmax, out=np.zeros(lead + (seq_q, value_dim), dtype),
                        lse=np.full(lead + (seq_q,), np.inf), bad_v=bad_v)  # lse float64: backward splits it
    run = _Pass(tiles=tiles, dtype=dtype, scale=dtype.type(scale),
                dropout_p=float(dropout_p), seed=dropout_seed, drop_lead=drop_lead)
    if math.prod(lead) and seq_q and seq_k:
        order = list(range(len(tiles.q_blocks)))
        if causal:
            order.reverse()  # the last query blocks see the most keys: hand them out first
        views = [(run.select(box), data.select(box)) for box in plan.boxes]
        tasks = [(view, qb) for qb in order for view in range(len(views))]
        scratch = [_Scratch(dtype) for _ in range(min(num_threads, len(tasks)))]  # one per worker run_tasks uses
        run_tasks(tasks, functools.partial(_forward_block, views=views, scratch=scratch), num_threads)
    if sinks is not None:
        _add_sinks(data, np.asarray(sinks, dtype=np.float64).reshape((1,) + lead[1:] + (1,)))  # (1, *heads, 1)
    ctx = FlashContext(q=q, k_aug=k_aug, v_aug=v_aug, out=data.out, lse=data.lse, scale=scale, lead=lead,
                       q_shape=q.shape, k_shape=k.shape, v_shape=v.shape, out_dtype=args.out_dtype, mask=args.mask,
                       causal=causal, bias=args.bias, dropout_p=float(dropout_p), dropout_seed=dropout_seed,
                       drop_lead=drop_lead, blocks=fixed_blocks, num_threads=num_threads, window=args.window,
                       bad_k=bad_k, bad_v=bad_v, score_mod=score_mod, block_mask=block_mask,
                       sinks=None if sinks is None else np.array(sinks))
    # copies: the caller may edit what it gets back, the backward reads ctx.out and ctx.lse (float64). A
    # log-sum-exp beyond float16's range (65504) becomes inf without a warning: most callers never read it
    with np.errstate(over="ignore"):
        lse = data.lse.astype(args.out_dtype, copy=True)
    return data.out.astype(args.out_dtype, copy=True), lse, ctx


def _add_sinks(data: _ForwardData, sink: np.ndarray) -> None:
    """Let each row's softmax include its head's sink logit: a virtual key of value zero.

    With ``Z = exp(lse)`` over the real keys, the sink rescales the output by ``Z / (Z + exp(sink))`` and the
    log-sum-exp becomes ``logaddexp(lse, sink)``; a row with no key left keeps a zero output.
    """
    lse = np.where(np.isposinf(data.lse), -np.inf, data.lse)  # (*lead, Lq) float64; no key: -inf
    total = np.logaddexp(lse, sink)  # (*lead, Lq)
    data.out *= np.exp(lse - total)[..., None].astype(data.out.dtype)  # (*lead, Lq, Dv)
    data.lse[...] = total


@dataclass
class _Rows:
    """Running state of one query block in the forward."""

    q0: int
    q1: int
    qa: np.ndarray  # (*lead, Tq, D+1) [q * scale, -m]; the last column only moves when folded
    qn: np.ndarray | None  # (*lead, Tq) |q_i| * |scale|, for the lazy-shift bound (folded only)
    acc: np.ndarray  # (*lead, Tq, Dv+1) [sum p v, sum p]
    pv: np.ndarray  # (*lead, Tq, Dv+1) one tile's p @ [v, 1]
    m: np.ndarray  # (*lead, Tq) current shift of each row
    l_sum: np.ndarray  # (*lead, Tq) softmax denominators (a view of acc's last column without dropout)
    first: bool = True  # the first tile's p @ v goes straight into acc


def _start_rows(run: _Pass, data: _ForwardData, q0: int, q1: int, scratch: _Scratch) -> _Rows:
    """Scaled queries and zeroed accumulators of query block ``[q0, q1)``."""
    lead, tq = run.tiles.lead, q1 - q0
    d, value_dim = data.q.shape[-1], data.out.shape[-1]
    qa = scratch.get("qa", lead + (tq, d + 1))  # (*lead, Tq, D+1)
    np.multiply(data.q[..., q0:q1, :], run.scale, out=qa[..., :d])
    qa[..., d] = 0
    qn = np.sqrt(np.einsum("...ld,...ld->...l", qa[..., :d], qa[..., :d])) if run.fold else None  # (*lead, Tq)
    if qn is not None and not np.isfinite(qn).all():
        # a query holding NaN or inf has non-finite scores whatever its shift: leave it out of the block's
        # bound, so that it cannot change how the other rows are shifted (and so their rounding)
        qn[~np.isfinite(qa[..., :d]).all(axis=-1)] = 0
    acc = scratch.get("acc", lead + (tq, value_dim + 1))  # (*lead, Tq, Dv+1)
    acc[...] = 0
    pv = scratch.get("pv", lead + (tq, value_dim + 1))  # (*lead, Tq, Dv+1)
    m = np.zeros(lead + (tq,), run.dtype)  # (*lead, Tq)
    l_sum = np.zeros(lead + (tq,), run.dtype) if run.dropout else acc[..., value_dim]  # (*lead, Tq)
    return _Rows(q0=q0, q1=q1, qa=qa, qn=qn, acc=acc, pv=pv, m=m, l_sum=l_sum)


def _forward_block(task: tuple[int, int], worker: int, views: list[tuple[_Pass, _ForwardData]],
                   scratch: list[_Scratch]) -> None:
    """Fill the output and log-sum-exp rows of query block ``qb`` of one box of heads, key tile by key tile."""
    view, qb = task
    run, data = views[view]
    tiles = run.tiles
    q0, q1 = tiles.q_blocks[qb]
    rows = _start_rows(run, data, q0, q1, scratch[worker])
    for kb in tiles.k_range(q0, q1):
        check_stop()
        skip, blocked = tiles.blocked(q0, q1, *tiles.k_blocks[kb])
        if not skip:
            _forward_tile(run, data, rows, kb, blocked, scratch[worker])
    _finish_rows(run, data, rows)


def _forward_tile(run: _Pass, data: _ForwardData, rows: _Rows, kb: int, blocked, scratch: _Scratch) -> None:
    """One key tile of the online softmax: scores, shift, exp, accumulate ``p @ [v, 1]``."""
    k0, k1 = run.tiles.k_blocks[kb]
    d = data.q.shape[-1]
    s = scratch.get("s", run.tiles.lead + (rows.q1 - rows.q0, k1 - k0))  # (*lead, Tq, Tk)
    tile_product(rows.qa, data.k_aug[..., k0:k1, :d + 1].swapaxes(-1, -2), out=s)  # scale q.k (- m if folded)
    if run.tiles.bias is not None:
        np.add(s, run.tiles.bias_tile(rows.q0, rows.q1, k0, k1), out=s)
    if run.tiles.score_mod is not None:
        s = run.tiles.modify(s, rows.q0, rows.q1, k0, k1)
    if blocked is not None:
        np.copyto(s, -np.inf, where=blocked)
    alpha = _shift_rows(run, rows, s, data.kmax[..., kb, None])
    np.exp(s, out=s)  # p, up to e^16 times the final probabilities
    if alpha is not None:
        np.multiply(rows.acc, alpha, out=rows.acc)
        if run.dropout:
            rows.l_sum *= alpha[..., 0]
    if run.dropout:
        rows.l_sum += s.sum(axis=-1)
        np.multiply(s, run.keep(rows.q0, rows.q1, k0, k1), out=s)
    value_dim = data.out.shape[-1]
    # a masked entry's p is exactly 0; where it meets a NaN or inf value, 0 * NaN must stay 0
    product = zero_safe_matmul if (blocked is not None and data.bad_v is not None
                                   and data.bad_v[k0:k1].any()) else tile_product
    if rows.first and alpha is None and not run.dropout:
        product(s, data.v_aug[..., k0:k1, :value_dim + 1], out=rows.acc)  # (*lead, Tq, Dv+1)
    else:
        product(s, data.v_aug[..., k0:k1, :value_dim + 1], out=rows.pv)  # (*lead, Tq, Dv+1)
        np.add(rows.acc, rows.pv, out=rows.acc)
    rows.first = False


def _shift_rows(run: _Pass, rows: _Rows, s: np.ndarray, kmax: np.ndarray) -> np.ndarray | None:
    """Make ``s`` relative to each row's shift, moving the shift where the tile needs it.

    While ``|q_i| |k_j| scale - m_i <= 16`` bounds the whole tile (folded case), nothing is done: the
    shift already in the matmul keeps ``exp`` from overflowing. Otherwise rows whose tile max exceeds the
    shift by more than 16, or that see their first key, move it. Returns the factor ``exp(-delta)``
    (*lead, Tq, 1) that rescales what was accumulated, or None when no shift moved.
    """
    if run.fold and (rows.qn * kmax - rows.m).max() <= _LAZY_SHIFT:
        return None
    t = s.max(axis=-1)  # (*lead, Tq) tile max, relative to m when folded
    if not run.fold:
        t -= rows.m
    fresh = rows.l_sum == 0  # (*lead, Tq) nothing accumulated yet (then m == 0)
    need = (t > _LAZY_SHIFT) | (fresh & (t > -np.inf))  # (*lead, Tq) rows whose shift moves
    alpha = None
    if need.any():
        delta = np.where(need, t, 0).astype(run.dtype, copy=False)  # (*lead, Tq)
        rows.m += delta
        if run.fold:
            np.subtract(s, delta[..., None], out=s)
            rows.qa[..., -1] = -rows.m
        alpha = np.exp(-np.where(fresh, 0, delta))[..., None]  # (*lead, Tq, 1)
    if not run.fold:
        np.subtract(s, rows.m[..., None], out=s)
    return alpha


def _finish_rows(run: _Pass, data: _ForwardData, rows: _Rows) -> None:
    """Normalise the accumulated rows into the output; store each row's log-sum-exp."""
    value_dim = data.out.shape[-1]
    ok = rows.l_sum > 0  # (*lead, Tq) rows that attend to at least one key
    norm = np.divide(1.0 if not run.dropout else 1.0 / (1.0 - run.dropout_p), rows.l_sum, where=ok,
                     out=np.zeros(rows.l_sum.shape, run.dtype))  # (*lead, Tq)
    np.multiply(rows.acc[..., :value_dim], norm[..., None], out=data.out[..., rows.q0:rows.q1, :])
    log_l = np.log(rows.l_sum.astype(np.float64), where=ok, out=np.zeros(rows.l_sum.shape))  # (*lead, Tq)
    data.lse[..., rows.q0:rows.q1] = np.where(ok, rows.m + log_l, np.inf)

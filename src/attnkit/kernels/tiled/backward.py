"""The tiled backward: probabilities recomputed tile by tile (FlashAttention-2), key blocks in lanes so that
every partial gradient is summed in an order fixed by the plan."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..._validation import unbroadcast
from .._masked_product import tile_product, zero_safe_matmul
from .._threads import check_stop, run_tasks
from ..flex import checked_scores
from .plan import (
    FlashContext,
    _group_axes,
    _Pass,
    _PlanRequest,
    _Scratch,
    _splittable_axes,
    _take,
    _tile,
    _tile_plan,
    _Tiles,
)


@dataclass
class _BackwardData:
    """The backward's operands (augmented so that matmuls fold in the row constants) and gradients."""

    q_aug: np.ndarray  # (*lead, Lq, D+2) [q * scale, -lse_hi, -lse_lo] (folded) or [q * scale, 0, 0]
    k_aug: np.ndarray  # (*Kl, Lk, D+2)
    v_aug: np.ndarray  # (*Vl, Lk, Dv+2)
    do_aug: np.ndarray  # (*lead, Lq, Dv+2) [dO, -D_hi, -D_lo], D = rowsum(dO * O)
    lse_hi: np.ndarray  # (*lead, Lq) compute dtype; 0 for fully masked rows (every entry is masked)
    lse_lo: np.ndarray  # (*lead, Lq) the rest of the float64 lse
    dk: np.ndarray  # (*Kl, Lk, D)
    dv: np.ndarray  # (*Vl, Lk, Dv)
    dq_lanes: list[np.ndarray]  # one (*lead, Lq, D) per lane, summed in lane order at the end
    dbias_lanes: list[np.ndarray | None]  # per lane if lanes share bias entries, else one shared array
    k_axes: tuple[int, ...]  # leading axes along which k is shared (grouped-query): dk sums over them
    v_axes: tuple[int, ...]
    bad_k: np.ndarray | None = None  # (Lk,) keys holding a NaN or inf; None: all finite
    bad_v: np.ndarray | None = None  # (Lk,) values holding a NaN or inf

    def select(self, heads: tuple[slice, ...]) -> _BackwardData:
        """Views of the operands and gradient accumulators a box of heads reads and writes."""
        def part(arr, trailing=2):
            return _take(arr, heads, trailing)

        return replace(self, q_aug=part(self.q_aug), k_aug=part(self.k_aug), v_aug=part(self.v_aug),
                       do_aug=part(self.do_aug), lse_hi=part(self.lse_hi, 1), lse_lo=part(self.lse_lo, 1),
                       dk=part(self.dk), dv=part(self.dv), dq_lanes=[part(a) for a in self.dq_lanes],
                       dbias_lanes=[part(a) for a in self.dbias_lanes])


def _check_grad(grad_out: np.ndarray, out_shape: tuple[int, ...]) -> None:
    try:
        fits = np.broadcast_shapes(grad_out.shape, out_shape) == out_shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"grad_out of shape {grad_out.shape} does not broadcast to the output shape "
                         f"{out_shape}")


def _split(x: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (float64) as ``hi + lo`` in ``dtype``, to twice the working precision; inf -> (0, 0)."""
    finite = np.isfinite(x)
    hi = np.where(finite, x, 0).astype(dtype)
    lo = np.where(finite, x - hi, 0).astype(dtype)
    return hi, lo


def _augment_backward(grad_out: np.ndarray, ctx: FlashContext, dtype: np.dtype, fold: bool):
    """``do_aug``, ``q_aug`` and the split log-sum-exp of the backward (see :class:`_BackwardData`).

    One matmul then gives ``s - lse`` (folded) as accurately as the forward's ``s - m``, and another
    ``dP - D``. Fully masked rows get a zero in place of ``-lse = -inf``: all their entries are masked
    anyway, and an infinity inside BLAS raises spurious invalid-value warnings.
    """
    lead, (seq_q, value_dim), d = ctx.lead, ctx.out.shape[-2:], ctx.q.shape[-1]
    do_aug = np.empty(lead + (seq_q, value_dim + 2), dtype)  # (*lead, Lq, Dv+2)
    do_aug[..., :value_dim] = grad_out
    d_row = np.einsum("...ld,...ld->...l", do_aug[..., :value_dim], ctx.out, dtype=np.float64)  # (*lead, Lq)
    d_hi, d_lo = _split(d_row, dtype)
    np.negative(d_hi, out=do_aug[..., value_dim])
    np.negative(d_lo, out=do_aug[..., value_dim + 1])
    q_aug = np.empty(lead + (seq_q, d + 2), dtype)  # (*lead, Lq, D+2)
    np.multiply(ctx.q, dtype.type(ctx.scale), out=q_aug[..., :d])
    lse_hi, lse_lo = _split(ctx.lse, dtype)  # (*lead, Lq) each
    if fold:
        np.negative(lse_hi, out=q_aug[..., d])
        np.negative(lse_lo, out=q_aug[..., d + 1])
    else:
        q_aug[..., d:] = 0
    return do_aug, q_aug, lse_hi, lse_lo


def _lanes(n_blocks: int, workers: int) -> list[list[int]]:
    """Key blocks dealt to ``workers`` lanes in snake order (0..W-1, W-1..0, ...).

    (``workers`` here is the number of lanes, a function of the thread count only.)

    A lane's key blocks run in order in one task and accumulate dQ into the lane's own buffer; the
    buffers are summed in lane order, so the result does not depend on thread scheduling. The snake
    balances causal work, where early key blocks meet the most queries.
    """
    lanes: list[list[int]] = [[] for _ in range(workers)]
    for i in range(n_blocks):
        turn, pos = divmod(i, workers)
        lanes[pos if turn % 2 == 0 else workers - 1 - pos].append(i)
    return lanes


def _backward_data(grad_out, ctx: FlashContext, run: _Pass, n_lanes: int) -> _BackwardData:
    """Allocate the backward's operands and gradient accumulators."""
    lead, seq_q, d = ctx.lead, ctx.out.shape[-2], ctx.q.shape[-1]
    do_aug, q_aug, lse_hi, lse_lo = _augment_backward(grad_out, ctx, run.dtype, run.fold)
    k_lead, v_lead = ctx.k_aug.shape[:-2], ctx.v_aug.shape[:-2]
    bias = ctx.bias
    if isinstance(bias, np.ndarray) and bias.shape[-1] == 1:  # key blocks share entries: one per lane
        dbias_lanes = [np.zeros(bias.shape, run.dtype) for _ in range(n_lanes)]
    elif isinstance(bias, np.ndarray):  # key blocks write disjoint columns
        dbias_lanes = [np.zeros(bias.shape, run.dtype)] * n_lanes
    else:
        dbias_lanes = [None] * n_lanes
    return _BackwardData(
        q_aug=q_aug, k_aug=ctx.k_aug, v_aug=ctx.v_aug, do_aug=do_aug, lse_hi=lse_hi, lse_lo=lse_lo,
        dk=np.zeros(k_lead + ctx.k_aug.shape[-2:-1] + (d,), run.dtype),
        dv=np.zeros(v_lead + ctx.v_aug.shape[-2:-1] + (ctx.v_aug.shape[-1] - 2,), run.dtype),
        dq_lanes=[np.zeros(lead + (seq_q, d), run.dtype) for _ in range(n_lanes)], dbias_lanes=dbias_lanes,
        k_axes=_group_axes(lead, k_lead), v_axes=_group_axes(lead, v_lead), bad_k=ctx.bad_k, bad_v=ctx.bad_v)


def flash_attention_backward(grad_out: np.ndarray, ctx: FlashContext):
    """Gradients of :func:`flash_attention_forward`'s output, by tile-wise recomputation.

    Deterministic: identical calls give bitwise identical gradients, whatever the thread scheduling
    (dQ partial sums are reduced in a fixed order; see ``docs/kernels.md``). A score modifier with
    parameters runs its tiles on one thread, in a fixed order.

    Shapes
    ------
    grad_out : (..., Lq, Dv), broadcastable to the forward output.

    Returns
    -------
    dq, dk, dv : ndarrays shaped like the forward's q, k, v (broadcast dims summed: grouped-query keys
        and values get the sum over their group)
    dbias : ndarray shaped like an array ``bias``, else None
    """
    lead, (seq_q, value_dim) = ctx.lead, ctx.out.shape[-2:]
    seq_k, dtype = ctx.k_aug.shape[-2], ctx.out.dtype
    grad_out = np.asarray(grad_out)
    _check_grad(grad_out, lead + (seq_q, value_dim))
    # a score modifier that adds into shared parameter gradients takes its tiles in one fixed order
    threads = 1 if getattr(ctx.score_mod, "accumulates", False) else ctx.num_threads
    whole = ctx.score_mod is not None or ctx.block_mask is not None
    plan = _tile_plan(_PlanRequest(
        lead=lead, splittable=_splittable_axes(lead, ctx.k_shape, ctx.v_shape, ctx.bias, ctx.dropout_p > 0.0,
                                               whole),
        seq_q=seq_q, seq_k=seq_k, head_dim=ctx.q.shape[-1], value_dim=value_dim, itemsize=dtype.itemsize,
        num_threads=threads, split="k", fixed=ctx.blocks, window=ctx.window))  # tasks: key blocks
    tiles = _Tiles(lead, seq_q, seq_k, ctx.mask, ctx.causal, ctx.bias, plan.block_q, plan.block_k, ctx.window,
                   ctx.score_mod, ctx.block_mask)
    run = _Pass(tiles=tiles, dtype=dtype, scale=dtype.type(ctx.scale),
                dropout_p=ctx.dropout_p, seed=ctx.dropout_seed, drop_lead=ctx.drop_lead)
    # one lane per thread, each with its own dQ buffer: a second lane per thread (to rebalance when a core is
    # busy elsewhere) cost more than it saved, as its buffer's fresh pages fault in while the other thread
    # works (8 documents, GQA 9/3, L 2048, 2 threads: 41-51 ms with four lanes, 26-28 ms with two). The
    # count depends on num_threads only, never on scheduling, so the reduction order is fixed.
    n_lanes = min(threads, len(tiles.k_blocks))
    lanes = _lanes(len(tiles.k_blocks), max(1, n_lanes))
    data = _backward_data(grad_out, ctx, run, len(lanes))
    if math.prod(lead) and seq_q and seq_k:
        views = [(run.select(box), data.select(box)) for box in plan.boxes]
        tasks = [(view, lane) for lane in range(len(lanes)) for view in range(len(views))]
        scratch = [_Scratch(dtype) for _ in range(min(threads, len(tasks)))]  # one per worker run_tasks uses
        step = functools.partial(_backward_lane, views=views, lanes=lanes, scratch=scratch)
        run_tasks(tasks, step, threads)
    if ctx.sinks is not None:
        ctx.sinks_grad = _sinks_grad(ctx, data.do_aug[..., value_dim:])
    dq = data.dq_lanes[0]
    for partial in data.dq_lanes[1:]:  # fixed order: bitwise reproducible
        np.add(dq, partial, out=dq)
    np.multiply(dq, run.scale, out=dq)
    cast = ctx.out_dtype
    dq = unbroadcast(dq, ctx.q_shape).astype(cast, copy=False)
    dk = unbroadcast(data.dk, ctx.k_shape).astype(cast, copy=False)
    dv = unbroadcast(data.dv, ctx.v_shape).astype(cast, copy=False)
    return dq, dk, dv, _reduce_dbias(data.dbias_lanes, cast)


def _sinks_grad(ctx: FlashContext, minus_d: np.ndarray) -> np.ndarray:
    """``d loss / d sink[h] = -sum over rows of p_sink D``, with ``p_sink = exp(sink - lse)`` and ``D`` the
    row's ``dO . O`` (``minus_d`` (*lead, Lq, 2) holds ``-D`` split in two)."""
    lead = ctx.lead
    sink = ctx.sinks.astype(np.float64).reshape((1,) + lead[1:] + (1,))  # (1, *heads, 1)
    d_row = -minus_d.astype(np.float64).sum(axis=-1)  # (*lead, Lq)
    grad = -(np.exp(sink - ctx.lse) * d_row).sum(axis=(0, -1))  # (*heads,)
    return grad.reshape(-1).astype(ctx.out_dtype)  # (H,)


def _reduce_dbias(lanes: list[np.ndarray | None], cast: np.dtype) -> np.ndarray | None:
    """The array bias's gradient: the lanes' partial sums added in lane order (or the one shared array)."""
    if lanes[0] is None:
        return None
    total = lanes[0]
    for part in lanes[1:]:
        if part is not total:
            np.add(total, part, out=total)
    return total.astype(cast, copy=False)


def _backward_lane(task: tuple[int, int], worker: int, views: list[tuple[_Pass, _BackwardData]],
                   lanes: list[list[int]], scratch: list[_Scratch]) -> None:
    """Every tile of one box of heads in the lane's key blocks, key block by key block, query block by
    query block (boxes write disjoint parts of every gradient, so the lane's order is all that counts)."""
    view, lane = task
    run, data = views[view]
    tiles = run.tiles
    for kb in lanes[lane]:
        k0, k1 = tiles.k_blocks[kb]
        for qb in tiles.q_range(k0, k1):
            check_stop()
            q0, q1 = tiles.q_blocks[qb]
            skip, blocked = tiles.blocked(q0, q1, k0, k1)
            if not skip:
                _backward_tile(run, data, lane, (q0, q1, k0, k1), blocked, scratch[worker])


def _probabilities(run: _Pass, data: _BackwardData, tile, blocked, scratch: _Scratch) -> np.ndarray:
    """The tile's softmax probabilities before dropout, recomputed from q, k and the log-sum-exp."""
    q0, q1, k0, k1 = tile
    p = scratch.get("p", run.tiles.lead + (q1 - q0, k1 - k0))  # (*lead, Tq, Tk)
    tile_product(data.q_aug[..., q0:q1, :], data.k_aug[..., k0:k1, :].swapaxes(-1, -2), out=p)  # s - lse or s
    if not run.fold:
        if run.tiles.bias is not None:
            np.add(p, run.tiles.bias_tile(q0, q1, k0, k1), out=p)
        if run.tiles.score_mod is not None:
            np.copyto(scratch.get("raw", p.shape), p)  # the modifier's backward reads its input scores
            p = run.tiles.modify(p, q0, q1, k0, k1)
        np.subtract(p, data.lse_hi[..., q0:q1, None], out=p)
        if run.dtype == np.float32:
            np.subtract(p, data.lse_lo[..., q0:q1, None], out=p)
    if blocked is not None:
        np.copyto(p, -np.inf, where=blocked)
    return np.exp(p, out=p)


def _score_grads(run: _Pass, data: _BackwardData, tile, p: np.ndarray, scratch: _Scratch) -> np.ndarray:
    """``dS = P (dP - D)`` of the tile; with dropout, ``p`` becomes the dropped, rescaled weights."""
    q0, q1, k0, k1 = tile
    value_dim = data.dv.shape[-1]
    ds = scratch.get("ds", p.shape)  # (*lead, Tq, Tk)
    if not run.dropout:
        tile_product(data.do_aug[..., q0:q1, :], data.v_aug[..., k0:k1, :].swapaxes(-1, -2), out=ds)  # dP - D
        return np.multiply(ds, p, out=ds)
    keep = run.keep(q0, q1, k0, k1)  # (*drop_lead, Tq, Tk)
    keep_scale = run.dtype.type(1.0 / (1.0 - run.dropout_p))
    tile_product(data.do_aug[..., q0:q1, :value_dim], data.v_aug[..., k0:k1, :value_dim].swapaxes(-1, -2),
                 out=ds)  # dO.v
    np.multiply(ds, keep, out=ds)
    np.multiply(ds, keep_scale, out=ds)  # dP, the gradient of the weights before dropout
    np.add(ds, data.do_aug[..., q0:q1, value_dim:value_dim + 1], out=ds)  # dP - D (the columns hold -D)
    np.add(ds, data.do_aug[..., q0:q1, value_dim + 1:], out=ds)
    np.multiply(ds, p, out=ds)
    np.multiply(p, keep, out=p)
    np.multiply(p, keep_scale, out=p)
    return ds


def _add_product(target: np.ndarray, a: np.ndarray, b: np.ndarray, axes: tuple[int, ...],
                 scratch: _Scratch, name: str, zero_safe: bool = False) -> None:
    """``target += a @ b``, summed over the leading ``axes`` where the target is shared (grouped k/v).

    ``a`` has the full leading shape (a score tile), ``b`` one that broadcasts to it. ``zero_safe``: zeros
    of ``a`` (masked entries) contribute 0 even against NaN or inf in ``b``.
    """
    product = scratch.get(name, a.shape[:-1] + b.shape[-1:])  # (*lead, rows of a, columns of b)
    (zero_safe_matmul if zero_safe else tile_product)(a, b, out=product)
    if axes:
        product = product.sum(axis=axes, keepdims=True)
    np.add(target, product, out=target)


def _backward_tile(run: _Pass, data: _BackwardData, lane: int, tile, blocked, scratch: _Scratch) -> None:
    """One tile's contribution to dV, dK (the key block's own rows), dQ (the lane's buffer) and the bias."""
    q0, q1, k0, k1 = tile
    d, value_dim = data.dk.shape[-1], data.dv.shape[-1]
    p = _probabilities(run, data, tile, blocked, scratch)  # (*lead, Tq, Tk)
    ds = _score_grads(run, data, tile, p, scratch)  # (*lead, Tq, Tk); p is now the dropped weights
    bad_k = blocked is not None and data.bad_k is not None and data.bad_k[k0:k1].any()
    if blocked is not None and data.bad_v is not None and data.bad_v[k0:k1].any():
        np.copyto(ds, 0, where=blocked)  # masked: p = 0, but dP = dO . v is NaN where v is
    _add_product(data.dv[..., k0:k1, :], p.swapaxes(-1, -2), data.do_aug[..., q0:q1, :value_dim], data.v_axes,
                 scratch, "kv")  # (*Vl, Tk, Dv)
    if run.tiles.score_mod is not None:
        ds = _modifier_grad(run.tiles, ds, scratch.get("raw", ds.shape), tile, blocked, bad_k)
    if run.tiles.bias is not None:
        _bias_grad(run.tiles, data, lane, ds, tile)
    _add_product(data.dq_lanes[lane][..., q0:q1, :], ds, data.k_aug[..., k0:k1, :d], (), scratch, "q", bad_k)
    _add_product(data.dk[..., k0:k1, :], ds.swapaxes(-1, -2), data.q_aug[..., q0:q1, :d], data.k_axes,
                 scratch, "kv")  # (*Kl, Tk, D); q_aug holds the scaled q


def _modifier_grad(tiles: _Tiles, ds: np.ndarray, raw: np.ndarray, tile, blocked, bad_k: bool) -> np.ndarray:
    """The score gradient through the score modifier (whose own parameters get theirs), masked entries 0."""
    if bad_k:
        np.copyto(raw, 0, where=blocked)  # the modifier must not read a masked NaN score
    heads = tiles.to_heads(ds)  # (B, H, Tq, Tk)
    grad = checked_scores(tiles.score_mod.backward(heads, tiles.to_heads(raw), *tiles.score_index(*tile)),
                          heads.shape, "score_mod.backward")
    grad = grad.reshape(ds.shape)  # (*lead, Tq, Tk)
    if blocked is not None:
        grad = np.where(blocked, 0, grad)
    return grad


def _bias_grad(tiles: _Tiles, data: _BackwardData, lane: int, ds: np.ndarray, tile) -> None:
    """Add the score gradient of one tile into the lane's array-bias gradient."""
    q0, q1, k0, k1 = tile
    target = _tile(data.dbias_lanes[lane], q0, q1, k0, k1)  # (..., Tq|1, Tk|1) view into the lane's dbias
    target += unbroadcast(ds, target.shape)

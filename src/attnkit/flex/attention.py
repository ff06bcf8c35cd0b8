"""``flex_attention`` and ``flex_attention_backward``: the checked entry points."""
from __future__ import annotations

import math

import numpy as np

from .._validation import check_scale
from ..kernels import attention_backward, attention_forward, tiled
from ..kernels.flex import FlexContext, flex_backward, flex_forward
from ..kernels.registry import resolve_kernel
from .masks import BlockMask, KernelMask
from .modifiers import as_score_mod

__all__ = ["flex_attention", "flex_attention_backward", "FlexAttentionContext", "FLEX_KERNELS"]

FLEX_KERNELS = ("auto", "reference", "tiled")


class FlexAttentionContext:
    """What :func:`flex_attention_backward` needs. After the backward, ``sinks_grad`` (H,) holds the sinks'
    gradient (``None`` without sinks); the same array is also returned as the fourth value.

    ``kernel`` names the kernel that ran: ``"tiled"`` (:mod:`attnkit.kernels.tiled`, every description),
    ``"reference"`` (:mod:`attnkit.kernels.reference`, a :class:`~attnkit.flex.KernelMask`, any score
    modifier, dropout) or ``"flex-reference"`` (:mod:`attnkit.kernels.flex`, every other description, weights
    formed).
    """

    def __init__(self, kernel_ctx, kernel: str, group: int, dtype, weights, out_shape):
        self.kernel_ctx = kernel_ctx
        self.kernel = kernel
        self.group = group
        self.dtype = dtype  # of every result, forward and backward
        self.weights = weights
        self.out_shape = out_shape
        self.sinks_grad = None


def _check(name, x, ndim=4):
    if not isinstance(x, np.ndarray) or x.ndim != ndim or x.dtype.kind != "f":
        got = f"shape {x.shape} dtype {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{name} must be a floating ndarray with {ndim} dims, got {got}")


def flex_attention(q, k, v, score_mod=None, block_mask: BlockMask | None = None, *, scale=None, sinks=None,
                   enable_gqa: bool = False, return_lse: bool = False, kernel: str = "auto",
                   need_weights: bool = False, dropout_p: float = 0.0, dropout_seed: int | None = None):
    """Attention whose scores are changed by ``score_mod`` and restricted by ``block_mask``.

    ``out = softmax([mask(score_mod(scale * q k^T)), sinks[h]]) v``: masked scores are removed, ``sinks``
    (optional) is a per-head logit that joins each row's softmax and contributes no value. Fully masked rows
    (without sinks) give zeros and ``lse = -inf``; with sinks all their mass goes to the sink, so they give
    zeros and ``lse = sinks[h]``. No keys (Lk = 0) is a fully masked row. No features (D = 0) makes every
    score 0 (a uniform average of the values before ``score_mod``); empty batch, head, query or value axes
    give empty results.

    One dtype rule on every kernel: ``out``, ``lse``, ``ctx.weights`` and every gradient of
    :func:`flex_attention_backward` have ``np.result_type(q, k, v)`` (a float32 q with a float64 k gives
    float64). float16 inputs are computed in float32 (float16 scores and their exponentials overflow at
    65504) and the results rounded to float16 once, as the rest of attnkit does; float32 computes in
    float32, float64 in float64. A log-sum-exp beyond float16's range is returned as ``inf``.

    Parameters
    ----------
    q : ndarray, shape (B, Hq, Lq, D)
    k : ndarray, shape (B, Hkv, Lk, D)
    v : ndarray, shape (B, Hkv, Lk, Dv)
    score_mod : ScoreMod or callable ``(score, b, h, q_idx, kv_idx) -> score``, optional
        A plain callable works forward only.
    block_mask : BlockMask, optional
        From :func:`create_block_mask` with ``Q_LEN == Lq`` and ``KV_LEN == Lk``.
    scale : float, optional
        A real number of magnitude at most 65504 (:func:`attnkit._validation.check_scale`: ``TypeError`` for a
        string or a bool, ``ValueError`` for NaN, inf, 10**400 and ±1e308, whose scores overflow to inf and
        whose softmax is NaN). Default ``1 / sqrt(D)`` (1 when D = 0).
    sinks : array of real numbers, shape (Hq,), optional
    enable_gqa : bool
        Allow ``Hkv`` dividing ``Hq`` (query head h reads K/V head ``h // (Hq / Hkv)``).
    return_lse : bool
        Also return the log-sum-exp (B, Hq, Lq) (including the sink).
    kernel : {"auto", "reference", "tiled"}
        Resolved by :func:`attnkit.kernels.registry.resolve_kernel`, the one rule of the library: ``"auto"``
        is ``"reference"`` when ``need_weights`` or ``Lq == 1``, else ``"tiled"``. ``"tiled"``: attnkit's tiled
        FlashAttention kernel, which never forms the ``Lq x Lk`` scores. A mask with a
        :class:`~attnkit.flex.KernelMask` (causal at the bottom-right corner, windowed, padded, a dense boolean
        mask) becomes its own arguments; any other block mask is read tile by tile (empty tiles skipped,
        ``mask_mod`` called on partial tiles only); a score modifier runs on each tile's scores.
        ``"reference"`` forms the scores (``ctx.weights`` holds the (B, Hq, Lq, Lk) softmax): on the reference
        attention kernel for a described mask without sinks or ``return_lse``, otherwise on the flex
        reference kernel.
    need_weights : bool, default False
        The weights are wanted in ``ctx.weights`` (``kernel="tiled"`` is then a ``ValueError``).
    dropout_p, dropout_seed : float, int
        Dropout on the weights after the softmax (inverted scaling, counter-based from ``dropout_seed``), on
        the reference and tiled attention kernels; ``ValueError`` where the flex reference kernel would run.

    Returns
    -------
    out : ndarray, shape (B, Hq, Lq, Dv), dtype ``np.result_type(q, k, v)``
    lse : ndarray, shape (B, Hq, Lq), the same dtype (only with ``return_lse=True``)
    ctx : FlexAttentionContext
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x)
    B, Hq, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2] \
            or k.shape[3] != D:
        raise ValueError(f"k and v must have shapes (B, Hkv, Lk, D) and (B, Hkv, Lk, Dv) matching q {q.shape}; "
                         f"got k {k.shape}, v {v.shape}")
    Hkv = k.shape[1]
    if Hkv != Hq and not (enable_gqa and Hkv and Hq % Hkv == 0):
        raise ValueError(f"k has {Hkv} heads and q {Hq}: pass enable_gqa=True with Hq a multiple of Hkv")
    if kernel not in FLEX_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(map(repr, FLEX_KERNELS))}, got {kernel!r}")
    chosen = resolve_kernel(kernel, need_weights=need_weights, seq_q=Lq).name  # "reference" or "tiled"
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask from create_block_mask, got "
                            f"{type(block_mask).__name__}")
        bb, bh = block_mask.batch, block_mask.heads
        if (block_mask.q_len, block_mask.kv_len) != (Lq, k.shape[2]) or bb not in (1, B) or bh not in (1, Hq):
            raise ValueError(f"block_mask of shape {block_mask.shape} does not fit q {q.shape} and k {k.shape}")
    dtype = np.result_type(q.dtype, k.dtype, v.dtype)  # of every result, whichever kernel runs
    if sinks is not None:
        sinks = np.asarray(sinks)
        if sinks.dtype.kind not in "fiu":
            raise TypeError(f"sinks must be real numbers, one per query head, got dtype {sinks.dtype}")
        if sinks.shape != (Hq,):
            raise ValueError(f"sinks must have shape (Hq,) = ({Hq},), got {sinks.shape}")
    if score_mod is not None:
        score_mod = as_score_mod(score_mod)
        score_mod.check_shape((B, Hq, Lq, k.shape[2]))
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D else 1.0  # no features: every score is 0 whatever the scale
    else:
        scale = check_scale(scale)
    group = Hq // Hkv if Hkv else 1  # the kernels read each key/value head for its G query heads, without copies
    Lk = k.shape[2]
    described = _kernel_mask(block_mask, Lq, Lk)
    dropout = dict(dropout_p=float(dropout_p), dropout_seed=dropout_seed)
    if chosen == "tiled":  # the tiled kernel computes in the same dtype, by the same rule
        return _on_tiled_kernel(q, k, v, score_mod, block_mask, described, scale, sinks, group, return_lse,
                                dropout)
    # float16 scores and exponentials overflow at 65504: compute in float32 (float64 for wider floats)
    compute = np.dtype(np.float64) if dtype.itemsize > 4 else np.dtype(np.float32)
    q, k, v = (x.astype(compute, copy=False) for x in (q, k, v))
    if sinks is None and not return_lse and described is not None:
        return _on_reference_kernel(q, k, v, described, score_mod, scale, group, dtype, dropout)
    if dropout_p:
        raise ValueError("dropout_p needs the reference or tiled attention kernel: a mask they take as arguments "
                         "(no mask function), no sinks and no return_lse, or kernel='tiled'")
    return _on_flex_reference_kernel(q, k, v, score_mod, block_mask, scale, sinks, dtype, group, return_lse)


def _kernel_mask(block_mask: BlockMask | None, q_len: int, kv_len: int) -> KernelMask | None:
    """The block mask in the attention kernels' arguments (causal at the bottom-right corner, a window, a
    key mask), or None when only its function can say it."""
    if block_mask is None:
        return KernelMask()
    described = block_mask.kernel_mask
    if described is None or (described.offset is not None and described.offset != kv_len - q_len):
        return None
    return described


def _grouped(q, k, v, group: int):
    """(B, Hkv, G, L, D) queries against (B, Hkv, 1, S, D) keys and values: the kernels broadcast K/V over
    each group instead of repeating them."""
    if group == 1:
        return q, k, v
    B, _, Lq, D = q.shape
    return q.reshape(B, k.shape[1], group, Lq, D), k[:, :, None], v[:, :, None]


def _mask_args(described: KernelMask, q_shape: tuple[int, ...], group: int) -> dict:
    """The description as the attention kernels' ``mask``, ``causal`` and ``window`` arguments, the mask shaped
    for queries of ``q_shape`` ((B, Hq, Lq, D), or (B, Hkv, G, Lq, D) when grouped)."""
    mask = None
    if described.key_mask is not None:
        rows, length = described.key_mask.shape
        mask = described.key_mask.reshape(rows, *(1,) * (len(q_shape) - 2), length)  # (B', 1, [1,] 1, Lk)
    if described.dense is not None:
        dense = described.dense  # (B'|1, H'|1, Lq|1, Lk|1)
        if group > 1:  # query head h is member h % G of key/value head h // G
            heads = dense.shape[1]
            dense = dense.reshape(dense.shape[0], heads // group if heads > 1 else 1, group if heads > 1 else 1,
                                  *dense.shape[2:])  # (B'|1, Hkv|1, G|1, Lq|1, Lk|1)
        mask = dense if mask is None else mask & dense
    return dict(mask=mask, causal=described.offset is not None, window=described.window)


def _on_reference_kernel(q, k, v, described: KernelMask, score_mod, scale: float, group: int, dtype, dropout):
    """The reference attention kernel (the weights are formed): a described mask, any score modifier."""
    B, Hq, Lq, _ = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    qg, kg, vg = _grouped(q, k, v, group)
    out, weights, kctx = attention_forward(
        qg, kg, vg, **_mask_args(described, qg.shape, group), scale=scale, score_mod=score_mod,
        need_weights=True, kernel="reference", **dropout)
    out = out.reshape(B, Hq, Lq, Dv).astype(dtype, copy=False)  # (B, Hq, Lq, Dv)
    weights = weights.reshape(B, Hq, Lq, Lk).astype(dtype, copy=False)  # (B, Hq, Lq, Lk)
    return out, FlexAttentionContext(kctx, "reference", group, dtype, weights, out.shape)


def _on_tiled_kernel(q, k, v, score_mod, block_mask, described, scale: float, sinks, group: int,
                     return_lse: bool, dropout):
    """The tiled FlashAttention kernel: a described mask as its own arguments, any other block mask tile by
    tile; the score modifier on each tile's scores."""
    B, Hq, Lq, _ = q.shape
    Dv = v.shape[3]
    qg, kg, vg = _grouped(q, k, v, group)
    masks = dict(block_mask=block_mask) if described is None else _mask_args(described, qg.shape, group)
    out, _, kctx = tiled.flash_attention_forward(qg, kg, vg, scale=scale, score_mod=score_mod, sinks=sinks,
                                                 **masks, **dropout)
    out = out.reshape(B, Hq, Lq, Dv)  # (B, Hq, Lq, Dv)
    ctx = FlexAttentionContext(kctx, "tiled", group, out.dtype, None, out.shape)
    if not return_lse:
        return out, ctx
    # from the kernel's float64 copy: its +inf marks a row with nothing to attend to (exp(lse) = 0 here),
    # where a float16 log-sum-exp beyond 65504 is +inf as well
    lse = np.where(np.isposinf(kctx.lse), -np.inf, kctx.lse).reshape(B, Hq, Lq)  # (B, Hq, Lq)
    with np.errstate(over="ignore"):  # beyond float16's range: inf
        return out, lse.astype(out.dtype), ctx


def _on_flex_reference_kernel(q, k, v, score_mod, block_mask, scale: float, sinks, dtype, group: int,
                              return_lse: bool):
    """The flex reference kernel: any description on the whole score matrix, the weights formed."""
    Lq, Lk = q.shape[2], k.shape[2]
    out, lse, weights, kctx = flex_forward(
        q, k, v, scale=scale, score_mod=score_mod,
        mask=None if block_mask is None else block_mask.tile_mask(0, Lq, 0, Lk), sinks=sinks)
    out = out.astype(dtype, copy=False)
    ctx = FlexAttentionContext(kctx, "flex-reference", group, dtype, weights.astype(dtype, copy=False), out.shape)
    if not return_lse:
        return out, ctx
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as the tiled kernel gives
        return out, lse.astype(dtype, copy=True), ctx  # a copy: the backward reads ctx's


def flex_attention_backward(grad_out, ctx: FlexAttentionContext):
    """Gradients of :func:`flex_attention`.

    Parameters
    ----------
    grad_out : ndarray, shape (B, Hq, Lq, Dv)
    ctx : FlexAttentionContext

    Returns
    -------
    (dq, dk, dv) with the shapes of q, k, v, all in the dtype of the forward's output (whatever
    ``grad_out``'s); ``(dq, dk, dv, dsinks)`` with ``dsinks`` (Hq,) when ``sinks``
    was given (also left in ``ctx.sinks_grad``). A :class:`ScoreMod`'s parameter gradients are added into its
    ``.grads``.
    """
    if not isinstance(ctx, FlexAttentionContext):
        raise TypeError(f"ctx must be the context flex_attention returned, got {type(ctx).__name__}")
    kctx = ctx.kernel_ctx
    _check("grad_out", grad_out)
    if grad_out.shape != ctx.out_shape:
        raise ValueError(f"grad_out must have shape {ctx.out_shape}, got {grad_out.shape}")
    if not isinstance(kctx, FlexContext):
        B, Hq, Lq, Dv = ctx.out_shape
        if ctx.group > 1:
            grad_out = grad_out.reshape(B, Hq // ctx.group, ctx.group, Lq, Dv)  # (B, Hkv, G, Lq, Dv)
        if ctx.kernel == "reference":
            grad_out = grad_out.astype(kctx.q.dtype, copy=False)  # the dtype the forward computed in
        dq, dk, dv, _ = attention_backward(grad_out, kctx)
        if ctx.group > 1:
            dq, dk, dv = dq.reshape(B, Hq, Lq, -1), dk[:, :, 0], dv[:, :, 0]  # (B, Hq, Lq, D), (B, Hkv, Lk, *)
        dsinks = getattr(kctx, "sinks_grad", None)
    else:
        dq, dk, dv, dsinks = flex_backward(grad_out, kctx)  # dk, dv (B, Hkv, Lk, *): summed over each group
    dq, dk, dv = (g.astype(ctx.dtype, copy=False) for g in (dq, dk, dv))
    if dsinks is None:
        return dq, dk, dv
    ctx.sinks_grad = dsinks = dsinks.astype(ctx.dtype, copy=False)
    return dq, dk, dv, dsinks

"""``flex_attention`` and ``flex_attention_backward``: the checked entry points."""
from __future__ import annotations

import math

import numpy as np

from ..kernels.flex import FlexContext, flex_backward, flex_forward
from .masks import BlockMask
from .modifiers import as_score_mod

__all__ = ["flex_attention", "flex_attention_backward", "FlexAttentionContext"]


class FlexAttentionContext:
    """What :func:`flex_attention_backward` needs. After the backward, ``sinks_grad`` (H,) holds the sinks'
    gradient (``None`` without sinks); the same array is also returned as the fourth value."""

    def __init__(self, kernel_ctx: FlexContext, group: int, q_dtype, weights):
        self.kernel_ctx = kernel_ctx
        self.group = group
        self.dtype = q_dtype
        self.weights = weights
        self.sinks_grad = None


def _check(name, x, ndim=4):
    if not isinstance(x, np.ndarray) or x.ndim != ndim or not np.issubdtype(x.dtype, np.floating):
        got = f"shape {x.shape} dtype {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
        raise ValueError(f"{name} must be a floating ndarray with {ndim} dims, got {got}")


def flex_attention(q, k, v, score_mod=None, block_mask: BlockMask | None = None, *, scale=None, sinks=None,
                   enable_gqa: bool = False, return_lse: bool = False, kernel: str = "auto"):
    """Attention whose scores are changed by ``score_mod`` and restricted by ``block_mask``.

    ``out = softmax([mask(score_mod(scale * q k^T)), sinks[h]]) v``: masked scores are removed, ``sinks``
    (optional) is a per-head logit that joins each row's softmax and contributes no value. Fully masked rows
    (without sinks) give zeros and ``lse = -inf``.

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
        Default ``1 / sqrt(D)``.
    sinks : ndarray, shape (Hq,), optional
    enable_gqa : bool
        Allow ``Hkv`` dividing ``Hq`` (query head h reads K/V head ``h // (Hq / Hkv)``).
    return_lse : bool
        Also return the log-sum-exp (B, Hq, Lq) (including the sink).
    kernel : {"auto", "reference", "tiled"}
        ``"reference"`` materialises the scores (``ctx.weights`` holds the (B, Hq, Lq, Lk) softmax);
        ``"tiled"`` visits the block mask's tiles, skipping empty ones and masking only partial ones.
        ``"auto"`` is ``"tiled"``.

    Returns
    -------
    out : ndarray, shape (B, Hq, Lq, Dv), dtype of q
    lse : ndarray, shape (B, Hq, Lq) (only with ``return_lse=True``)
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
    if Hkv != Hq and not (enable_gqa and Hq % Hkv == 0):
        raise ValueError(f"k has {Hkv} heads and q {Hq}: pass enable_gqa=True with Hq a multiple of Hkv")
    if kernel not in ("auto", "reference", "tiled"):
        raise ValueError(f"kernel must be 'auto', 'reference' or 'tiled', got {kernel!r}")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask from create_block_mask, got "
                            f"{type(block_mask).__name__}")
        bb, bh = block_mask.kinds.shape[:2]
        if (block_mask.q_len, block_mask.kv_len) != (Lq, k.shape[2]) or bb not in (1, B) or bh not in (1, Hq):
            raise ValueError(f"block_mask of shape {block_mask.shape} does not fit q {q.shape} and k {k.shape}")
    dtype = np.result_type(q.dtype, k.dtype, v.dtype)
    if sinks is not None:
        sinks = np.asarray(sinks)
        if sinks.shape != (Hq,):
            raise ValueError(f"sinks must have shape (Hq,) = ({Hq},), got {sinks.shape}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    group = Hq // Hkv  # the kernel reads each key/value head for its G query heads, without copies
    mod = as_score_mod(score_mod)
    tiled = kernel != "reference"
    out, lse, weights, kctx = flex_forward(
        q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False),
        scale=scale, score_mod=mod, mask_tile=None if block_mask is None else block_mask.tile_mask,
        kinds=None if block_mask is None else block_mask.kinds,
        block_q=None if block_mask is None else block_mask.block_q,
        block_k=None if block_mask is None else block_mask.block_k, sinks=sinks, tiled=tiled)
    ctx = FlexAttentionContext(kctx, group, dtype, weights)
    if return_lse:
        return out, lse.copy(), ctx
    return out, ctx


def flex_attention_backward(grad_out, ctx: FlexAttentionContext):
    """Gradients of :func:`flex_attention`.

    Parameters
    ----------
    grad_out : ndarray, shape (B, Hq, Lq, Dv)
    ctx : FlexAttentionContext

    Returns
    -------
    (dq, dk, dv) with the shapes of q, k, v; ``(dq, dk, dv, dsinks)`` with ``dsinks`` (Hq,) when ``sinks``
    was given (also left in ``ctx.sinks_grad``). A :class:`ScoreMod`'s parameter gradients are added into its
    ``.grads``.
    """
    if not isinstance(ctx, FlexAttentionContext):
        raise TypeError(f"ctx must be the context flex_attention returned, got {type(ctx).__name__}")
    kctx = ctx.kernel_ctx
    _check("grad_out", grad_out)
    if grad_out.shape != kctx.out.shape:
        raise ValueError(f"grad_out must have shape {kctx.out.shape}, got {grad_out.shape}")
    dq, dk, dv, dsinks = flex_backward(grad_out, kctx)  # dk, dv (B, Hkv, Lk, *): summed over each group
    if dsinks is None:
        return dq, dk, dv
    ctx.sinks_grad = dsinks
    return dq, dk, dv, dsinks

"""Tiled (FlashAttention-style) attention: online softmax forward, recomputing backward, threads.

Same semantics as :mod:`attnkit.kernels.reference` (boolean masks with ``True`` = may attend,
bottom-right-aligned causal masking and sliding windows, fully masked rows give zero output and zero
gradients, keys no query may attend to are zeroed so NaN/Inf padding cannot leak, inverted dropout after
the softmax from the counter-based :func:`~attnkit.kernels.dropout.keep_mask`), but nothing of size
``Lq x Lk`` is ever allocated: forward keeps the output and the per-row log-sum-exp, backward recomputes
the probabilities tile by tile (FlashAttention-2), so memory is linear in the sequence length. Tiles
entirely outside the causal band or the sliding window are skipped: with a window W the work is ~L W.

Dimension letters: ``...`` the broadcast leading batch/head dims of q, k, v, mask and bias (all heads of
a tile go to BLAS in one batched matmul); k and v keep their own leading shape, so grouped-query keys
``(B, Hkv, 1, Lk, D)`` are never repeated per query head ``(B, Hkv, G, Lq, D)``. Lq/Lk query/key length,
D query/key features, Dv value features, Tq/Tk tile lengths.

The code is a sequence of tile steps, each a function of what it reads: ``_Pass`` (geometry and settings
of one call), the operand dataclasses, and a per-worker :class:`_Scratch`. How the time is spent, the
tricks that remove overhead, and why the tiles have their sizes: ``docs/kernels.md``.
"""
from __future__ import annotations

import copy
import functools
import itertools
import math
import threading
from dataclasses import dataclass, field, replace

import numpy as np

from .._validation import unbroadcast
from ._masked_product import zero_safe_matmul
from ._threads import check_stop, default_num_threads, run_tasks
from ._tile_sizes import choose_heads, choose_tiles, heads_override, tile_override
from .bias import ScoreBias
from .dropout import keep_mask

__all__ = ["FlashContext", "flash_attention_forward", "flash_attention_backward", "default_blocks"]

_LAZY_SHIFT = 16.0  # exp(s - m) may reach e^16 before the shift m is moved (float32-safe)


def default_blocks(n_heads: int, seq_q: int, seq_k: int, num_threads: int = 1, split: str = "q", *,
                   head_dim: int = 64, value_dim: int | None = None, itemsize: int = 4,
                   l2: int | None = None) -> tuple[int, int]:
    """Default ``(block_q, block_k)`` for ``n_heads`` folded heads (why these sizes: ``docs/kernels.md``).

    The tile comes from the per-core L2 (``l2`` bytes, default read from the machine) through the cost
    model of :func:`attnkit.kernels._tile_sizes.choose_tiles`, unless ``ATTNKIT_TILE_Q`` /
    ``ATTNKIT_TILE_K`` set a length. ``split`` names the axis the tasks run over ("q" in the forward, "k"
    in the backward); unless set by the environment, that block is halved (down to 64) until every thread
    has at least two tasks.

    >>> default_blocks(8, 4096, 4096, l2=512 << 10)
    (256, 256)
    >>> default_blocks(8, 512, 512, num_threads=2, l2=512 << 10)
    (128, 256)
    >>> default_blocks(1, 32768, 32768, l2=1 << 20)
    (256, 512)
    """
    _, block_q, block_k = _tile_plan((n_heads,), (False,), seq_q, seq_k, num_threads, split, head_dim, value_dim,
                                     itemsize, (None, None), l2)
    return block_q, block_k


def _splittable_axes(lead: tuple[int, ...], k_shape, v_shape, bias, dropout: bool) -> tuple[bool, ...]:
    """Leading axes along which heads may go to different tasks.

    A task must write only gradients no other task writes: keys, values and an array bias that are shared
    along an axis (grouped-query keys, a per-head-shared bias) get the sum over it, so that axis stays in
    one task. A :class:`ScoreBias` and dropout produce every head's values per tile, so they keep all heads
    together.
    """
    nd = len(lead)
    if dropout or isinstance(bias, ScoreBias):
        return (False,) * nd
    owners = [_padded_lead(k_shape, nd), _padded_lead(v_shape, nd)]
    if bias is not None:
        owners.append(_padded_lead(bias.shape, nd))
    return tuple(n > 1 and all(own[i] == n for own in owners) for i, n in enumerate(lead))


def _head_blocks(lead: tuple[int, ...], splittable: tuple[bool, ...], group: int) -> list[tuple[slice, ...]]:
    """The leading index space cut into boxes of about ``group`` heads, as slices of each leading axis.

    Axes are filled from the last (heads) to the first (batch); an axis that may not be split is taken
    whole, so a box can hold more than ``group`` heads.

    >>> [tuple((c.start, c.stop) for c in box) for box in _head_blocks((2, 4), (True, True), 2)]
    [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((1, 2), (0, 2)), ((1, 2), (2, 4))]
    >>> len(_head_blocks((2, 4), (True, False), 2))  # the head axis is shared (grouped keys): whole
    2
    """
    chunk, budget = list(lead), max(1, group)
    for i in reversed(range(len(lead))):
        if splittable[i] and budget < lead[i]:
            chunk[i], budget = budget, 1
        else:
            budget = max(1, budget // max(1, lead[i]))
    # an empty axis (a batch of 0) has no boxes: step 1 over range(0) keeps range() away from a zero step
    axes = [[slice(a, min(a + c, n)) for a in range(0, n, max(1, c))] for n, c in zip(lead, chunk)]
    return list(itertools.product(*axes))


def _take(arr, heads: tuple[slice, ...], trailing: int):
    """The part of ``arr`` (leading dims broadcasting to the full leading shape, then ``trailing`` dims)
    that a box of heads reads; size-1 (broadcast) axes are kept whole. Non-arrays pass through."""
    if not isinstance(arr, np.ndarray):
        return arr
    n = arr.ndim - trailing
    offset = len(heads) - n
    return arr[tuple(slice(None) if arr.shape[j] == 1 else heads[offset + j] for j in range(n))]


def _tile_plan(lead, splittable, seq_q, seq_k, num_threads, split, head_dim, value_dim, itemsize, fixed,
               l2=None):
    """``(head boxes, block_q, block_k)`` of one call: the tile lengths and how many heads share a tile.

    Keywords (``fixed``) win over ``ATTNKIT_TILE_*``, which win over the cost model; the block the tasks
    run over is halved (down to 64) until every thread has two tasks, unless a keyword or the
    environment set it.
    """
    n_heads = math.prod(lead)
    env_q, env_k = tile_override()
    block_q, block_k = choose_tiles(n_heads, head_dim, value_dim, itemsize, l2)
    set_q, set_k = fixed[0] or env_q, fixed[1] or env_k
    block_q, block_k = set_q or block_q, set_k or block_k
    group = heads_override() or choose_heads(n_heads, min(block_q, seq_q) or 1, min(block_k, seq_k) or 1,
                                             head_dim, value_dim, itemsize, l2)
    boxes = _head_blocks(lead, splittable, group)
    if split == "q" and not set_q:
        while block_q > 64 and len(boxes) * -(-seq_q // block_q) < 2 * num_threads:
            block_q //= 2
    elif split != "q" and not set_k:
        while block_k > 64 and len(boxes) * -(-seq_k // block_k) < 2 * num_threads:
            block_k //= 2
    return boxes, max(1, min(block_q, seq_q)), max(1, min(block_k, seq_k))


@dataclass
class FlashContext:
    """What :func:`flash_attention_backward` needs from the forward: inputs, output, log-sum-exp.

    Nothing here is an array the forward returned: the output is a private copy.
    """

    q: np.ndarray  # (..., Lq, D) query as given (broadcasts to the leading shape), not scaled
    k_aug: np.ndarray  # (*Kl, Lk, D + 2) [k, 1, 1] in k's own leading shape, dead keys' features zeroed
    v_aug: np.ndarray  # (*Vl, Lk, Dv + 2) [v, 1, 1] in v's own leading shape, dead keys' features zeroed
    out: np.ndarray  # (*lead, Lq, Dv) in the compute dtype
    lse: np.ndarray  # (*lead, Lq) float64 log-sum-exp of the scaled, biased scores; +inf if fully masked
    scale: float
    lead: tuple[int, ...]  # broadcast leading shape
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    out_dtype: np.dtype
    mask: np.ndarray | None  # user mask (at least 2-D), not combined with causal
    causal: bool
    bias: np.ndarray | ScoreBias | None
    dropout_p: float
    dropout_seed: int | None
    drop_lead: tuple[int, ...]  # leading shape of the reference's weights (keep_mask's index space)
    blocks: tuple[int | None, int | None]  # the caller's block_q, block_k (None: default per pass)
    num_threads: int
    window: int | None = None
    bad_k: np.ndarray | None = None  # (Lk,) keys holding a NaN or inf in some head; None: all finite
    bad_v: np.ndarray | None = None  # (Lk,) the same for values


class _Tiles:
    """Tile geometry and per-tile masks/biases, shared by forward and backward."""

    def __init__(self, lead, seq_q, seq_k, mask, causal, bias, block_q, block_k, window=None):
        self.lead = lead
        self.seq_q, self.seq_k = seq_q, seq_k
        self.offset = seq_k - seq_q  # query i sees key j iff j <= i + offset (causal)
        self.mask, self.causal, self.bias = mask, causal, bias
        self.window = window  # with causal: query i also needs j > i + offset - window
        self.block_q, self.block_k = block_q, block_k
        self.q_blocks = [(q0, min(q0 + block_q, seq_q)) for q0 in range(0, seq_q, block_q)]
        self.k_blocks = [(k0, min(k0 + block_k, seq_k)) for k0 in range(0, seq_k, block_k)]

    def select(self, heads: tuple[slice, ...]) -> _Tiles:
        """The same tiles for a box of heads: its leading shape, and its part of the mask and bias."""
        sub = copy.copy(self)
        sub.lead = tuple(len(range(*h.indices(n))) for h, n in zip(heads, self.lead))
        sub.mask = _take(self.mask, heads, 2)
        sub.bias = _take(self.bias, heads, 2)
        return sub

    def causal_kind(self, q0, q1, k0, k1):
        """0: tile entirely outside the causal band (skip), 1: entirely visible, 2: partly visible."""
        if not self.causal:
            return 1
        top, bottom = q0 + self.offset, q1 - 1 + self.offset  # positions of the first and last query
        if k0 > bottom:
            return 0
        if self.window is None:
            return 1 if k1 - 1 <= top else 2
        if k1 - 1 <= top - self.window:
            return 0
        return 1 if k1 - 1 <= top and k0 > bottom - self.window else 2

    def k_range(self, q0, q1):
        """Key blocks a query block may see (causal: up to the last visible key; window: from the first)."""
        first, last = 0, self.seq_k
        if self.causal:
            last = min(self.seq_k, q1 + self.offset)
            if self.window is not None:
                first = q0 + self.offset - self.window + 1
        return [kb for kb, (k0, k1) in enumerate(self.k_blocks) if k0 < last and k1 > first]

    def q_range(self, k0, k1):
        """Query blocks that may see a key block (causal: from the first query seeing key k0)."""
        first, end = 0, self.seq_q
        if self.causal:
            first = k0 - self.offset
            if self.window is not None:
                end = k1 - 1 - self.offset + self.window  # queries i < end see key k1 - 1
        return [qb for qb, (q0, q1) in enumerate(self.q_blocks) if q1 - 1 >= first and q0 < end]

    def band(self, q0, q1, k0, k1):
        """(Tq, Tk) bool: the causal (and window) band of a tile."""
        kk = np.arange(k0, k1)[None, :]  # (1, Tk)
        pos = np.arange(q0, q1)[:, None] + self.offset  # (Tq, 1)
        allowed = kk <= pos  # (Tq, Tk)
        if self.window is not None:
            allowed &= kk > pos - self.window
        return allowed

    def blocked(self, q0, q1, k0, k1):
        """``(skip, blocked)``: skip the tile entirely, or the entries to mask (None: none).

        ``blocked`` is a boolean array broadcastable to the score tile ``(*lead, Tq, Tk)``.
        """
        kind = self.causal_kind(q0, q1, k0, k1)
        if kind == 0:
            return True, None
        allowed = self.band(q0, q1, k0, k1) if kind == 2 else None  # (Tq, Tk)
        if self.mask is not None:
            mt = _tile(self.mask, q0, q1, k0, k1)  # (..., Tq|1, Tk|1)
            allowed = mt if allowed is None else (mt & allowed)
        if allowed is None:
            return False, None
        if not allowed.any():
            return True, None
        if allowed.all():
            return False, None
        return False, ~allowed

    def bias_tile(self, q0, q1, k0, k1):
        if isinstance(self.bias, ScoreBias):
            return self.bias.tile(np.arange(q0, q1), np.arange(k0, k1), self.seq_q, self.seq_k)
        return _tile(self.bias, q0, q1, k0, k1)


def _tile(arr: np.ndarray, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
    """View of the ``[q0:q1, k0:k1]`` tile of an array broadcastable to (..., Lq, Lk) (size-1 axes kept)."""
    qs = slice(None) if arr.shape[-2] == 1 else slice(q0, q1)
    ks = slice(None) if arr.shape[-1] == 1 else slice(k0, k1)
    return arr[..., qs, ks]  # (..., Tq|1, Tk|1)


def _at_least_2d_right(x: np.ndarray) -> np.ndarray:
    """Prepend unit axes so that ``x`` has the two trailing (query, key) axes."""
    return x.reshape((1,) * (2 - x.ndim) + x.shape) if x.ndim < 2 else x


def _live_keys(mask: np.ndarray | None, tiles: _Tiles):
    """Keys at least one query may attend to, shape (..., Lk); None when all are live.

    Computed block by block over the queries when a full mask is combined with causal masking, so
    nothing of size Lq x Lk is built beyond the caller's own mask.
    """
    seq_q, seq_k = tiles.seq_q, tiles.seq_k
    if mask is None:
        if not tiles.causal or tiles.window is None:
            return None  # causal alone: key j is seen by the last query (j <= Lq - 1 + Lk - Lq)
        live = np.arange(seq_k) > tiles.offset - tiles.window if seq_q else np.zeros(seq_k, bool)  # (Lk,)
    elif not tiles.causal or (mask.shape[-2] == 1 and tiles.window is None):
        live = mask.any(axis=-2)  # (..., Lk); a causal row still sees every key of the last query
        if tiles.causal and seq_q == 0:
            live = np.zeros_like(live)
    else:
        live = np.zeros(mask.shape[:-2] + (seq_k,), dtype=bool)  # (..., Lk)
        for q0, q1 in tiles.q_blocks:
            rows = mask[..., q0:q1, :] if mask.shape[-2] != 1 else mask  # (..., Tq|1, Lk|1)
            live |= (rows & tiles.band(q0, q1, 0, seq_k)).any(axis=-2)  # (..., Lk)
    if live.all():
        return None
    return np.broadcast_to(live, live.shape[:-1] + (seq_k,))  # a per-query mask has a size-1 key axis


def _check(q, k, v):
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(f"query, key and value must be at least 2-D (..., L, D), got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"key has {k.shape[-1]} features but query has {q.shape[-1]} "
                         f"(query: {q.shape}, key: {k.shape})")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"value has {v.shape[-2]} positions but key has {k.shape[-2]} "
                         f"(key: {k.shape}, value: {v.shape})")


def _positive(value, name):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _padded_lead(shape: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """The leading (batch/head) part of ``shape`` (..., L, F), with unit axes prepended up to ``ndim``."""
    lead = tuple(shape[:-2])
    return (1,) * (ndim - len(lead)) + lead


def _reduce_to_lead(live: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """``live`` (..., Lk) reduced with ``any`` over the axes where ``lead`` is 1 (a shared key is live if
    any sharer sees it), so that it broadcasts against arrays of leading shape ``lead``."""
    live = live.reshape((1,) * (len(lead) + 1 - live.ndim) + live.shape)  # (*lead', Lk)
    axes = tuple(i for i, n in enumerate(lead) if n == 1 and live.shape[i] != 1)
    return live.any(axis=axes, keepdims=True) if axes else live


def _group_axes(lead: tuple[int, ...], own: tuple[int, ...]) -> tuple[int, ...]:
    """Axes of the leading shape along which an operand of leading shape ``own`` is shared."""
    return tuple(i for i, (n, m) in enumerate(zip(lead, own)) if m == 1 and n != 1)


class _Scratch:
    """Per-worker flat buffers handed out as views of each tile's shape (no allocation per tile)."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        size = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.size < size:
            buf = self.buffers[name] = np.empty(size, self.dtype)
        return buf[:size].reshape(shape)


@dataclass
class _Pass:
    """Settings of one forward or backward call that every tile step reads."""

    tiles: _Tiles
    dtype: np.dtype  # compute dtype, float32 or float64
    scale: np.floating  # in the compute dtype: a float64 scalar would upcast float32 tiles
    fold: bool  # no additive bias: the row shift rides in the score matmul (docs/kernels.md)
    dropout_p: float
    seed: int | None
    drop_lead: tuple[int, ...]

    def select(self, heads: tuple[slice, ...]) -> _Pass:
        return replace(self, tiles=self.tiles.select(heads))

    @property
    def dropout(self) -> bool:
        return self.dropout_p > 0.0

    def keep(self, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        """Dropout keep-mask of a tile, (*drop_lead, Tq, Tk)."""
        return keep_mask(self.seed, self.dropout_p, self.drop_lead, np.arange(q0, q1), np.arange(k0, k1),
                         self.tiles.seq_q, self.tiles.seq_k)


# ----------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------
def _normalise(q, k, v, mask, bias, dropout_p, dropout_seed, causal, window, num_threads):
    """Check the arguments; return the arrays, dtypes, mask, bias, window and thread count to use."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check(q, k, v)
    out_dtype = np.result_type(q.dtype, k.dtype, v.dtype)
    if out_dtype.kind != "f":
        out_dtype = np.dtype(np.float64)
    dtype = np.dtype(np.float64) if out_dtype.itemsize > 4 else np.dtype(np.float32)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("dropout_seed is required when dropout_p > 0")
    num_threads = _positive(num_threads, "num_threads") or default_num_threads()
    window = _positive(window, "window")
    if window is not None and not causal:
        raise ValueError(f"window={window} requires causal=True")
    if mask is not None:
        mask = _at_least_2d_right(np.asarray(mask))
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    if bias is not None and not isinstance(bias, ScoreBias):
        bias = _at_least_2d_right(np.asarray(bias))
    return q, k, v, out_dtype, dtype, mask, bias, window, num_threads


@dataclass
class _ForwardData:
    """The forward's operands: inputs in the augmented layout, and the outputs being filled."""

    q: np.ndarray  # (..., Lq, D)
    k_aug: np.ndarray  # (*Kl, Lk, D+2) [k, 1, 1]
    v_aug: np.ndarray  # (*Vl, Lk, Dv+2) [v, 1, 1]
    kmax: np.ndarray  # (*Kl, nKb) largest key norm of each key block (+inf: no bound)
    out: np.ndarray  # (*lead, Lq, Dv)
    lse: np.ndarray  # (*lead, Lq) float64
    bad_v: np.ndarray | None = None  # (Lk,) values holding a NaN or inf; None: all finite

    def select(self, heads: tuple[slice, ...]) -> _ForwardData:
        """Views of the operands a box of heads reads and writes."""
        return _ForwardData(q=_take(self.q, heads, 2), k_aug=_take(self.k_aug, heads, 2),
                            v_aug=_take(self.v_aug, heads, 2), kmax=_take(self.kmax, heads, 1),
                            out=_take(self.out, heads, 2), lse=_take(self.lse, heads, 1), bad_v=self.bad_v)


def _augment_block(kb: int, worker: int, k, v, live_k, live_v, tiles, k_aug, v_aug, kmax, bad_k, bad_v) -> None:
    """Copy one key block into the augmented layout, zero its dead keys, take its largest key norm.

    Keys or values holding a NaN or inf are marked in ``bad_k`` / ``bad_v`` (Lk,); such keys are left out
    of the norm bound, so that a value a query may not see cannot change how that query's row is shifted
    (their scores are NaN or infinite wherever they are seen, whatever the shift).
    """
    k0, k1 = tiles.k_blocks[kb]
    d, dv = k.shape[-1], v.shape[-1]
    k_aug[..., k0:k1, :d] = k[..., k0:k1, :]
    v_aug[..., k0:k1, :dv] = v[..., k0:k1, :]
    k_aug[..., k0:k1, d:] = 1
    v_aug[..., k0:k1, dv:] = 1
    if live_k is not None:
        np.copyto(k_aug[..., k0:k1, :d], 0, where=~live_k[..., k0:k1, None])  # (..., Tk, D)
        np.copyto(v_aug[..., k0:k1, :dv], 0, where=~live_v[..., k0:k1, None])  # (..., Tk, Dv)
    block = k_aug[..., k0:k1, :d]  # (*Kl, Tk, D)
    norms = np.einsum("...ld,...ld->...l", block, block)  # (*Kl, Tk)
    finite_k = np.isfinite(block).all(axis=-1)  # (*Kl, Tk)
    finite_v = np.isfinite(v_aug[..., k0:k1, :dv]).all(axis=-1)  # (*Vl, Tk)
    if not finite_k.all():
        norms = np.where(finite_k, norms, 0)  # (*Kl, Tk)
        bad_k[k0:k1] = ~finite_k.reshape(-1, k1 - k0).all(axis=0)  # (Tk,)
    if not finite_v.all():
        bad_v[k0:k1] = ~finite_v.reshape(-1, k1 - k0).all(axis=0)  # (Tk,)
    kmax[..., kb] = np.sqrt(norms.max(axis=-1))  # (*Kl,)


def _augment_keys(k, v, mask, tiles, dtype, num_threads):
    """``k_aug``, ``v_aug`` (keys/values with ones columns, dead keys zeroed) and per-block key norms."""
    nd = len(tiles.lead)
    k_lead, v_lead = _padded_lead(k.shape, nd), _padded_lead(v.shape, nd)
    seq_k, d, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    live = _live_keys(mask, tiles)  # (..., Lk) or None
    live_k = None if live is None else _reduce_to_lead(live, k_lead)  # (..., Lk)
    live_v = None if live is None else _reduce_to_lead(live, v_lead)  # (..., Lk)
    k_aug = np.empty(k_lead + (seq_k, d + 2), dtype)  # (*Kl, Lk, D+2)
    v_aug = np.empty(v_lead + (seq_k, dv + 2), dtype)  # (*Vl, Lk, Dv+2)
    kmax = np.empty(k_lead + (len(tiles.k_blocks),))  # (*Kl, nKb)
    bad_k, bad_v = np.zeros(seq_k, bool), np.zeros(seq_k, bool)  # (Lk,) each
    step = functools.partial(_augment_block, k=k, v=v, live_k=live_k, live_v=live_v, tiles=tiles,
                             k_aug=k_aug, v_aug=v_aug, kmax=kmax, bad_k=bad_k, bad_v=bad_v)
    run_tasks(list(range(len(tiles.k_blocks))), step, num_threads)  # copies in parallel too
    if not np.isfinite(kmax).all():  # finite keys whose squared norm overflows: no bound, every tile takes its max
        kmax[...] = np.inf
    return k_aug, v_aug, kmax, (bad_k if bad_k.any() else None), (bad_v if bad_v.any() else None)


def flash_attention_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, mask: np.ndarray | None = None,
                            causal: bool = False, scale: float | None = None,
                            bias: np.ndarray | ScoreBias | None = None, dropout_p: float = 0.0,
                            dropout_seed: int | None = None, block_q: int | None = None,
                            block_k: int | None = None, num_threads: int | None = None,
                            window: int | None = None):
    """Tiled softmax attention ``dropout(softmax(scale * q @ k.T + bias, masked)) @ v``.

    Shapes
    ------
    q : (..., Lq, D); k : (..., Lk, D); v : (..., Lk, Dv), leading dims broadcast against each other.
    mask : bool, broadcastable to (..., Lq, Lk); ``True`` = may attend (PyTorch's boolean
        ``attn_mask`` of ``scaled_dot_product_attention`` means the same; ``nn.MultiheadAttention``'s
        boolean masks mean the opposite). Never expanded: it is sliced tile by tile.
    bias : ndarray broadcastable to (..., Lq, Lk), or a :class:`ScoreBias` asked for each tile.
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
        ``ATTNKIT_TILE_Q`` / ``ATTNKIT_TILE_K``).
    num_threads : int, optional
        Tile threads; default: the cores this process may run on (CPU affinity). With more than one,
        BLAS runs single-threaded.

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
    q, k, v, out_dtype, dtype, mask, bias, window, num_threads = _normalise(
        q, k, v, mask, bias, dropout_p, dropout_seed, causal, window, num_threads)
    seq_q, d = q.shape[-2:]
    seq_k, dv = v.shape[-2:]
    extra = [m.shape[:-2] for m in (mask, bias) if isinstance(m, np.ndarray)]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], *extra)
    drop_lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], *extra)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    fixed_blocks = (_positive(block_q, "block_q"), _positive(block_k, "block_k"))
    splittable = _splittable_axes(lead, k.shape, v.shape, bias, dropout_p > 0.0)
    boxes, tile_q, tile_k = _tile_plan(lead, splittable, seq_q, seq_k, num_threads, "q", d, dv, dtype.itemsize,
                                       fixed_blocks)
    tiles = _Tiles(lead, seq_q, seq_k, mask, causal, bias, tile_q, tile_k, window)
    k_aug, v_aug, kmax, bad_k, bad_v = _augment_keys(k, v, mask, tiles, dtype, num_threads)
    data = _ForwardData(q=q, k_aug=k_aug, v_aug=v_aug, kmax=kmax, out=np.zeros(lead + (seq_q, dv), dtype),
                        lse=np.full(lead + (seq_q,), np.inf), bad_v=bad_v)  # lse float64: backward splits it
    run = _Pass(tiles=tiles, dtype=dtype, scale=dtype.type(scale), fold=bias is None,
                dropout_p=float(dropout_p), seed=dropout_seed, drop_lead=drop_lead)
    if math.prod(lead) and seq_q and seq_k:
        order = list(range(len(tiles.q_blocks)))
        if causal:
            order.reverse()  # the last query blocks see the most keys: hand them out first
        views = [(run.select(box), data.select(box)) for box in boxes]
        tasks = [(view, qb) for qb in order for view in range(len(views))]
        scratch = [_Scratch(dtype) for _ in range(num_threads)]
        run_tasks(tasks, functools.partial(_forward_block, views=views, scratch=scratch), num_threads)
    ctx = FlashContext(q=q, k_aug=k_aug, v_aug=v_aug, out=data.out, lse=data.lse, scale=scale, lead=lead,
                       q_shape=q.shape, k_shape=k.shape, v_shape=v.shape, out_dtype=out_dtype, mask=mask,
                       causal=causal, bias=bias, dropout_p=float(dropout_p), dropout_seed=dropout_seed,
                       drop_lead=drop_lead, blocks=fixed_blocks, num_threads=num_threads, window=window,
                       bad_k=bad_k, bad_v=bad_v)
    # copies: the caller may edit what it gets back, the backward reads ctx.out and ctx.lse
    return data.out.astype(out_dtype, copy=True), data.lse.astype(out_dtype, copy=True), ctx


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
    d, dv = data.q.shape[-1], data.out.shape[-1]
    qa = scratch.get("qa", lead + (tq, d + 1))  # (*lead, Tq, D+1)
    np.multiply(data.q[..., q0:q1, :], run.scale, out=qa[..., :d])
    qa[..., d] = 0
    qn = np.sqrt(np.einsum("...ld,...ld->...l", qa[..., :d], qa[..., :d])) if run.fold else None  # (*lead, Tq)
    if qn is not None and not np.isfinite(qn).all():
        # a query holding NaN or inf has non-finite scores whatever its shift: leave it out of the block's
        # bound, so that it cannot change how the other rows are shifted (and so their rounding)
        qn[~np.isfinite(qa[..., :d]).all(axis=-1)] = 0
    acc = scratch.get("acc", lead + (tq, dv + 1))  # (*lead, Tq, Dv+1)
    acc[...] = 0
    pv = scratch.get("pv", lead + (tq, dv + 1))  # (*lead, Tq, Dv+1)
    m = np.zeros(lead + (tq,), run.dtype)  # (*lead, Tq)
    l_sum = np.zeros(lead + (tq,), run.dtype) if run.dropout else acc[..., dv]  # (*lead, Tq)
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
    np.matmul(rows.qa, data.k_aug[..., k0:k1, :d + 1].swapaxes(-1, -2), out=s)  # scale q.k (- m if folded)
    if not run.fold:
        np.add(s, run.tiles.bias_tile(rows.q0, rows.q1, k0, k1), out=s)
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
    dv = data.out.shape[-1]
    # a masked entry's p is exactly 0; where it meets a NaN or inf value, 0 * NaN must stay 0
    product = zero_safe_matmul if (blocked is not None and data.bad_v is not None
                                   and data.bad_v[k0:k1].any()) else np.matmul
    if rows.first and alpha is None and not run.dropout:
        product(s, data.v_aug[..., k0:k1, :dv + 1], out=rows.acc)  # (*lead, Tq, Dv+1)
    else:
        product(s, data.v_aug[..., k0:k1, :dv + 1], out=rows.pv)  # (*lead, Tq, Dv+1)
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
    dv = data.out.shape[-1]
    ok = rows.l_sum > 0  # (*lead, Tq) rows that attend to at least one key
    norm = np.divide(1.0 if not run.dropout else 1.0 / (1.0 - run.dropout_p), rows.l_sum, where=ok,
                     out=np.zeros(rows.l_sum.shape, run.dtype))  # (*lead, Tq)
    np.multiply(rows.acc[..., :dv], norm[..., None], out=data.out[..., rows.q0:rows.q1, :])
    log_l = np.log(rows.l_sum.astype(np.float64), where=ok, out=np.zeros(rows.l_sum.shape))  # (*lead, Tq)
    data.lse[..., rows.q0:rows.q1] = np.where(ok, rows.m + log_l, np.inf)


# ----------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------
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
    lock: threading.Lock = field(default_factory=threading.Lock)  # ScoreBias.accumulate_grad

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
    lead, (seq_q, dv), d = ctx.lead, ctx.out.shape[-2:], ctx.q.shape[-1]
    do_aug = np.empty(lead + (seq_q, dv + 2), dtype)  # (*lead, Lq, Dv+2)
    do_aug[..., :dv] = grad_out
    d_row = np.einsum("...ld,...ld->...l", do_aug[..., :dv], ctx.out, dtype=np.float64)  # (*lead, Lq)
    d_hi, d_lo = _split(d_row, dtype)
    np.negative(d_hi, out=do_aug[..., dv])
    np.negative(d_lo, out=do_aug[..., dv + 1])
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
    (dQ partial sums are reduced in a fixed order; see ``docs/kernels.md``). A :class:`ScoreBias`'s
    ``accumulate_grad`` is called once per tile, in an order that may vary between threaded runs.

    Shapes
    ------
    grad_out : (..., Lq, Dv), broadcastable to the forward output.

    Returns
    -------
    dq, dk, dv : ndarrays shaped like the forward's q, k, v (broadcast dims summed: grouped-query keys
        and values get the sum over their group)
    dbias : ndarray shaped like an array ``bias``, else None (a ScoreBias gets ``accumulate_grad`` per tile)
    """
    lead, (seq_q, dv) = ctx.lead, ctx.out.shape[-2:]
    seq_k, dtype = ctx.k_aug.shape[-2], ctx.out.dtype
    grad_out = np.asarray(grad_out)
    _check_grad(grad_out, lead + (seq_q, dv))
    splittable = _splittable_axes(lead, ctx.k_shape, ctx.v_shape, ctx.bias, ctx.dropout_p > 0.0)
    boxes, tile_q, tile_k = _tile_plan(lead, splittable, seq_q, seq_k, ctx.num_threads, "k",  # tasks: key blocks
                                       ctx.q.shape[-1], dv, dtype.itemsize, ctx.blocks)
    tiles = _Tiles(lead, seq_q, seq_k, ctx.mask, ctx.causal, ctx.bias, tile_q, tile_k, ctx.window)
    run = _Pass(tiles=tiles, dtype=dtype, scale=dtype.type(ctx.scale), fold=ctx.bias is None,
                dropout_p=ctx.dropout_p, seed=ctx.dropout_seed, drop_lead=ctx.drop_lead)
    # two lanes per thread: tasks still balance when a core is busy elsewhere; the count depends on
    # num_threads only, never on scheduling, so the reduction order is fixed
    n_lanes = 1 if ctx.num_threads == 1 else min(2 * ctx.num_threads, len(tiles.k_blocks))
    lanes = _lanes(len(tiles.k_blocks), max(1, n_lanes))
    data = _backward_data(grad_out, ctx, run, len(lanes))
    if math.prod(lead) and seq_q and seq_k:
        views = [(run.select(box), data.select(box)) for box in boxes]
        scratch = [_Scratch(dtype) for _ in range(ctx.num_threads)]
        step = functools.partial(_backward_lane, views=views, lanes=lanes, scratch=scratch)
        run_tasks([(view, lane) for lane in range(len(lanes)) for view in range(len(views))], step, ctx.num_threads)
    dq = data.dq_lanes[0]
    for partial in data.dq_lanes[1:]:  # fixed order: bitwise reproducible
        np.add(dq, partial, out=dq)
    np.multiply(dq, run.scale, out=dq)
    cast = ctx.out_dtype
    dq = unbroadcast(dq, ctx.q_shape).astype(cast, copy=False)
    dk = unbroadcast(data.dk, ctx.k_shape).astype(cast, copy=False)
    dv_ = unbroadcast(data.dv, ctx.v_shape).astype(cast, copy=False)
    return dq, dk, dv_, _reduce_dbias(data.dbias_lanes, cast)


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


def _probabilities(run: _Pass, data: _BackwardData, box, blocked, scratch: _Scratch) -> np.ndarray:
    """The tile's softmax probabilities before dropout, recomputed from q, k and the log-sum-exp."""
    q0, q1, k0, k1 = box
    p = scratch.get("p", run.tiles.lead + (q1 - q0, k1 - k0))  # (*lead, Tq, Tk)
    np.matmul(data.q_aug[..., q0:q1, :], data.k_aug[..., k0:k1, :].swapaxes(-1, -2), out=p)  # s - lse or s
    if not run.fold:
        np.add(p, run.tiles.bias_tile(q0, q1, k0, k1), out=p)
        np.subtract(p, data.lse_hi[..., q0:q1, None], out=p)
        if run.dtype == np.float32:
            np.subtract(p, data.lse_lo[..., q0:q1, None], out=p)
    if blocked is not None:
        np.copyto(p, -np.inf, where=blocked)
    return np.exp(p, out=p)


def _score_grads(run: _Pass, data: _BackwardData, box, p: np.ndarray, scratch: _Scratch) -> np.ndarray:
    """``dS = P (dP - D)`` of the tile; with dropout, ``p`` becomes the dropped, rescaled weights."""
    q0, q1, k0, k1 = box
    dv = data.dv.shape[-1]
    ds = scratch.get("ds", p.shape)  # (*lead, Tq, Tk)
    if not run.dropout:
        np.matmul(data.do_aug[..., q0:q1, :], data.v_aug[..., k0:k1, :].swapaxes(-1, -2), out=ds)  # dP - D
        return np.multiply(ds, p, out=ds)
    keep = run.keep(q0, q1, k0, k1)  # (*drop_lead, Tq, Tk)
    keep_scale = run.dtype.type(1.0 / (1.0 - run.dropout_p))
    np.matmul(data.do_aug[..., q0:q1, :dv], data.v_aug[..., k0:k1, :dv].swapaxes(-1, -2), out=ds)  # dO.v
    np.multiply(ds, keep, out=ds)
    np.multiply(ds, keep_scale, out=ds)  # dP, the gradient of the weights before dropout
    np.add(ds, data.do_aug[..., q0:q1, dv:dv + 1], out=ds)  # dP - D (the columns hold -D)
    np.add(ds, data.do_aug[..., q0:q1, dv + 1:], out=ds)
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
    (zero_safe_matmul if zero_safe else np.matmul)(a, b, out=product)
    if axes:
        product = product.sum(axis=axes, keepdims=True)
    np.add(target, product, out=target)


def _backward_tile(run: _Pass, data: _BackwardData, lane: int, box, blocked, scratch: _Scratch) -> None:
    """One tile's contribution to dV, dK (the key block's own rows), dQ (the lane's buffer) and the bias."""
    q0, q1, k0, k1 = box
    d, dv = data.dk.shape[-1], data.dv.shape[-1]
    p = _probabilities(run, data, box, blocked, scratch)  # (*lead, Tq, Tk)
    ds = _score_grads(run, data, box, p, scratch)  # (*lead, Tq, Tk); p is now the dropped weights
    bad_k = blocked is not None and data.bad_k is not None and data.bad_k[k0:k1].any()
    if blocked is not None and data.bad_v is not None and data.bad_v[k0:k1].any():
        np.copyto(ds, 0, where=blocked)  # masked: p = 0, but dP = dO . v is NaN where v is
    _add_product(data.dv[..., k0:k1, :], p.swapaxes(-1, -2), data.do_aug[..., q0:q1, :dv], data.v_axes,
                 scratch, "kv")  # (*Vl, Tk, Dv)
    if run.tiles.bias is not None:
        _bias_grad(run.tiles, data, lane, ds, box)
    _add_product(data.dq_lanes[lane][..., q0:q1, :], ds, data.k_aug[..., k0:k1, :d], (), scratch, "q", bad_k)
    _add_product(data.dk[..., k0:k1, :], ds.swapaxes(-1, -2), data.q_aug[..., q0:q1, :d], data.k_axes,
                 scratch, "kv")  # (*Kl, Tk, D); q_aug holds the scaled q


def _bias_grad(tiles: _Tiles, data: _BackwardData, lane: int, ds: np.ndarray, box) -> None:
    """Hand the score gradient of one tile to the bias: a ScoreBias's hook, or the lane's array tile."""
    q0, q1, k0, k1 = box
    if isinstance(tiles.bias, ScoreBias):
        with data.lock:  # accumulate_grad updates shared parameter gradients
            tiles.bias.accumulate_grad(np.arange(q0, q1), np.arange(k0, k1), tiles.seq_q, tiles.seq_k, ds)
        return
    target = _tile(data.dbias_lanes[lane], q0, q1, k0, k1)  # (..., Tq|1, Tk|1) view into the lane's dbias
    target += unbroadcast(ds, target.shape)

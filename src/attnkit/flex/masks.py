"""Mask modifiers ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: attend) and the :class:`BlockMask`.

Index arguments are broadcastable integer arrays as for score modifiers; a mask modifier returns a boolean
array broadcastable to (B, H, Tq, Tk).

The built-in causal, sliding-window and padding masks (and their :func:`and_masks`) also carry a
:class:`KernelMask`: the same mask in the arguments of attnkit's attention kernels (``causal``, ``window``,
a key mask). :func:`flex_attention` hands such a description to the tiled FlashAttention kernel, which
needs neither the mask function nor a block classification, so the common variants cost what they cost
without modifiers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .._validation import check_positive_int
from ..kernels.flex import score_index

__all__ = ["KernelMask", "boolean_mask", "causal_mask", "causal_lower_right", "sliding_window_mask", "chunked_mask",
           "document_mask", "prefix_lm_mask", "padding_mask", "and_masks", "or_masks", "BlockMask", "create_block_mask",
           "EMPTY", "PARTIAL", "FULL"]

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class KernelMask:
    """A mask in the attention kernels' own terms: query i sees key j iff all of

    - ``j <= i + offset`` (``offset`` None: no causal limit),
    - ``j > i + offset - window`` (``window`` None: no window; requires an ``offset``),
    - ``key_mask[b, j]`` (``key_mask`` (B', Lk) bool, B' 1 or B; None: every key),
    - ``dense[b, h, i, j]`` (``dense`` bool of shape (B'|1, H'|1, Lq|1, Lk|1); None: every pair).

    The kernels align causal masks at the bottom-right corner, so they take it when
    ``offset == kv_len - q_len``.
    """

    offset: int | None = None
    window: int | None = None
    key_mask: np.ndarray | None = None
    dense: np.ndarray | None = None

    def __and__(self, other: KernelMask) -> KernelMask | None:
        """Both masks at once, or None when the kernels cannot say it (two different causal offsets)."""
        if None not in (self.offset, other.offset) and self.offset != other.offset:
            return None
        offset = self.offset if other.offset is None else other.offset
        windows = [w for w in (self.window, other.window) if w is not None]
        keys = [m for m in (self.key_mask, other.key_mask) if m is not None]
        key_mask = keys[0] if len(keys) == 1 else (np.logical_and(*keys) if keys else None)
        dense = [m for m in (self.dense, other.dense) if m is not None]
        dense = dense[0] if len(dense) == 1 else (np.logical_and(*dense) if dense else None)
        return KernelMask(offset, min(windows) if windows else None, key_mask, dense)


def _describe(mask: Callable, kernel_mask: KernelMask | None) -> Callable:
    mask.kernel_mask = kernel_mask
    return mask


def kernel_mask_of(mask_mod) -> KernelMask | None:
    """The :class:`KernelMask` a mask modifier carries, or None (a mask only its function can say)."""
    return getattr(mask_mod, "kernel_mask", None)


def boolean_mask(mask) -> Callable:
    """Attend where ``mask[b, h, q_idx, kv_idx]`` is True: a mask given as an array, shape (B|1, H|1, Lq|1, Lk|1).

    The kernels take it as their own ``mask`` argument (tile by tile, never expanded), so it costs what a
    mask costs without flex.

    Examples
    --------
    >>> m = boolean_mask(np.array([[True, False], [True, True]])[None, None])
    >>> m(0, 0, np.arange(2)[:, None], np.arange(2)[None]).tolist()
    [[True, False], [True, True]]
    """
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ or mask.ndim != 4:
        raise ValueError(f"boolean_mask: mask must be a 4-D boolean array (B|1, H|1, Lq|1, Lk|1), got shape "
                         f"{mask.shape} and dtype {mask.dtype}")

    def allowed(b, h, q_idx, kv_idx):
        index = tuple(0 if n == 1 else np.asarray(i) for n, i in zip(mask.shape, (b, h, q_idx, kv_idx)))
        return mask[index]
    return _describe(allowed, KernelMask(dense=mask))


def causal_mask(b, h, q_idx, kv_idx):
    """``kv_idx <= q_idx`` (top-left aligned, as torch's FlexAttention examples)."""
    return np.asarray(kv_idx) <= np.asarray(q_idx)


causal_mask.kernel_mask = KernelMask(offset=0)


def causal_lower_right(q_len: int, kv_len: int) -> Callable:
    """Causal attention aligned at the bottom-right corner: query i sees keys ``kv_idx <= i + kv_len - q_len``.

    The queries are the last ``q_len`` of the ``kv_len`` positions, as when new tokens attend to a cache (torch's
    ``causal_lower_right``, attnkit's ``causal=True`` for Lq != Lk). With ``q_len == kv_len`` this is
    :func:`causal_mask`; a query with no key left (``q_len > kv_len``) gets a zero output.

    Examples
    --------
    >>> causal_lower_right(2, 4)(0, 0, np.arange(2)[:, None], np.arange(4)[None]).astype(int).tolist()
    [[1, 1, 1, 0], [1, 1, 1, 1]]
    """
    q_len, kv_len = check_positive_int(q_len, "q_len"), check_positive_int(kv_len, "kv_len")
    offset = kv_len - q_len

    def mask(b, h, q_idx, kv_idx):
        return np.asarray(kv_idx) <= np.asarray(q_idx) + offset
    return _describe(mask, KernelMask(offset=offset))


def sliding_window_mask(window: int, *, offset: int = 0) -> Callable:
    """Causal window of ``window`` keys: ``q + offset - window < kv_idx <= q + offset`` for query ``q``.

    ``offset`` = ``kv_len - q_len`` aligns the window at the bottom-right corner (new tokens after a cache).
    """
    window = check_positive_int(window, "window")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    offset = int(offset)

    def mask(b, h, q_idx, kv_idx):
        q, k = np.asarray(q_idx) + offset, np.asarray(kv_idx)
        return (k <= q) & (k > q - window)
    return _describe(mask, KernelMask(offset=offset, window=window))


def chunked_mask(chunk: int, *, offset: int = 0, positions=None) -> Callable:
    """Causal attention inside chunks of ``chunk`` positions (Llama 4's chunked layers): query q, the key index
    ``q + offset``, sees key k iff ``k <= q + offset`` and both lie in one chunk, ``pos[k] // C == pos[q + offset]
    // C``.

    ``positions`` (Lk,) or (B, Lk) non-negative ints: each key's position (a left-padded row's count of real
    tokens before it, so that its chunks start at its first real token, as transformers' chunked mask does);
    default: its index. ``offset`` = ``kv_len - q_len`` aligns the queries at the bottom-right corner (new tokens
    after a cache). With positions the mask also carries its :class:`KernelMask` (the same-chunk pairs as a dense
    (B', 1, Lq, Lk) part), so the tiled kernel runs it.

    Examples
    --------
    >>> chunked_mask(2)(0, 0, np.arange(4)[:, None], np.arange(4)[None]).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    >>> m = chunked_mask(2, offset=1, positions=np.array([[0, 0, 1, 2]]))  # a left pad, then positions 1 and 2
    >>> m(0, 0, np.arange(3)[:, None], np.arange(4)[None]).astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    """
    chunk = check_positive_int(chunk, "chunk")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise TypeError(f"offset must be a non-negative int, got {offset!r}")
    offset = int(offset)
    if positions is None:
        def by_index(b, h, q_idx, kv_idx):
            q, k = np.asarray(q_idx) + offset, np.asarray(kv_idx)
            return (q // chunk == k // chunk) & (k <= q)
        return by_index
    pos = _per_batch(positions, "positions")
    if pos.dtype.kind not in "iu" or (pos < 0).any() or pos.shape[1] <= offset:
        raise ValueError(f"positions must be non-negative ints of shape (Lk,) or (B, Lk) with Lk > offset "
                         f"({offset}), got dtype {pos.dtype} and shape {pos.shape}")
    chunks = pos // chunk  # (B', Lk)

    def mask(b, h, q_idx, kv_idx):
        row = b if chunks.shape[0] > 1 else 0
        q, k = np.asarray(q_idx) + offset, np.asarray(kv_idx)
        return (k <= q) & (chunks[row, q] == chunks[row, k])
    same = (chunks[:, offset:, None] == chunks[:, None, :])[:, None]  # (B', 1, Lq, Lk)
    return _describe(mask, KernelMask(offset=offset, dense=same))


def _per_batch(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim == 1:
        arr = arr[None]  # (1, L)
    if arr.ndim != 2:
        raise ValueError(f"{name} must have shape (L,) or (B, L), got shape {arr.shape}")
    return arr


def document_mask(document_ids) -> Callable:
    """Attend only within a document: ``ids[b, q_idx] == ids[b, kv_idx]``; ``document_ids`` (L,) or (B, L)."""
    ids = _per_batch(document_ids, "document_ids")

    def mask(b, h, q_idx, kv_idx):
        row = b if ids.shape[0] > 1 else 0
        return ids[row, np.asarray(q_idx)] == ids[row, np.asarray(kv_idx)]
    return mask


def prefix_lm_mask(prefix_length) -> Callable:
    """Bidirectional over the first ``prefix_length`` keys, causal after: ``kv_idx < P or kv_idx <= q_idx``.

    ``prefix_length`` is an int or one int per batch row, shape (B,).
    """
    prefix = np.asarray(prefix_length)
    if prefix.ndim > 1 or not np.issubdtype(prefix.dtype, np.integer):
        raise ValueError(f"prefix_length must be an int or ints of shape (B,), got {prefix_length!r}")

    def mask(b, h, q_idx, kv_idx):
        p = prefix[np.asarray(b)] if prefix.ndim == 1 else prefix
        return (np.asarray(kv_idx) < p) | (np.asarray(kv_idx) <= np.asarray(q_idx))
    return mask


def padding_mask(attention_mask) -> Callable:
    """Keys kept where ``attention_mask[b, kv_idx]`` is nonzero; ``attention_mask`` (B, Lk) or (Lk,)."""
    keep = _per_batch(attention_mask, "attention_mask").astype(bool)

    def mask(b, h, q_idx, kv_idx):
        return keep[b if keep.shape[0] > 1 else 0, np.asarray(kv_idx)]
    return _describe(mask, KernelMask(key_mask=keep))


def and_masks(*masks) -> Callable:
    """Intersection of mask modifiers (all must allow)."""
    def mask(b, h, q_idx, kv_idx):
        out = np.asarray(True)
        for m in masks:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    described = [kernel_mask_of(m) for m in masks]
    combined = None
    if masks and None not in described:
        combined = described[0]
        for part in described[1:]:
            combined = None if combined is None else combined & part
    return _describe(mask, combined)


def or_masks(*masks) -> Callable:
    """Union of mask modifiers (any may allow)."""
    def mask(b, h, q_idx, kv_idx):
        out = np.asarray(False)
        for m in masks:
            out = out | m(b, h, q_idx, kv_idx)
        return out
    return mask


class BlockMask:
    """Which tiles of the score matrix are empty, partial or full, per ``(b, h)``.

    Attributes
    ----------
    kinds : ndarray of int8, shape (B', H', nQ, nK)
        :data:`EMPTY` (0, skipped), :data:`PARTIAL` (1, ``mask_mod`` applied) or :data:`FULL` (2, no mask);
        ``B'``/``H'`` are 1 when built with ``B``/``H`` ``None`` (broadcast over batch/heads). A mask with a
        :class:`KernelMask` is classified the first time ``kinds`` is read (the tiled FlashAttention kernel
        never reads it).
    mask_mod : callable
    kernel_mask : KernelMask or None
    q_len, kv_len, block_q, block_k : int
    """

    def __init__(self, mask_mod: Callable, batch: int, heads: int, q_len: int, kv_len: int, block_q: int,
                 block_k: int, kinds: np.ndarray | None = None, kernel_mask: KernelMask | None = None) -> None:
        if kinds is None and kernel_mask is None:
            raise ValueError("a BlockMask needs its tile kinds or a KernelMask to classify them from")
        self.mask_mod, self.batch, self.heads = mask_mod, batch, heads
        self.q_len, self.kv_len, self.block_q, self.block_k = q_len, kv_len, block_q, block_k
        self.kernel_mask = kernel_mask
        self._kinds = kinds

    @property
    def kinds(self) -> np.ndarray:
        if self._kinds is None:
            self._kinds = _classify(self.mask_mod, self.batch, self.heads, self.q_len, self.kv_len,
                                    self.block_q, self.block_k)
        return self._kinds

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B', H', Q_LEN, KV_LEN)."""
        return (self.batch, self.heads, self.q_len, self.kv_len)

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, block_size=({self.block_q}, {self.block_k}), "
                f"kernel_mask={self.kernel_mask})")

    def to_dense(self) -> np.ndarray:
        """The full boolean mask, shape (B', H', Q_LEN, KV_LEN) (for inspection: it is Lq x Lk)."""
        allowed = _mask_values(self.mask_mod, self.batch, self.heads, 0, self.q_len, 0, self.kv_len)
        return np.broadcast_to(allowed, self.shape).copy()  # (B', H', Lq, Lk)

    def tile_mask(self, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
        """``mask_mod`` on one tile, shape broadcastable to (B', H', q1 - q0, k1 - k0)."""
        return _mask_values(self.mask_mod, self.batch, self.heads, q0, q1, k0, k1)


def _mask_values(mask_mod: Callable, nb: int, nh: int, q0: int, q1: int, k0: int, k1: int) -> np.ndarray:
    """``mask_mod`` on the tile ``[q0:q1, k0:k1]``, checked to be booleans broadcastable to its shape
    (B', H', Tq, Tk).

    Integers are refused rather than read as truth values: the kernels take a mask's entries as booleans,
    and a count of 2 in a classification or a cast to bool would each read them differently.
    """
    allowed = np.asarray(mask_mod(*score_index(nb, nh, q0, q1, k0, k1)))
    if allowed.dtype != np.bool_:
        raise TypeError(f"mask_mod must return booleans (True = may attend), got dtype {allowed.dtype}; "
                        "compare instead (e.g. kv_idx <= q_idx)")
    shape = (nb, nh, q1 - q0, k1 - k0)
    try:
        fits = np.broadcast_shapes(allowed.shape, shape) == shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"mask_mod returned shape {allowed.shape}, which does not broadcast to the mask's "
                         f"tile of shape {shape} (B', H', Tq, Tk)")
    return allowed


def _classify(mask_mod: Callable, nb: int, nh: int, q_len: int, kv_len: int, bq: int, bk: int) -> np.ndarray:
    """Tile kinds (B', H', nQ, nK), evaluating ``mask_mod`` one band of ``bq`` query rows at a time."""
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    kinds = np.empty((nb, nh, nq, nk), dtype=np.int8)
    pad_k = nk * bk - kv_len
    for i in range(nq):
        q0, q1 = i * bq, min(q_len, (i + 1) * bq)
        band = np.broadcast_to(_mask_values(mask_mod, nb, nh, q0, q1, 0, kv_len),
                               (nb, nh, q1 - q0, kv_len))  # (B', H', Tq, Lk)
        counts = band.sum(axis=2, dtype=np.int64)  # (B', H', Lk)
        counts = np.pad(counts, ((0, 0), (0, 0), (0, pad_k))).reshape(nb, nh, nk, bk).sum(axis=-1)  # (B', H', nK)
        sizes = (q1 - q0) * np.minimum(bk, kv_len - np.arange(nk) * bk)  # (nK,)
        kinds[:, :, i] = np.where(counts == 0, EMPTY, np.where(counts == sizes, FULL, PARTIAL))
    return kinds


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      block_size: int | tuple[int, int] = 128) -> BlockMask:
    """Classify every ``block_size`` tile of ``mask_mod`` as empty, partial or full.

    ``mask_mod`` is evaluated on row bands of tiles (one band of ``block_q`` query rows at a time, all key
    tiles at once), so memory stays ``block_q x KV_LEN`` per (b, h). A built-in mask that carries a
    :class:`KernelMask` is classified only when ``kinds`` is first read.

    Parameters
    ----------
    mask_mod : callable ``(b, h, q_idx, kv_idx) -> bool array``
    B, H : int or None
        Batch and head counts; ``None`` evaluates once and broadcasts.
    Q_LEN, KV_LEN : int
    block_size : int or (int, int)
        Tile height and width.

    Returns
    -------
    BlockMask with ``kinds`` of shape (B or 1, H or 1, ceil(Q_LEN / bq), ceil(KV_LEN / bk))
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    bq, bk = check_positive_int(bq, "block_size"), check_positive_int(bk, "block_size")
    Q_LEN, KV_LEN = check_positive_int(Q_LEN, "Q_LEN"), check_positive_int(KV_LEN, "KV_LEN")
    nb = 1 if B is None else check_positive_int(B, "B")
    nh = 1 if H is None else check_positive_int(H, "H")
    described = kernel_mask_of(mask_mod)
    if described is not None and described.key_mask is not None and described.key_mask.shape != (nb, KV_LEN):
        described = None  # a key mask of another shape is read only where mask_mod reads it
    if described is not None and described.dense is not None and any(
            n not in (1, m) for n, m in zip(described.dense.shape, (nb, nh, Q_LEN, KV_LEN))):
        raise ValueError(f"create_block_mask: a boolean mask of shape {described.dense.shape} does not fit "
                         f"(B, H, Q_LEN, KV_LEN) = {(nb, nh, Q_LEN, KV_LEN)} (each axis 1 or that size)")
    kinds = None if described is not None else _classify(mask_mod, nb, nh, Q_LEN, KV_LEN, bq, bk)
    return BlockMask(mask_mod, nb, nh, Q_LEN, KV_LEN, bq, bk, kinds, described)

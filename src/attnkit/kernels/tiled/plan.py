"""The tile plan of the tiled kernel: head boxes and tile sizes, the per-call geometry (:class:`_Pass`), the
context forward leaves for backward (:class:`FlashContext`), operand checks and the per-worker scratch."""
from __future__ import annotations

import copy
import enum
import functools
import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..._validation import check_positive_int, check_qkv_shapes
from .._threads import check_num_threads, default_num_threads, run_tasks
from .._tile_sizes import choose_heads, choose_tiles, heads_override, tile_override
from ..dropout import keep_mask
from ..flex import checked_scores, score_index
from ..tuning import current_choices

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
    plan = _tile_plan(_PlanRequest(lead=(n_heads,), splittable=(False,), seq_q=seq_q, seq_k=seq_k,
                                   head_dim=head_dim, value_dim=value_dim, itemsize=itemsize,
                                   num_threads=num_threads, split=split, l2=l2))
    return plan.block_q, plan.block_k


def _splittable_axes(lead: tuple[int, ...], k_shape, v_shape, bias, dropout: bool,
                     whole: bool = False) -> tuple[bool, ...]:
    """Leading axes along which heads may go to different tasks.

    A task must write only gradients no other task writes: keys, values and an array bias that are shared
    along an axis (grouped-query keys, a per-head-shared bias) get the sum over it, so that axis stays in
    one task. A score modifier, a block mask (``whole``) and dropout produce every head's values per tile,
    so they keep all heads together.
    """
    nd = len(lead)
    if dropout or whole:
        return (False,) * nd
    owners = [_padded_lead(k_shape, nd), _padded_lead(v_shape, nd)]
    if bias is not None:
        owners.append(_padded_lead(bias.shape, nd))
    return tuple(n > 1 and all(own[i] == n for own in owners) for i, n in enumerate(lead))


def _head_boxes(lead: tuple[int, ...], splittable: tuple[bool, ...], group: int) -> list[tuple[slice, ...]]:
    """The leading index space cut into boxes of about ``group`` heads, as slices of each leading axis.

    Axes are filled from the last (heads) to the first (batch); an axis that may not be split is taken
    whole, so a box can hold more than ``group`` heads.

    >>> [tuple((c.start, c.stop) for c in box) for box in _head_boxes((2, 4), (True, True), 2)]
    [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((1, 2), (0, 2)), ((1, 2), (2, 4))]
    >>> len(_head_boxes((2, 4), (True, False), 2))  # the head axis is shared (grouped keys): whole
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


@dataclass(frozen=True)
class _PlanRequest:
    """Everything the tile plan of one call depends on."""

    lead: tuple[int, ...]  # broadcast leading (batch/head) shape
    splittable: tuple[bool, ...]  # per leading axis: may its heads go to different tasks
    seq_q: int
    seq_k: int
    head_dim: int  # D
    value_dim: int | None  # Dv (None: D)
    itemsize: int  # bytes per element of the compute dtype
    num_threads: int = 1
    split: str = "q"  # the axis the tasks run over: "q" (forward) or "k" (backward)
    fixed: tuple[int | None, int | None] = (None, None)  # the caller's block_q, block_k
    window: int | None = None  # a sliding window: key tiles much wider than it are mostly skipped work
    l2: int | None = None  # per-core L2 bytes (None: read from the machine)
    causal: bool = False  # the causal diagonal: a key tile wider than the query tile there is mostly masked


@dataclass(frozen=True)
class _TilePlan:
    """How one call is cut: boxes of heads that share a tile, and the tile lengths."""

    boxes: list[tuple[slice, ...]]
    block_q: int
    block_k: int


def _tile_plan(request: _PlanRequest) -> _TilePlan:
    """The tile lengths of one call and how many heads share a tile.

    Keywords (``fixed``) win over ``ATTNKIT_TILE_*``, which win over the cost model (for the request's
    ``l2``, else the cache size ``attnkit tune`` measured for the pass, else the machine's L2); with a sliding window
    the model's key tile is at most the window rounded up to a power of two (at least 64); the block the
    tasks run over is halved (down to 64) until every thread has two tasks, unless a keyword or the
    environment set it; a causal forward over several query blocks takes key tiles no longer than them.
    """
    r = request
    n_heads = math.prod(r.lead)
    env_q, env_k = tile_override()
    if r.l2 is None:  # the cache size the tiles are modelled for: measured by attnkit tune, else the L2
        tuned = current_choices()
        r = replace(r, l2=tuned.tile_l2_forward if r.split == "q" else tuned.tile_l2_backward)
    block_q, block_k = choose_tiles(n_heads, r.head_dim, r.value_dim, r.itemsize, r.l2)
    set_q, set_k = r.fixed[0] or env_q, r.fixed[1] or env_k
    if r.window is not None:  # each query tile sees about W keys: wider key tiles compute masked entries
        block_k = min(block_k, max(64, 1 << (r.window - 1).bit_length()))
    block_q, block_k = set_q or block_q, set_k or block_k
    group = heads_override() or choose_heads(n_heads, min(block_q, r.seq_q) or 1, min(block_k, r.seq_k) or 1,
                                             r.head_dim, r.value_dim, r.itemsize, r.l2)
    boxes = _head_boxes(r.lead, r.splittable, group)
    if r.split == "q" and not set_q:
        while block_q > 64 and len(boxes) * -(-r.seq_q // block_q) < 2 * r.num_threads:
            block_q //= 2
    elif r.split != "q" and not set_k:
        while block_k > 64 and len(boxes) * -(-r.seq_k // block_k) < 2 * r.num_threads:
            block_k //= 2
    if r.causal and r.split == "q" and not set_k and r.seq_q > block_q:
        # each query block's last key tile straddles the diagonal; wider than the query block, most of it is
        # masked work (9 heads, L 1024: 21.7 -> 16.8 ms with key tiles of 256 instead of 512)
        block_k = min(block_k, block_q)
    return _TilePlan(boxes, max(1, min(block_q, r.seq_q)), max(1, min(block_k, r.seq_k)))


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
    bias: np.ndarray | None
    dropout_p: float
    dropout_seed: int | None
    drop_lead: tuple[int, ...]  # leading shape of the reference's weights (keep_mask's index space)
    blocks: tuple[int | None, int | None]  # the caller's block_q, block_k (None: default per pass)
    num_threads: int
    window: int | None = None
    bad_k: np.ndarray | None = None  # (Lk,) keys holding a NaN or inf in some head; None: all finite
    bad_v: np.ndarray | None = None  # (Lk,) the same for values
    score_mod: object = None  # a score modifier (forward/backward over (B, H, Tq, Tk) tiles), or None
    block_mask: object = None  # kinds (B', H', nQ, nK) and tile_mask(q0, q1, k0, k1), or None
    sinks: np.ndarray | None = None  # (H,) per query head, or None
    sinks_grad: np.ndarray | None = None  # (H,), set by the backward when there are sinks


class TileKind(enum.Enum):
    """A tile against the causal band: no entry visible (skipped), every entry visible (no mask), or some."""

    EMPTY = "empty"
    FULL = "full"
    PARTIAL = "partial"


class _Tiles:
    """Tile geometry and per-tile masks/biases, shared by forward and backward."""

    def __init__(self, lead, seq_q, seq_k, mask, causal, bias, block_q, block_k, window=None, score_mod=None,
                 block_mask=None):
        self.lead = lead
        self.seq_q, self.seq_k = seq_q, seq_k
        self.offset = seq_k - seq_q  # query i sees key j iff j <= i + offset (causal)
        self.mask, self.causal, self.bias = mask, causal, bias
        self.window = window  # with causal: query i also needs j > i + offset - window
        self.block_q, self.block_k = block_q, block_k
        self.q_blocks = [(q0, min(q0 + block_q, seq_q)) for q0 in range(0, seq_q, block_q)]
        self.k_blocks = [(k0, min(k0 + block_k, seq_k)) for k0 in range(0, seq_k, block_k)]
        # Score modifiers and block masks see tiles as (B, H, Tq, Tk): lead is (B, H) or (B, Hkv, G), and
        # they keep every head in one box, so a tile holds all of them.
        self.score_mod, self.block_mask = score_mod, block_mask
        self.block_plan = None if block_mask is None else _reduce_kinds(block_mask.kinds)  # (nQ, nK)

    def select(self, heads: tuple[slice, ...]) -> _Tiles:
        """The same tiles for a box of heads: its leading shape, and its part of the mask and bias."""
        sub = copy.copy(self)
        sub.lead = tuple(len(range(*h.indices(n))) for h, n in zip(heads, self.lead))
        sub.mask = _take(self.mask, heads, 2)
        sub.bias = _take(self.bias, heads, 2)
        return sub

    def band_kind(self, q0, q1, k0, k1) -> TileKind:
        """Where a tile lies against the causal band (and window): outside it, inside it, or across its edge."""
        if not self.causal:
            return TileKind.FULL
        top, bottom = q0 + self.offset, q1 - 1 + self.offset  # positions of the first and last query
        if k0 > bottom:
            return TileKind.EMPTY
        if self.window is None:
            return TileKind.FULL if k1 - 1 <= top else TileKind.PARTIAL
        if k1 - 1 <= top - self.window:
            return TileKind.EMPTY
        return TileKind.FULL if k1 - 1 <= top and k0 > bottom - self.window else TileKind.PARTIAL

    def k_range(self, q0, q1):
        """Key blocks a query block may see (causal: up to the last visible key; window: from the first)."""
        first, last = 0, self.seq_k
        if self.causal:
            last = min(self.seq_k, q1 + self.offset)
            if self.window is not None:
                first = q0 + self.offset - self.window + 1
        blocks = [kb for kb, (k0, k1) in enumerate(self.k_blocks) if k0 < last and k1 > first]
        if self.block_plan is not None:
            row = self.block_plan[q0 // self.block_q]  # (nK,)
            blocks = [kb for kb in blocks if row[kb]]
        return blocks

    def q_range(self, k0, k1):
        """Query blocks that may see a key block (causal: from the first query seeing key k0)."""
        first, end = 0, self.seq_q
        if self.causal:
            first = k0 - self.offset
            if self.window is not None:
                end = k1 - 1 - self.offset + self.window  # queries i < end see key k1 - 1
        blocks = [qb for qb, (q0, q1) in enumerate(self.q_blocks) if q1 - 1 >= first and q0 < end]
        if self.block_plan is not None:
            column = self.block_plan[:, k0 // self.block_k]  # (nQ,)
            blocks = [qb for qb in blocks if column[qb]]
        return blocks

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
        kind = self.band_kind(q0, q1, k0, k1)
        if kind is TileKind.EMPTY:
            return True, None
        block_kind = TileKind.FULL
        if self.block_plan is not None:
            block_kind = _BLOCK_KINDS[self.block_plan[q0 // self.block_q, k0 // self.block_k]]
            if block_kind is TileKind.EMPTY:
                return True, None
        allowed = self.band(q0, q1, k0, k1) if kind is TileKind.PARTIAL else None  # (Tq, Tk)
        if self.mask is not None:
            mt = _tile(self.mask, q0, q1, k0, k1)  # (..., Tq|1, Tk|1)
            allowed = mt if allowed is None else (mt & allowed)
        if block_kind is TileKind.PARTIAL:
            mt = self.from_heads(np.asarray(self.block_mask.tile_mask(q0, q1, k0, k1)))  # (B'|1, *H'|1, Tq, Tk)
            allowed = mt if allowed is None else (mt & allowed)
        if allowed is None:
            return False, None
        if not allowed.any():
            return True, None
        if allowed.all():
            return False, None
        return False, ~allowed

    def to_heads(self, tile: np.ndarray) -> np.ndarray:
        """A (*lead, Tq, Tk) tile as (B, H, Tq, Tk), the shape score modifiers see (a view)."""
        return tile.reshape(tile.shape[0], -1, *tile.shape[-2:]) if tile.ndim != 4 else tile

    def from_heads(self, tile: np.ndarray) -> np.ndarray:
        """A (B|1, H|1, Tq, Tk) tile shaped to broadcast against (*lead, Tq, Tk)."""
        if len(self.lead) == 2:
            return tile
        heads = self.lead[1:] if tile.shape[1] != 1 else (1,) * (len(self.lead) - 1)
        return tile.reshape(tile.shape[0], *heads, *tile.shape[-2:])

    def score_index(self, q0, q1, k0, k1):
        """``(b, h, q_idx, kv_idx)`` of a tile, broadcastable integer arrays against (B, H, Tq, Tk)."""
        return score_index(self.lead[0], math.prod(self.lead[1:]), q0, q1, k0, k1)

    def modify(self, s: np.ndarray, q0, q1, k0, k1) -> np.ndarray:
        """The score modifier applied to the tile ``s`` (*lead, Tq, Tk): the modifier's own array when it is
        writeable and of the tile's shape (no copy back into ``s``), else ``s`` overwritten."""
        heads = self.to_heads(s)  # (B, H, Tq, Tk)
        changed = checked_scores(self.score_mod.forward(heads, *self.score_index(q0, q1, k0, k1)), heads.shape)
        changed = changed.reshape(s.shape)  # (*lead, Tq, Tk)
        if changed.flags.writeable and changed.dtype == s.dtype:
            return changed
        np.copyto(s, changed)
        return s

    def bias_tile(self, q0, q1, k0, k1):
        return _tile(self.bias, q0, q1, k0, k1)


_BLOCK_KINDS = (TileKind.EMPTY, TileKind.PARTIAL, TileKind.FULL)  # a block mask's 0, 1, 2


def _reduce_kinds(kinds: np.ndarray) -> np.ndarray:
    """A block mask's kinds (B', H', nQ, nK) for the tiles all heads share: empty where every (b, h) is
    empty, full where every one is full, partial otherwise; (nQ, nK) int8."""
    flat = kinds.reshape(-1, *kinds.shape[-2:])  # (B'H', nQ, nK)
    return np.where((flat == 0).all(axis=0), 0, np.where((flat == 2).all(axis=0), 2, 1)).astype(np.int8)


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


def _positive(value, name):
    """``value`` as an int, or None when not given (the kernel then picks its own)."""
    return None if value is None else check_positive_int(value, name)


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
    dropout_p: float
    seed: int | None
    drop_lead: tuple[int, ...]

    def select(self, heads: tuple[slice, ...]) -> _Pass:
        return replace(self, tiles=self.tiles.select(heads))

    @property
    def fold(self) -> bool:
        """No bias and no score modifier: the row shift rides in the score matmul (docs/kernels.md)."""
        return self.tiles.bias is None and self.tiles.score_mod is None

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
@dataclass
class _Operands:
    """The forward's arguments, checked: arrays, dtypes and settings as the tile steps use them."""

    q: np.ndarray  # (..., Lq, D)
    k: np.ndarray  # (..., Lk, D)
    v: np.ndarray  # (..., Lk, Dv)
    out_dtype: np.dtype  # what the caller gets back
    dtype: np.dtype  # compute dtype, float32 or float64
    mask: np.ndarray | None  # bool, at least 2-D
    bias: np.ndarray | None  # at least 2-D
    window: int | None
    num_threads: int


def _normalise(q, k, v, mask, bias, dropout_p, dropout_seed, causal, window, num_threads) -> _Operands:
    """Check the arguments and put them in the form the tile steps read."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    check_qkv_shapes(q, k, v, names=("query", "key", "value"), same_features=True, same_rank=False)
    out_dtype = np.result_type(q.dtype, k.dtype, v.dtype)
    if out_dtype.kind != "f":
        out_dtype = np.dtype(np.float64)
    dtype = np.dtype(np.float64) if out_dtype.itemsize > 4 else np.dtype(np.float32)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and dropout_seed is None:
        raise ValueError("dropout_seed is required when dropout_p > 0")
    num_threads = default_num_threads() if num_threads is None else check_num_threads(num_threads, "num_threads")
    window = _positive(window, "window")
    if window is not None and not causal:
        raise ValueError(f"window={window} requires causal=True")
    if mask is not None:
        mask = _at_least_2d_right(np.asarray(mask))
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    if bias is not None:
        bias = _at_least_2d_right(np.asarray(bias))
    return _Operands(q=q, k=k, v=v, out_dtype=out_dtype, dtype=dtype, mask=mask, bias=bias, window=window,
                     num_threads=num_threads)


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

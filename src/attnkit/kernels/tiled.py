"""Tiled (FlashAttention-style) attention: online softmax forward, recomputing backward, threads.

Same semantics as :mod:`attnkit.kernels.reference` (boolean masks with ``True`` = may attend,
bottom-right-aligned causal masking, fully masked rows give zero output and zero gradients, keys no
query may attend to are zeroed so NaN/Inf padding cannot leak, inverted dropout after the softmax from
the counter-based :func:`~attnkit.kernels.dropout.keep_mask`), but nothing of size ``Lq x Lk`` is ever
allocated: forward keeps the output and the per-row log-sum-exp, backward recomputes the probabilities
tile by tile (FlashAttention-2), so memory is linear in the sequence length.

Dimension letters: ``...`` leading batch/head dims (broadcast between q, k, v, mask and bias; flattened to
N inside the kernel so that all heads of a tile go to BLAS in one batched matmul), Lq/Lk query/key
length, D query/key features, Dv value features, Tq/Tk tile lengths.

How the time is spent, and the tricks
-------------------------------------
Per score element the forward does two matmul FMAs per feature (``q.k`` and ``p.v``, ~3 ns per element
at D = 64 on one core) and one ``exp`` (~0.45 ns); everything else is overhead to be removed:

* the scale is folded into q once, and the row shift is folded into the first matmul: the query tile
  carries an extra column ``-m`` and the keys an extra column of ones, so ``[q*scale, -m] @ [k, 1].T``
  is already ``s - m`` (no subtract pass);
* the softmax denominator comes out of the second matmul: the values carry a column of ones, so
  ``p @ [v, 1]`` is ``[p @ v, rowsum(p)]`` (no sum pass);
* the running max is lazy: a tile is exponentiated against the current shift ``m`` as long as
  ``|q_i| |k_j| scale - m_i <= 16`` for the whole tile (a Cauchy-Schwarz bound from precomputed norms),
  so most tiles need no max pass; otherwise the tile max is taken and ``m`` only moves when it grows
  by more than 16 (``e^16`` cannot overflow the float32 accumulators). The result is the exact softmax;
* ``exp`` runs in place in per-thread scratch buffers; float32 stays float32 (the scale is cast to
  the compute dtype, never a float64 scalar that would upcast whole tiles);
* causal attention skips the tiles above the diagonal and builds the triangular mask only on the
  diagonal tiles; boolean masks are checked per tile (all-allowed tiles are not masked, all-blocked
  tiles are skipped, so fully padded key blocks cost nothing);
* backward folds ``-lse`` into q and ``-D`` into dO (``D = rowsum(dO * O)``), each as two columns
  holding the float64 value split into a float32 head and tail, so that
  ``[q*scale, -lse_hi, -lse_lo] @ [k, 1, 1].T = s - lse`` and ``[dO, -D_hi, -D_lo] @ [v, 1, 1].T =
  dP - D`` come out of the matmuls as accurately as the forward computed them; what is left per element
  is one ``exp`` and one multiply next to five matmuls.

With an additive bias the shift is not folded (cancellation between a large bias and the shift would
cost float32 accuracy); the tile gets an explicit max and subtract instead.

Profile (py-spy --native, one thread, L = 2048, H = 8, D = 64, float32): forward 67% in OpenBLAS's
sgemm kernel, 15% in its operand packing (every ``p`` tile is copied once into BLAS's panel format),
12% in ``exp``, ~5% everything else; backward ~75% sgemm kernel, ~13% packing, 6% ``exp``, 6% the
small accumulating adds and the ``dS = P * (dP - D)`` multiply. The remaining gap to PyTorch's fused
kernel is BLAS packing and the separate ``exp`` pass, which NumPy cannot fuse into the matmul.

Threads: forward tasks are query blocks (all heads of a block in one task, the longest causal rows
first), backward tasks are key blocks, each owning its dK/dV rows outright, with dQ accumulated in one
buffer per worker and summed at the end: no write is shared between threads. BLAS is limited to one
thread while the tile threads run (:mod:`attnkit.kernels._threads`); ``num_threads=1`` leaves the BLAS
setting alone.

Tile sizes
----------
Chosen for the 1 MiB per-core L2 of the machine this was tuned on (AMD EPYC, Zen 4; most current x86
server cores have 1-2 MiB). A float32 ``256 x 256`` score tile of one head is 256 KiB; with the 256
query rows and 256 key and value rows it touches (66 floats each, ~200 KiB) the working set of one
head's two matmuls and its ``exp`` is ~450 KiB, inside L2 with room for BLAS's packed panels. Measured
single-core sgemm throughput for the two products ``(Tq x 65)(65 x Tk)`` and ``(Tq x Tk)(Tk x 65)``
peaks there (~88-93 GFLOP/s, against 73-80 for 128 x 512, 512 x 512 or 1024 x 1024 tiles, whose
working sets spill to L3). Smaller tiles cost more BLAS packing per flop and more Python calls.

All N heads of a tile are one batched ``np.matmul`` (N BLAS calls in NumPy's loop, one Python call),
so the ~20 NumPy calls of Python overhead per tile are shared by all heads: with H = 8 a tile is ~0.6M
scores and the overhead is ~1%. With fewer than four heads the tiles grow to ``512 x 512`` for the same
reason. float64 keeps the same sizes (512 KiB per head tile, still within L2). The block the tasks
run over (queries forward, keys backward) is halved, down to 64, until every thread has two tasks.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from .._validation import unbroadcast
from ._threads import default_num_threads, run_tasks
from .bias import ScoreBias
from .dropout import keep_mask

__all__ = ["FlashContext", "flash_attention_forward", "flash_attention_backward", "default_blocks"]

_LAZY_SHIFT = 16.0  # exp(s - m) may reach e^16 before the shift m is moved (float32-safe)


def default_blocks(n_heads: int, seq_q: int, seq_k: int, num_threads: int = 1,
                   split: str = "q") -> tuple[int, int]:
    """Default ``(block_q, block_k)`` for ``n_heads`` folded heads (see the module docstring).

    ``split`` names the axis the tasks run over ("q" in the forward, "k" in the backward); that block
    is halved (down to 64) until every thread has at least two tasks.

    >>> default_blocks(8, 4096, 4096)
    (256, 256)
    >>> default_blocks(8, 512, 512, num_threads=2)
    (128, 256)
    >>> default_blocks(1, 32768, 32768)
    (512, 512)
    """
    block_q = block_k = 256 if n_heads >= 4 else 512
    if split == "q":
        while block_q > 64 and -(-seq_q // block_q) < 2 * num_threads:
            block_q //= 2
    else:
        while block_k > 64 and -(-seq_k // block_k) < 2 * num_threads:
            block_k //= 2
    return max(1, min(block_q, seq_q)), max(1, min(block_k, seq_k))


@dataclass
class FlashContext:
    """What :func:`flash_attention_backward` needs from the forward: inputs, output, log-sum-exp.

    Arrays are in the flattened layout (N = product of the broadcast leading dims).
    """

    q: np.ndarray  # (N, Lq, D) query, not scaled
    k_aug: np.ndarray  # (N, Lk, D + 2) [k, 1, 1], dead keys' features zeroed
    v_aug: np.ndarray  # (N, Lk, Dv + 2) [v, 1, 1], dead keys' features zeroed
    out: np.ndarray  # (N, Lq, Dv)
    lse: np.ndarray  # (N, Lq) float64 log-sum-exp of the scaled, biased scores; +inf if fully masked
    scale: float
    lead: tuple[int, ...]  # broadcast leading shape, prod(lead) = N
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


def _live_keys(mask: np.ndarray | None, tiles: "_Tiles"):
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
    block_q, block_k : int, optional
        Tile lengths; default from :func:`default_blocks`.
    num_threads : int, optional
        Tile threads; default ``os.cpu_count()``. With more than one, BLAS runs single-threaded.

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
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check(q, k, v)
    out_dtype = np.result_type(q.dtype, k.dtype, v.dtype)
    if out_dtype.kind != "f":
        out_dtype = np.dtype(np.float64)
    dtype = np.dtype(np.float64) if out_dtype.itemsize > 4 else np.dtype(np.float32)
    seq_q, d = q.shape[-2:]
    seq_k, dv = v.shape[-2:]
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
    extra = [m.shape[:-2] for m in (mask, bias) if isinstance(m, np.ndarray)]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], *extra)
    drop_lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], *extra)
    n = math.prod(lead)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    auto_q, auto_k = default_blocks(n, seq_q, seq_k, num_threads, "q")
    fixed_blocks = (_positive(block_q, "block_q"), _positive(block_k, "block_k"))
    block_q, block_k = fixed_blocks[0] or auto_q, fixed_blocks[1] or auto_k

    # Keys and values once, with their ones columns; keys no query may see are zeroed (NaN padding).
    q_flat = np.broadcast_to(q, lead + (seq_q, d)).reshape(n, seq_q, d)  # (N, Lq, D), a view if q is full
    tiles = _Tiles(lead, seq_q, seq_k, mask, causal, bias, block_q, block_k, window)
    live = _live_keys(mask, tiles)  # (..., Lk) or None
    k_aug = np.empty((n, seq_k, d + 2), dtype)  # (N, Lk, D+2) [k, 1, 1]
    v_aug = np.empty((n, seq_k, dv + 2), dtype)  # (N, Lk, Dv+2) [v, 1, 1]
    kmax = np.empty((n, len(tiles.k_blocks)))  # (N, nKb) largest key norm of each key block
    k_aug4 = k_aug.reshape(lead + (seq_k, d + 2))  # (..., Lk, D+2)
    v_aug4 = v_aug.reshape(lead + (seq_k, dv + 2))  # (..., Lk, Dv+2)

    def prepare(kb, worker):
        """Copy one key block into the augmented layout, zero its dead keys, take its largest norm."""
        k0, k1 = tiles.k_blocks[kb]
        k_aug4[..., k0:k1, :d] = k[..., k0:k1, :]
        v_aug4[..., k0:k1, :dv] = v[..., k0:k1, :]
        k_aug[:, k0:k1, d:] = 1
        v_aug[:, k0:k1, dv:] = 1
        if live is not None:
            dead = ~live[..., k0:k1, None]  # (..., Tk, 1)
            np.copyto(k_aug4[..., k0:k1, :d], 0, where=dead)
            np.copyto(v_aug4[..., k0:k1, :dv], 0, where=dead)
        kb_ = k_aug[:, k0:k1, :d]  # (N, Tk, D)
        kmax[:, kb] = np.sqrt(np.einsum("nld,nld->nl", kb_, kb_).max(axis=1))  # (N,)

    run_tasks(list(range(len(tiles.k_blocks))), prepare, num_threads)  # copies in parallel too
    out = np.zeros((n, seq_q, dv), dtype)  # (N, Lq, Dv)
    lse = np.full((n, seq_q), np.inf)  # (N, Lq) float64: backward splits it into two columns
    if n and seq_q and seq_k:
        _forward(tiles, q_flat, k_aug, v_aug, kmax, out, lse, dtype.type(scale), dropout_p, dropout_seed,
                 drop_lead, num_threads)
    ctx = FlashContext(q=q_flat, k_aug=k_aug, v_aug=v_aug, out=out, lse=lse, scale=scale, lead=lead,
                       q_shape=q.shape, k_shape=k.shape, v_shape=v.shape, out_dtype=out_dtype, mask=mask,
                       causal=causal, bias=bias, dropout_p=float(dropout_p), dropout_seed=dropout_seed,
                       drop_lead=drop_lead, blocks=fixed_blocks, num_threads=num_threads, window=window)
    out_r = out.reshape(lead + (seq_q, dv)).astype(out_dtype, copy=False)  # (..., Lq, Dv)
    return out_r, lse.reshape(lead + (seq_q,)).astype(out_dtype, copy=False), ctx


def _forward(tiles, q, k_aug, v_aug, kmax, out, lse, scale, dropout_p, seed, drop_lead, num_threads):
    """Fill ``out`` (N, Lq, Dv) and ``lse`` (N, Lq) block of queries by block of queries."""
    n, seq_q, d = q.shape
    seq_k, dv = v_aug.shape[1], v_aug.shape[2] - 2
    dtype = out.dtype
    lead = tiles.lead
    fold = tiles.bias is None  # fold the shift into the matmul (see the module docstring)
    dropout = dropout_p > 0.0
    bq, bk = tiles.block_q, tiles.block_k
    if fold and not np.isfinite(kmax).all():  # non-finite keys: no bound, take every tile's max
        kmax = np.full_like(kmax, np.inf)
    scratch = {}

    def work(qb, worker):
        if worker not in scratch:
            scratch[worker] = (np.empty(n * bq * bk, dtype), np.empty(n * bq * (d + 1), dtype),
                               np.empty(n * bq * (dv + 1), dtype), np.empty(n * bq * (dv + 1), dtype))
        s_buf, q_buf, acc_buf, pv_buf = scratch[worker]
        q0, q1 = tiles.q_blocks[qb]
        tq = q1 - q0
        qa = q_buf[:n * tq * (d + 1)].reshape(n, tq, d + 1)  # (N, Tq, D+1) [q*scale, -m]
        np.multiply(q[:, q0:q1], scale, out=qa[..., :d])
        qa[..., d] = 0
        if fold:
            qn = np.sqrt(np.einsum("nld,nld->nl", qa[..., :d], qa[..., :d]))  # (N, Tq) |q_i| * |scale|
        acc = acc_buf[:n * tq * (dv + 1)].reshape(n, tq, dv + 1)  # (N, Tq, Dv+1) [sum p v, sum p]
        acc[...] = 0
        first = True  # the first tile's p @ v goes straight into acc
        pv = pv_buf[:n * tq * (dv + 1)].reshape(n, tq, dv + 1)  # (N, Tq, Dv+1)
        m = np.zeros((n, tq), dtype)  # (N, Tq) current shift of each row
        l_sum = np.zeros((n, tq), dtype) if dropout else acc[..., dv]  # (N, Tq) softmax denominators
        for kb in tiles.k_range(q0, q1):
            k0, k1 = tiles.k_blocks[kb]
            skip, blocked = tiles.blocked(q0, q1, k0, k1)
            if skip:
                continue
            tk = k1 - k0
            s = s_buf[:n * tq * tk].reshape(n, tq, tk)  # (N, Tq, Tk)
            s4 = s.reshape(lead + (tq, tk))  # (..., Tq, Tk) the same memory
            np.matmul(qa, k_aug[:, k0:k1, :d + 1].swapaxes(-1, -2), out=s)  # scale q.k - m (fold) or scale q.k
            if not fold:
                np.add(s4, tiles.bias_tile(q0, q1, k0, k1), out=s4)
            if blocked is not None:
                np.copyto(s4, -np.inf, where=blocked)
            exact = not fold or not (qn * kmax[:, kb, None] - m).max() <= _LAZY_SHIFT
            alpha = None
            if exact:
                t = s.max(axis=-1)  # (N, Tq) tile max, relative to m when folded
                if not fold:
                    t -= m
                fresh = l_sum == 0  # (N, Tq) nothing accumulated yet (then m == 0)
                need = (t > _LAZY_SHIFT) | (fresh & (t > -np.inf))  # (N, Tq) rows whose shift moves
                if need.any():
                    delta = np.where(need, t, 0).astype(dtype, copy=False)  # (N, Tq)
                    m += delta
                    if fold:
                        np.subtract(s, delta[..., None], out=s)
                        qa[..., d] = -m
                    alpha = np.exp(-np.where(fresh, 0, delta))[..., None]  # (N, Tq, 1)
                if not fold:
                    np.subtract(s, m[..., None], out=s)
            np.exp(s, out=s)  # p, up to e^16 times the final probabilities
            if alpha is not None:
                np.multiply(acc, alpha, out=acc)
                if dropout:
                    l_sum *= alpha[..., 0]
            if dropout:
                l_sum += s.sum(axis=-1)
                keep = keep_mask(seed, dropout_p, drop_lead, np.arange(q0, q1), np.arange(k0, k1),
                                 seq_q, seq_k)  # (*drop_lead, Tq, Tk)
                np.multiply(s4, keep, out=s4)
            if first and alpha is None and not dropout:
                np.matmul(s, v_aug[:, k0:k1, :dv + 1], out=acc)  # (N, Tq, Dv+1)
            else:
                np.matmul(s, v_aug[:, k0:k1, :dv + 1], out=pv)  # (N, Tq, Dv+1)
                np.add(acc, pv, out=acc)
            first = False
        ok = l_sum > 0  # (N, Tq) rows that attend to at least one key
        norm = np.divide(1.0 if not dropout else 1.0 / (1.0 - dropout_p), l_sum, where=ok,
                         out=np.zeros((n, tq), dtype))  # (N, Tq)
        np.multiply(acc[..., :dv], norm[..., None], out=out[:, q0:q1])
        lse[:, q0:q1] = np.where(ok, m + np.log(l_sum.astype(np.float64), where=ok, out=np.zeros((n, tq))),
                                 np.inf)

    order = list(range(len(tiles.q_blocks)))
    if tiles.causal:
        order.reverse()  # the last query blocks see the most keys: hand them out first
    run_tasks(order, work, num_threads)


def flash_attention_backward(grad_out: np.ndarray, ctx: FlashContext):
    """Gradients of :func:`flash_attention_forward`'s output, by tile-wise recomputation.

    Shapes
    ------
    grad_out : (..., Lq, Dv), broadcastable to the forward output.

    Returns
    -------
    dq, dk, dv : ndarrays shaped like the forward's q, k, v (broadcast dims summed)
    dbias : ndarray shaped like an array ``bias``, else None (a ScoreBias gets ``accumulate_grad`` per tile)
    """
    n, seq_q, d = ctx.q.shape
    seq_k, dv = ctx.v_aug.shape[1], ctx.v_aug.shape[2] - 2
    dtype = ctx.out.dtype
    lead = ctx.lead
    grad_out = np.asarray(grad_out)
    try:
        fits = np.broadcast_shapes(grad_out.shape, lead + (seq_q, dv)) == lead + (seq_q, dv)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"grad_out of shape {grad_out.shape} does not broadcast to the output shape "
                         f"{lead + (seq_q, dv)}")
    auto_q, auto_k = default_blocks(n, seq_q, seq_k, ctx.num_threads, "k")  # tasks are key blocks
    tiles = _Tiles(lead, seq_q, seq_k, ctx.mask, ctx.causal, ctx.bias, ctx.blocks[0] or auto_q,
                   ctx.blocks[1] or auto_k, ctx.window)
    fold = ctx.bias is None
    scale = dtype.type(ctx.scale)
    # [dO, -D] with D = rowsum(dO * O): one matmul gives dP - D (without dropout).
    do_aug = np.empty((n, seq_q, dv + 2), dtype)  # (N, Lq, Dv+2) [dO, -D_hi, -D_lo]
    do_aug.reshape(lead + (seq_q, dv + 2))[..., :dv] = grad_out
    do = do_aug[..., :dv]  # (N, Lq, Dv)
    d_row = np.einsum("nld,nld->nl", do, ctx.out, dtype=np.float64)  # (N, Lq)
    np.negative(d_row, out=do_aug[..., dv], casting="same_kind")
    np.subtract(do_aug[..., dv], -d_row, out=do_aug[..., dv + 1], casting="same_kind")
    # [q * scale, -hi, -lo] with hi + lo = lse to twice the working precision: one matmul gives
    # s - lse (without bias) as accurately as the forward's s - m; fully masked rows get -inf.
    q_aug = np.empty((n, seq_q, d + 2), dtype)  # (N, Lq, D+2)
    np.multiply(ctx.q, scale, out=q_aug[..., :d])
    lse_hi = ctx.lse.astype(dtype)  # (N, Lq)
    with np.errstate(invalid="ignore"):
        lse_lo = np.where(np.isfinite(lse_hi), ctx.lse - lse_hi, 0).astype(dtype)  # (N, Lq)
    if fold:
        np.negative(lse_hi, out=q_aug[..., d])
        np.negative(lse_lo, out=q_aug[..., d + 1])
    else:
        q_aug[..., d:] = 0
    dk = np.zeros((n, seq_k, d), dtype)  # (N, Lk, D)
    dv_ = np.zeros((n, seq_k, dv), dtype)  # (N, Lk, Dv)
    dbias = None
    if isinstance(ctx.bias, np.ndarray):
        dbias = np.zeros(ctx.bias.shape, dtype)
    lock = threading.Lock()
    dropout = ctx.dropout_p > 0.0
    keep_scale = dtype.type(1.0 / (1.0 - ctx.dropout_p)) if dropout else None
    bq, bk = tiles.block_q, tiles.block_k
    scratch = {}

    def work(kb, worker):
        if worker not in scratch:
            scratch[worker] = (np.empty(n * bq * bk, dtype), np.empty(n * bq * bk, dtype),
                               np.zeros((n, seq_q, d), dtype), np.empty(n * bk * max(d, dv), dtype),
                               np.empty(n * bq * d, dtype))
        s_buf, dp_buf, dq_acc, kv_tmp, q_tmp = scratch[worker]
        k0, k1 = tiles.k_blocks[kb]
        tk = k1 - k0
        ka = ctx.k_aug[:, k0:k1]  # (N, Tk, D+2)
        va = ctx.v_aug[:, k0:k1]  # (N, Tk, Dv+2)
        dk_t = kv_tmp[:n * tk * d].reshape(n, tk, d)  # (N, Tk, D)
        dv_t = kv_tmp[:n * tk * dv].reshape(n, tk, dv)  # (N, Tk, Dv)
        for qb in tiles.q_range(k0, k1):
            q0, q1 = tiles.q_blocks[qb]
            skip, blocked = tiles.blocked(q0, q1, k0, k1)
            if skip:
                continue
            tq = q1 - q0
            p = s_buf[:n * tq * tk].reshape(n, tq, tk)  # (N, Tq, Tk)
            p4 = p.reshape(lead + (tq, tk))
            ds = dp_buf[:n * tq * tk].reshape(n, tq, tk)  # (N, Tq, Tk)
            ds4 = ds.reshape(lead + (tq, tk))
            np.matmul(q_aug[:, q0:q1], ka.swapaxes(-1, -2), out=p)  # s - lse (fold) or s
            if not fold:
                np.add(p4, tiles.bias_tile(q0, q1, k0, k1), out=p4)
                np.subtract(p, lse_hi[:, q0:q1, None], out=p)
                if dtype == np.float32:
                    np.subtract(p, lse_lo[:, q0:q1, None], out=p)
            if blocked is not None:
                np.copyto(p4, -np.inf, where=blocked)
            np.exp(p, out=p)  # probabilities before dropout
            if not dropout:
                np.matmul(do_aug[:, q0:q1], va.swapaxes(-1, -2), out=ds)  # dO.v - D
                np.matmul(p.swapaxes(-1, -2), do[:, q0:q1], out=dv_t)  # (N, Tk, Dv)
                np.add(dv_[:, k0:k1], dv_t, out=dv_[:, k0:k1])
                np.multiply(ds, p, out=ds)  # dS = P (dP - D)
            else:
                keep = keep_mask(ctx.dropout_seed, ctx.dropout_p, ctx.drop_lead, np.arange(q0, q1),
                                 np.arange(k0, k1), seq_q, seq_k)  # (*drop_lead, Tq, Tk)
                np.matmul(do[:, q0:q1], va[..., :dv].swapaxes(-1, -2), out=ds)  # dO.v = grad of dropped p
                np.multiply(ds4, keep, out=ds4)
                np.multiply(ds, keep_scale, out=ds)
                np.add(ds, do_aug[:, q0:q1, dv:dv + 1], out=ds)  # dP - D (the columns hold -D)
                np.add(ds, do_aug[:, q0:q1, dv + 1:], out=ds)
                np.multiply(ds, p, out=ds)  # dS
                np.multiply(p4, keep, out=p4)
                np.multiply(p, keep_scale, out=p)  # dropped, rescaled weights
                np.matmul(p.swapaxes(-1, -2), do[:, q0:q1], out=dv_t)  # (N, Tk, Dv)
                np.add(dv_[:, k0:k1], dv_t, out=dv_[:, k0:k1])
            if ctx.bias is not None:
                _bias_grad(ctx.bias, dbias, ds4, tiles, q0, q1, k0, k1, lock)
            dq_t = q_tmp[:n * tq * d].reshape(n, tq, d)  # (N, Tq, D)
            np.matmul(ds, ka[..., :d], out=dq_t)
            np.add(dq_acc[:, q0:q1], dq_t, out=dq_acc[:, q0:q1])
            np.matmul(ds.swapaxes(-1, -2), q_aug[:, q0:q1, :d], out=dk_t)  # (N, Tk, D), q already scaled
            np.add(dk[:, k0:k1], dk_t, out=dk[:, k0:k1])

    if n and seq_q and seq_k:
        run_tasks(list(range(len(tiles.k_blocks))), work, ctx.num_threads)
    accs = [scratch[w][2] for w in sorted(scratch)]
    dq = accs[0] if accs else np.zeros((n, seq_q, d), dtype)  # (N, Lq, D)
    for extra in accs[1:]:
        np.add(dq, extra, out=dq)
    np.multiply(dq, scale, out=dq)
    cast = ctx.out_dtype
    dq = unbroadcast(dq.reshape(lead + (seq_q, d)), ctx.q_shape).astype(cast, copy=False)
    dk = unbroadcast(dk.reshape(lead + (seq_k, d)), ctx.k_shape).astype(cast, copy=False)
    dv_ = unbroadcast(dv_.reshape(lead + (seq_k, dv)), ctx.v_shape).astype(cast, copy=False)
    if dbias is not None:
        dbias = dbias.astype(cast, copy=False)
    return dq, dk, dv_, dbias


def _bias_grad(bias, dbias, ds4, tiles, q0, q1, k0, k1, lock):
    """Hand the score gradient of one tile to the bias: a ScoreBias's hook, or the array's tile."""
    if isinstance(bias, ScoreBias):
        with lock:  # accumulate_grad updates shared parameter gradients
            bias.accumulate_grad(np.arange(q0, q1), np.arange(k0, k1), tiles.seq_q, tiles.seq_k, ds4)
        return
    target = _tile(dbias, q0, q1, k0, k1)  # (..., Tq|1, Tk|1) view into dbias
    g = unbroadcast(ds4, target.shape)
    with lock:  # tiles of other key blocks may share this region when the bias broadcasts over keys
        target += g

"""Tile lengths of the tiled kernel, chosen from the machine's per-core L2 by a small cost model.

A tile is ``G`` heads (batched into one matmul) of ``Tq`` queries against ``Tk`` keys. Per score element
it costs its share of the BLAS work plus three overheads, each in units of one score's matmul work
(measured on the machines in ``docs/kernels.md``):

* ``_CALL / (G Tq Tk)``: the ~20 NumPy calls of Python per tile, shared by the ``G`` heads of the tile;
* ``_PACK (1/Tq + 1/Tk)``: BLAS copies the q/k/v operands of every tile into its panel format, once per
  tile, so longer tiles amortise it over more products;
* ``_SPILL log2(W / L2)``: once one head's working set ``W`` (the score tile, the q, k and v tiles with
  their two folded columns, and the accumulator rows) outgrows the per-core L2, the matmuls and the
  ``exp`` pass stream from L3 and, further out, from memory (measured: a 512 x 512 tile, 2.8 L2s, ran
  1.4-1.5x slower than 256 x 256 on a 512 KiB L2);
* ``_SPILL log2(G W / (_GROUP_L2S L2))``: BLAS works one head at a time, but every elementwise pass
  (``exp``, the accumulation) sweeps all ``G`` heads of the tile. Up to about four L2s those sweeps run
  at full speed from L3; beyond, they slow down (measured with D = 32, 256 x 256 tiles, one thread: 4
  heads a tile 1.3x faster than 1 head, whose Python calls then dominate, and 1.3-1.6x faster than 32
  or 64 heads; with 48 x 48 tiles, 64 heads 1.3x faster than 384).

The chooser scores every power-of-two ``G`` up to the head count (and the head count itself) with every
power-of-two pair ``Tq, Tk`` from 32 to 1024, and keeps the cheapest. Environment variables
``ATTNKIT_TILE_Q``, ``ATTNKIT_TILE_K`` and ``ATTNKIT_TILE_HEADS`` override it (experiments); the kernels'
``block_q`` / ``block_k`` keywords override the first two.
"""
from __future__ import annotations

import functools
import math
import os
from pathlib import Path

from .._cpu import SYSFS_CACHE, l2_bytes

__all__ = ["choose_tiles", "choose_heads", "tile_override", "heads_override", "working_set", "ENV_TILE_Q",
           "ENV_TILE_K", "ENV_TILE_HEADS"]

ENV_TILE_Q, ENV_TILE_K, ENV_TILE_HEADS = "ATTNKIT_TILE_Q", "ATTNKIT_TILE_K", "ATTNKIT_TILE_HEADS"
_CALL = 9000.0  # Python overhead per tile, in score-equivalents (~60 us against ~6.5 ns per score)
_PACK = 2.6  # BLAS packing of (Tq + Tk) rows of D + 2 features, per score, times Tq Tk / (Tq + Tk)
_SPILL = 0.3  # time added per doubling of one head's working set beyond the L2
_GROUP_L2S = 4.0  # a tile's heads together may fill this many L2s before the elementwise passes slow
_CANDIDATES = (32, 64, 128, 256, 512, 1024)


def working_set(block_q: int, block_k: int, head_dim: int, value_dim: int, itemsize: int) -> int:
    """Bytes one head of a tile touches: scores, q / k / v tiles and accumulator rows (``+2`` folded columns).

    >>> working_set(256, 256, 64, 64, 4) >> 10
    520
    """
    features_qk, features_v = head_dim + 2, value_dim + 2
    elements = (block_q * block_k + (block_q + block_k) * features_qk  # scores, q and k tiles
                + block_k * features_v + block_q * features_v)  # v tile, accumulator rows
    return elements * itemsize


def _cost(heads, block_q, block_k, head_dim, value_dim, itemsize, l2):
    one_head = working_set(block_q, block_k, head_dim, value_dim, itemsize)
    spill = max(0.0, math.log2(one_head / l2)) + max(0.0, math.log2(heads * one_head / (_GROUP_L2S * l2)))
    return _CALL / (heads * block_q * block_k) + _PACK * (1.0 / block_q + 1.0 / block_k) + _SPILL * spill


def _head_candidates(n_heads: int) -> list[int]:
    """Powers of two below ``n_heads``, and ``n_heads`` itself."""
    n_heads = max(1, n_heads)
    return [1 << i for i in range(n_heads.bit_length()) if 1 << i < n_heads] + [n_heads]


def choose_tiles(n_heads: int, head_dim: int = 64, value_dim: int | None = None, itemsize: int = 4,
                 l2: int | None = None, sysfs_root: Path = SYSFS_CACHE) -> tuple[int, int]:
    """``(block_q, block_k)`` of least modelled cost for attention over ``n_heads`` heads.

    ``l2`` is the per-core L2 in bytes; by default read from the machine (:func:`attnkit._cpu.l2_bytes`,
    512 KiB when unknown). Ties go to the squarer, then the longer key tile.

    Shapes
    ------
    The tiles are ``(G, block_q, block_k)`` scores against ``(block_k, head_dim)`` keys and
    ``(block_k, value_dim)`` values, for the best ``G <= n_heads`` (see :func:`choose_heads`).

    Examples
    --------
    >>> choose_tiles(8, 64, l2=512 << 10)  # AMD Zen 2/3
    (256, 256)
    >>> choose_tiles(8, 64, l2=256 << 10)
    (128, 128)
    >>> choose_tiles(8, 64, l2=2 << 20)  # Intel Sapphire Rapids
    (512, 512)
    """
    value_dim = head_dim if value_dim is None else value_dim
    l2 = l2_bytes(sysfs_root) if l2 is None else l2
    return _best_tiles(n_heads, head_dim, value_dim, itemsize, l2)


@functools.lru_cache(maxsize=256)  # asked on every kernel call; ~400 cost evaluations each
def _best_tiles(n_heads, head_dim, value_dim, itemsize, l2):
    best = min((_cost(g, tq, tk, head_dim, value_dim, itemsize, l2), abs(tq - tk), -tk, tq, tk)
               for g in _head_candidates(n_heads) for tq in _CANDIDATES for tk in _CANDIDATES)
    return best[3], best[4]


def choose_heads(n_heads: int, block_q: int, block_k: int, head_dim: int = 64, value_dim: int | None = None,
                 itemsize: int = 4, l2: int | None = None, sysfs_root: Path = SYSFS_CACHE) -> int:
    """How many of ``n_heads`` heads one tile of ``block_q x block_k`` should batch (least modelled cost).

    Ties go to more heads (fewer Python calls).

    Examples
    --------
    >>> choose_heads(64, 256, 256, 32, l2=512 << 10)  # a BERT-sized batch at L = 512
    4
    >>> choose_heads(384, 48, 48, 32, l2=512 << 10)  # short sentences: many heads share a tile
    64
    """
    value_dim = head_dim if value_dim is None else value_dim
    l2 = l2_bytes(sysfs_root) if l2 is None else l2
    return _best_heads(n_heads, block_q, block_k, head_dim, value_dim, itemsize, l2)


@functools.lru_cache(maxsize=256)
def _best_heads(n_heads, block_q, block_k, head_dim, value_dim, itemsize, l2):
    return -min((_cost(g, block_q, block_k, head_dim, value_dim, itemsize, l2), -g)
                for g in _head_candidates(n_heads))[1]


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer (a tile size), got {text!r}")
    return int(text)


def heads_override() -> int | None:
    """Heads per tile from ``ATTNKIT_TILE_HEADS`` (None when unset)."""
    return _env_int(ENV_TILE_HEADS)


def tile_override() -> tuple[int | None, int | None]:
    """``(block_q, block_k)`` from ``ATTNKIT_TILE_Q`` / ``ATTNKIT_TILE_K`` (None where unset).

    >>> import os
    >>> os.environ.pop(ENV_TILE_Q, None) and None
    >>> tile_override()[0] is None
    True
    """
    return _env_int(ENV_TILE_Q), _env_int(ENV_TILE_K)

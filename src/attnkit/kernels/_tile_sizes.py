"""Tile lengths of the tiled kernel, chosen from the machine's per-core L2 by a small cost model.

Per score element a tile costs its share of the BLAS work plus three overheads, each in units of one
score's matmul work (measured on the machines in ``docs/kernels.md``):

* ``_CALL / (H Tq Tk)``: the ~20 NumPy calls of Python per tile, shared by the ``H`` heads of one batched
  matmul;
* ``_PACK (1/Tq + 1/Tk)``: BLAS copies the q/k/v operands of every tile into its panel format, once per
  tile, so longer tiles amortise it over more products;
* ``_SPILL log2(working set / L2)``: once one head's working set (the score tile, the q, k and v tiles
  with their two folded columns, and the accumulator rows) outgrows the per-core L2, the matmuls and the
  ``exp`` pass stream from L3 and, further out, from memory (measured: a 512 x 512 tile, 2.8 L2s, ran
  1.4-1.5x slower than 256 x 256 on a 512 KiB L2).

The chooser scores every power-of-two pair from 32 to 1024 and keeps the cheapest. Environment variables
``ATTNKIT_TILE_Q`` and ``ATTNKIT_TILE_K`` override it (experiments); the kernels' ``block_q`` / ``block_k``
keywords override both.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from .._cpu import SYSFS_CACHE, l2_bytes

__all__ = ["choose_tiles", "tile_override", "working_set", "ENV_TILE_Q", "ENV_TILE_K"]

ENV_TILE_Q, ENV_TILE_K = "ATTNKIT_TILE_Q", "ATTNKIT_TILE_K"
_CALL = 9000.0  # Python overhead per tile, in score-equivalents (~60 us against ~6.5 ns per score)
_PACK = 2.6  # BLAS packing of (Tq + Tk) rows of D + 2 features, per score, times Tq Tk / (Tq + Tk)
_SPILL = 0.3  # time added per doubling of one head's working set beyond the L2
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


def _cost(block_q, block_k, n_heads, head_dim, value_dim, itemsize, l2):
    spill = max(0.0, math.log2(working_set(block_q, block_k, head_dim, value_dim, itemsize) / l2))
    return _CALL / (n_heads * block_q * block_k) + _PACK * (1.0 / block_q + 1.0 / block_k) + _SPILL * spill


def choose_tiles(n_heads: int, head_dim: int = 64, value_dim: int | None = None, itemsize: int = 4,
                 l2: int | None = None, sysfs_root: Path = SYSFS_CACHE) -> tuple[int, int]:
    """``(block_q, block_k)`` of least modelled cost for ``n_heads`` heads batched per tile.

    ``l2`` is the per-core L2 in bytes; by default read from the machine (:func:`attnkit._cpu.l2_bytes`,
    512 KiB when unknown). Ties go to the squarer, then the longer key tile.

    Shapes
    ------
    The tiles are ``(n_heads, block_q, block_k)`` scores against ``(block_k, head_dim)`` keys and
    ``(block_k, value_dim)`` values.

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
    best = min((_cost(tq, tk, n_heads, head_dim, value_dim, itemsize, l2), abs(tq - tk), -tk, tq, tk)
               for tq in _CANDIDATES for tk in _CANDIDATES)
    return best[3], best[4]


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{name} must be a positive integer (a tile length), got {text!r}")
    return int(text)


def tile_override() -> tuple[int | None, int | None]:
    """``(block_q, block_k)`` from ``ATTNKIT_TILE_Q`` / ``ATTNKIT_TILE_K`` (None where unset).

    >>> import os
    >>> os.environ.pop(ENV_TILE_Q, None) and None
    >>> tile_override()[0] is None
    True
    """
    return _env_int(ENV_TILE_Q), _env_int(ENV_TILE_K)

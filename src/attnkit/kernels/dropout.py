"""Counter-based dropout masks for attention weights.

The keep/drop decision for the weight of query ``i`` and key ``j`` in attention matrix ``n`` (the flat index
over the leading batch and head dimensions) is a pure function of ``(seed, n, i, j)``: a splitmix64 hash of
the element's global index. So the reference kernel and the tiled kernel drop exactly the same entries,
whatever the tile sizes, and backward regenerates the mask from the seed instead of storing it.
"""
from __future__ import annotations

import numpy as np

__all__ = ["keep_mask"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """Finaliser of splitmix64: a bijective, well-mixed hash of uint64 counters (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * _MIX1
    z = z ^ (z >> np.uint64(27))
    z = z * _MIX2
    return z ^ (z >> np.uint64(31))


def keep_mask(seed: int, p: float, lead_shape: tuple[int, ...], q_idx: np.ndarray, k_idx: np.ndarray,
              seq_q: int, seq_k: int) -> np.ndarray:
    """Boolean keep-mask for a tile of attention weights.

    Parameters
    ----------
    seed : int
        Dropout seed; the same seed gives the same mask.
    p : float
        Drop probability in [0, 1).
    lead_shape : tuple of int
        Leading (batch, head, ...) shape of the attention matrices.
    q_idx : ndarray of int, shape (Tq,)
        Global query positions of the tile.
    k_idx : ndarray of int, shape (Tk,)
        Global key positions of the tile.
    seq_q, seq_k : int
        Full query and key lengths (they fix the global element index).

    Returns
    -------
    ndarray of bool, shape (*lead_shape, Tq, Tk)
        ``True`` where the weight is kept.
    """
    n_lead = int(np.prod(lead_shape, dtype=np.int64))
    lead = np.arange(n_lead, dtype=np.uint64).reshape(*lead_shape, 1, 1)  # (*lead, 1, 1)
    q = np.asarray(q_idx, dtype=np.uint64)[:, None]  # (Tq, 1)
    k = np.asarray(k_idx, dtype=np.uint64)[None, :]  # (1, Tk)
    with np.errstate(over="ignore"):
        flat = (lead * np.uint64(seq_q) + q) * np.uint64(seq_k) + k  # (*lead, Tq, Tk)
        z = _splitmix64(flat + np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _GOLDEN)
    u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)  # uniform in [0, 1)
    return u >= p

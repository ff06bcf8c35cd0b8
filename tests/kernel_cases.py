"""Shared pieces of the kernel tests: a learnable score modifier and one forward-and-backward runner.

Dimension letters: B batch, H heads, Tq/Tk rows/columns of one tile.
"""
from __future__ import annotations

import numpy as np

from attnkit.flex import ScoreMod


class RelativeTable(ScoreMod):
    """A learnable per-head table of relative-position biases: ``bias[h, i, j] = table[h, j - (i + offset)]``.

    Each tile's gradient partial is kept with its corner and :attr:`grad` adds them in an order fixed by corner
    and content, so the table's gradient does not depend on the order the kernel visits the tiles in.
    """

    def __init__(self, table: np.ndarray, offset: int = 0):
        super().__init__()
        self.table, self.offset = table, offset  # (H, 2 R + 1)
        self.radius = (table.shape[1] - 1) // 2
        self._partials: list[tuple[int, int, bytes, np.ndarray]] = []

    @property
    def accumulates(self) -> bool:
        return True

    @property
    def grad(self) -> np.ndarray:
        total = np.zeros_like(self.table)
        for *_, partial in sorted(self._partials, key=lambda entry: entry[:3]):
            total += partial
        return total

    def _index(self, q_idx, k_idx):
        rel = np.ravel(k_idx)[None, :] - np.ravel(q_idx)[:, None] - self.offset  # (Tq, Tk), 0 on the diagonal
        return np.clip(rel, -self.radius, self.radius) + self.radius  # (Tq, Tk)

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.table[:, self._index(q_idx, kv_idx)].astype(score.dtype)  # (B, H, Tq, Tk)

    def backward(self, grad, score, b, h, q_idx, kv_idx):
        g = grad.sum(axis=0)  # (H, Tq, Tk)
        idx = self._index(q_idx, kv_idx)  # (Tq, Tk)
        heads = np.arange(self.table.shape[0])[:, None, None]  # (H, 1, 1)
        partial = np.zeros_like(self.table)
        np.add.at(partial, (heads, idx[None]), g)
        self._partials.append((int(np.ravel(q_idx)[0]), int(np.ravel(kv_idx)[0]), partial.tobytes(), partial))
        return grad


def run_attention(fn_fwd, fn_bwd, q, k, v, grad, bias=None, **kw):
    """Forward and backward; returns a dict of outputs and gradients (a RelativeTable's included).

    A :class:`RelativeTable` given as ``bias`` runs as the kernel's ``score_mod``, aligned at the bottom-right
    corner (query i at key position ``i + Lk - Lq``)."""
    if isinstance(bias, RelativeTable):
        kw["score_mod"] = bias = RelativeTable(bias.table.copy(), offset=k.shape[-2] - q.shape[-2])
    out, _, ctx = fn_fwd(q, k, v, bias=None if isinstance(bias, RelativeTable) else bias, **kw)
    dq, dk, dv, dbias = fn_bwd(grad, ctx)
    res = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if dbias is not None:
        res["dbias"] = dbias
    if isinstance(bias, RelativeTable):
        res["dtable"] = bias.grad
    return res

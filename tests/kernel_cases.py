"""Shared pieces of the kernel tests: a learnable score bias and one forward-and-backward runner.

Dimension letters: H heads, Tq/Tk rows/columns of one tile.
"""
from __future__ import annotations

import numpy as np

from attnkit.kernels.bias import ScoreBias


class RelativeTable(ScoreBias):
    """A learnable per-head table of relative-position biases: ``bias[h, i, j] = table[h, j - i]``.

    The threaded kernel hands over tile gradients in a scheduling-dependent order. Summing float32 partials
    in that order would make the table's gradient differ in its last bits from run to run, so each tile's
    partial is kept with its corner and :attr:`grad` adds them in an order fixed by corner and content.
    """

    def __init__(self, table: np.ndarray):
        self.table = table  # (H, 2 R + 1)
        self.radius = (table.shape[1] - 1) // 2
        self._partials: list[tuple[int, int, bytes, np.ndarray]] = []

    @property
    def grad(self) -> np.ndarray:
        total = np.zeros_like(self.table)
        for *_, partial in sorted(self._partials, key=lambda entry: entry[:3]):
            total += partial
        return total

    def _index(self, q_idx, k_idx, seq_q, seq_k):
        rel = k_idx[None, :] - q_idx[:, None] - (seq_k - seq_q)  # (Tq, Tk), 0 on the causal diagonal
        return np.clip(rel, -self.radius, self.radius) + self.radius  # (Tq, Tk)

    def tile(self, q_idx, k_idx, seq_q, seq_k):
        return self.table[:, self._index(q_idx, k_idx, seq_q, seq_k)]  # (H, Tq, Tk)

    def accumulate_grad(self, q_idx, k_idx, seq_q, seq_k, grad_tile):
        g = grad_tile.reshape((-1,) + grad_tile.shape[-3:]).sum(axis=0)  # (H, Tq, Tk)
        idx = self._index(q_idx, k_idx, seq_q, seq_k)  # (Tq, Tk)
        heads = np.arange(self.table.shape[0])[:, None, None]  # (H, 1, 1)
        partial = np.zeros_like(self.table)
        np.add.at(partial, (heads, idx[None]), g)
        self._partials.append((int(q_idx[0]), int(k_idx[0]), partial.tobytes(), partial))


def run_attention(fn_fwd, fn_bwd, q, k, v, grad, bias=None, **kw):
    """Forward and backward; returns a dict of outputs and gradients (ScoreBias grads included)."""
    if isinstance(bias, RelativeTable):
        bias = RelativeTable(bias.table.copy())
    out, _, ctx = fn_fwd(q, k, v, bias=bias, **kw)
    dq, dk, dv, dbias = fn_bwd(grad, ctx)
    res = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    if dbias is not None:
        res["dbias"] = dbias
    if isinstance(bias, RelativeTable):
        res["dtable"] = bias.grad
    return res

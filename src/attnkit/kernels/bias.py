"""Score biases given as functions of query and key positions (FlexAttention-style).

A bias that depends only on positions (relative-position tables, ALiBi slopes, physical distance priors)
never needs a full ``Lq x Lk`` matrix: a kernel asks for the tile it is working on and hands back the
gradient of that same tile. The reference kernel asks for one tile covering everything; the tiled kernel
asks tile by tile. Both call :meth:`ScoreBias.tile` in forward and :meth:`ScoreBias.accumulate_grad` in
backward with the same index vectors.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ScoreBias"]


class ScoreBias:
    """Interface of a positional score bias added to attention logits before the softmax.

    Subclasses implement :meth:`tile` and, if they have learnable parameters, :meth:`accumulate_grad`.

    Shapes
    ------
    q_idx : (Tq,) int   positions of the queries in the tile (0-based, within the query sequence)
    k_idx : (Tk,) int   positions of the keys in the tile (0-based, within the key sequence)
    tile  : (..., Tq, Tk), broadcastable against the score tile ``(..., Tq, Tk)`` (e.g. ``(H, Tq, Tk)``)
    """

    def tile(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
        """Bias values for queries ``q_idx`` against keys ``k_idx`` of sequences of length seq_q, seq_k."""
        raise NotImplementedError

    def accumulate_grad(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int,
                        grad_tile: np.ndarray) -> None:
        """Add the gradient of the loss with respect to this tile's bias values to the parameters' grads.

        ``grad_tile`` has the full score-tile shape ``(..., Tq, Tk)``; reduce it to the parameters.
        A bias without parameters does nothing.
        """
        return None

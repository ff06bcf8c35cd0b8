"""``LearnedBiasAttention``: scaled dot-product attention plus a learnable relative-position bias.

Two biases, both :class:`attnkit.kernels.bias.ScoreBias` objects (so a tiled kernel can ask for them tile by
tile): T5's log-bucketed relative-position table and ALiBi's per-head linear distance penalty with
learnable slopes.

Dimension letters: B batch, H heads, Lq/Lk query/key length, Tq/Tk the query/key positions of one tile
(the whole sequences for the reference kernel), NB ``num_buckets``, Dh head features.

Relative positions use bottom-right alignment, like the causal mask: query i sits at key position
``i + Lk - Lq`` (with ``Lq == Lk`` that is just i; with a key/value cache the last query is the last key).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_positive_int
from ..flex.modifiers import alibi_slopes, t5_relative_position_bucket
from ..kernels.bias import ScoreBias
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["LearnedBiasAttention", "T5RelativeBias", "ALiBiBias", "t5_relative_position_bucket", "alibi_slopes"]


def _query_positions(q_idx: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
    """Key-axis positions of queries ``q_idx``: bottom-right aligned, ``i + Lk - Lq``."""
    return np.asarray(q_idx, dtype=np.int64) + (seq_k - seq_q)  # (Tq,)


def _per_head(grad_tile: np.ndarray, num_heads: int, owner: str) -> np.ndarray:
    """Sum a (..., H, Tq, Tk) score-tile gradient over its leading dims: (H, Tq, Tk)."""
    if grad_tile.ndim < 3 or grad_tile.shape[-3] != num_heads:
        raise ValueError(f"{owner}: the score gradient of shape {grad_tile.shape} has no head axis of size "
                         f"{num_heads} at position -3")
    return grad_tile.reshape(-1, *grad_tile.shape[-3:]).sum(axis=0)  # (H, Tq, Tk)


class T5RelativeBias(ScoreBias):
    """T5 relative-position bias: ``bias[h, i, j] = table[h, bucket(j - pos(i))]``.

    Parameters
    ----------
    table : ndarray, shape (H, NB)
        Bias values per head and bucket (used as given, in its dtype).
    grad : ndarray, shape (H, NB), optional
        Gradient array that :meth:`accumulate_grad` adds into (in place); ``None`` for a frozen table.
    bidirectional, num_buckets, max_distance
        As in :func:`t5_relative_position_bucket`.

    Shapes
    ------
    tile : (H, Tq, Tk); grad_tile : (..., H, Tq, Tk). Query i sits at key position ``i + Lk - Lq``.

    Examples
    --------
    >>> bias = T5RelativeBias(np.arange(16.0).reshape(2, 8), num_buckets=8, max_distance=16)
    >>> bias.tile(np.arange(3), np.arange(3), 3, 3)[1]  # head 1 = 8 + bucket
    array([[ 8., 13., 14.],
           [ 9.,  8., 13.],
           [10.,  9.,  8.]])
    """

    def __init__(self, table: np.ndarray, grad: np.ndarray | None = None, *, bidirectional: bool = True,
                 num_buckets: int = 32, max_distance: int = 128) -> None:
        self.table, self.grad = table, grad
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance

    def buckets(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
        """Bucket of each (query, key) pair of the tile: (Tq, Tk) int64."""
        rel = np.asarray(k_idx, dtype=np.int64)[None, :] - _query_positions(q_idx, seq_q, seq_k)[:, None]  # (Tq, Tk)
        return t5_relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)

    def tile(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
        return self.table[:, self.buckets(q_idx, k_idx, seq_q, seq_k)]  # (H, Tq, Tk)

    def accumulate_grad(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int,
                        grad_tile: np.ndarray) -> None:
        if self.grad is None:
            return
        num_heads, nb = self.table.shape
        g = _per_head(grad_tile, num_heads, "T5RelativeBias")  # (H, Tq, Tk)
        flat = np.arange(num_heads)[:, None, None] * nb + self.buckets(q_idx, k_idx, seq_q, seq_k)  # (H, Tq, Tk)
        summed = np.bincount(flat.ravel(), weights=g.ravel(), minlength=num_heads * nb)  # (H * NB,)
        self.grad += summed.reshape(num_heads, nb)  # (H, NB)


class ALiBiBias(ScoreBias):
    """ALiBi bias with learnable slopes: ``bias[h, i, j] = -slopes[h] * dist(i, j)``.

    ``dist = |pos(i) - j|`` when ``bidirectional``, else ``max(pos(i) - j, 0)`` (keys after the query cost
    nothing: meant for use with the causal mask, as in the ALiBi paper). ``pos(i) = i + Lk - Lq``.

    Parameters
    ----------
    slopes : ndarray, shape (H,)
    grad : ndarray, shape (H,), optional
        Gradient array that :meth:`accumulate_grad` adds into (in place); ``None`` for frozen slopes.
    bidirectional : bool

    Shapes
    ------
    tile : (H, Tq, Tk); grad_tile : (..., H, Tq, Tk).

    Examples
    --------
    >>> ALiBiBias(np.array([0.5])).tile(np.arange(3), np.arange(4), 3, 4)[0]
    array([[-0.5, -0. , -0.5, -1. ],
           [-1. , -0.5, -0. , -0.5],
           [-1.5, -1. , -0.5, -0. ]])
    """

    def __init__(self, slopes: np.ndarray, grad: np.ndarray | None = None, *, bidirectional: bool = True) -> None:
        self.slopes, self.grad, self.bidirectional = slopes, grad, bidirectional

    def distance(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
        """Distance of each (query, key) pair of the tile, (Tq, Tk), in the slopes' dtype."""
        rel = _query_positions(q_idx, seq_q, seq_k)[:, None] - np.asarray(k_idx, dtype=np.int64)[None, :]  # (Tq, Tk)
        dist = np.abs(rel) if self.bidirectional else np.maximum(rel, 0)
        return dist.astype(self.slopes.dtype)

    def tile(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
        return -self.slopes[:, None, None] * self.distance(q_idx, k_idx, seq_q, seq_k)  # (H, Tq, Tk)

    def accumulate_grad(self, q_idx: np.ndarray, k_idx: np.ndarray, seq_q: int, seq_k: int,
                        grad_tile: np.ndarray) -> None:
        if self.grad is None:
            return
        g = _per_head(grad_tile, self.slopes.shape[0], "ALiBiBias")  # (H, Tq, Tk)
        self.grad -= np.einsum("hqk,qk->h", g, self.distance(q_idx, k_idx, seq_q, seq_k))  # (H,)


class LearnedBiasAttention(ScaledDotProductAttention):
    """Scaled dot-product attention with a learnable relative-position bias per head.

    ``weights = softmax(scale * q k^T + bias[h, i, j])``, the bias given by ``mode``:

    - ``"t5"``: T5's bucketed relative positions (exact for distances below a quarter of ``num_buckets``
      (bidirectional) or half of it, log-spaced up to ``max_distance``, one bucket beyond); a learnable
      table ``rel_bias`` of shape (H, NB), zero-initialised (the head starts as plain attention).
    - ``"alibi"``: ``-slopes[h] * |pos(i) - j|`` with learnable ``slopes`` (H,), initialised to ALiBi's
      geometric sequence (:func:`alibi_slopes`). ``bidirectional=False`` uses ``max(pos(i) - j, 0)``.
      ``num_buckets`` and ``max_distance`` are not used.

    Query i sits at key position ``pos(i) = i + Lk - Lq`` (bottom-right aligned, like the causal mask).

    Parameters
    ----------
    num_heads : int
        H; the inputs must have H at axis -3, as ``MultiHeadAttention(embed_dim, H, attention=...)`` gives.
    max_distance : int, default 128
        T5: distances from here on share the last bucket. Must exceed the exact range ``max_exact``.
    num_buckets : int, default 32
        T5: buckets per head (split between the two directions when ``bidirectional``).
    bidirectional : bool, default True
        Distinguish keys before and after the query (encoders); ``False`` for causal decoders.
    mode : {"t5", "alibi"}, default "t5"
    dropout : float, default 0.0
        Dropout on the weights after the softmax, training mode only (inverted scaling).
    scale : float, optional
        Score multiplier; default ``1 / sqrt(Dh)``.
    seed : int, optional
        Seed of the dropout stream.

    Attributes
    ----------
    rel_bias : (H, NB) in mode "t5", or slopes : (H,) in mode "alibi"; gradients in ``grads`` by the same name.

    Shapes
    ------
    q : (..., H, Lq, Dh), k : (..., H, Lk, Dh), v : (..., H, Lk, Dv). Axis -3 is always the head axis: a
        3-D input is read as (H, L, D) (no batch); for one head over a batch use (B, 1, L, D).
    mask : bool broadcastable to (..., H, Lq, Lk), ``True`` = may attend; ``is_causal`` ANDs the causal mask.
    output : (..., H, Lq, Dv), weights : (..., H, Lq, Lk) (before dropout), in the inputs' dtype.

    Examples
    --------
    >>> from attnkit.attention import MultiHeadAttention
    >>> head = LearnedBiasAttention(num_heads=2, mode="alibi")
    >>> head.slopes
    array([0.0625  , 0.00390625])
    >>> mha = MultiHeadAttention(8, 2, attention=head, rng=0)
    >>> x = np.random.default_rng(0).normal(size=(3, 5, 8))
    >>> out, w = mha(x, x, x, is_causal=True)
    >>> _ = mha.backward(np.ones_like(out))
    >>> out.shape, mha.attention.grads["slopes"].shape
    ((3, 5, 8), (2,))
    """

    def __init__(self, num_heads: int, max_distance: int = 128, num_buckets: int = 32, bidirectional: bool = True,
                 mode: str = "t5", dropout: float = 0.0, scale: float | None = None,
                 seed: int | None = None) -> None:
        super().__init__(dropout=dropout, scale=scale, is_causal=False, seed=seed)
        self.num_heads = check_positive_int(num_heads, "num_heads")
        self.bidirectional = bool(bidirectional)
        if mode not in ("t5", "alibi"):
            raise ValueError(f"mode must be 't5' or 'alibi', got {mode!r}")
        self.mode = mode
        self.num_buckets = check_positive_int(num_buckets, "num_buckets")
        self.max_distance = check_positive_int(max_distance, "max_distance")
        if mode == "t5":
            per_direction = self.num_buckets // 2 if self.bidirectional else self.num_buckets
            max_exact = per_direction // 2
            if max_exact < 1:
                raise ValueError(f"num_buckets = {num_buckets} is too small: need at least "
                                 f"{4 if self.bidirectional else 2} (bidirectional={self.bidirectional})")
            if self.max_distance <= max_exact:
                raise ValueError(f"max_distance = {max_distance} must exceed the exact range max_exact = "
                                 f"{max_exact} (num_buckets = {num_buckets}, bidirectional={self.bidirectional})")
            self.register_parameter("rel_bias", np.zeros((self.num_heads, self.num_buckets)))
        else:
            self.register_parameter("slopes", alibi_slopes(self.num_heads))

    def extra_repr(self) -> str:
        extra = (f", num_buckets={self.num_buckets}, max_distance={self.max_distance}" if self.mode == "t5" else "")
        return (f"num_heads={self.num_heads}, mode={self.mode!r}, bidirectional={self.bidirectional}{extra}, "
                f"dropout={self.dropout}, scale={self.scale}")

    def score_bias(self, dtype: Any = None) -> ScoreBias:
        """The :class:`ScoreBias` of the current parameters (cast to ``dtype``), accumulating into ``grads``."""
        name = "rel_bias" if self.mode == "t5" else "slopes"
        param = self._parameters[name]
        param = param if dtype is None else param.astype(dtype, copy=False)
        if self.mode == "t5":
            return T5RelativeBias(param, self.grads[name], bidirectional=self.bidirectional,
                                  num_buckets=self.num_buckets, max_distance=self.max_distance)
        return ALiBiBias(param, self.grads[name], bidirectional=self.bidirectional)

    def forward(self, q: Any, k: Any, v: Any, mask: Any = None, *, is_causal: bool = False,
                need_weights: bool = True):
        """Attend with the bias; returns ``(output (..., H, Lq, Dv), weights (..., H, Lq, Lk) or None)``."""
        q, k, v, lead, mask = self._check_inputs(q, k, v, mask)
        if not lead or lead[-1] != self.num_heads:
            raise ValueError(f"LearnedBiasAttention has num_heads = {self.num_heads} but the inputs have "
                             f"{lead[-1] if lead else 'no'} heads at axis -3 (q: {q.shape}, k: {k.shape}); "
                             f"expected (..., {self.num_heads}, L, D), e.g. from MultiHeadAttention with "
                             f"num_heads={self.num_heads}")
        return self._attend(q, k, v, mask, is_causal, self.score_bias(q.dtype), need_weights)

    def backward(self, grad_output: Any):
        """Return ``(grad_q, grad_k, grad_v)`` and add the gradient of ``rel_bias`` / ``slopes``."""
        return super().backward(grad_output)

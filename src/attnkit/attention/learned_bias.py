"""``LearnedBiasAttention``: scaled dot-product attention plus a learnable relative-position bias.

Two biases, both the score modifiers of :mod:`attnkit.flex` (one ALiBi, one T5 bias in the library): T5's
log-bucketed relative-position table (:class:`~attnkit.flex.RelativePositionBias`, a (buckets, heads) table as in
``transformers``) and ALiBi's per-head linear distance penalty with learnable slopes
(:class:`~attnkit.flex.ALiBi`). The head's parameter is the modifier's parameter and its gradient buffer the
modifier's gradient, so the head runs through :func:`attnkit.flex.flex_attention` like every other.

Dimension letters: B batch, H heads, Lq/Lk query/key length, NB ``num_buckets``, Dh head features.

Relative positions use bottom-right alignment, like the causal mask: query i sits at key position
``i + Lk - Lq`` (with ``Lq == Lk`` that is just i; with a key/value cache the last query is the last key).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_positive_int
from ..flex.modifiers import ALiBi, RelativePositionBias, ScoreMod, alibi_slopes, t5_relative_position_bucket
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["LearnedBiasAttention", "t5_relative_position_bucket", "alibi_slopes"]


class LearnedBiasAttention(ScaledDotProductAttention):
    """Scaled dot-product attention with a learnable relative-position bias per head.

    ``weights = softmax(scale * q k^T + bias[h, i, j])``, the bias given by ``mode``:

    - ``"t5"``: T5's bucketed relative positions (exact for distances below a quarter of ``num_buckets``
      (bidirectional) or half of it, log-spaced up to ``max_distance``, one bucket beyond); a learnable
      table ``rel_bias`` of shape (NB, H) (``transformers``' layout of T5's ``relative_attention_bias``),
      zero-initialised (the head starts as plain attention).
    - ``"alibi"``: ``-slopes[h] * |pos(i) - j|`` with learnable ``slopes`` (H,), initialised to ALiBi's
      geometric sequence (:func:`alibi_slopes`). ``bidirectional=False`` is the paper's one-sided
      ``slopes[h] * (j - pos(i))``, meant for use with the causal mask (``is_causal=True``).
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
    rel_bias : (NB, H) in mode "t5", or slopes : (H,) in mode "alibi"; gradients in ``grads`` by the same name.

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
            self.register_parameter("rel_bias", np.zeros((self.num_buckets, self.num_heads)))
        else:
            self.register_parameter("slopes", alibi_slopes(self.num_heads))

    def extra_repr(self) -> str:
        extra = (f", num_buckets={self.num_buckets}, max_distance={self.max_distance}" if self.mode == "t5" else "")
        return (f"num_heads={self.num_heads}, mode={self.mode!r}, bidirectional={self.bidirectional}{extra}, "
                f"dropout={self.dropout}, scale={self.scale}")

    def score_mod_for(self, seq_q: int, seq_k: int) -> ScoreMod:
        """The bias for Lq queries after Lk keys (bottom-right aligned) as a score modifier on the current
        parameter (``rel_bias`` or ``slopes``), adding its gradient into ``grads`` under the same name."""
        offset = seq_k - seq_q
        if self.mode == "t5":
            return RelativePositionBias(self._parameters["rel_bias"], self.max_distance, self.bidirectional,
                                        offset=offset, grad=self.grads["rel_bias"])
        return ALiBi(self._parameters["slopes"], bidirectional=self.bidirectional, offset=offset,
                     grad=self.grads["slopes"])

    def forward(self, q: Any, k: Any, v: Any, mask: Any = None, *, is_causal: bool = False,
                need_weights: bool = True):
        """Attend with the bias; returns ``(output (..., H, Lq, Dv), weights (..., H, Lq, Lk) or None)``."""
        q, k, v, lead, mask = self._check_inputs(q, k, v, mask)
        if not lead or lead[-1] != self.num_heads:
            raise ValueError(f"LearnedBiasAttention has num_heads = {self.num_heads} but the inputs have "
                             f"{lead[-1] if lead else 'no'} heads at axis -3 (q: {q.shape}, k: {k.shape}); "
                             f"expected (..., {self.num_heads}, L, D), e.g. from MultiHeadAttention with "
                             f"num_heads={self.num_heads}")
        return self._attend(q, k, v, mask, is_causal, self.score_mod_for(q.shape[-2], k.shape[-2]), need_weights)

    def backward(self, grad_output: Any):
        """Return ``(grad_q, grad_k, grad_v)`` and add the gradient of ``rel_bias`` / ``slopes``."""
        return super().backward(grad_output)

"""``GatedAttention``: grouped-query attention whose heads' outputs pass through a sigmoid gate (Qwen3-Next, Qwen3.5).

Dimension letters: B batch, L new tokens, D ``hidden_size``, Hq query heads, Dh ``head_dim``.

The layer is :class:`~attnkit.attention.grouped_query.GroupedQueryAttention` except for its output: every
feature of every head is scaled by a gate computed from the layer's input, before the output projection,

    o = softmax-attention(q, k, v)  (B, L, Hq*Dh),    y = (o * sigmoid(x W_G + b_G)) W_O + b_O

so a head can switch itself off for a token (the gate is near 0) without the softmax having to attend
somewhere harmless: the "attention sink" problem answered by a gate rather than by a sink logit.

Hugging Face's ``q_proj`` makes the queries and the gate in one product, (Hq, 2, Dh) per row: each head's Dh
query rows followed by its Dh gate rows; attnkit keeps them as ``W_Q`` and ``W_G`` (the checkpoint reader
splits them per head, :class:`~attnkit.pretrained.tensor_map.TensorMap`'s ``head_split_transpose``).
"""
from __future__ import annotations

import numpy as np

from ..init import as_generator, normal
from ..kernels.linear import linear, linear_backward
from .grouped_query import GroupedQueryAttention

__all__ = ["GatedAttention"]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # never overflows, unlike 1 / (1 + exp(-x))


class GatedAttention(GroupedQueryAttention):
    """Grouped-query attention with an output gate ``sigmoid(x W_G + b_G)`` per head and feature.

    Parameters
    ----------
    config : DecoderConfig
        As :class:`~attnkit.attention.grouped_query.GroupedQueryAttention`; ``attention_bias`` also gives the
        gate a bias ``b_G``.
    layer_index : int
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (biases start at zero).

    Attributes
    ----------
    Those of :class:`~attnkit.attention.grouped_query.GroupedQueryAttention`, and W_G (D, Hq*Dh) (b_G (Hq*Dh,)
    with ``attention_bias``); ``grads`` with the same names.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D), as :class:`~attnkit.attention.grouped_query.GroupedQueryAttention`. Its hook
    points are that layer's; ``hook_z`` holds the heads' outputs before the gate.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=4,
    ...                     num_kv_heads=2, head_dim=2, intermediate_size=8)
    >>> attn = GatedAttention(cfg, 0, rng=0)
    >>> y = attn(np.ones((2, 3, 8)))
    >>> y.shape, attn.backward(np.ones_like(y)).shape, attn.W_G.shape
    ((2, 3, 8), (2, 3, 8), (8, 8))
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        gen = as_generator(rng)
        super().__init__(config, layer_index, rng=gen)
        width = self.num_heads * self.head_dim
        self.register_parameter("W_G", normal(gen, (self.hidden_size, width), std=0.02))
        if config.attention_bias:
            self.register_parameter("b_G", np.zeros(width))

    def _output(self, x: np.ndarray, merged: np.ndarray):
        """``(merged * sigmoid(x W_G + b_G)) W_O + b_O``: ``(y (B, L, D), saved)``."""
        p = self._parameters
        gate = _sigmoid(linear(x, p["W_G"], p.get("b_G")))  # (B, L, Hq*Dh)
        gated = merged * gate  # (B, L, Hq*Dh)
        y, _ = super()._output(x, gated)  # (B, L, D)
        return y, (merged, gate, gated)

    def _output_backward(self, grad_y: np.ndarray, x: np.ndarray, saved):
        """Gradients of :meth:`_output`: the heads' outputs' (B, L, Hq*Dh) and x's through the gate (B, L, D)."""
        merged, gate, gated = saved
        grad_gated, _ = super()._output_backward(grad_y, x, gated)  # (B, L, Hq*Dh)
        grad_pre = grad_gated * merged * gate * (1 - gate)  # (B, L, Hq*Dh): sigmoid' = s (1 - s)
        p = self._parameters
        grad_x, grad_w, grad_b = linear_backward(grad_pre, x, p["W_G"], "b_G" in p)  # (B, L, D)
        self._accumulate("G", grad_w, grad_b)
        return grad_gated * gate, grad_x

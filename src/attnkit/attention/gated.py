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
        As :class:`~attnkit.attention.grouped_query.GroupedQueryAttention`; ``attention.bias`` also gives the
        gate a bias ``b_G``.
    layer_index : int
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (biases start at zero).

    Attributes
    ----------
    Those of :class:`~attnkit.attention.grouped_query.GroupedQueryAttention`, and W_G (D, Hq*Dh) (b_G (Hq*Dh,)
    with ``attention.bias``); ``grads`` with the same names.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D), as :class:`~attnkit.attention.grouped_query.GroupedQueryAttention`. Its hook
    points are that layer's; ``hook_z`` holds the heads' outputs after the gate, as ``W_O`` reads them (so a
    head's share of the output is ``hook_z`` times its rows of ``W_O``, as in an ungated layer).

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=4,
    ...                     num_kv_heads=2, head_dim=2, mlp=MLPConfig(8))
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
        if config.attention.bias:
            self.register_parameter("b_G", np.zeros(width))

    def _gate(self, x: np.ndarray, heads: np.ndarray):
        """``heads * sigmoid(x W_G + b_G)``, per head and feature: (B, L, Hq, Dh), and what backward needs."""
        p = self._parameters
        gate = _sigmoid(linear(x, p["W_G"], p.get("b_G"))).reshape(heads.shape)  # (B, L, Hq, Dh)
        return heads * gate, (heads, gate)

    def _gate_backward(self, grad: np.ndarray, x: np.ndarray, saved):
        """Gradients of :meth:`_gate`: the heads' outputs' (B, L, Hq, Dh) and x's through the gate (B, L, D)."""
        heads, gate = saved
        grad_pre = (grad * heads * gate * (1 - gate)).reshape(x.shape[:2] + (-1,))  # (B, L, Hq*Dh): s' = s (1 - s)
        p = self._parameters
        grad_x, grad_w, grad_b = linear_backward(grad_pre, x, p["W_G"], "b_G" in p)  # (B, L, D)
        self._accumulate("G", grad_w, grad_b)
        return grad * gate, grad_x

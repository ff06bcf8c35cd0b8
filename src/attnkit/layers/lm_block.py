"""``LMBlock``: one pre-norm layer of a decoder-only language model.

Dimension letters: B batch, L new tokens, D ``hidden_size``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..attention.grouped_query import GroupedQueryAttention
from ..core.module import Module
from ..init import as_generator, normal
from .feed_forward import FeedForward
from .gated_mlp import GatedMLP
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm

__all__ = ["LMBlock", "make_norm"]


def make_norm(config) -> Module:
    """The norm the config names: :class:`RMSNorm` or :class:`LayerNorm` over ``hidden_size``."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=config.norm_eps)
    return LayerNorm(config.hidden_size, eps=config.norm_eps)


class LMBlock(Module):
    """``x = x + attention(attn_norm(x)); x = x + mlp(mlp_norm(x))``.

    Parameters
    ----------
    config : DecoderConfig
        ``norm`` picks RMSNorm or LayerNorm, ``mlp`` picks :class:`GatedMLP` or the plain
        :class:`FeedForward` (GPT-2), ``window_of(layer_index)`` the attention's sliding window.
    layer_index : int
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    attn_norm, attention (:class:`~attnkit.attention.grouped_query.GroupedQueryAttention`), mlp_norm, mlp.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D); ``rotary``, ``attention_mask`` and ``cache`` go to the attention unchanged.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=12)
    >>> block = LMBlock(cfg, 0, rng=0)
    >>> y = block(np.ones((1, 3, 8)))
    >>> y.shape, block.backward(np.ones_like(y)).shape
    ((1, 3, 8), (1, 3, 8))
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        self.attn_norm = make_norm(config)
        self.attention = GroupedQueryAttention(config, layer_index, rng=gen)
        self.mlp_norm = make_norm(config)
        if config.mlp == "gated":
            self.mlp = GatedMLP(config, rng=gen)
        else:
            self.mlp = FeedForward(config.hidden_size, config.intermediate_size, config.activation, rng=gen)
            for name in ("W1", "W2"):  # GPT-2's N(0, 0.02^2) rather than FeedForward's Glorot default
                setattr(self.mlp, name, normal(gen, self.mlp._parameters[name].shape, std=0.02))

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """The block's output (B, L, D); each sublayer caches what its backward needs.

        With ``output_attentions=True`` the result is ``(y, weights)``, weights (B, Hq, L, S) from the
        attention (see :meth:`GroupedQueryAttention.forward`).
        """
        attended = self.attention(self.attn_norm(x), rotary=rotary, attention_mask=attention_mask, cache=cache,
                                  output_attentions=output_attentions)
        weights = None
        if output_attentions:
            attended, weights = attended
        x = x + attended
        y = x + self.mlp(self.mlp_norm(x))
        return (y, weights) if output_attentions else y

    def backward(self, grad_output: Any) -> np.ndarray:
        """The forward read backwards: each residual branch adds its sublayers' input gradient."""
        g = np.asarray(grad_output)
        g = g + self.mlp_norm.backward(self.mlp.backward(g))
        return g + self.attn_norm.backward(self.attention.backward(g))

"""``LMBlock`` and ``ParallelLMBlock``: one layer of a decoder-only language model, composed from its parts.

Dimension letters: B batch, L new tokens, D ``hidden_size``.

The config is read once, when the block is built: which norm sits before and after each branch (an
:class:`~attnkit.layers.identity.Identity` where there is none), which token mixer (:data:`MIXERS`, by the
layer's type and the attention's kind), which MLP (:data:`MLPS`), and how the residuals join (:data:`BLOCKS`).
forward and backward read no setting.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..attention.grouped_query import GroupedQueryAttention
from ..attention.latent import MultiHeadLatentAttention
from ..core.module import Module
from ..init import as_generator, normal
from .experts import MixtureOfExperts
from .feed_forward import FeedForward
from .gated_mlp import GatedMLP
from .identity import Identity
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm
from .shared_experts import SharedExpertsMoE

__all__ = ["LMBlock", "ParallelLMBlock", "BLOCKS", "MIXERS", "MLPS", "attention_kind", "mlp_kind", "make_norm",
           "make_block"]


def make_norm(config) -> Module:
    """The norm ``config.norm`` names, over ``hidden_size``: :class:`RMSNorm` or :class:`LayerNorm`."""
    norm = config.norm
    if norm.kind == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=norm.eps, offset=norm.offset)
    return LayerNorm(config.hidden_size, eps=norm.eps)


def _plain_mlp(config, *, rng: np.random.Generator) -> FeedForward:
    mlp = FeedForward(config.hidden_size, config.intermediate_size, config.activation, rng=rng)
    for name in ("W1", "W2"):  # GPT-2's N(0, 0.02^2) rather than FeedForward's Glorot default
        setattr(mlp, name, normal(rng, mlp._parameters[name].shape, std=0.02))
    return mlp


def _latent_attention(config, layer_index: int, *, rng: np.random.Generator) -> MultiHeadLatentAttention:
    return MultiHeadLatentAttention(config.latent, layer_index, rng=rng)


MLPS: dict[str, Callable[..., Module]] = {"gated": GatedMLP, "plain": _plain_mlp, "experts": MixtureOfExperts,
                                          "shared_experts": SharedExpertsMoE}
"""The MLP of each kind (:func:`mlp_kind`): ``build(config, rng=...)``."""

MIXERS: dict[tuple[str, str], Callable[..., Module]] = {
    ("full_attention", "grouped"): GroupedQueryAttention,
    ("sliding_attention", "grouped"): GroupedQueryAttention,
    ("full_attention", "latent"): _latent_attention,
}
"""The token mixer of each (layer type, attention kind) (``DecoderConfig.layer_types``, :func:`attention_kind`):
``build(config, layer_index, rng=...)``.

A mixer maps (B, L, D) to (B, L, D) with ``forward(x, *, rotary, attention_mask, cache, output_attentions)``
and ``backward``; a new kind of layer or of attention is a new entry here."""


def attention_kind(config) -> str:
    """The attention of every layer: ``"latent"`` with the ``latent`` part (multi-head latent attention), else
    ``"grouped"`` (grouped-query attention)."""
    return "grouped" if config.latent is None else "latent"


def mlp_kind(config, layer_index: int) -> str:
    """Layer ``layer_index``'s MLP: ``"shared_experts"`` past the ``shared_experts`` part's dense layers, else
    ``config.mlp``."""
    routed = config.shared_experts is not None and config.shared_experts.routed(layer_index)
    return "shared_experts" if routed else config.mlp


class LMBlock(Module):
    """One decoder layer with sequential residuals: ``x = x + attention(x)``, then ``x = x + mlp(x)``, each branch
    between its norms.

    Each branch is ``post_norm(sublayer(pre_norm(x)))``; ``config.norm.placement`` decides which of the two
    norms exist (``pre``: the input's, Llama; ``post``: the output's, OLMo 2; ``sandwich``: both, Gemma), the
    others are identities.

    Parameters
    ----------
    config : DecoderConfig
        ``norm`` (kind and placement), the layer's MLP (:data:`MLPS` by :func:`mlp_kind`) and its token mixer
        (:data:`MIXERS` by the layer's type and :func:`attention_kind`): the ``latent`` part makes it
        :class:`~attnkit.attention.latent.MultiHeadLatentAttention`, the ``shared_experts`` part the routed
        layers' MLP :class:`~attnkit.layers.shared_experts.SharedExpertsMoE`.
    layer_index : int
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    attn_norm, attention, attn_post_norm, mlp_norm, mlp, mlp_post_norm : Module
        Absent norms are :class:`~attnkit.layers.identity.Identity`.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D); ``rotary``, ``attention_mask`` and ``cache`` go to the mixer unchanged.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=12)
    >>> block = LMBlock(cfg, 0, rng=0)
    >>> y = block(np.ones((1, 3, 8)))
    >>> y.shape, block.backward(np.ones_like(y)).shape, type(block.attn_post_norm).__name__
    ((1, 3, 8), (1, 3, 8), 'Identity')
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)

        def norm(present: bool) -> Module:
            return make_norm(config) if present else Identity()

        self.attn_norm = norm(config.norm.before)
        mixer = MIXERS[config.layer_types[layer_index], attention_kind(config)]
        self.attention = mixer(config, layer_index, rng=gen)
        self.attn_post_norm = norm(config.norm.after)
        self.mlp_norm = norm(config.norm.before)
        self.mlp = MLPS[mlp_kind(config, layer_index)](config, rng=gen)
        self.mlp_post_norm = norm(config.norm.after)

    def hook_points(self) -> tuple[str, ...]:
        """``hook_resid_pre`` (the block's input), ``hook_attn_out`` and ``hook_mlp_out`` (what each branch adds
        to the residual stream, after its post-norm if any), ``hook_resid_mid`` (the residual between the
        branches), ``hook_resid_post`` (the output); all (B, L, D)."""
        return ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")

    def _attention_branch(self, x: np.ndarray, kwargs: dict):
        """The attention branch's addition (B, L, D) and the weights (None unless asked for)."""
        attended = self.attention(self.attn_norm(x), **kwargs)
        weights = None
        if kwargs["output_attentions"]:
            attended, weights = attended
        return self.hook_point("hook_attn_out", self.attn_post_norm(attended)), weights  # (B, L, D)

    def _attention_branch_backward(self, g: np.ndarray) -> np.ndarray:
        g = self.attn_post_norm.backward(self.hook_backward("hook_attn_out", g))
        return self.attn_norm.backward(self.attention.backward(g))  # (B, L, D)

    def _mlp_branch(self, x: np.ndarray) -> np.ndarray:
        h = self.mlp(self.mlp_norm(x))  # (B, L, D)
        return self.hook_point("hook_mlp_out", self.mlp_post_norm(h))

    def _mlp_branch_backward(self, g: np.ndarray) -> np.ndarray:
        g = self.mlp.backward(self.mlp_post_norm.backward(self.hook_backward("hook_mlp_out", g)))  # (B, L, D)
        return self.mlp_norm.backward(g)

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """The block's output (B, L, D); each part saves what its backward needs.

        With ``output_attentions=True`` the result is ``(y, weights)``, weights (B, Hq, L, S) from the
        attention (see :meth:`GroupedQueryAttention.forward`).
        """
        x = self.hook_point("hook_resid_pre", x)
        kwargs = dict(rotary=rotary, attention_mask=attention_mask, cache=cache, output_attentions=output_attentions)
        y, weights = self._residuals(x, kwargs)  # (B, L, D)
        y = self.hook_point("hook_resid_post", y)
        return (y, weights) if output_attentions else y

    def _residuals(self, x: np.ndarray, kwargs: dict):
        attended, weights = self._attention_branch(x, kwargs)
        x = self.hook_point("hook_resid_mid", x + attended)  # (B, L, D)
        return x + self._mlp_branch(x), weights  # (B, L, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """The forward read backwards: each residual branch adds its parts' input gradient."""
        g = self.hook_backward("hook_resid_post", np.asarray(grad_output))
        g = self.hook_backward("hook_resid_mid", g + self._mlp_branch_backward(g))
        return self.hook_backward("hook_resid_pre", g + self._attention_branch_backward(g))


class ParallelLMBlock(LMBlock):
    """:class:`LMBlock` with parallel residuals: ``y = x + attention(x) + mlp(x)``, both branches reading the
    block's input (GPT-NeoX). There is no ``hook_resid_mid``.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig
    >>> cfg = DecoderConfig(family="gpt_neox", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=2, head_dim=4, intermediate_size=12, residual="parallel")
    >>> block = ParallelLMBlock(cfg, 0, rng=0)
    >>> y = block(np.ones((1, 3, 8)))
    >>> y.shape, block.backward(np.ones_like(y)).shape
    ((1, 3, 8), (1, 3, 8))
    """

    def hook_points(self) -> tuple[str, ...]:
        """As :meth:`LMBlock.hook_points`, without ``hook_resid_mid``."""
        return ("hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post")

    def _residuals(self, x: np.ndarray, kwargs: dict):
        attended, weights = self._attention_branch(x, kwargs)
        return x + attended + self._mlp_branch(x), weights  # (B, L, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Both branches' input gradients join the residual's."""
        g = self.hook_backward("hook_resid_post", np.asarray(grad_output))
        g_mlp = self._mlp_branch_backward(g)  # (B, L, D)
        return self.hook_backward("hook_resid_pre", g + self._attention_branch_backward(g) + g_mlp)


BLOCKS: dict[str, type[LMBlock]] = {"sequential": LMBlock, "parallel": ParallelLMBlock}
"""The block of each ``DecoderConfig.residual`` kind."""


def make_block(config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> LMBlock:
    """Layer ``layer_index`` of the decoder ``config`` describes, composed from its parts."""
    return BLOCKS[config.residual](config, layer_index, rng=rng)

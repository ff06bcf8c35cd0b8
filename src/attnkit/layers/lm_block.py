"""``LMBlock``: one pre-norm layer of a decoder-only language model.

Dimension letters: B batch, L new tokens, D ``hidden_size``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..attention.grouped_query import GroupedQueryAttention
from ..attention.latent import MultiHeadLatentAttention
from ..core.module import Module
from ..init import as_generator, normal
from .experts import MixtureOfExperts
from .feed_forward import FeedForward
from .gated_mlp import GatedMLP
from .layer_norm import LayerNorm
from .rms_norm import RMSNorm
from .shared_experts import SharedExpertsMoE

__all__ = ["LMBlock", "make_mixer", "make_mlp", "make_norm"]


def make_norm(config) -> Module:
    """The norm the config names: :class:`RMSNorm` or :class:`LayerNorm` over ``hidden_size``."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=config.norm_eps, offset=config.norm_offset)
    return LayerNorm(config.hidden_size, eps=config.norm_eps)


def make_mixer(config, layer_index: int, rng: np.random.Generator) -> Module:
    """Layer ``layer_index``'s token mixer: :class:`MultiHeadLatentAttention` when the config has the ``latent``
    part, else :class:`GroupedQueryAttention` (full or sliding as ``config.layer_types`` says)."""
    if config.latent is not None:
        return MultiHeadLatentAttention(config.latent, layer_index, rng=rng)
    return GroupedQueryAttention(config, layer_index, rng=rng)


def make_mlp(config, layer_index: int, rng: np.random.Generator) -> Module:
    """Layer ``layer_index``'s MLP: :class:`SharedExpertsMoE` past the ``shared_experts`` part's dense layers,
    else the one ``config.mlp`` names (:class:`GatedMLP`, :class:`MixtureOfExperts` or GPT-2's
    :class:`FeedForward`)."""
    if config.shared_experts is not None and config.shared_experts.routed(layer_index):
        return SharedExpertsMoE(config, rng=rng)
    if config.mlp == "gated":
        return GatedMLP(config, rng=rng)
    if config.mlp == "experts":
        return MixtureOfExperts(config, rng=rng)
    mlp = FeedForward(config.hidden_size, config.intermediate_size, config.activation, rng=rng)
    for name in ("W1", "W2"):  # GPT-2's N(0, 0.02^2) rather than FeedForward's Glorot default
        setattr(mlp, name, normal(rng, mlp._parameters[name].shape, std=0.02))
    return mlp


class LMBlock(Module):
    """One decoder layer: ``x = x + attention(attn_norm(x)); x = x + mlp(mlp_norm(x))`` and its variants.

    The config's switches decide which norms exist and how the residuals join:

    * ``pre_norm`` (default): ``attn_norm`` and ``mlp_norm`` on each branch's input;
    * ``post_norm``: ``attn_post_norm`` and ``mlp_post_norm`` on each branch's output, before the add
      (OLMo 2: post-norms only; Gemma: both);
    * ``parallel_residual``: ``y = x + attention(attn_norm(x)) + mlp(mlp_norm(x))`` (GPT-NeoX).

    Parameters
    ----------
    config : DecoderConfig
        ``norm`` picks RMSNorm or LayerNorm, ``mlp`` picks :class:`GatedMLP`, the plain
        :class:`FeedForward` (GPT-2) or :class:`MixtureOfExperts` (gpt-oss), ``window_of(layer_index)``
        the attention's sliding window; the ``latent`` part makes the token mixer
        :class:`~attnkit.attention.latent.MultiHeadLatentAttention` and the ``shared_experts`` part the MLP
        :class:`~attnkit.layers.shared_experts.SharedExpertsMoE` (see :func:`make_mixer`, :func:`make_mlp`).
    layer_index : int
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    attention (the token mixer), mlp; attn_norm, mlp_norm
    with ``pre_norm``; attn_post_norm, mlp_post_norm with ``post_norm``.

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
        self.pre_norm, self.post_norm = config.pre_norm, config.post_norm
        self.parallel_residual = config.parallel_residual
        if self.pre_norm:
            self.attn_norm = make_norm(config)
        self.attention = make_mixer(config, layer_index, gen)
        if self.post_norm:
            self.attn_post_norm = make_norm(config)
        if self.pre_norm:
            self.mlp_norm = make_norm(config)
        self.mlp = make_mlp(config, layer_index, gen)
        if self.post_norm:
            self.mlp_post_norm = make_norm(config)

    def hook_points(self) -> tuple[str, ...]:
        """``hook_resid_pre`` (the block's input), ``hook_attn_out`` and ``hook_mlp_out`` (what each branch adds
        to the residual stream, after its post-norm if any), ``hook_resid_mid`` (the residual between the
        branches; not with ``parallel_residual``, whose branches both read the input), ``hook_resid_post``
        (the output); all (B, L, D)."""
        mid = () if self.parallel_residual else ("hook_resid_mid",)
        return ("hook_resid_pre", "hook_attn_out", *mid, "hook_mlp_out", "hook_resid_post")

    def _mlp_branch(self, x: np.ndarray) -> np.ndarray:
        h = self.mlp(self.mlp_norm(x) if self.pre_norm else x)  # (B, L, D)
        return self.hook_point("hook_mlp_out", self.mlp_post_norm(h) if self.post_norm else h)

    def _mlp_branch_backward(self, g: np.ndarray) -> np.ndarray:
        g = self.hook_backward("hook_mlp_out", g)
        g = self.mlp.backward(self.mlp_post_norm.backward(g) if self.post_norm else g)  # (B, L, D)
        return self.mlp_norm.backward(g) if self.pre_norm else g

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """The block's output (B, L, D); each sublayer saves what its backward needs.

        With ``output_attentions=True`` the result is ``(y, weights)``, weights (B, Hq, L, S) from the
        attention (see :meth:`GroupedQueryAttention.forward`).
        """
        x = self.hook_point("hook_resid_pre", x)
        attended = self.attention(self.attn_norm(x) if self.pre_norm else x, rotary=rotary,
                                  attention_mask=attention_mask, cache=cache, output_attentions=output_attentions)
        weights = None
        if output_attentions:
            attended, weights = attended
        if self.post_norm:
            attended = self.attn_post_norm(attended)  # (B, L, D)
        attended = self.hook_point("hook_attn_out", attended)
        if self.parallel_residual:
            y = x + attended + self._mlp_branch(x)  # (B, L, D)
        else:
            x = self.hook_point("hook_resid_mid", x + attended)
            y = x + self._mlp_branch(x)  # (B, L, D)
        y = self.hook_point("hook_resid_post", y)
        return (y, weights) if output_attentions else y

    def backward(self, grad_output: Any) -> np.ndarray:
        """The forward read backwards: each residual branch adds its sublayers' input gradient."""
        g = self.hook_backward("hook_resid_post", np.asarray(grad_output))
        g_mlp = self._mlp_branch_backward(g)
        if not self.parallel_residual:
            g = self.hook_backward("hook_resid_mid", g + g_mlp)
        g_attended = self.hook_backward("hook_attn_out", g)
        g_attn = self.attention.backward(self.attn_post_norm.backward(g_attended) if self.post_norm else g_attended)
        g = g + (self.attn_norm.backward(g_attn) if self.pre_norm else g_attn)
        return self.hook_backward("hook_resid_pre", g + g_mlp if self.parallel_residual else g)

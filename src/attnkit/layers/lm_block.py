"""``LMBlock`` and ``ParallelLMBlock``: one layer of a decoder-only language model, composed from its parts.

Dimension letters: B batch, L new tokens, D ``hidden_size``.

The config is read once, when the block is built, through the layer's spec (``config.layers[i]``, a
:class:`~attnkit.models.layer_spec.LayerSpec`): which norm sits before and after each branch (an
:class:`~attnkit.layers.identity.Identity` where there is none), which token mixer (:data:`MIXERS`), which MLP
(:data:`MLPS`), and how the residuals join (:data:`BLOCKS`): table lookups by the kinds the spec names.
forward and backward read no setting.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..attention.gated import GatedAttention
from ..attention.grouped_query import GroupedQueryAttention
from ..attention.latent import MultiHeadLatentAttention
from ..attention.shared_kv import KVOwnerAttention, KVReaderAttention
from ..core.module import Module
from ..init import as_generator, normal
from .attention_mamba2 import AttentionMamba2Mixer
from .experts import MixtureOfExperts
from .feed_forward import FeedForward
from .gated_deltanet import GatedDeltaNetMixer
from .gated_mlp import GatedMLP, ScaledGatedMLP
from .identity import Identity, Scale
from .kimi_delta_attention import KimiDeltaAttentionMixer
from .layer_norm import LayerNorm
from .mamba2 import Mamba2Mixer
from .per_layer_input import PerLayerInputBranch, PerLayerInputs
from .rms_norm import RMSNorm
from .short_conv import ShortConvMixer
from .ungated_mlp import UngatedMLP
from .xielu_mlp import XIELUMLP

__all__ = ["LMBlock", "ParallelLMBlock", "MixerOnlyBlock", "MLPOnlyBlock", "LayerwiseBlock", "PerLayerInputBlock",
           "BLOCKS", "MIXERS", "MLPS", "LAYER_INPUTS", "make_norm", "make_block"]


def _branch(config, sublayer: Module | None) -> tuple[Module, Module, Module, Module]:
    """The norm, ``sublayer``, post-norm and scale of one residual branch (the norms where ``config.norm``
    places them); a branch the layer does not have (``sublayer`` None: a layer of its mixer or its MLP alone) is
    four identities."""
    if sublayer is None:
        return Identity(), Identity(), Identity(), Identity()
    return (_optional_norm(config, config.norm.before), sublayer, _optional_norm(config, config.norm.after),
            _branch_scale(config))


def make_norm(config) -> Module:
    """The norm ``config.norm`` names, over ``hidden_size``: :class:`RMSNorm` or :class:`LayerNorm`."""
    norm = config.norm
    if norm.kind == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=norm.eps, offset=norm.offset)
    return LayerNorm(config.hidden_size, eps=norm.eps)


def _optional_norm(config, present: bool) -> Module:
    """The model's norm where a block has one at this place (``present``), else an identity."""
    return make_norm(config) if present else Identity()


def _branch_scale(config) -> Module:
    """What a residual branch's output is multiplied by before it joins the stream: Granite's
    ``residual_multiplier``, an identity where it is 1."""
    return Identity() if config.scales.residual == 1.0 else Scale(config.scales.residual)


def _gated_mlp(config, spec, *, rng: np.random.Generator) -> GatedMLP:
    return GatedMLP(config.hidden_size, spec.intermediate_size, config.mlp.activation, config.mlp.bias, rng=rng)


def _scaled_gated_mlp(config, spec, *, rng: np.random.Generator) -> ScaledGatedMLP:
    gate_scale, output_scale = config.scales.mlp_gate, config.scales.mlp_output
    return ScaledGatedMLP(config.hidden_size, spec.intermediate_size, config.mlp.activation, config.mlp.bias,
                          gate_scale=gate_scale, output_scale=output_scale, rng=rng)


def _ungated_mlp(config, spec, *, rng: np.random.Generator) -> UngatedMLP:
    return UngatedMLP(config.hidden_size, spec.intermediate_size, config.mlp.activation, config.mlp.bias, rng=rng)


def _xielu_mlp(config, spec, *, rng: np.random.Generator) -> XIELUMLP:
    return XIELUMLP(config.hidden_size, spec.intermediate_size, rng=rng)


def _plain_mlp(config, spec, *, rng: np.random.Generator) -> FeedForward:
    mlp = FeedForward(config.hidden_size, spec.intermediate_size, config.mlp.activation, rng=rng)
    for name in ("W1", "W2"):  # GPT-2's N(0, 0.02^2) rather than FeedForward's Glorot default
        setattr(mlp, name, normal(rng, mlp._parameters[name].shape, std=0.02))
    return mlp


def _experts(config, spec, *, rng: np.random.Generator) -> MixtureOfExperts:
    return MixtureOfExperts(config.hidden_size, config.experts, config.mlp.activation, rng=rng)


def _latent_attention(config, layer_index: int, *, rng: np.random.Generator) -> MultiHeadLatentAttention:
    return MultiHeadLatentAttention(config.layers[layer_index].part, layer_index, rng=rng)


MLPS: dict[str, Callable[..., Module]] = {"gated": _gated_mlp, "plain": _plain_mlp, "xielu": _xielu_mlp,
                                          "ungated": _ungated_mlp, "scaled_gated": _scaled_gated_mlp,
                                          "experts": _experts}
"""The MLP of each kind a layer's spec names (``LayerSpec.mlp``): ``build(config, spec, rng=...)``, the module
made from its own sizes (the spec's width, the model's hidden size, activation and biases)."""

MIXERS: dict[str, Callable[..., Module]] = {"full_attention": GroupedQueryAttention,
                                            "sliding_attention": GroupedQueryAttention,
                                            "chunked_attention": GroupedQueryAttention,
                                            "gated_attention": GatedAttention,
                                            "latent_attention": _latent_attention,
                                            "kv_owner_attention": KVOwnerAttention,
                                            "kv_reader_attention": KVReaderAttention,
                                            "linear_attention": GatedDeltaNetMixer,
                                            "kimi_delta_attention": KimiDeltaAttentionMixer,
                                            "short_conv": ShortConvMixer,
                                            "mamba2": Mamba2Mixer,
                                            "attention_mamba2": AttentionMamba2Mixer}
"""The token mixer of each kind a layer's spec names (``LayerSpec.mixer``): ``build(config, layer_index,
rng=...)``, the layer reading its own settings from ``config.layers[layer_index]``.

A mixer maps (B, L, D) to (B, L, D) with ``forward(x, *, rotary, attention_mask, cache, output_attentions)``
and ``backward``; a new kind of layer or of attention is a new entry here; a mixer that is not plain attention
reads its shape from its spec's ``part``. ``latent_attention``: every attention layer of a config with a latent
part (a :class:`~attnkit.attention.latent.LatentAttentionConfig` in ``mixer_parts``); ``kv_owner_attention`` /
``kv_reader_attention``: the layers of a config with the ``layerwise`` part that compute their keys and values, and
those that reuse an earlier layer's (:mod:`attnkit.attention.shared_kv`)."""


class LMBlock(Module):
    """One decoder layer with sequential residuals: ``x = x + attention(x)``, then ``x = x + mlp(x)``, each branch
    between its norms.

    ``INPUTS`` names what a block reads beside the residual stream, each made once for every layer by the
    model (the modules of :data:`LAYER_INPUTS`) and handed to the block as a keyword: none here.

    Each branch is ``scale(post_norm(sublayer(pre_norm(x))))``; ``config.norm.placement`` decides which of the
    two norms exist (``pre``: the input's, Llama; ``post``: the output's, OLMo 2; ``sandwich``: both, Gemma), the
    others are identities; ``scale`` is a :class:`~attnkit.layers.identity.Scale` by ``config.scales.residual``
    (Granite), an identity where it is 1.

    Parameters
    ----------
    config : DecoderConfig
        ``norm`` (kind and placement), and the layer's spec (``config.layers[layer_index]``): its token mixer
        (:data:`MIXERS`) and its MLP (:data:`MLPS`) by the kinds it names; a branch the spec has none of (a layer
        of its mixer or its MLP alone) is four identities.
    layer_index : int
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    attn_norm, attention, attn_post_norm, attn_scale, mlp_norm, mlp, mlp_post_norm, mlp_scale : Module
        Absent norms and scales are :class:`~attnkit.layers.identity.Identity`.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D); ``rotary``, ``attention_mask`` and ``cache`` go to the mixer unchanged.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> block = LMBlock(cfg, 0, rng=0)
    >>> y = block(np.ones((1, 3, 8)))
    >>> y.shape, block.backward(np.ones_like(y)).shape, type(block.attn_post_norm).__name__
    ((1, 3, 8), (1, 3, 8), 'Identity')
    """

    INPUTS: tuple[str, ...] = ()

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        spec = config.layers[layer_index]
        mixer = None if spec.mixer is None else MIXERS[spec.mixer](config, layer_index, rng=gen)
        self.attn_norm, self.attention, self.attn_post_norm, self.attn_scale = _branch(config, mixer)
        mlp = None if spec.mlp is None else MLPS[spec.mlp](config, spec, rng=gen)
        self.mlp_norm, self.mlp, self.mlp_post_norm, self.mlp_scale = _branch(config, mlp)

    def hook_points(self) -> tuple[str, ...]:
        """``hook_resid_pre`` (the block's input), ``hook_attn_out`` and ``hook_mlp_out`` (what each branch adds
        to the residual stream, after its post-norm and scale if any), ``hook_resid_mid`` (the residual between the
        branches), ``hook_resid_post`` (the output); all (B, L, D)."""
        return ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")

    def _attention_branch(self, x: np.ndarray, kwargs: dict):
        """The attention branch's addition (B, L, D) and the weights (None unless asked for)."""
        attended = self.attention(self.attn_norm(x), **kwargs)
        weights = None
        if kwargs["output_attentions"]:
            attended, weights = attended
        return self.hook_point("hook_attn_out", self.attn_scale(self.attn_post_norm(attended))), weights  # (B, L, D)

    def _attention_branch_backward(self, g: np.ndarray) -> np.ndarray:
        g = self.attn_post_norm.backward(self.attn_scale.backward(self.hook_backward("hook_attn_out", g)))
        return self.attn_norm.backward(self.attention.backward(g))  # (B, L, D)

    def _mlp_branch(self, x: np.ndarray) -> np.ndarray:
        h = self.mlp(self.mlp_norm(x))  # (B, L, D)
        return self.hook_point("hook_mlp_out", self.mlp_scale(self.mlp_post_norm(h)))

    def _mlp_branch_backward(self, g: np.ndarray) -> np.ndarray:
        g = self.mlp_post_norm.backward(self.mlp_scale.backward(self.hook_backward("hook_mlp_out", g)))
        return self.mlp_norm.backward(self.mlp.backward(g))  # (B, L, D)

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

    def step(self, x: np.ndarray, *, rotary=None, attention_mask: np.ndarray | None = None, cache=None,
             **inputs) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): :meth:`forward`'s parts in its order, each through its own
        ``step`` (the mixer's with the cache), nothing saved."""
        return self._residuals_step(x, dict(rotary=rotary, attention_mask=attention_mask, cache=cache))

    def _attention_step(self, x: np.ndarray, kwargs: dict) -> np.ndarray:
        attended = self.attention.step(self.attn_norm.step(x), **kwargs)  # (B, D)
        return self.attn_scale.step(self.attn_post_norm.step(attended))  # (B, D)

    def _mlp_step(self, x: np.ndarray) -> np.ndarray:
        return self.mlp_scale.step(self.mlp_post_norm.step(self.mlp.step(self.mlp_norm.step(x))))  # (B, D)

    def _residuals_step(self, x: np.ndarray, kwargs: dict) -> np.ndarray:
        x = x + self._attention_step(x, kwargs)  # (B, D)
        return x + self._mlp_step(x)  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """The forward read backwards: each residual branch adds its parts' input gradient."""
        g = self.hook_backward("hook_resid_post", np.asarray(grad_output))
        return self.hook_backward("hook_resid_pre", self._residuals_backward(g))

    def _residuals_backward(self, g: np.ndarray) -> np.ndarray:
        g = self.hook_backward("hook_resid_mid", g + self._mlp_branch_backward(g))
        return g + self._attention_branch_backward(g)  # (B, L, D)


class ParallelLMBlock(LMBlock):
    """:class:`LMBlock` with parallel residuals: ``y = x + attention(x) + mlp(x)``, both branches reading the
    block's input (GPT-NeoX). There is no ``hook_resid_mid``.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="gpt_neox", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=2, head_dim=4, mlp=MLPConfig(12), residual="parallel")
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

    def _residuals_step(self, x: np.ndarray, kwargs: dict) -> np.ndarray:
        attended = self._attention_step(x, kwargs)  # (B, D)
        return x + attended + self._mlp_step(x)  # (B, D)

    def _residuals_backward(self, g: np.ndarray) -> np.ndarray:
        g_mlp = self._mlp_branch_backward(g)  # (B, L, D)
        return g + self._attention_branch_backward(g) + g_mlp  # (B, L, D)


class MixerOnlyBlock(LMBlock):
    """A layer that is its token mixer alone: ``y = x + scale(post_norm(mixer(attn_norm(x))))``, no MLP (a
    Nemotron-H layer of Mamba-2 or attention). The MLP's parts are identities.

    Hook points: ``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_post``.

    Shapes
    ------
    x (B, L, D) -> (B, L, D).

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="nemotron_h", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12), residual="single",
    ...                     layer_types=("full_attention", "mlp"))
    >>> block = make_block(cfg, 0, rng=0)
    >>> y = block(np.ones((1, 3, 8)))
    >>> type(block).__name__, type(block.mlp).__name__, y.shape, block.backward(np.ones_like(y)).shape
    ('MixerOnlyBlock', 'Identity', (1, 3, 8), (1, 3, 8))
    """

    def hook_points(self) -> tuple[str, ...]:
        """``hook_resid_pre``, ``hook_attn_out`` (what the mixer adds), ``hook_resid_post``; all (B, L, D)."""
        return ("hook_resid_pre", "hook_attn_out", "hook_resid_post")

    def _residuals(self, x: np.ndarray, kwargs: dict):
        attended, weights = self._attention_branch(x, kwargs)
        return x + attended, weights  # (B, L, D)

    def _residuals_step(self, x: np.ndarray, kwargs: dict) -> np.ndarray:
        return x + self._attention_step(x, kwargs)  # (B, D)

    def _residuals_backward(self, g: np.ndarray) -> np.ndarray:
        return g + self._attention_branch_backward(g)  # (B, L, D)


class MLPOnlyBlock(LMBlock):
    """A layer that is its MLP alone: ``y = x + scale(post_norm(mlp(mlp_norm(x))))``, no token mixer (a Nemotron-H
    ``"mlp"`` layer). The mixer's parts are identities; its cache entry holds nothing.

    Hook points: ``hook_resid_pre``, ``hook_mlp_out``, ``hook_resid_post``.

    Shapes
    ------
    x (B, L, D) -> (B, L, D); ``rotary``, ``attention_mask`` and ``cache`` are not read.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="nemotron_h", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12), residual="single",
    ...                     layer_types=("full_attention", "mlp"))
    >>> block = make_block(cfg, 1, rng=0)
    >>> y = block(np.ones((1, 3, 8)))
    >>> type(block).__name__, type(block.attention).__name__, y.shape, block.backward(np.ones_like(y)).shape
    ('MLPOnlyBlock', 'Identity', (1, 3, 8), (1, 3, 8))
    """

    def hook_points(self) -> tuple[str, ...]:
        """``hook_resid_pre``, ``hook_mlp_out`` (what the MLP adds), ``hook_resid_post``; all (B, L, D)."""
        return ("hook_resid_pre", "hook_mlp_out", "hook_resid_post")

    def _residuals(self, x: np.ndarray, kwargs: dict):
        if kwargs["output_attentions"]:
            raise ValueError("this layer is its MLP alone: it has no attention weights")
        return x + self._mlp_branch(x), None  # (B, L, D)

    def _residuals_step(self, x: np.ndarray, kwargs: dict) -> np.ndarray:
        return x + self._mlp_step(x)  # (B, D)

    def _residuals_backward(self, g: np.ndarray) -> np.ndarray:
        return g + self._mlp_branch_backward(g)  # (B, L, D)


class LayerwiseBlock(LMBlock):
    """Gemma 4's layer without per-layer inputs: :class:`LMBlock` (norms before and after each branch), its
    output times a learned ``layer_scalar`` (1,), and its token mixer a ``kv_reader_attention`` or a
    ``kv_owner_attention`` of :data:`MIXERS` (a layer that reuses an earlier layer's keys and values reads them;
    the others own theirs)::

        y = layer_scalar * (m + mlp_post_norm(mlp(mlp_norm(m)))),  m = x + attn_post_norm(attention(attn_norm(x)))

    The block is built with its layer's MLP width (its spec's: the layers that reuse keys and values may have a
    double-wide MLP). Hook points are LMBlock's, ``hook_resid_post`` after the scalar.

    Shapes
    ------
    x (B, L, D) -> (B, L, D).
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__(config, layer_index, rng=rng)
        self.register_parameter("layer_scalar", np.ones(1))

    def _residuals(self, x: np.ndarray, kwargs: dict):
        y, weights = super()._residuals(x, kwargs)  # (B, L, D)
        y = self._before_scalar(y)  # (B, L, D)
        if kwargs["cache"] is None:  # the cached path is inference: it keeps nothing
            self.save_for_backward(y)
        else:
            self.save_for_backward()
        return y * self._parameters["layer_scalar"].astype(y.dtype, copy=False), weights  # (B, L, D)

    def _residuals_step(self, x: np.ndarray, kwargs: dict) -> np.ndarray:
        y = self._before_scalar_step(super()._residuals_step(x, kwargs))  # (B, D)
        return y * self._parameters["layer_scalar"].astype(y.dtype, copy=False)  # (B, D)

    def _before_scalar(self, y: np.ndarray) -> np.ndarray:
        """What the block adds to its residual stream after the MLP, before the scalar: nothing here."""
        return y

    def _before_scalar_step(self, y: np.ndarray) -> np.ndarray:
        return y

    def _before_scalar_backward(self, g: np.ndarray) -> np.ndarray:
        return g

    def _residuals_backward(self, g: np.ndarray) -> np.ndarray:
        if not self.saved_tensors:
            raise RuntimeError(f"{type(self).__name__}.backward needs a forward without a cache just before it")
        (before_scalar,) = self.saved_tensors
        self.grads["layer_scalar"] += np.sum(g * before_scalar).reshape(1)
        g = g * self._parameters["layer_scalar"].astype(g.dtype, copy=False)  # (B, L, D)
        return super()._residuals_backward(self._before_scalar_backward(g))  # (B, L, D)


class PerLayerInputBlock(LayerwiseBlock):
    """Gemma 4's layer: :class:`LayerwiseBlock` with the per-layer input's branch
    (:class:`~attnkit.layers.per_layer_input.PerLayerInputBranch`) added after the MLP, before the scalar::

        y = layer_scalar * (h + per_layer(h, e)),  h = m + mlp_post_norm(mlp(mlp_norm(m)))

    Hook points: LayerwiseBlock's, with ``hook_per_layer_out`` (what the branch adds) before ``hook_resid_post``.

    Shapes
    ------
    x (B, L, D), per_layer_input e (B, L, P) -> (B, L, D). After :meth:`backward`, ``grad_per_layer_input``
    holds the gradient of ``per_layer_input`` (B, L, P).

    Examples
    --------
    >>> from attnkit.models import AttentionConfig, DecoderConfig, LayerwiseConfig, NormConfig, MLPConfig
    >>> cfg = DecoderConfig(family="gemma4_text", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12), norm=NormConfig(placement="sandwich"),
    ...                     attention=AttentionConfig(scale=1.0),
    ...                     layerwise=LayerwiseConfig(global_head_dim=6, global_kv_heads=1, per_layer_input_size=3,
    ...                                               per_layer_vocab_size=8))
    >>> block = make_block(cfg, 0, rng=0)
    >>> y = block(np.ones((1, 3, 8)), per_layer_input=np.ones((1, 3, 3)))
    >>> type(block).__name__, type(block.attention).__name__, block.attention.head_dim, y.shape
    ('PerLayerInputBlock', 'KVOwnerAttention', 6, (1, 3, 8))
    >>> block.backward(np.ones_like(y)).shape, block.grad_per_layer_input.shape
    ((1, 3, 8), (1, 3, 3))
    """

    INPUTS = ("per_layer_input",)

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        gen = as_generator(rng)
        super().__init__(config, layer_index, rng=gen)
        self.per_layer = PerLayerInputBranch(config, rng=gen)
        self.per_layer_input = self.grad_per_layer_input = None

    def hook_points(self) -> tuple[str, ...]:
        """LMBlock's, with ``hook_per_layer_out`` (B, L, D) before ``hook_resid_post``."""
        *points, last = super().hook_points()
        return (*points, "hook_per_layer_out", last)

    def forward(self, x: Any, *, per_layer_input: Any = None, **kwargs):
        """The block's output (B, L, D) with this layer's ``per_layer_input`` (B, L, P); the other arguments as
        :meth:`LMBlock.forward`."""
        if per_layer_input is None:
            raise ValueError("PerLayerInputBlock: per_layer_input (B, L, P) is required")
        self.per_layer_input = per_layer_input
        return super().forward(x, **kwargs)

    def step(self, x: np.ndarray, *, per_layer_input: np.ndarray | None = None, **kwargs) -> np.ndarray:
        """One decoding step (B, D) -> (B, D) with this layer's ``per_layer_input`` (B, P)."""
        self.per_layer_input = per_layer_input
        return super().step(x, **kwargs)

    def _before_scalar(self, y: np.ndarray) -> np.ndarray:
        return y + self.hook_point("hook_per_layer_out", self.per_layer(y, self.per_layer_input))  # (B, L, D)

    def _before_scalar_step(self, y: np.ndarray) -> np.ndarray:
        return y + self.per_layer.step(y, self.per_layer_input)  # (B, D)

    def _before_scalar_backward(self, g: np.ndarray) -> np.ndarray:
        g_h, self.grad_per_layer_input = self.per_layer.backward(self.hook_backward("hook_per_layer_out", g))
        return g + g_h  # (B, L, D)


BLOCKS: dict[str, type[LMBlock]] = {"sequential": LMBlock, "parallel": ParallelLMBlock,
                                    "mixer_only": MixerOnlyBlock, "mlp_only": MLPOnlyBlock,
                                    "layerwise": LayerwiseBlock, "per_layer_input": PerLayerInputBlock}
"""The block of each kind a layer's spec names (``LayerSpec.block``): a ``residual`` kind (``"single"`` is one of
the two one-branch blocks, by the layer's type), or a ``LayerwiseConfig.block`` kind."""

LAYER_INPUTS: dict[str, tuple[str, type[Module]]] = {"per_layer_input": ("per_layer_inputs", PerLayerInputs)}
"""What a block's ``INPUTS`` name: the model's attribute and the module that makes the input of every layer at once
(Gemma 4's per-layer inputs, (B, L, N, P), layer i reading ``[:, :, i]``)."""


def make_block(config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> LMBlock:
    """Layer ``layer_index`` of the decoder ``config`` describes, composed from its parts."""
    return BLOCKS[config.layers[layer_index].block](config, layer_index, rng=rng)

"""``LayerSpec``: what one decoder layer is, resolved once from a :class:`~attnkit.models.DecoderConfig`.

A decoder config says what its layers are in the terms its checkpoint family uses (``layer_types``, the parts of
``mixer_parts`` that shape its mixers, a latent part that turns every attention layer into latent attention, a
layerwise part whose last layers reuse keys and values, the experts part's list of layers, NoPE layers in the
rotary part). :attr:`DecoderConfig.layers` reads all of them once and answers, for each layer, one
:class:`LayerSpec`: its token mixer (and the part that shapes it) and MLP (keys of
:data:`attnkit.layers.lm_block.MIXERS` and :data:`~attnkit.layers.lm_block.MLPS`), its block
(:data:`~attnkit.layers.lm_block.BLOCKS`), its sizes, its window, rotary and q/k norm, and what its cache entry
holds. Blocks and layers are built from it by table lookups; nothing else asks the config what a layer is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LayerSpec", "CACHE_KINDS"]

CACHE_KINDS = ("keys_values", "latent", "state", "paired", "shared", "none")
"""What a layer's cache entry holds: its keys and values; the latent of latent attention; a fixed-size state (its
mixer's ``new_cache``); both keys and values and a state (attention beside a state-space mixer); nothing of its own
(it reads the keys and values of layer ``kv_owner``); nothing (a layer of the MLP alone)."""


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer, as :attr:`DecoderConfig.layers` resolves it.

    Parameters
    ----------
    index : int
        The layer's position in the stack.
    layer_type : str
        Its entry of ``DecoderConfig.layer_types``.
    mixer : str or None
        Its token mixer, a key of :data:`attnkit.layers.lm_block.MIXERS`; None for a layer of the MLP alone.
    part : dataclass or None
        The shape of its token mixer, the part of ``DecoderConfig.mixer_parts`` that shapes it (a
        ``GatedDeltaNetConfig``, ``LatentAttentionConfig``, ...); None for grouped-query attention, whose settings
        are the config's ``attention`` part, and for a layer of the MLP alone.
    mlp : str or None
        Its MLP, a key of :data:`attnkit.layers.lm_block.MLPS`; None for a layer of the mixer alone.
    block : str
        How its branches join the residual stream, a key of :data:`attnkit.layers.lm_block.BLOCKS`.
    head_dim : int
        Dh of its attention heads.
    num_kv_heads : int
        Hkv of its attention.
    intermediate_size : int
        F, the hidden width of its (non-expert) MLP.
    rotary : RotaryConfig or None
        The rotary embedding of its queries and keys; None: learned positions (GPT-2) or a NoPE layer.
    window : int or None
        W of a sliding-window layer.
    chunk : int or None
        C of a chunked-attention layer (its queries see their own chunk of C positions).
    kv_owner : int or None
        The earlier layer whose keys and values it reads (Gemma 4's last layers), None if it computes its own.
    qk_norm : str or None
        Its q/k norm (``AttentionConfig.qk_norm``'s kinds).
    query_temperature : (float, float) or None
        ``(floor_scale, attn_scale)`` of the query temperature of a NoPE layer (Llama 4).
    cache : str
        What its cache entry holds, one of :data:`CACHE_KINDS`.
    score_mod : ScoreMod or None
        The :mod:`attnkit.flex` score modifier of its attention (Gemma 2's soft-cap), or None.

    Examples
    --------
    >>> from attnkit.models import AttentionConfig, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="mistral", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12),
    ...                     attention=AttentionConfig(sliding_window=4),
    ...                     layer_types=("sliding_attention", "full_attention"))
    >>> [(s.mixer, s.mlp, s.window, s.keys_kept, s.cache) for s in cfg.layers]
    [('sliding_attention', 'gated', 4, 4, 'keys_values'), ('full_attention', 'gated', None, None, 'keys_values')]
    """

    index: int
    layer_type: str
    mixer: str | None
    part: Any
    mlp: str | None
    block: str
    head_dim: int
    num_kv_heads: int
    intermediate_size: int
    rotary: Any = None
    window: int | None = None
    chunk: int | None = None
    kv_owner: int | None = None
    qk_norm: str | None = None
    query_temperature: tuple[float, float] | None = None
    cache: str = "keys_values"
    score_mod: Any = None

    @property
    def keys_kept(self) -> int | None:
        """The most recent cache slots the layer can read: its window or its chunk; None for all."""
        return self.window or self.chunk

"""Layers with parameters, one concept per module, all :class:`attnkit.core.Module` subclasses.

- :class:`Projection` ``x @ W + b``, :class:`LayerNorm`, :class:`FeedForward`, :class:`Dropout`,
  :class:`Embedding`;
- :class:`SinusoidalPositionalEncoding` and :class:`LearnedPositionalEmbedding`;
- :class:`TransformerEncoderBlock`, made of the layers above and :class:`~attnkit.attention.MultiHeadAttention`,
  and the :class:`TransformerEncoder` stack;
- :class:`TransformerDecoderBlock` (self-attention, cross-attention, feed-forward), the
  :class:`TransformerDecoder` stack and the encoder-decoder :class:`Transformer`;
- the parts of decoder-only language models: :class:`RMSNorm`, :class:`GatedMLP`, :class:`UngatedMLP`,
  :class:`XIELUMLP`, :class:`MixtureOfExperts`
  (with its :class:`Router`, shaped by an :class:`ExpertsConfig`), :class:`RotaryEmbedding` and :class:`LMBlock`
  (built on :class:`~attnkit.attention.GroupedQueryAttention`);
- :class:`GatedDeltaNet`, the linear-attention layer of Qwen3-Next and Qwen3.5, and its
  :class:`GatedDeltaNetCache`; :class:`GatedDeltaNetMixer` is it as a decoder block's token mixer, shaped by a
  :class:`GatedDeltaNetConfig`;
- :class:`KimiDeltaAttention`, Kimi Linear's linear-attention layer (the delta rule with a decay per key channel),
  which keeps Gated DeltaNet's cache; :class:`KimiDeltaAttentionMixer` is it as a decoder block's token mixer,
  shaped by a :class:`KimiDeltaAttentionConfig`;
- :class:`ShortConv`, LFM2's gated short convolution, and its :class:`ShortConvCache`; :class:`ShortConvMixer` is
  it as a decoder block's token mixer, shaped by a :class:`ShortConvConfig`;
- :class:`Mamba2`, the Mamba-2 mixer of the state-space hybrids (the SSD scan), and its :class:`Mamba2Cache`;
  :class:`Mamba2Mixer` is it as a decoder block's token mixer, shaped by a :class:`Mamba2Config`;
  :class:`AttentionMamba2Mixer` runs attention beside it (Falcon-H1), its factors an
  :class:`AttentionMamba2Config`; :class:`ScaledGatedMLP` is the gated MLP with fixed gate and output factors.

Every layer's ``forward`` saves what its ``backward`` needs; ``backward(grad_output)`` returns the gradient
of the input and adds (``+=``) the parameter gradients into ``self.grads``.
"""
from .attention_mamba2 import AttentionMamba2Config, AttentionMamba2Mixer
from .decoder import TransformerDecoder, TransformerDecoderBlock
from .dropout import Dropout
from .embedding import Embedding
from .encoder import TransformerEncoder
from .encoder_block import TransformerEncoderBlock
from .experts import ExpertsConfig, MixtureOfExperts
from .feed_forward import FeedForward
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetCache, GatedDeltaNetConfig, GatedDeltaNetMixer
from .gated_mlp import GatedMLP, ScaledGatedMLP
from .identity import Identity, Scale, Zero
from .kimi_delta_attention import KimiDeltaAttention, KimiDeltaAttentionConfig, KimiDeltaAttentionMixer
from .layer_norm import LayerNorm
from .lm_block import LMBlock, ParallelLMBlock
from .mamba2 import Mamba2, Mamba2Cache, Mamba2Config, Mamba2Mixer
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .projection import Projection
from .rms_norm import RMSNorm
from .rotary import RotaryEmbedding
from .router import Router
from .short_conv import ShortConv, ShortConvCache, ShortConvConfig, ShortConvMixer
from .transformer import Transformer
from .ungated_mlp import UngatedMLP
from .xielu_mlp import XIELUMLP

__all__ = [
    "Projection", "LayerNorm", "FeedForward", "Dropout", "Embedding",
    "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding",
    "TransformerEncoderBlock", "TransformerEncoder",
    "TransformerDecoderBlock", "TransformerDecoder", "Transformer",
    "RMSNorm", "GatedMLP", "UngatedMLP", "XIELUMLP", "MixtureOfExperts", "ExpertsConfig", "Router",
    "RotaryEmbedding", "LMBlock", "ParallelLMBlock", "Identity", "Zero", "Scale",
    "GatedDeltaNet", "GatedDeltaNetCache", "GatedDeltaNetConfig", "GatedDeltaNetMixer",
    "KimiDeltaAttention", "KimiDeltaAttentionConfig", "KimiDeltaAttentionMixer",
    "ShortConv", "ShortConvCache", "ShortConvConfig", "ShortConvMixer",
    "Mamba2", "Mamba2Cache", "Mamba2Config", "Mamba2Mixer", "AttentionMamba2Config", "AttentionMamba2Mixer",
    "ScaledGatedMLP",
]

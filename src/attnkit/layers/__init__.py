"""Layers with parameters, one concept per module, all :class:`attnkit.core.Module` subclasses.

- :class:`Projection` ``x @ W + b`` and :class:`LayerNorm` (seed 001), :class:`FeedForward`, :class:`Dropout`,
  :class:`Embedding`;
- :class:`SinusoidalPositionalEncoding` and :class:`LearnedPositionalEmbedding`;
- :class:`TransformerEncoderBlock` (seed 003, defined in :mod:`attnkit.transformer_block`) and the
  :class:`TransformerEncoder` stack;
- :class:`TransformerDecoderBlock` (self-attention, cross-attention, feed-forward), the
  :class:`TransformerDecoder` stack and the encoder-decoder :class:`Transformer`.

Every layer's ``forward`` caches what its ``backward`` needs; ``backward(grad_output)`` returns the gradient
of the input and adds (``+=``) the parameter gradients into ``self.grads``.
"""
from ..transformer_block import TransformerEncoderBlock
from .dropout import Dropout
from .decoder import TransformerDecoder, TransformerDecoderBlock
from .embedding import Embedding
from .encoder import TransformerEncoder
from .feed_forward import FeedForward
from .layer_norm import LayerNorm
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .projection import Projection
from .transformer import Transformer

__all__ = [
    "Projection", "LayerNorm", "FeedForward", "Dropout", "Embedding",
    "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding",
    "TransformerEncoderBlock", "TransformerEncoder",
    "TransformerDecoderBlock", "TransformerDecoder", "Transformer",
]

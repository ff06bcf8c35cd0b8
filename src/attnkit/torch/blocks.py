"""Twins of attnkit's blocks and stacks: encoder and decoder blocks, their stacks, the encoder-decoder
Transformer, and the decoder-only LM block.

Dimension letters: B batch, L / Lt / Ls sequence / target / memory length, D model width.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import layers as _layers
from ..layers.lm_block import LMBlock as _LMBlock
from ..layers.lm_block import MixerOnlyBlock as _MixerOnlyBlock
from ..layers.lm_block import MLPOnlyBlock as _MLPOnlyBlock
from ..layers.lm_block import ParallelLMBlock as _ParallelLMBlock
from ._twin import TwinModule, as_tensor

__all__ = ["TransformerEncoderBlock", "TransformerEncoder", "TransformerDecoderBlock", "TransformerDecoder",
           "Transformer", "LMBlock", "ParallelLMBlock", "MixerOnlyBlock", "MLPOnlyBlock"]


def _no_weights(need_weights: bool, owner: str) -> None:
    if need_weights:
        raise ValueError(f"{owner} (torch twin) runs fused attention kernels, which return no weights; "
                         f"use attnkit's module (attnkit.torch.to_numpy) to inspect attention weights")


class TransformerEncoderBlock(TwinModule):
    """Twin of :class:`attnkit.layers.TransformerEncoderBlock` (pre-norm or post-norm).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); ``mask`` bool (L, L), (L,) or 4-D, ``True`` = may attend; ``key_padding_mask``
    bool (B, L), ``True`` = real token (non-finite values at padded positions are replaced by zeros first).

    Examples
    --------
    >>> block = TransformerEncoderBlock(16, 4, rng=0)
    >>> block(torch.randn(2, 6, 16, dtype=torch.float64), is_causal=True).shape
    torch.Size([2, 6, 16])
    """

    numpy_class = _layers.TransformerEncoderBlock

    def setup(self, source) -> None:
        self.norm_first = source.norm_first

    def forward(self, x: torch.Tensor, mask: Any = None, key_padding_mask: Any = None, is_causal: bool = False,
                need_weights: bool = False) -> torch.Tensor:
        _no_weights(need_weights, "TransformerEncoderBlock")
        if key_padding_mask is not None:
            kpm = as_tensor(key_padding_mask, x.device)
            bad = ~kpm[..., None] & ~torch.isfinite(x)  # (B, L, D)
            x = torch.where(bad, torch.zeros((), dtype=x.dtype, device=x.device), x)  # (B, L, D)
        masks = dict(attn_mask=mask, key_padding_mask=key_padding_mask, is_causal=is_causal)
        if self.norm_first:
            a = self.norm1(x)  # (B, L, D)
            h = x + self.attention(a, a, a, **masks)[0]  # (B, L, D)
            return h + self.ffn(self.norm2(h))  # (B, L, D)
        h = self.norm1(x + self.attention(x, x, x, **masks)[0])  # (B, L, D)
        return self.norm2(h + self.ffn(h))  # (B, L, D)


class TransformerEncoder(TwinModule):
    """Twin of :class:`attnkit.layers.TransformerEncoder`: the blocks in turn, then the optional final norm.

    Shapes
    ------
    x (B, L, D) -> (B, L, D), masks as :class:`TransformerEncoderBlock`.

    Examples
    --------
    >>> enc = TransformerEncoder(2, d_model=8, num_heads=2, rng=0)
    >>> [name for name, _ in enc.named_parameters()][:2]
    ['layers.0.norm1.gamma', 'layers.0.norm1.beta']
    """

    numpy_class = _layers.TransformerEncoder

    def forward(self, x: torch.Tensor, mask: Any = None, key_padding_mask: Any = None, is_causal: bool = False,
                need_weights: bool = False) -> torch.Tensor:
        _no_weights(need_weights, "TransformerEncoder")
        for block in self.layers:
            x = block(x, mask, key_padding_mask, is_causal)  # (B, L, D)
        norm = self._modules.get("norm")
        return x if norm is None else norm(x)


class TransformerDecoderBlock(TwinModule):
    """Twin of :class:`attnkit.layers.TransformerDecoderBlock` (dot-product cross-attention only).

    Shapes
    ------
    x (B, Lt, D), memory (B, Ls, D) -> (B, Lt, D); masks as attnkit's (``True`` = may attend / real token).

    Examples
    --------
    >>> block = TransformerDecoderBlock(8, 2, rng=0)
    >>> x, memory = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)
    >>> block(x, memory, tgt_is_causal=True).shape
    torch.Size([2, 3, 8])
    """

    numpy_class = _layers.TransformerDecoderBlock

    def setup(self, source) -> None:
        self.norm_first = source.norm_first

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_mask: Any = None, memory_mask: Any = None,
                tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
                tgt_is_causal: bool = False, need_weights: bool = False) -> torch.Tensor:
        _no_weights(need_weights, "TransformerDecoderBlock")

        def self_block(h):
            return self.dropout1(self.self_attention(h, h, h, tgt_mask, tgt_key_padding_mask,
                                                     is_causal=tgt_is_causal)[0])  # (B, Lt, D)

        def cross_block(h):
            return self.dropout2(self.cross_attention(h, memory, memory, memory_mask,
                                                      memory_key_padding_mask)[0])  # (B, Lt, D)

        if self.norm_first:
            h1 = x + self_block(self.norm1(x))  # (B, Lt, D)
            h2 = h1 + cross_block(self.norm2(h1))  # (B, Lt, D)
            return h2 + self.dropout3(self.ffn(self.norm3(h2)))  # (B, Lt, D)
        h1 = self.norm1(x + self_block(x))  # (B, Lt, D)
        h2 = self.norm2(h1 + cross_block(h1))  # (B, Lt, D)
        return self.norm3(h2 + self.dropout3(self.ffn(h2)))  # (B, Lt, D)


class TransformerDecoder(TwinModule):
    """Twin of :class:`attnkit.layers.TransformerDecoder`: the blocks in turn, then the optional final norm.

    Shapes
    ------
    x (B, Lt, D), memory (B, Ls, D) -> (B, Lt, D).

    Examples
    --------
    >>> dec = TransformerDecoder(2, 8, 2, rng=0)
    >>> dec(torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 3, 8])
    """

    numpy_class = _layers.TransformerDecoder

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_mask: Any = None, memory_mask: Any = None,
                tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
                tgt_is_causal: bool = False, need_weights: bool = False) -> torch.Tensor:
        _no_weights(need_weights, "TransformerDecoder")
        for block in self.layers:
            x = block(x, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                      tgt_is_causal)  # (B, Lt, D)
        norm = self._modules.get("norm")
        return x if norm is None else norm(x)


class Transformer(TwinModule):
    """Twin of :class:`attnkit.layers.Transformer`: ``decoder(tgt, encoder(src))``.

    Shapes
    ------
    src (B, Ls, D), tgt (B, Lt, D) -> (B, Lt, D).

    Examples
    --------
    >>> model = Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1, rng=0)
    >>> model(torch.randn(2, 5, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)).shape
    torch.Size([2, 3, 8])
    """

    numpy_class = _layers.Transformer

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_mask: Any = None, tgt_mask: Any = None,
                memory_mask: Any = None, src_key_padding_mask: Any = None, tgt_key_padding_mask: Any = None,
                memory_key_padding_mask: Any = None, tgt_is_causal: bool = False) -> torch.Tensor:
        memory = self.encoder(src, src_mask, src_key_padding_mask)  # (B, Ls, D)
        return self.decoder(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                            tgt_is_causal)  # (B, Lt, D)


class LMBlock(TwinModule):
    """Twin of :class:`attnkit.layers.lm_block.LMBlock`: ``x + attention(x)``, then ``+ mlp(x)``, each branch between
    its norms and then its scale (identities where the architecture has none).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); ``rotary`` and ``attention_mask`` go to the attention.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> LMBlock(cfg, 0, rng=0)(torch.ones(1, 3, 8, dtype=torch.float64)).shape
    torch.Size([1, 3, 8])
    """

    numpy_class = _LMBlock

    def _attention_branch(self, x: torch.Tensor, rotary, attention_mask) -> torch.Tensor:
        attended = self.attention(self.attn_norm(x), rotary=rotary, attention_mask=attention_mask)  # (B, L, D)
        return self.attn_scale(self.attn_post_norm(attended))

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp_scale(self.mlp_post_norm(self.mlp(self.mlp_norm(x))))  # (B, L, D)

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None) -> torch.Tensor:
        x = x + self._attention_branch(x, rotary, attention_mask)  # (B, L, D)
        return x + self._mlp_branch(x)  # (B, L, D)


class ParallelLMBlock(LMBlock):
    """Twin of :class:`attnkit.layers.lm_block.ParallelLMBlock`: ``x + attention(x) + mlp(x)``."""

    numpy_class = _ParallelLMBlock

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None) -> torch.Tensor:
        return x + self._attention_branch(x, rotary, attention_mask) + self._mlp_branch(x)  # (B, L, D)


class MixerOnlyBlock(LMBlock):
    """Twin of :class:`attnkit.layers.lm_block.MixerOnlyBlock`: ``x + mixer(x)``, no MLP."""

    numpy_class = _MixerOnlyBlock

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None) -> torch.Tensor:
        return x + self._attention_branch(x, rotary, attention_mask)  # (B, L, D)


class MLPOnlyBlock(LMBlock):
    """Twin of :class:`attnkit.layers.lm_block.MLPOnlyBlock`: ``x + mlp(x)``, no token mixer."""

    numpy_class = _MLPOnlyBlock

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None) -> torch.Tensor:
        return x + self._mlp_branch(x)  # (B, L, D)

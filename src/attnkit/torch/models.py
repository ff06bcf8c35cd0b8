"""Twins of attnkit's models: the decoder-only :class:`CausalLM` (every family attnkit loads) and
the encoder-decoder :class:`Seq2SeqTransformer`.

Dimension letters: B batch, L tokens, V vocabulary, D hidden size, Ls/Lt source/target length.
"""
from __future__ import annotations

from typing import Any

import torch

from ..attention.shared_kv import connect_shared_kv
from ..models.causal_lm import CausalLM as _CausalLM
from ..models.seq2seq import Seq2SeqTransformer as _Seq2SeqTransformer
from ._twin import TwinModule, as_tensor

__all__ = ["CausalLM", "Seq2SeqTransformer", "positions_from_mask"]


def positions_from_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Positions of the last ``length`` columns: ``cumsum(mask) - 1`` clipped at 0 (as attnkit).

    Shapes
    ------
    attention_mask (B, P + L) bool -> (B, L) int64

    Examples
    --------
    >>> positions_from_mask(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool), 3).tolist()
    [[0, 1, 2], [2, 3, 4]]
    """
    counts = torch.cumsum(attention_mask.to(torch.int64), dim=1) - 1  # (B, P + L)
    return counts[:, attention_mask.shape[1] - length:].clamp(min=0)  # (B, L)


class CausalLM(TwinModule):
    """Twin of :class:`attnkit.models.CausalLM`: the same :class:`~attnkit.models.DecoderConfig`, parameter
    names (``embed.weight``, ``layers.0.attention.W_Q``, ...) and initial weights for the same ``rng``.

    Parameters
    ----------
    config : DecoderConfig
    rng : numpy.random.Generator or int, optional

    Shapes
    ------
    input_ids (B, L) int; attention_mask (B, L) bool or 0/1, ``True`` = real token (positions are
    ``cumsum(mask) - 1``, so left padding is computed as the tokens alone); position_ids (B, L) optional
    -> logits (B, L, V) in the parameters' dtype. No KV cache (training); decode with attnkit or transformers.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> lm(torch.tensor([[1, 2, 3]])).shape, next(lm.parameters()).dtype
    (torch.Size([1, 3, 11]), torch.float64)
    """

    numpy_class = _CausalLM

    def __init__(self, config: Any, rng: Any = None) -> None:
        super().__init__(config, rng)

    def setup(self, source) -> None:
        self.config = source.config
        self.layer_rotary = source.layer_rotary
        self.layer_inputs = source.layer_inputs
        self.shares_kv = source.config.layerwise is not None

    @property
    def head_weight(self) -> torch.Tensor:
        """The (V, D) matrix the logits are taken against (the embedding when tied)."""
        return self.embed.weight if self.config.tie_word_embeddings else self.head.weight

    @staticmethod
    def after_rebuild(model) -> None:
        """:func:`attnkit.torch.to_numpy`'s model gets keys-and-values links of its own (Gemma 4), as its
        constructor would give it."""
        if model.config.layerwise is not None:
            connect_shared_kv([layer.attention for layer in model.layers])

    def forward(self, input_ids: Any, attention_mask: Any = None, *, position_ids: Any = None) -> torch.Tensor:
        device = self.embed.weight.device
        ids = as_tensor(input_ids, device, torch.long)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a 2-D (B, L) tensor with L >= 1, got shape {tuple(ids.shape)}")
        b, length = ids.shape
        mask = None
        if attention_mask is not None:
            mask = as_tensor(attention_mask, device).to(torch.bool)
            if mask.shape != (b, length):
                raise ValueError(f"attention_mask must have shape (B, L) = ({b}, {length}), got {tuple(mask.shape)}")
        if position_ids is not None:
            positions = as_tensor(position_ids, device, torch.long)
        elif mask is not None:
            positions = positions_from_mask(mask, length)  # (B, L)
        else:
            positions = torch.arange(length, device=device).expand(b, length)  # (B, L)
        config = self.config
        h = self.embed(ids)  # (B, L, D)
        if config.scales.embedding != 1.0:
            h = h * torch.tensor(config.scales.embedding, dtype=h.dtype)  # (B, L, D), rounded as attnkit does
        if config.rotary is None:
            h = h + self.pos_embed(positions)  # (B, L, D)
        tables = {name: getattr(self, name)(positions, dtype=h.dtype)  # (B, L, R) each
                  for name in set(self.layer_rotary) - {None}}
        layer_mask = None if mask is None or bool(mask.all()) else mask  # no padding: the fused causal kernel
        # Gemma 4: every layer's per-layer input (B, L, N, P), and one dict of the pass's shared keys and values
        extra = {key: getattr(self, name)(ids, h) for key, name in self.layer_inputs.items()}
        shared = {"shared_kv": {}} if self.shares_kv else {}
        for index, layer in enumerate(self.layers):
            inputs = {**shared, **{key: e[:, :, index] for key, e in extra.items()}}
            h = layer(h, rotary=tables.get(self.layer_rotary[index]), attention_mask=layer_mask, **inputs)  # (B, L, D)
        h = self.norm(h)  # (B, L, D)
        logits = h @ self.head_weight.to(h.dtype).T  # (B, L, V)
        logits = self.head_scale(logits)  # (B, L, V)
        if config.scales.final_logit_softcap is not None:
            cap = torch.tensor(config.scales.final_logit_softcap, dtype=logits.dtype)
            logits = torch.tanh(logits / cap) * cap  # (B, L, V)
        return logits


class Seq2SeqTransformer(TwinModule):
    """Twin of :class:`attnkit.models.Seq2SeqTransformer` (dot-product cross-attention): embeddings,
    sinusoidal positions, the Transformer with a causal target, the output head.

    Shapes
    ------
    src_ids (B, Ls) int, tgt_ids (B, Lt) int -> logits (B, Lt, V); ``*_key_padding_mask`` bool (B, L),
    ``True`` = real token. Generation stays with attnkit's model (:func:`attnkit.torch.to_numpy`).

    Examples
    --------
    >>> from attnkit.models import Seq2SeqConfig
    >>> config = Seq2SeqConfig(7, 6, d_model=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
    ...                        max_length=10)
    >>> model = Seq2SeqTransformer(config, rng=0)
    >>> model(torch.tensor([[3, 4, 5, 6]]), torch.tensor([[1, 3, 4]])).shape
    torch.Size([1, 3, 6])
    """

    numpy_class = _Seq2SeqTransformer

    def forward(self, src_ids: Any, tgt_ids: Any, src_key_padding_mask: Any = None,
                tgt_key_padding_mask: Any = None) -> torch.Tensor:
        src = self.src_positional(self.src_embedding(src_ids))  # (B, Ls, D)
        tgt = self.tgt_positional(self.tgt_embedding(tgt_ids))  # (B, Lt, D)
        h = self.transformer(src, tgt, src_key_padding_mask=src_key_padding_mask,
                             tgt_key_padding_mask=tgt_key_padding_mask,
                             memory_key_padding_mask=src_key_padding_mask, tgt_is_causal=True)  # (B, Lt, D)
        return self.head(h)  # (B, Lt, V)

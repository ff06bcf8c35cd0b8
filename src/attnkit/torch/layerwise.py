"""Twins of the parts of a model whose layers differ (Gemma 4): the attention that owns or reuses keys and
values, the per-layer inputs and the block that adds them.

The twin shares keys and values the way autograd wants it: the model passes one dict per forward to every
layer, an owner puts its keys and values there under its layer index, and a reader attends to its owner's. The
readers' gradients reach the owner's projections through the graph.

Dimension letters: B batch, L tokens, D hidden size, Hq/Hkv query and key/value heads, Dh head features,
N layers, P per-layer input features.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import torch

from ..attention.shared_kv import KVOwnerAttention as _KVOwnerAttention
from ..attention.shared_kv import KVReaderAttention as _KVReaderAttention
from ..layers.lm_block import LayerwiseBlock as _LayerwiseBlock
from ..layers.lm_block import PerLayerInputBlock as _PerLayerInputBlock
from ..layers.per_layer_input import PerLayerInputBranch as _PerLayerInputBranch
from ..layers.per_layer_input import PerLayerInputs as _PerLayerInputs
from ._twin import TwinModule, attend
from .attention import _bool_mask, _merge, _split
from .blocks import LMBlock
from .layers import _linear, _rms, activation, rotary_apply

__all__ = ["KVOwnerAttention", "KVReaderAttention", "PerLayerInputs", "PerLayerInputBranch", "LayerwiseBlock",
           "PerLayerInputBlock"]


class _Attention(TwinModule):
    def setup(self, source) -> None:
        for name in ("layer_index", "num_heads", "num_kv_heads", "head_dim", "window", "interleaved", "norm_eps",
                     "scale", "uses_rotary"):
            setattr(self, name, getattr(source, name))

    def _queries(self, x: torch.Tensor, rotary) -> torch.Tensor:
        q = _rms(_split(_linear(x, self.W_Q), self.num_heads), self.q_norm, self.norm_eps)  # (B, Hq, L, Dh)
        return q if rotary is None else rotary_apply(q, *rotary, self.interleaved)  # (B, Hq, L, Dh)

    def _attend(self, q, k, v, x, attention_mask) -> torch.Tensor:
        mask = _bool_mask(attention_mask, x.device, "attention_mask")
        mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, L)
        out = attend(q, k, v, mask, causal=True, window=self.window, scale=self.scale)  # (B, Hq, L, Dh)
        return _linear(_merge(out), self.W_O)  # (B, L, D)


class KVOwnerAttention(_Attention):
    """Twin of :class:`attnkit.attention.shared_kv.KVOwnerAttention` (no cache: the twin is for training).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); ``shared_kv``: the pass's dict, which receives ``{layer_index: (k, v)}``.
    """

    numpy_class = _KVOwnerAttention

    def setup(self, source) -> None:
        super().setup(source)
        self.keys_are_values = source.keys_are_values

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, shared_kv: dict | None = None
                ) -> torch.Tensor:
        rotary = rotary if self.uses_rotary else None
        k_raw = _split(_linear(x, self.W_K), self.num_kv_heads)  # (B, Hkv, L, Dh)
        v_raw = k_raw if self.keys_are_values else _split(_linear(x, self.W_V), self.num_kv_heads)
        k = _rms(k_raw, self.k_norm, self.norm_eps)  # (B, Hkv, L, Dh)
        k = k if rotary is None else rotary_apply(k, *rotary, self.interleaved)  # (B, Hkv, L, Dh)
        v = _rms(v_raw, torch.ones(self.head_dim, dtype=x.dtype), self.norm_eps)  # (B, Hkv, L, Dh)
        if shared_kv is not None:
            shared_kv[self.layer_index] = (k, v)
        return self._attend(self._queries(x, rotary), k, v, x, attention_mask)


class KVReaderAttention(_Attention):
    """Twin of :class:`attnkit.attention.shared_kv.KVReaderAttention`: its queries over ``shared_kv[owner]``."""

    numpy_class = _KVReaderAttention

    def setup(self, source) -> None:
        super().setup(source)
        self.owner_index = source.owner_index

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, shared_kv: dict | None = None
                ) -> torch.Tensor:
        if not shared_kv or self.owner_index not in shared_kv:
            raise RuntimeError(f"KVReaderAttention (layer {self.layer_index}, torch twin): layer {self.owner_index}, "
                               f"whose keys and values it reads, has not run in this pass")
        rotary = rotary if self.uses_rotary else None
        k, v = shared_kv[self.owner_index]
        return self._attend(self._queries(x, rotary), k, v, x, attention_mask)


def _scales(source_size: int, hidden_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """sqrt(P) rounded to float32 first, 1/sqrt(D) and 1/sqrt(2) in ``dtype``, as attnkit takes them."""
    return [torch.tensor(value, dtype=dtype) for value in (float(np.float32(source_size ** 0.5)), hidden_size ** -0.5,
                                                           0.5 ** 0.5)]


class PerLayerInputs(TwinModule):
    """Twin of :class:`attnkit.layers.per_layer_input.PerLayerInputs`: ids (B, L), h (B, L, D) -> (B, L, N, P)."""

    numpy_class = _PerLayerInputs

    def setup(self, source) -> None:
        self.num_layers, self.size, self.hidden_size = source.num_layers, source.size, source.hidden_size

    def forward(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        b, length = ids.shape
        token_scale, context_scale, mean_scale = _scales(self.size, self.hidden_size, h.dtype)
        tokens = self.embed(ids).to(h.dtype) * token_scale  # (B, L, N*P)
        context = self.norm((_linear(h, self.W_proj) * context_scale).reshape(b, length, self.num_layers, self.size))
        return (context + tokens.reshape(b, length, self.num_layers, self.size)) * mean_scale  # (B, L, N, P)


class PerLayerInputBranch(TwinModule):
    """Twin of :class:`attnkit.layers.per_layer_input.PerLayerInputBranch`: what h (B, L, D) and e (B, L, P) add
    to the residual stream (B, L, D)."""

    numpy_class = _PerLayerInputBranch

    def setup(self, source) -> None:
        self.activation = source.activation

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        mixed = activation(_linear(h, self.W_gate), self.activation) * e.to(h.dtype)  # (B, L, P)
        return self.norm(_linear(mixed, self.W_up))  # (B, L, D)


class LayerwiseBlock(LMBlock):
    """Twin of :class:`attnkit.layers.lm_block.LayerwiseBlock`: the LM block (its attention given the pass's
    shared keys and values), times the layer scalar. x (B, L, D) -> (B, L, D)."""

    numpy_class = _LayerwiseBlock

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, shared_kv: dict | None = None,
                **inputs) -> torch.Tensor:
        attended = self.attention(self.attn_norm(x), rotary=rotary, attention_mask=attention_mask,
                                  shared_kv=shared_kv)  # (B, L, D)
        x = x + self.attn_post_norm(attended)  # (B, L, D)
        y = self._before_scalar(x + self._mlp_branch(x), **inputs)  # (B, L, D)
        return y * self.layer_scalar.to(y.dtype)  # (B, L, D)

    def _before_scalar(self, y: torch.Tensor) -> torch.Tensor:
        return y


class PerLayerInputBlock(LayerwiseBlock):
    """Twin of :class:`attnkit.layers.lm_block.PerLayerInputBlock`: :class:`LayerwiseBlock` with the per-layer
    input's branch before the scalar. x (B, L, D), per_layer_input (B, L, P) -> (B, L, D)."""

    numpy_class = _PerLayerInputBlock

    def _before_scalar(self, y: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        return y + self.per_layer(y, per_layer_input)  # (B, L, D)

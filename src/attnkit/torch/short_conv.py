"""Twins of attnkit's gated short convolution (LFM2) and its decoder-block mixer.

Dimension letters: B batch, L length, D hidden size (the convolved channels too), K the kernel size.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F

import torch

from ..layers.short_conv import ShortConv as _ShortConv
from ..layers.short_conv import ShortConvMixer as _ShortConvMixer
from ._twin import TwinModule, as_tensor

__all__ = ["ShortConv", "ShortConvMixer"]


class ShortConv(TwinModule):
    """Twin of :class:`attnkit.layers.ShortConv` (training: no cache).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); attention_mask (B, L) bool, ``True`` = real token (a padded input is zeroed).

    Examples
    --------
    >>> layer = ShortConv(6, kernel_size=3, bias=True, rng=0)
    >>> layer(torch.ones(2, 5, 6, dtype=torch.float64)).shape
    torch.Size([2, 5, 6])
    """

    numpy_class = _ShortConv

    def setup(self, source) -> None:
        for name in ("hidden_size", "kernel_size", "bias"):
            setattr(self, name, getattr(source, name))

    def forward(self, x: torch.Tensor, *, attention_mask: Any = None) -> torch.Tensor:
        if attention_mask is not None:
            x = x * as_tensor(attention_mask, x.device).to(x.dtype)[..., None]  # (B, L, D): pads zeroed
        projected = x @ self.W_in + (self.b_in if self.bias else 0)  # (B, L, 3 D)
        gate_in, gate_out, values = projected.chunk(3, dim=-1)  # (B, L, D) each
        h = F.pad((gate_in * values).transpose(1, 2), (self.kernel_size - 1, 0))  # (B, D, K - 1 + L)
        u = F.conv1d(h, self.conv_weight[:, None, :], self.conv_bias if self.bias else None,
                     groups=self.hidden_size).transpose(1, 2)  # (B, L, D)
        return (gate_out * u) @ self.W_out + (self.b_out if self.bias else 0)  # (B, L, D)


class ShortConvMixer(ShortConv):
    """Twin of :class:`attnkit.layers.ShortConvMixer`: a block's ``"short_conv"`` mixer (``rotary`` is ignored;
    ``attention_mask`` (B, L) as :class:`ShortConv`).

    Examples
    --------
    >>> from attnkit.layers import ShortConvConfig
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="lfm2", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(8), layer_types=("short_conv",),
    ...                     mixer_parts=(ShortConvConfig(3),))
    >>> ShortConvMixer(cfg, 0, rng=0)(torch.ones(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 5, 8])
    """

    numpy_class = _ShortConvMixer

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("ShortConvMixer (torch twin) has no cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        return super().forward(x, attention_mask=attention_mask)

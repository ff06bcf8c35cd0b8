"""Twins of attnkit's Kimi Delta Attention layer and its decoder-block mixer.

Dimension letters: B batch, L length, D hidden size, H heads, Dh head dim, E = H Dh, K the convolution's
kernel size. The delta rule is :func:`attnkit.torch.gated_deltanet.delta_rule` with a log-decay per key channel.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F

import torch

from ..layers.kimi_delta_attention import KimiDeltaAttention as _KimiDeltaAttention
from ..layers.kimi_delta_attention import KimiDeltaAttentionMixer as _KimiDeltaAttentionMixer
from ._twin import TwinModule, as_tensor
from .gated_deltanet import _l2_normalize, delta_rule
from .layers import _rms

__all__ = ["KimiDeltaAttention", "KimiDeltaAttentionMixer"]


class KimiDeltaAttention(TwinModule):
    """Twin of :class:`attnkit.layers.KimiDeltaAttention` (training: no cache).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); attention_mask (B, L) bool, ``True`` = real token (a padded input is zeroed).

    Examples
    --------
    >>> layer = KimiDeltaAttention(8, 2, 4, rng=0)
    >>> layer(torch.ones(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 5, 8])
    """

    numpy_class = _KimiDeltaAttention

    def setup(self, source) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "conv_kernel_size", "eps", "chunk_size"):
            setattr(self, name, getattr(source, name))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, Dh)

    def forward(self, x: torch.Tensor, *, attention_mask: Any = None) -> torch.Tensor:
        if attention_mask is not None:
            x = x * as_tensor(attention_mask, x.device).to(x.dtype)[..., None]  # (B, L, D): pads zeroed
        mixed = torch.cat([x @ self.W_q, x @ self.W_k, x @ self.W_v], dim=-1).transpose(1, 2)  # (B, 3 E, L)
        mixed = F.pad(mixed, (self.conv_kernel_size - 1, 0))  # (B, 3 E, K - 1 + L)
        weight = self.conv_weight.reshape(-1, 1, self.conv_kernel_size)  # (3 E, 1, K)
        mixed = F.silu(F.conv1d(mixed, weight, groups=mixed.shape[1])).transpose(1, 2)  # (B, L, 3 E)
        q, k, v = (self._heads(t) for t in mixed.chunk(3, dim=-1))  # (B, H, L, Dh) each
        beta = torch.sigmoid(x @ self.W_b).transpose(1, 2)  # (B, H, L)
        pre = self._heads(x @ self.W_fa @ self.W_fb + self.dt_bias)  # (B, H, L, Dh)
        g = -torch.exp(self.A_log)[:, None, None] * F.softplus(pre)  # (B, H, L, Dh)
        o = delta_rule(_l2_normalize(q), _l2_normalize(k), v, g, beta, self.chunk_size)  # (B, H, L, Dh)
        o = o.transpose(1, 2)  # (B, L, H, Dh)
        z = (x @ self.W_ga @ self.W_gb).reshape(o.shape)  # (B, L, H, Dh)
        normed = _rms(o, self.norm_gamma, self.eps) * torch.sigmoid(z)  # (B, L, H, Dh)
        return normed.reshape(*x.shape[:2], -1) @ self.W_out  # (B, L, D)


class KimiDeltaAttentionMixer(KimiDeltaAttention):
    """Twin of :class:`attnkit.layers.KimiDeltaAttentionMixer`: a block's ``"kimi_delta_attention"`` mixer
    (``rotary`` is ignored; ``attention_mask`` (B, L) as :class:`KimiDeltaAttention`)."""

    numpy_class = _KimiDeltaAttentionMixer

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("KimiDeltaAttentionMixer (torch twin) has no cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        return super().forward(x, attention_mask=attention_mask)

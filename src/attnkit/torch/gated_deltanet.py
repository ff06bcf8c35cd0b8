"""Twins of attnkit's Gated DeltaNet layer and its decoder-block mixer.

Dimension letters: B batch, L length, D hidden size, Hk / Hv key / value heads, Dk / Dv their head dims,
Cc = 2 Hk Dk + Hv Dv the convolved channels, K the convolution's kernel size.

The delta rule runs in its recurrent form, one step per token with autograd through the steps: exact, and
simple to read beside attnkit's kernels; attnkit's chunked form is the fast one on a CPU.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F

import torch

from ..layers.gated_deltanet import GatedDeltaNet as _GatedDeltaNet
from ..layers.gated_deltanet import GatedDeltaNetMixer as _GatedDeltaNetMixer
from ._twin import TwinModule, as_tensor
from .layers import _rms

__all__ = ["GatedDeltaNet", "GatedDeltaNetMixer", "delta_rule"]


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule from a zero state, one step at a time (see :mod:`attnkit.kernels.delta_rule`).

    Shapes
    ------
    q, k (B, H, L, Dk); v (B, H, L, Dv); g, beta (B, H, L) -> (B, H, L, Dv). q is scaled by ``Dk ** -0.5``.
    """
    q = q * q.shape[-1] ** -0.5  # (B, H, L, Dk)
    state = q.new_zeros(q.shape[:2] + (k.shape[-1], v.shape[-1]))  # (B, H, Dk, Dv)
    out = []
    for t in range(q.shape[2]):
        state = state * torch.exp(g[..., t, None, None])  # (B, H, Dk, Dv)
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])  # (B, H, Dv)
        delta = beta[..., t, None] * (v[:, :, t] - predicted)  # (B, H, Dv)
        state = state + k[:, :, t, :, None] * delta[..., None, :]  # (B, H, Dk, Dv)
        out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    return torch.stack(out, dim=2)  # (B, H, L, Dv)


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)  # (..., D)


class GatedDeltaNet(TwinModule):
    """Twin of :class:`attnkit.layers.GatedDeltaNet` (training: no cache).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); attention_mask (B, L) bool, ``True`` = real token (a padded input is zeroed).

    Examples
    --------
    >>> layer = GatedDeltaNet(8, 1, 2, 4, 3, rng=0)
    >>> layer(torch.ones(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 5, 8])
    """

    numpy_class = _GatedDeltaNet

    def setup(self, source) -> None:
        for name in ("hidden_size", "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim",
                     "conv_kernel_size", "eps", "key_dim", "value_dim"):
            setattr(self, name, getattr(source, name))

    def _heads(self, x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        return x.reshape(*x.shape[:2], heads, dim).transpose(1, 2)  # (B, H, L, dim)

    def forward(self, x: torch.Tensor, *, attention_mask: Any = None) -> torch.Tensor:
        if attention_mask is not None:
            x = x * as_tensor(attention_mask, x.device).to(x.dtype)[..., None]  # (B, L, D): pads zeroed
        mixed = F.pad((x @ self.W_qkv).transpose(1, 2), (self.conv_kernel_size - 1, 0))  # (B, Cc, K - 1 + L)
        mixed = F.silu(F.conv1d(mixed, self.conv_weight[:, None, :], groups=mixed.shape[1])).transpose(1, 2)
        kd, group = self.key_dim, self.num_value_heads // self.num_key_heads
        q = _l2_normalize(self._heads(mixed[..., :kd], self.num_key_heads, self.key_head_dim))  # (B, Hk, L, Dk)
        k = _l2_normalize(self._heads(mixed[..., kd:2 * kd], self.num_key_heads, self.key_head_dim))
        v = self._heads(mixed[..., 2 * kd:], self.num_value_heads, self.value_head_dim)  # (B, Hv, L, Dv)
        beta = torch.sigmoid(x @ self.W_b).transpose(1, 2)  # (B, Hv, L)
        g = (-torch.exp(self.A_log) * F.softplus(x @ self.W_a + self.dt_bias)).transpose(1, 2)  # (B, Hv, L)
        o = delta_rule(q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v, g, beta)  # (B, Hv, L, Dv)
        o = o.transpose(1, 2)  # (B, L, Hv, Dv)
        z = (x @ self.W_z).reshape(o.shape)  # (B, L, Hv, Dv)
        normed = _rms(o, self.norm_gamma, self.eps) * F.silu(z)  # (B, L, Hv, Dv)
        return normed.reshape(*x.shape[:2], self.value_dim) @ self.W_out  # (B, L, D)


class GatedDeltaNetMixer(GatedDeltaNet):
    """Twin of :class:`attnkit.layers.GatedDeltaNetMixer`: a block's ``"linear_attention"`` mixer (``rotary`` is
    ignored; ``attention_mask`` (B, L) as :class:`GatedDeltaNet`).

    Examples
    --------
    >>> from attnkit.layers import GatedDeltaNetConfig
    >>> from attnkit.models import DecoderConfig
    >>> cfg = DecoderConfig(family="qwen3_5_text", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=8, layer_types=("linear_attention",),
    ...                     linear_attention=GatedDeltaNetConfig(1, 2, 4, 3))
    >>> GatedDeltaNetMixer(cfg, 0, rng=0)(torch.ones(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 5, 8])
    """

    numpy_class = _GatedDeltaNetMixer

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("GatedDeltaNetMixer (torch twin) has no cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        return super().forward(x, attention_mask=attention_mask)

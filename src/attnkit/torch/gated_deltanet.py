"""Twins of attnkit's Gated DeltaNet layer and its decoder-block mixer.

Dimension letters: B batch, L length, D hidden size, Hk / Hv key / value heads, Dk / Dv their head dims,
Cc = 2 Hk Dk + Hv Dv the convolved channels, K the convolution's kernel size.

The delta rule runs in its chunked form (the same as attnkit's kernel, differentiated by autograd), so a long
training sequence costs L / 64 sequential steps, not L.
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


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule from a zero state in its chunked (WY/UT) form, as :mod:`attnkit.kernels.delta_rule`
    writes it: one triangular solve per chunk, a loop over the L / C chunks only; autograd differentiates it.

    Shapes
    ------
    q, k (B, H, L, Dk); v (B, H, L, Dv); g (B, H, L) (Gated DeltaNet) or (B, H, L, Dk) (one log-decay per key
    channel, Kimi Delta Attention); beta (B, H, L) -> (B, H, L, Dv). q is scaled by ``Dk ** -0.5``.
    """
    length, c = q.shape[2], chunk_size
    g = g if g.dim() == q.dim() else g[..., None]  # (B, H, L, Dg), Dg = 1 for a scalar gate
    pad = (-length) % c  # zero keys, values, betas and log-decays leave the state as it is
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q * q.shape[-1] ** -0.5, k, v, g))  # (B, H, N C, D)
    beta = F.pad(beta, (0, pad))  # (B, H, N C)
    q, k, v, g = (t.reshape(*t.shape[:2], -1, c, t.shape[-1]) for t in (q, k, v, g))  # (B, H, N, C, D)
    cum = g.cumsum(-2)  # (B, H, N, C, Dg): G
    beta = beta.reshape(cum.shape[:-1])  # (B, H, N, C)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()[..., None]  # (C, C, 1)
    gamma = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(~lower, float("-inf")).exp()  # (.., C, C, Dg)

    def decayed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # sum_d a_id b_jd gamma_ijd: (B, H, N, C, C)
        if gamma.shape[-1] == 1:
            return (a @ b.transpose(-1, -2)) * gamma[..., 0]
        return torch.einsum("...id,...jd,...ijd->...ij", a, b, gamma)

    system = torch.eye(c, dtype=q.dtype, device=q.device) + (beta[..., None] * decayed(k, k)).tril(-1)
    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)  # (.., C, Dv)
    w = torch.linalg.solve_triangular(system, beta[..., None] * cum.exp() * k, upper=False,
                                      unitriangular=True)  # (B, H, N, C, Dk)
    attn = decayed(q, k)  # (B, H, N, C, C)
    qd, kd = q * cum.exp(), k * (cum[..., -1:, :] - cum).exp()  # (B, H, N, C, Dk)
    state = q.new_zeros(q.shape[:2] + (k.shape[-1], v.shape[-1]))  # (B, H, Dk, Dv)
    out = []
    for i in range(q.shape[2]):  # the chunks are sequential: each starts from the state the last one left
        v_new = u[:, :, i] - w[:, :, i] @ state  # (B, H, C, Dv)
        out.append(qd[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = cum[:, :, i, -1, :, None].exp() * state + kd[:, :, i].transpose(-1, -2) @ v_new
    return torch.cat(out, dim=2)[:, :, :length]  # (B, H, L, Dv)


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
                     "conv_kernel_size", "eps", "key_dim", "value_dim", "chunk_size"):
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
        o = delta_rule(q.repeat_interleave(group, 1), k.repeat_interleave(group, 1), v, g, beta,
                       self.chunk_size)  # (B, Hv, L, Dv)
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
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="qwen3_5_text", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(8), layer_types=("linear_attention",),
    ...                     mixer_parts=(GatedDeltaNetConfig(1, 2, 4, 3),))
    >>> GatedDeltaNetMixer(cfg, 0, rng=0)(torch.ones(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 5, 8])
    """

    numpy_class = _GatedDeltaNetMixer

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("GatedDeltaNetMixer (torch twin) has no cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        return super().forward(x, attention_mask=attention_mask)

"""Twins of attnkit's Mamba-2 mixer, its decoder-block mixer, and that mixer beside attention (Falcon-H1).

Dimension letters: B batch, L length, D hidden size, H heads, P head dim, I = H P, G groups, N state size,
Cc = I + 2 G N the convolved channels, K the convolution's kernel size, C the chunk size.

The scan runs in its chunked form (:mod:`attnkit.kernels.ssd`'s, differentiated by autograd), so a long training
sequence costs L / C sequential steps, not L.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F

import torch

from ..layers.attention_mamba2 import AttentionMamba2Mixer as _AttentionMamba2Mixer
from ..layers.mamba2 import Mamba2 as _Mamba2
from ..layers.mamba2 import Mamba2Mixer as _Mamba2Mixer
from ._twin import TwinModule, as_tensor

__all__ = ["Mamba2", "Mamba2Mixer", "AttentionMamba2Mixer", "ssd"]


def ssd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """The SSD scan from a zero state, C steps at a time, as :func:`attnkit.kernels.ssd.chunked_forward` writes it.

    Shapes
    ------
    q, k (B, H, L, N); v (B, H, L, P); g (B, H, L) -> (B, H, L, P).
    """
    length, c = q.shape[2], chunk_size
    pad = (-length) % c  # zero inputs and log-decays leave the state as it is
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # (B, H, Nc C, *)
    q, k, v = (t.reshape(*t.shape[:2], -1, c, t.shape[-1]) for t in (q, k, v))  # (B, H, Nc, C, *)
    cum = F.pad(g, (0, pad)).reshape(*g.shape[:2], -1, c).cumsum(-1)  # (B, H, Nc, C)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()  # (C, C)
    within = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (B, H, Nc, C, C)
    out = ((q @ k.transpose(-1, -2)) * within) @ v  # (B, H, Nc, C, P)
    local = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2) @ v  # (B, H, Nc, N, P)
    state = q.new_zeros(q.shape[:2] + (k.shape[-1], v.shape[-1]))  # (B, H, N, P)
    starts = []
    for i in range(q.shape[2]):  # the chunks are sequential: each starts from the state the last one left
        starts.append(state)
        state = cum[:, :, i, -1, None, None].exp() * state + local[:, :, i]
    out = out + (q * cum.exp()[..., None]) @ torch.stack(starts, dim=2)  # (B, H, Nc, C, P)
    return out.reshape(*out.shape[:2], -1, out.shape[-1])[:, :, :length]  # (B, H, L, P)


class Mamba2(TwinModule):
    """Twin of :class:`attnkit.layers.Mamba2` (training: no cache).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); attention_mask (B, L) bool, ``True`` = real token (a padded input is zeroed).

    Examples
    --------
    >>> from attnkit.layers import Mamba2Config
    >>> layer = Mamba2(8, Mamba2Config(num_heads=2, head_dim=3, state_size=4, chunk_size=2), rng=0)
    >>> layer(torch.ones(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 5, 8])
    """

    numpy_class = _Mamba2

    def setup(self, source) -> None:
        for name in ("hidden_size", "shape", "eps", "inner_size", "conv_dim", "widths", "projection_scale"):
            setattr(self, name, getattr(source, name))

    def _optional(self, name: str) -> Any:
        return getattr(self, name) if name in self._parameters else None

    def forward(self, x: torch.Tensor, *, attention_mask: Any = None) -> torch.Tensor:
        s = self.shape
        keep = None if attention_mask is None else as_tensor(attention_mask, x.device).to(x.dtype)[..., None]
        if keep is not None:
            x = x * keep  # (B, L, D): pads zeroed
        projected = F.linear(x, self.W_in.T, self._optional("b_in"))  # (B, L, I + Cc + H)
        projected = projected * torch.as_tensor(self.projection_scale, dtype=x.dtype, device=x.device)
        z, xbc, dt = projected.split(list(self.widths), dim=-1)
        xbc = F.pad(xbc.transpose(1, 2), (s.conv_kernel_size - 1, 0))  # (B, Cc, K - 1 + L)
        xbc = F.silu(F.conv1d(xbc, self.conv_weight[:, None, :], self._optional("conv_bias"),
                              groups=self.conv_dim)).transpose(1, 2)  # (B, L, Cc)
        if keep is not None:
            xbc = xbc * keep
        b, length = x.shape[:2]
        gn, per_group = s.n_groups * s.state_size, s.num_heads // s.n_groups
        xs = xbc[..., :self.inner_size].reshape(b, length, s.num_heads, s.head_dim)  # (B, L, H, P)

        def heads(part: torch.Tensor) -> torch.Tensor:  # (B, L, G N) -> (B, H, L, N)
            grouped = part.reshape(b, length, s.n_groups, s.state_size)
            return grouped.repeat_interleave(per_group, dim=2).transpose(1, 2)

        k, q = heads(xbc[..., self.inner_size:self.inner_size + gn]), heads(xbc[..., self.inner_size + gn:])
        dt = F.softplus(dt + self.dt_bias)  # (B, L, H)
        if s.time_step_min:
            dt = torch.clamp(dt, min=s.time_step_min)  # (B, L, H): the floor
        g = (dt * -torch.exp(self.A_log)).transpose(1, 2)  # (B, H, L)
        o = ssd(q, k, (xs * dt[..., None]).transpose(1, 2), g, s.chunk_size).transpose(1, 2)  # (B, L, H, P)
        y = (o + self.D_skip[:, None] * xs).reshape(b, length, self.inner_size)  # (B, L, I)
        if s.norm is None:
            gated = y * F.silu(z)  # (B, L, I)
        else:
            grouped = (y * F.silu(z) if s.norm == "after_gate" else y).reshape(b, length, s.n_groups, -1)
            normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, L, G, I / G)
            gated = normed.reshape(y.shape) * self.norm_gamma  # (B, L, I)
            if s.norm == "before_gate":
                gated = gated * F.silu(z)
        return F.linear(gated, self.W_out.T, self._optional("b_out"))


class Mamba2Mixer(Mamba2):
    """Twin of :class:`attnkit.layers.Mamba2Mixer`: a block's ``"mamba2"`` mixer (``rotary`` is ignored;
    ``attention_mask`` (B, L) as :class:`Mamba2`).

    Examples
    --------
    >>> from attnkit.layers import Mamba2Config
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="bamba", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(8), layer_types=("mamba2",),
    ...                     mixer_parts=(Mamba2Config(num_heads=2, head_dim=4, state_size=3),))
    >>> Mamba2Mixer(cfg, 0, rng=0)(torch.ones(2, 5, 8, dtype=torch.float64)).shape
    torch.Size([2, 5, 8])
    """

    numpy_class = _Mamba2Mixer

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("Mamba2Mixer (torch twin) has no cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        return super().forward(x, attention_mask=attention_mask)


class AttentionMamba2Mixer(TwinModule):
    """Twin of :class:`attnkit.layers.attention_mamba2.AttentionMamba2Mixer`: attention and the Mamba-2 mixer on
    the same input, ``attn_out(attn(attn_in(x))) + mamba_out(mamba(mamba_in(x)))``.

    Shapes
    ------
    x (B, L, D) -> (B, L, D); ``rotary`` goes to the attention, ``attention_mask`` (B, L) to both.
    """

    numpy_class = _AttentionMamba2Mixer

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("AttentionMamba2Mixer (torch twin) has no cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        attended = self.attn(self.attn_in(x), rotary=rotary, attention_mask=attention_mask)  # (B, L, D)
        mixed = self.mamba(self.mamba_in(x), attention_mask=attention_mask)  # (B, L, D)
        return self.attn_out(attended) + self.mamba_out(mixed)  # (B, L, D)

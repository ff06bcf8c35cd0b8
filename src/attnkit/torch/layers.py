"""Twins of attnkit's parameter layers: norms, MLPs, embeddings, projection, dropout, positions.

Each class takes the constructor arguments of the attnkit class of the same name (and builds it to get its
initial weights); parameters carry attnkit's names and ``x @ W`` layout.

Dimension letters: ``...`` any leading dims, D features, F hidden width, V table size, L positions,
R rotated features per head.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch.nn.functional as F

import torch

from .. import layers as _layers
from ..kernels import rotary as _rotary
from ..layers.experts import GatedSharedExpert as _GatedSharedExpert
from ..layers.experts import MixtureOfExperts as _MixtureOfExperts
from ..layers.gated_mlp import GatedMLP as _GatedMLP
from ..layers.gated_mlp import ScaledGatedMLP as _ScaledGatedMLP
from ..layers.identity import Identity as _Identity
from ..layers.identity import Scale as _Scale
from ..layers.identity import Zero as _Zero
from ..layers.rms_norm import RMSNorm as _RMSNorm
from ..layers.rotary import RotaryEmbedding as _RotaryEmbedding
from ..layers.router import Router as _Router
from ..layers.ungated_mlp import UngatedMLP as _UngatedMLP
from ..layers.xielu_mlp import XIELUMLP as _XIELUMLP
from ._twin import TwinModule, as_tensor

__all__ = ["LayerNorm", "RMSNorm", "FeedForward", "GatedMLP", "ScaledGatedMLP", "UngatedMLP", "XIELUMLP", "Router",
           "MixtureOfExperts", "GatedSharedExpert",
           "Embedding", "Projection", "Dropout", "Identity", "Zero", "Scale", "SinusoidalPositionalEncoding",
           "RotaryEmbedding", "activation"]


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """attnkit's activations: ``relu``, ``gelu`` (exact erf), ``gelu_tanh``, ``silu`` and ``relu2``."""
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "silu":
        return F.silu(x)
    if name == "relu2":
        return torch.square(F.relu(x))
    raise ValueError(f"activation must be relu, gelu, gelu_tanh, silu or relu2, got {name!r}")


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x @ w  # (..., Out)
    return y if b is None else y + b


class LayerNorm(TwinModule):
    """Twin of :class:`attnkit.layers.LayerNorm`: ``gamma * (x - mean) / sqrt(var + eps) + beta``.

    Shapes
    ------
    x (..., D) -> (..., D); float16 inputs are normalised in float32 as in attnkit.

    Examples
    --------
    >>> LayerNorm(3)(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)).round(decimals=4).tolist()
    [[-1.2247, 0.0, 1.2247]]
    """

    numpy_class = _layers.LayerNorm

    def setup(self, source) -> None:
        self.normalized_shape, self.eps = source.normalized_shape, source.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        y = F.layer_norm(x.to(compute), (self.normalized_shape,), self.gamma.to(compute), self.beta.to(compute),
                         self.eps)  # (..., D)
        return y.to(x.dtype)


class RMSNorm(TwinModule):
    """Twin of :class:`attnkit.layers.rms_norm.RMSNorm`: ``(offset + gamma) * x / sqrt(mean(x^2) + eps)``.

    Half-precision inputs are normalised in float32 and cast back before the gain, as attnkit (and Hugging
    Face's Llama) do.

    Shapes
    ------
    x (..., D) -> (..., D).

    Examples
    --------
    >>> RMSNorm(2, eps=0.0)(torch.tensor([[3.0, 4.0]], dtype=torch.float64)).round(decimals=4).tolist()
    [[0.8485, 1.1314]]
    """

    numpy_class = _RMSNorm

    def setup(self, source) -> None:
        self.normalized_shape, self.eps, self.offset = source.normalized_shape, source.eps, source.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.gamma + self.offset if self.offset else self.gamma, self.eps)  # (..., D)


def _rms(x: torch.Tensor, gamma: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``gamma * x / sqrt(mean(x^2) + eps)`` over the last axis (no gain when ``gamma`` is None), normalised in
    float32 at least."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    x_hat = xc * torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)  # (..., D)
    return x_hat.to(x.dtype) if gamma is None else gamma.to(x.dtype) * x_hat.to(x.dtype)  # (..., D)


class FeedForward(TwinModule):
    """Twin of :class:`attnkit.layers.FeedForward`: ``act(x @ W1 + b1) @ W2 + b2``.

    Shapes
    ------
    x (..., D) -> (..., D).

    Examples
    --------
    >>> ffn = FeedForward(4, 8, activation="gelu", rng=0)
    >>> ffn(torch.ones(2, 3, 4, dtype=torch.float64)).shape
    torch.Size([2, 3, 4])
    """

    numpy_class = _layers.FeedForward

    def setup(self, source) -> None:
        self.activation = source.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = activation(_linear(x, self.W1, self.b1), self.activation)  # (..., F)
        return _linear(hidden, self.W2, self.b2)  # (..., D)


class GatedMLP(TwinModule):
    """Twin of :class:`attnkit.layers.gated_mlp.GatedMLP`: ``(act(x W_gate + b_g) * (x W_up + b_u)) W_down + b_d``.

    Shapes
    ------
    x (..., D) -> (..., D).

    Examples
    --------
    >>> [name for name, _ in GatedMLP(4, 6, "silu", rng=0).named_parameters()]
    ['W_gate', 'W_up', 'W_down']
    """

    numpy_class = _GatedMLP

    def setup(self, source) -> None:
        self.activation, self.bias = source.activation, source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = (self.b_gate, self.b_up, self.b_down) if self.bias else (None, None, None)
        gate = activation(_linear(x, self.W_gate, b[0]), self.activation)  # (..., F)
        return _linear(gate * _linear(x, self.W_up, b[1]), self.W_down, b[2])  # (..., D)


class UngatedMLP(TwinModule):
    """Twin of :class:`attnkit.layers.ungated_mlp.UngatedMLP`: ``act(x W_up + b_up) W_down + b_down``.

    Shapes
    ------
    x (..., D) -> (..., D).
    """

    numpy_class = _UngatedMLP

    def setup(self, source) -> None:
        self.activation = source.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = activation(_linear(x, self.W_up, getattr(self, "b_up", None)), self.activation)  # (..., F)
        return _linear(hidden, self.W_down, getattr(self, "b_down", None))  # (..., D)


class ScaledGatedMLP(GatedMLP):
    """Twin of :class:`attnkit.layers.gated_mlp.ScaledGatedMLP`:
    ``m_down * (act(m_gate * (x W_gate + b_g)) * (x W_up + b_u)) W_down + b_d`` (``b_d`` scaled too).

    Shapes
    ------
    x (..., D) -> (..., D).
    """

    numpy_class = _ScaledGatedMLP

    def setup(self, source) -> None:
        super().setup(source)
        self.gate_scale, self.output_scale = source.gate_scale, source.output_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = (self.b_gate, self.b_up, self.b_down) if self.bias else (None, None, None)
        gate = activation(_linear(x, self.W_gate, b[0]) * self.gate_scale, self.activation)  # (..., F)
        return _linear(gate * _linear(x, self.W_up, b[1]), self.W_down, b[2]) * self.output_scale  # (..., D)


class XIELUMLP(TwinModule):
    """Twin of :class:`attnkit.layers.xielu_mlp.XIELUMLP`: ``xielu(x W_up) W_down``, xIELU's slopes learned.

    Shapes
    ------
    x (..., D) -> (..., D).
    """

    numpy_class = _XIELUMLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.W_up  # (..., F)
        a_p, a_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)  # (1,) each
        negative = torch.expm1(torch.minimum(h, self.eps)) - h  # (..., F)
        a = torch.where(h > 0, a_p * h * h, a_n * negative) + self.beta * h  # (..., F)
        return a @ self.W_down  # (..., D)


class Router(TwinModule):
    """Twin of :class:`attnkit.layers.router.Router`: the logits ``x W_router (+ b_router)``, then the named rule
    (:mod:`attnkit.kernels.routing`). The choice is made without gradient (``torch.topk`` indices); the weights
    carry it.

    Shapes
    ------
    x (..., D) -> (chosen (..., k) int64, weights (..., k)).

    Examples
    --------
    >>> from attnkit.models import ExpertsConfig
    >>> part = ExpertsConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, layers=(0,),
    ...                      router="sigmoid_group_topk", n_group=4, topk_group=2)
    >>> [t.shape for t in Router(4, part, rng=0)(torch.ones(3, 4, dtype=torch.float64))]
    [torch.Size([3, 2]), torch.Size([3, 2])]
    """

    numpy_class = _Router

    def setup(self, source) -> None:
        for name in ("top_k", "rule", "normalize", "scaling", "n_group", "topk_group"):
            setattr(self, name, getattr(source, name))

    def _sigmoid_group_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(logits)  # (N, E)
        with torch.no_grad():
            corrected = scores + self.e_score_correction_bias.to(scores.dtype)  # (N, E)
            grouped = corrected.reshape(logits.shape[0], self.n_group, -1)  # (N, G, E/G)
            kept = torch.topk(torch.topk(grouped, 2, dim=-1).values.sum(-1), self.topk_group, dim=-1).indices
            in_kept = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, kept, True)  # (N, G)
            candidates = corrected.masked_fill(~in_kept.repeat_interleave(grouped.shape[-1], dim=-1), -torch.inf)
            chosen = torch.topk(candidates, self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, chosen)  # (N, k)
        return chosen, weights / (weights.sum(-1, keepdim=True) + 1e-20) if self.normalize else weights

    def _softmax_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)  # (N, k) each
        return chosen, weights / weights.sum(dim=-1, keepdim=True) if self.normalize else weights

    def _topk_softmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, chosen = torch.topk(logits, self.top_k, dim=-1)  # (N, k) each, largest first
        return chosen, torch.softmax(top, dim=-1)

    def _topk_sigmoid(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, chosen = torch.topk(logits, self.top_k, dim=-1)  # (N, k) each, largest first
        return chosen, torch.sigmoid(top)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        logits = _linear(flat, self.W_router.to(flat.dtype), getattr(self, "b_router", None))  # (N, E)
        chosen, weights = getattr(self, f"_{self.rule}")(logits)  # (N, k) each
        lead = x.shape[:-1]
        return chosen.reshape(*lead, self.top_k), (weights * self.scaling).reshape(*lead, self.top_k)


class MixtureOfExperts(TwinModule):
    """Twin of :class:`attnkit.layers.experts.MixtureOfExperts`: the router's k experts per token (gated MLPs, or
    gpt-oss's clamped SwiGLU), each run over the tokens routed to it and weighed, plus the shared expert.

    Shapes
    ------
    x (..., D) -> (..., D).

    Examples
    --------
    >>> from attnkit.models import ExpertsConfig
    >>> part = ExpertsConfig(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=5, layers=(0,),
    ...                      router="topk_softmax", router_bias=True, expert_bias=True, swiglu_limit=7.0)
    >>> MixtureOfExperts(4, part, "silu", rng=0)(torch.ones(2, 3, 4, dtype=torch.float64)).shape
    torch.Size([2, 3, 4])
    """

    numpy_class = _MixtureOfExperts

    def setup(self, source) -> None:
        self.activation, self.limit, self.alpha = source.activation, source.limit, source.alpha
        self.weigh_inputs = source.weigh_inputs

    def _expert(self, xe: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e`` over its tokens (n, D) -> (n, D)."""
        bias = [getattr(self, name)[e] if hasattr(self, name) else None for name in ("b_gate", "b_up", "b_down")]
        gate, up = _linear(xe, self.W_gate[e], bias[0]), _linear(xe, self.W_up[e], bias[1])  # (n, F) each
        if self.limit is None:
            hidden = activation(gate, self.activation) * up  # (n, F)
        else:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)  # (n, F) each
            hidden = (up + 1) * gate * torch.sigmoid(self.alpha * gate)  # (n, F)
        return _linear(hidden, self.W_down[e], bias[2])  # (n, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        chosen, weights = self.router(flat)  # (N, k) each
        y = self.shared_expert(flat)  # (N, D)
        for expert in range(self.W_gate.shape[0]):  # each expert over its own tokens
            tokens, slot = torch.where(chosen == expert)  # (n,) each
            if tokens.numel() == 0:
                continue
            w = weights[tokens, slot, None]  # (n, 1)
            if self.weigh_inputs:  # the weight scales the expert's input (Llama 4)
                out = self._expert(flat[tokens] * w, expert)  # (n, D)
            else:
                out = self._expert(flat[tokens], expert) * w  # (n, D)
            y = y.index_add(0, tokens, out)  # (N, D)
        return y.reshape(x.shape)


class GatedSharedExpert(GatedMLP):
    """Twin of :class:`attnkit.layers.experts.GatedSharedExpert`: ``sigmoid(x W_shared_gate) * mlp(x)``.

    Shapes
    ------
    x (..., D) -> (..., D).
    """

    numpy_class = _GatedSharedExpert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x @ self.W_shared_gate) * super().forward(x)  # (..., D)


class Embedding(TwinModule):
    """Twin of :class:`attnkit.layers.Embedding`: ``weight[ids]`` (the padding row gets no gradient).

    Shapes
    ------
    ids (...) int -> (..., D).

    Examples
    --------
    >>> Embedding(5, 3, rng=0)(torch.tensor([[1, 2]])).shape
    torch.Size([1, 2, 3])
    """

    numpy_class = _layers.Embedding

    def setup(self, source) -> None:
        self.padding_idx = source.padding_idx

    def forward(self, ids: Any) -> torch.Tensor:
        ids = as_tensor(ids, self.weight.device, torch.long)
        return F.embedding(ids, self.weight, padding_idx=self.padding_idx)  # (..., D)


class Projection(TwinModule):
    """Twin of :class:`attnkit.layers.Projection`: ``x @ W + b``.

    Shapes
    ------
    x (..., In) -> (..., Out).

    Examples
    --------
    >>> Projection(3, 2, rng=0)(torch.ones(4, 3, dtype=torch.float64)).shape
    torch.Size([4, 2])
    """

    numpy_class = _layers.Projection

    def setup(self, source) -> None:
        self.bias = source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.W, self.b if self.bias else None)  # (..., Out)


class Dropout(TwinModule):
    """Twin of :class:`attnkit.layers.Dropout` (torch's random stream, so masks differ from attnkit's).

    Shapes
    ------
    x (...) -> (...); the identity in eval mode.

    Examples
    --------
    >>> Dropout(0.5).eval()(torch.ones(3)).tolist()
    [1.0, 1.0, 1.0]
    """

    numpy_class = _layers.Dropout

    def setup(self, source) -> None:
        self.p = source.p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training) if self.p else x


class SinusoidalPositionalEncoding(TwinModule):
    """Twin of :class:`attnkit.layers.SinusoidalPositionalEncoding`: ``x + PE[:L]`` (a buffer, not a parameter).

    Shapes
    ------
    x (B, L, D) -> (B, L, D), L <= ``max_length``.

    Examples
    --------
    >>> SinusoidalPositionalEncoding(10, 4)(torch.zeros(1, 2, 4))[0, 1].round(decimals=4)
    tensor([0.8415, 0.5403, 0.0100, 0.9999])
    """

    numpy_class = _layers.SinusoidalPositionalEncoding

    def setup(self, source) -> None:
        self.max_length = source.max_length
        self.register_buffer("encodings", torch.from_numpy(np.array(source.encodings, copy=True)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-2]
        if length > self.max_length:
            raise ValueError(f"SinusoidalPositionalEncoding: sequence length {length} exceeds max_length = "
                             f"{self.max_length}")
        return x + self.encodings[:length].to(x.dtype)  # (B, L, D)


class RotaryEmbedding(TwinModule):
    """Twin of :class:`attnkit.layers.rotary.RotaryEmbedding`: cos/sin of the rotary angles (no parameters).

    Frequencies come from attnkit's own :func:`~attnkit.kernels.rotary.rotary_frequencies` (every scaling
    it supports); angles are taken in float64 on the positions' device and cast once.

    Shapes
    ------
    position_ids (B, L) int -> cos, sin (B, L, R) in ``dtype``.

    Examples
    --------
    >>> from attnkit.models import RotaryConfig
    >>> cos, sin = RotaryEmbedding(RotaryConfig(), head_dim=4, max_position_embeddings=8)(torch.tensor([[0, 1]]))
    >>> cos.shape, round(float(sin[0, 1, 0]), 4)
    (torch.Size([1, 2, 4]), 0.8415)
    """

    numpy_class = _RotaryEmbedding

    def setup(self, source) -> None:
        self.rotary_dim, self.theta, self.scaling = source.rotary_dim, source.theta, source.scaling
        self.interleaved, self.dynamic = source.interleaved, source.dynamic
        self.max_position_embeddings = source.max_position_embeddings
        self.inv_freq, self.attention_factor = source.inv_freq, source.attention_factor

    def forward(self, position_ids: Any, dtype: torch.dtype = torch.float32):
        positions = as_tensor(position_ids, torch.device("cpu") if not isinstance(position_ids, torch.Tensor)
                              else position_ids.device)
        inv_freq, factor = self.inv_freq, self.attention_factor
        if self.dynamic and positions.numel():
            inv_freq, factor = _rotary.rotary_frequencies(
                self.rotary_dim, self.theta, self.scaling, max_position_embeddings=self.max_position_embeddings,
                seq_len=int(positions.max()) + 1)
        freq = torch.as_tensor(inv_freq, dtype=torch.float64, device=positions.device)  # (R/2,)
        angles = positions[..., None].to(torch.float64) * freq  # (B, L, R/2)
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)  # (B, L, R)
        else:
            angles = torch.cat([angles, angles], dim=-1)  # (B, L, R)
        return (torch.cos(angles) * factor).to(dtype), (torch.sin(angles) * factor).to(dtype)


def turn(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Map every rotary feature pair ``(a, b)`` to ``(-b, a)`` in the given layout."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))  # (..., R/2, 2)
        return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)  # (..., R)
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (..., R)


def rotary_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first R features of every head; the rest pass through.

    Shapes
    ------
    x (B, H, L, Dh), cos/sin (B, L, R) -> (B, H, L, Dh).
    """
    r = cos.shape[-1]
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (B, 1, L, R)
    rot = x[..., :r]  # (B, H, L, R)
    rotated = rot * c + turn(rot, interleaved) * s  # (B, H, L, R)
    return rotated if r == x.shape[-1] else torch.cat([rotated, x[..., r:]], dim=-1)  # (B, H, L, Dh)


class Identity(TwinModule):
    """Twin of :class:`attnkit.layers.identity.Identity`: returns its input."""

    numpy_class = _Identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Scale(TwinModule):
    """Twin of :class:`attnkit.layers.identity.Scale`: its input times a fixed factor, in the input's dtype."""

    numpy_class = _Scale

    def setup(self, source) -> None:
        self.factor = source.factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(self.factor, dtype=x.dtype, device=x.device)


class Zero(TwinModule):
    """Twin of :class:`attnkit.layers.identity.Zero`: zeros of its input's shape."""

    numpy_class = _Zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

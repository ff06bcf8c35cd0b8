"""``GroupedExpertsMoE``: many small routed experts plus shared experts every token uses (DeepSeek-V3's MLP).

Dimension letters: ``...`` any leading dims, N tokens (their product), D ``hidden_size``, E routed experts,
k experts per token, F ``expert_intermediate_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from .._validation import check_factor, check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import experts as _experts
from .gated_mlp import GatedMLP
from .group_router import GroupLimitedRouter, check_routing

__all__ = ["GroupedExpertsConfig", "GroupedExpertsMoE"]


@dataclass(frozen=True)
class GroupedExpertsConfig:
    """The mixture-of-experts part of a decoder config whose MLPs are :class:`GroupedExpertsMoE` (the
    ``transformers`` DeepseekV3Config names in brackets).

    Attributes
    ----------
    num_experts : int
        E, routed experts (``n_routed_experts``).
    num_experts_per_tok : int
        k.
    expert_intermediate_size : int
        F, each expert's hidden width (``moe_intermediate_size``); the shared experts are one gated MLP of
        width ``num_shared_experts * F``.
    num_shared_experts : int
        (``n_shared_experts``).
    num_groups, topk_groups : int
        G expert groups and the groups a token may draw from (``n_group``, ``topk_group``).
    normalize_weights : bool
        The chosen scores are divided by their sum (``norm_topk_prob``).
    routed_scaling_factor : float
        Multiplies the routed weights; in ``[2**-14, 65504]`` (float16's normal range: 1e308 made every logit NaN).
    first_dense_layers : int
        The first layers keep a dense gated MLP of ``intermediate_size`` (``first_k_dense_replace``).
    """

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    num_shared_experts: int = 1
    num_groups: int = 1
    topk_groups: int = 1
    normalize_weights: bool = True
    routed_scaling_factor: float = 1.0
    first_dense_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "num_shared_experts",
                     "num_groups", "topk_groups"):
            check_positive_int(getattr(self, name), name)
        check_positive_int(self.first_dense_layers, "first_dense_layers", allow_zero=True)
        if not isinstance(self.normalize_weights, bool):
            raise TypeError(f"normalize_weights must be True or False, got {self.normalize_weights!r}")
        factor = check_factor(self.routed_scaling_factor, "routed_scaling_factor")
        check_routing(1, self.num_experts, self.num_experts_per_tok, self.num_groups, self.topk_groups, factor)

    def routed(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture (past the first dense layers)."""
        return layer >= self.first_dense_layers


class GroupedExpertsMoE(Module):
    """``y = sum_j w_j expert_{c_j}(x) + shared(x)``: a :class:`GroupLimitedRouter` picks k of E gated experts
    per token, and the shared experts (one :class:`GatedMLP`) see every token.

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size``, ``activation`` and the part ``grouped_experts`` (:class:`GroupedExpertsConfig`).
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights.

    Attributes
    ----------
    router : GroupLimitedRouter
        ``mlp.gate``.
    W_gate, W_up : (E, D, F); W_down : (E, F, D)
        The routed experts, stored for ``x @ W``: ``mlp.experts.gate_up_proj`` (E, 2F, D) is ``[W_gate^T;
        W_up^T]`` per expert, ``mlp.experts.down_proj`` (E, D, F) is ``W_down`` transposed.
    shared_experts : GatedMLP
        ``mlp.shared_experts``.

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig
    >>> part = GroupedExpertsConfig(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=3, num_groups=2,
    ...                            topk_groups=1, routed_scaling_factor=2.5)
    >>> cfg = DecoderConfig(family="deepseek_v3", vocab_size=8, hidden_size=4, num_layers=1, num_heads=1,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=6, grouped_experts=part)
    >>> moe = GroupedExpertsMoE(cfg, rng=0)
    >>> y = moe(np.ones((2, 3, 4)))
    >>> y.shape, moe.backward(np.ones_like(y)).shape, moe.W_gate.shape, moe.shared_experts.W_up.shape
    ((2, 3, 4), (2, 3, 4), (4, 4, 3), (4, 3))
    """

    def __init__(self, config, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        part = config.grouped_experts
        gen = as_generator(rng)
        d, f, e = config.hidden_size, part.expert_intermediate_size, part.num_experts
        self.hidden_size, self.activation = d, config.activation
        self.router = GroupLimitedRouter(d, e, part.num_experts_per_tok, part.num_groups, part.topk_groups,
                                         normalize=part.normalize_weights, scaling=part.routed_scaling_factor,
                                         rng=gen)
        for name, shape in (("W_gate", (e, d, f)), ("W_up", (e, d, f)), ("W_down", (e, f, d))):
            self.register_parameter(name, normal(gen, shape, std=0.02))
        shared = SimpleNamespace(hidden_size=d, intermediate_size=part.num_shared_experts * f,
                                 activation=config.activation, mlp_bias=False)
        self.shared_experts = GatedMLP(shared, rng=gen)

    def extra_repr(self) -> str:
        e, d, f = self.W_gate.shape
        return f"hidden_size={d}, num_experts={e}, expert_intermediate_size={f}, activation={self.activation!r}"

    def forward(self, x: Any) -> np.ndarray:
        """The routed experts' weighted outputs plus the shared experts' for every position of ``x`` (..., D)."""
        x = check_features(x, "x", self.hidden_size, "GroupedExpertsMoE", "hidden_size")
        flat = x.reshape(-1, self.hidden_size)  # (N, D)
        chosen, weights = self.router(flat)  # (N, k) each
        p = self._parameters
        y, saved = _experts.gated_experts_forward(flat, chosen, weights, p["W_gate"], p["W_up"], p["W_down"],
                                                  self.activation)  # (N, D)
        y += self.shared_experts(flat)  # (N, D)
        self.save_for_backward(x.shape, flat, weights, saved)
        return y.reshape(x.shape)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add every parameter's gradient into the grads (the router's into its own); return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("GroupedExpertsMoE.backward called before forward")
        shape, flat, weights, saved = self.saved_tensors
        g = check_grad_output(grad_output, shape, flat.dtype, "GroupedExpertsMoE").reshape(flat.shape)  # (N, D)
        p = self._parameters
        grad_x, grad_weights, grads = _experts.gated_experts_backward(g, flat, weights, p["W_gate"], p["W_up"],
                                                                      p["W_down"], saved, self.activation)
        for name, value in grads.items():
            self.grads[name] += value
        grad_x += self.router.backward(grad_weights)  # (N, D)
        grad_x += self.shared_experts.backward(g)  # (N, D)
        return grad_x.reshape(shape)

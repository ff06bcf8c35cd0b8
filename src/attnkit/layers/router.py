"""``Router``: the part of a mixture of experts that picks each token's experts and weighs them.

Dimension letters: ``...`` any leading dims, N tokens (their product), D ``hidden_size``, E experts, k experts per
token.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import routing as _routing
from ..kernels.linear import linear

__all__ = ["Router"]


class Router(Module):
    """``logits = x W_router (+ b_router)``, then the rule the experts part names (:data:`ROUTERS
    <attnkit.kernels.routing.ROUTERS>`: ``"softmax_topk"``, ``"topk_softmax"`` or ``"sigmoid_group_topk"``; see
    :mod:`attnkit.kernels.routing`) chooses k experts per token and their weights.

    Gradients reach ``W_router``, ``b_router`` and x through the k weights only (the choice is piecewise
    constant); ``e_score_correction_bias`` only chooses (it is in DeepSeek-V3's checkpoints and a trainer may move
    it) and its gradient is zero.

    Parameters
    ----------
    hidden_size : int
        D.
    experts : ExpertsConfig
        Reads ``num_experts``, ``num_experts_per_tok``, ``router``, ``router_bias``, ``norm_topk_prob``,
        ``routed_scaling_factor``, ``n_group`` and ``topk_group``.
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` router weights (the biases start at zero).

    Attributes
    ----------
    W_router : (D, E)
        transformers' ``mlp.gate.weight`` (gpt-oss: ``mlp.router.weight``) transposed.
    b_router : (E,)
        With ``router_bias`` (gpt-oss's ``mlp.router.bias``).
    e_score_correction_bias : (E,)
        With ``"sigmoid_group_topk"`` (``mlp.gate.e_score_correction_bias``).

    Shapes
    ------
    x : (..., D) -> ``(chosen, weights)``: int64 (..., k) by decreasing score, and (..., k) in ``x``'s float dtype.
    :meth:`backward` takes the weights' gradient (..., k) and returns x's (..., D).

    Examples
    --------
    >>> from attnkit.models import ExpertsConfig
    >>> part = ExpertsConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=4, layers=(0,),
    ...                      router="sigmoid_group_topk", n_group=4, topk_group=2)
    >>> router = Router(4, part, rng=0)
    >>> chosen, weights = router(np.ones((3, 4)))
    >>> chosen.shape, np.allclose(weights.sum(-1), 1.0), router.backward(np.ones_like(weights)).shape
    ((3, 2), True, (3, 4))
    """

    def __init__(self, hidden_size: int, experts, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.num_experts, self.top_k = hidden_size, experts.num_experts, experts.num_experts_per_tok
        self.rule, self.normalize, self.scaling = experts.router, experts.norm_topk_prob, experts.routed_scaling_factor
        self.n_group, self.topk_group = experts.n_group, experts.topk_group
        self.register_parameter("W_router", normal(as_generator(rng), (hidden_size, self.num_experts), std=0.02))
        if experts.router_bias:
            self.register_parameter("b_router", np.zeros(self.num_experts))
        if self.rule == "sigmoid_group_topk":
            self.register_parameter("e_score_correction_bias", np.zeros(self.num_experts))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"rule={self.rule!r}, normalize={self.normalize}, scaling={self.scaling}")

    def forward(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(chosen, weights)`` for every position of ``x``; saves what :meth:`backward` needs."""
        x = check_features(x, "x", self.hidden_size, "Router", "hidden_size")
        flat = x.reshape(-1, self.hidden_size)  # (N, D)
        p = self._parameters
        logits = flat @ p["W_router"].astype(flat.dtype, copy=False)  # (N, E)
        if "b_router" in p:
            logits = logits + p["b_router"].astype(flat.dtype, copy=False)  # (N, E)
        chosen, weights, saved = _routing.route(
            logits, self.rule, self.top_k, normalize=self.normalize, scaling=self.scaling,
            bias=p.get("e_score_correction_bias"), n_group=self.n_group, topk_group=self.topk_group)  # (N, k) each
        self.save_for_backward(x.shape, flat, chosen, saved)
        lead = x.shape[:-1]
        return chosen.reshape(*lead, self.top_k), weights.reshape(*lead, self.top_k)

    def step(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(chosen, weights)`` (B, k) each of a decoding step's rows x (B, D): :meth:`forward`'s numbers, the
        logits through :func:`~attnkit.kernels.linear.linear`, nothing saved."""
        p = self._parameters
        logits = linear(x, p["W_router"], p.get("b_router"))  # (B, E)
        chosen, weights, _ = _routing.route(
            logits, self.rule, self.top_k, normalize=self.normalize, scaling=self.scaling,
            bias=p.get("e_score_correction_bias"), n_group=self.n_group, topk_group=self.topk_group)  # (B, k) each
        return chosen, weights

    def backward(self, grad_weights: Any) -> np.ndarray:
        """Add the router's gradients into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("Router.backward called before forward")
        shape, flat, chosen, saved = self.saved_tensors
        g = check_grad_output(grad_weights, (*shape[:-1], self.top_k), flat.dtype, "Router")
        grad_logits = _routing.route_backward(g.reshape(chosen.shape), chosen, saved, self.rule, self.num_experts,
                                              normalize=self.normalize, scaling=self.scaling)  # (N, E)
        p = self._parameters
        self.grads["W_router"] += flat.T @ grad_logits  # (D, E)
        if "b_router" in p:
            self.grads["b_router"] += grad_logits.sum(axis=0)  # (E,)
        return (grad_logits @ p["W_router"].astype(flat.dtype, copy=False).T).reshape(shape)  # (..., D)

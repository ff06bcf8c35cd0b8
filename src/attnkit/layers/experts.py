"""Routed MLPs: ``MixtureOfExperts`` (gpt-oss: a top-k router over clamped-SwiGLU experts) and
``SharedExpertMixture`` (Qwen3-Next: softmax routing over SwiGLU experts beside a gated shared expert).

Dimension letters: ``...`` any leading dims, N tokens (their product), D ``hidden_size``, E ``num_experts``,
k ``num_experts_per_tok``, F ``intermediate_size`` (a routed expert's), Fs the shared expert's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import experts as _experts
from ..kernels.linear import linear, linear_backward
from .gated_mlp import GatedMLP

__all__ = ["MixtureOfExperts", "SharedExpertMixture", "SharedExpertMixtureConfig"]


class MixtureOfExperts(Module):
    """Each token is sent to its k highest-scoring experts and gets their outputs weighted by a softmax.

    ``logits = x W_router + b_router``; the k largest are softmaxed into weights; expert e maps x to
    ``((clip(x W_up[e] + b_up[e], -l, l) + 1) * g * sigmoid(alpha * g)) W_down[e] + b_down[e]`` with
    ``g = min(x W_gate[e] + b_gate[e], l)``. See :mod:`attnkit.kernels.experts` for the gradient.

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size``, ``intermediate_size`` and ``experts`` (an
        :class:`~attnkit.models.config.ExpertsConfig`).
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (expert biases start at zero, router bias too).

    Attributes
    ----------
    W_router : (D, E), b_router : (E,); W_gate, W_up : (E, D, F); b_gate, b_up : (E, F); W_down : (E, F, D);
    b_down : (E, D). ``grads`` with the same names. Weights are stored for ``x @ W``.

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, ExpertsConfig
    >>> cfg = DecoderConfig(family="gpt_oss", vocab_size=8, hidden_size=4, num_layers=1, num_heads=1,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=6, mlp="experts",
    ...                     experts=ExpertsConfig(num_experts=3, per_token=2))
    >>> moe = MixtureOfExperts(cfg, rng=0)
    >>> y = moe(np.ones((2, 3, 4)))
    >>> y.shape, moe.backward(np.ones_like(y)).shape, moe.W_gate.shape
    ((2, 3, 4), (2, 3, 4), (3, 4, 6))
    """

    def __init__(self, config, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = config.hidden_size, config.intermediate_size
        experts = config.experts
        self.num_experts, self.top_k = experts.num_experts, experts.per_token
        self.alpha, self.limit = float(experts.swiglu_alpha), float(experts.swiglu_limit)
        gen = as_generator(rng)
        d, f, e = self.hidden_size, self.intermediate_size, self.num_experts
        self.register_parameter("W_router", normal(gen, (d, e), std=0.02))
        self.register_parameter("b_router", np.zeros(e))
        for name, shape in (("W_gate", (e, d, f)), ("W_up", (e, d, f)), ("W_down", (e, f, d))):
            self.register_parameter(name, normal(gen, shape, std=0.02))
        for name, shape in (("b_gate", (e, f)), ("b_up", (e, f)), ("b_down", (e, d))):
            self.register_parameter(name, np.zeros(shape))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}")

    def route(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """The experts each token goes to and their weights: ``chosen`` int64 (..., k), ``weights`` (..., k)."""
        x = check_features(x, "x", self.hidden_size, "MixtureOfExperts", "hidden_size")
        flat = x.reshape(-1, self.hidden_size)  # (N, D)
        p = self._parameters
        chosen, weights = _experts.route(flat, p["W_router"], p["b_router"], self.top_k)  # (N, k) each
        return chosen.reshape(*x.shape[:-1], self.top_k), weights.reshape(*x.shape[:-1], self.top_k)

    def forward(self, x: Any) -> np.ndarray:
        """The routed experts' weighted output for every position of ``x`` (..., D); saves what backward
        needs."""
        x = check_features(x, "x", self.hidden_size, "MixtureOfExperts", "hidden_size")
        flat = x.reshape(-1, self.hidden_size)  # (N, D)
        p = self._parameters
        chosen, weights = _experts.route(flat, p["W_router"], p["b_router"], self.top_k)  # (N, k)
        y, saved = _experts.experts_forward(flat, chosen, weights, p["W_gate"], p["W_up"], p["W_down"],
                                            p["b_gate"], p["b_up"], p["b_down"], self.alpha, self.limit)  # (N, D)
        self.save_for_backward(x.shape, flat, chosen, weights, saved)
        return y.reshape(x.shape)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the parameter gradients into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("MixtureOfExperts.backward called before forward")
        shape, flat, chosen, weights, saved = self.saved_tensors
        g = check_grad_output(grad_output, shape, flat.dtype, "MixtureOfExperts").reshape(flat.shape)  # (N, D)
        p = self._parameters
        grad_x, grad_weights, grads = _experts.experts_backward(g, flat, weights, p["W_gate"], p["W_up"],
                                                                p["W_down"], saved, self.alpha, self.limit,
                                                                need_weights=self.grads.wanted)
        grad_xr, grads["W_router"], grads["b_router"] = _experts.route_backward(
            grad_weights, flat, chosen, weights, p["W_router"], self.num_experts)  # (N, D)
        for name, value in grads.items():
            self.grads.add(name, value)
        return (grad_x + grad_xr).reshape(shape)


@dataclass(frozen=True)
class SharedExpertMixtureConfig:
    """The routed MLP of Qwen3-Next's sparse layers (``DecoderConfig.shared_experts``), with ``transformers``' names.

    Attributes
    ----------
    num_experts : int
        E.
    num_experts_per_tok : int
        k <= E.
    expert_intermediate_size : int
        F, each routed expert's hidden width (``moe_intermediate_size``).
    shared_intermediate_size : int
        Fs, the shared expert's (``shared_expert_intermediate_size``).
    norm_topk_prob : bool
        Renormalise the k chosen probabilities to sum to one.
    layers : tuple of int
        The layers whose MLP this is (the others keep the dense gated MLP of ``intermediate_size``).
    """

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool = True
    layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "shared_intermediate_size"):
            check_positive_int(getattr(self, name), name)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_experts "
                             f"({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob must be True or False, got {self.norm_topk_prob!r}")
        layers = tuple(self.layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) \
                or len(set(layers)) != len(layers):
            raise ValueError(f"layers must hold distinct non-negative layer indices, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # never overflows, unlike 1 / (1 + exp(-x))


class SharedExpertMixture(Module):
    """Softmax-routed SwiGLU experts plus a shared expert that every token passes, scaled by its own gate.

    ``y = sum_k w_k expert_{e_k}(x) + sigmoid(x W_shared_gate) shared_expert(x)``: the router's softmax over
    all E logits picks the k most probable experts (their probabilities renormalised with ``norm_topk_prob``);
    expert e is ``(silu(x W_gate[e]) * x W_up[e]) W_down[e]``; the shared expert is a :class:`GatedMLP` of
    width Fs. See :mod:`attnkit.kernels.experts` for the gradient (the choice of experts is piecewise constant:
    the router learns through the chosen probabilities).

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size``, ``activation`` and ``shared_experts`` (a :class:`SharedExpertMixtureConfig`).
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights.

    Attributes
    ----------
    W_router : (D, E); W_gate, W_up : (E, D, F); W_down : (E, F, D); W_shared_gate : (D, 1);
    ``shared_expert`` a :class:`GatedMLP` (W_gate, W_up (D, Fs), W_down (Fs, D)). ``grads`` with the same names.

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig
    >>> cfg = DecoderConfig(family="qwen3_next", vocab_size=8, hidden_size=4, num_layers=1, num_heads=1,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=6,
    ...                     shared_experts=SharedExpertMixtureConfig(3, 2, 5, 7, layers=(0,)))
    >>> moe = SharedExpertMixture(cfg, rng=0)
    >>> y = moe(np.ones((2, 3, 4)))
    >>> y.shape, moe.backward(np.ones_like(y)).shape, moe.W_gate.shape, moe.shared_expert.W_gate.shape
    ((2, 3, 4), (2, 3, 4), (3, 4, 5), (4, 7))
    """

    def __init__(self, config, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        shape = config.shared_experts
        self.hidden_size, self.num_experts, self.top_k = config.hidden_size, shape.num_experts, \
            shape.num_experts_per_tok
        self.normalize = shape.norm_topk_prob
        gen = as_generator(rng)
        d, f, e = self.hidden_size, shape.expert_intermediate_size, self.num_experts
        self.register_parameter("W_router", normal(gen, (d, e), std=0.02))
        for name, size in (("W_gate", (e, d, f)), ("W_up", (e, d, f)), ("W_down", (e, f, d))):
            self.register_parameter(name, normal(gen, size, std=0.02))
        self.register_parameter("W_shared_gate", normal(gen, (d, 1), std=0.02))
        self.shared_expert = GatedMLP(replace(config, intermediate_size=shape.shared_intermediate_size,
                                              mlp_bias=False), rng=gen)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}"

    def forward(self, x: Any) -> np.ndarray:
        """The routed experts' weighted output plus the gated shared expert's, for every position of ``x``."""
        x = check_features(x, "x", self.hidden_size, "SharedExpertMixture", "hidden_size")
        flat = x.reshape(-1, self.hidden_size)  # (N, D)
        p = self._parameters
        chosen, weights, probs = _experts.route_softmax(flat, p["W_router"], self.top_k, self.normalize)  # (N, k)
        routed, saved = _experts.gated_experts_forward(flat, chosen, weights, p["W_gate"], p["W_up"],
                                                        p["W_down"])  # (N, D)
        shared = self.shared_expert(flat)  # (N, D)
        gate = _sigmoid(linear(flat, p["W_shared_gate"]))  # (N, 1)
        self.save_for_backward(x.shape, flat, chosen, weights, probs, saved, shared, gate)
        return (routed + gate * shared).reshape(x.shape)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the parameter gradients into ``grads`` (the shared expert's into its own); return ``grad_x``."""
        if self.saved_tensors is None:
            raise RuntimeError("SharedExpertMixture.backward called before forward")
        shape, flat, chosen, weights, probs, saved, shared, gate = self.saved_tensors
        g = check_grad_output(grad_output, shape, flat.dtype, "SharedExpertMixture").reshape(flat.shape)  # (N, D)
        p = self._parameters
        grad_x, grad_weights, grads = _experts.gated_experts_backward(g, flat, weights, p["W_gate"], p["W_up"],
                                                                       p["W_down"], saved)  # (N, D)
        grad_xr, grads["W_router"] = _experts.route_softmax_backward(grad_weights, flat, chosen, weights, probs,
                                                                     p["W_router"], self.normalize)  # (N, D)
        grad_x += grad_xr + self.shared_expert.backward(g * gate)
        grad_pre = np.einsum("nd,nd->n", g, shared)[:, None] * gate * (1 - gate)  # (N, 1)
        grad_xg, grads["W_shared_gate"], _ = linear_backward(grad_pre, flat, p["W_shared_gate"])  # (N, D)
        for name, value in grads.items():
            self.grads[name] += value
        return (grad_x + grad_xg).reshape(shape)

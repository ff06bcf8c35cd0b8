"""``MixtureOfExperts``: gpt-oss's routed MLP, a top-k router over clamped-SwiGLU experts.

Dimension letters: ``...`` any leading dims, N tokens (their product), D ``hidden_size``, E ``num_experts``,
k ``num_experts_per_tok``, F ``intermediate_size``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import experts as _experts

__all__ = ["MixtureOfExperts"]


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
                                                                p["W_down"], saved, self.alpha, self.limit)
        grad_xr, grads["W_router"], grads["b_router"] = _experts.route_backward(
            grad_weights, flat, chosen, weights, p["W_router"], self.num_experts)  # (N, D)
        for name, value in grads.items():
            self.grads[name] += value
        return (grad_x + grad_xr).reshape(shape)

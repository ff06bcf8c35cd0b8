"""``GroupLimitedRouter``: sigmoid expert scores, a bias-corrected choice within the best groups (DeepSeek-V3).

Dimension letters: ``...`` any leading dims, N tokens (their product), D ``hidden_size``, E experts, k experts
per token.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_factor, check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import group_routing as _routing

__all__ = ["GroupLimitedRouter", "check_routing"]


class GroupLimitedRouter(Module):
    """Picks k experts per token and weighs them (see :mod:`attnkit.kernels.group_routing` for the rule).

    ``s = sigmoid(x W_router)``; the k experts are chosen by ``s + e_score_correction_bias`` inside the
    ``topk_groups`` groups whose two best corrected scores sum highest; their weights are the uncorrected
    ``s``, normalised to sum to one when ``normalize``, times ``scaling``. Gradients reach ``W_router`` and x
    through those weights only (the choice is piecewise constant); ``e_score_correction_bias`` is a
    parameter (it is in the checkpoint and a trainer may move it) whose gradient is zero.

    Parameters
    ----------
    hidden_size, num_experts, top_k : int
        D, E and k.
    num_groups, topk_groups : int
        G (dividing E, with at least two experts per group) and the groups a token may use; k must fit in them.
    normalize : bool, default True
    scaling : float, default 1.0
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` router weights (the correction bias starts at zero).

    Attributes
    ----------
    W_router : (D, E)
        ``mlp.gate.weight`` transposed.
    e_score_correction_bias : (E,)
        ``mlp.gate.e_score_correction_bias``.

    Shapes
    ------
    x : (..., D) -> ``(chosen, weights)``: int64 (..., k) by decreasing corrected score, and (..., k) in
    ``x``'s float dtype. :meth:`backward` takes the weights' gradient (..., k) and returns x's (..., D).

    Examples
    --------
    >>> router = GroupLimitedRouter(4, num_experts=8, top_k=2, num_groups=4, topk_groups=2, rng=0)
    >>> chosen, weights = router(np.ones((3, 4)))
    >>> chosen.shape, np.allclose(weights.sum(-1), 1.0), router.backward(np.ones_like(weights)).shape
    ((3, 2), True, (3, 4))
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_groups: int = 1, topk_groups: int = 1,
                 *, normalize: bool = True, scaling: float = 1.0,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        check_routing(hidden_size, num_experts, top_k, num_groups, topk_groups, scaling)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.normalize, self.scaling = bool(normalize), float(scaling)
        self.register_parameter("W_router", normal(as_generator(rng), (hidden_size, num_experts), std=0.02))
        self.register_parameter("e_score_correction_bias", np.zeros(num_experts))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"num_groups={self.num_groups}, topk_groups={self.topk_groups}, normalize={self.normalize}, "
                f"scaling={self.scaling}")

    def forward(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(chosen, weights)`` for every position of ``x``; saves what :meth:`backward` needs."""
        x = check_features(x, "x", self.hidden_size, "GroupLimitedRouter", "hidden_size")
        flat = x.reshape(-1, self.hidden_size)  # (N, D)
        p = self._parameters
        chosen, weights, top = _routing.group_limited_route(
            flat, p["W_router"].astype(flat.dtype, copy=False), p["e_score_correction_bias"], self.top_k,
            self.num_groups, self.topk_groups, self.normalize, self.scaling)  # (N, k) each
        self.save_for_backward(x.shape, flat, chosen, top)
        lead = x.shape[:-1]
        return chosen.reshape(*lead, self.top_k), weights.reshape(*lead, self.top_k)

    def backward(self, grad_weights: Any) -> np.ndarray:
        """Add ``W_router``'s gradient into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("GroupLimitedRouter.backward called before forward")
        shape, flat, chosen, top = self.saved_tensors
        g = check_grad_output(grad_weights, (*shape[:-1], self.top_k), flat.dtype, "GroupLimitedRouter")
        grad_x, grad_w = _routing.group_limited_route_backward(
            g.reshape(chosen.shape), flat, chosen, top, self._parameters["W_router"].astype(flat.dtype, copy=False),
            self.normalize, self.scaling)  # (N, D), (D, E)
        self.grads["W_router"] += grad_w
        return grad_x.reshape(shape)


def check_routing(hidden_size, num_experts, top_k, num_groups, topk_groups, scaling) -> None:
    """Refuse routing that cannot work: groups not dividing the experts into groups of at least two (a group
    scores by its two best), more kept groups than groups, more experts per token than the kept groups hold,
    a scaling outside ``[2**-14, 65504]`` (:func:`attnkit._validation.check_factor`)."""
    for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("top_k", top_k),
                        ("num_groups", num_groups), ("topk_groups", topk_groups)):
        check_positive_int(value, name)
    if num_experts % num_groups or num_experts // num_groups < 2:
        raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts}) into groups of at least "
                         f"two experts (a group scores by its two best)")
    if topk_groups > num_groups:
        raise ValueError(f"topk_groups ({topk_groups}) must be at most num_groups ({num_groups})")
    if top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(f"top_k ({top_k}) must fit in the kept groups: at most topk_groups * num_experts / "
                         f"num_groups = {topk_groups * (num_experts // num_groups)}")
    check_factor(scaling, "scaling")

"""Group-limited sigmoid routing (DeepSeek-V3's router) and its gradient (unchecked kernels).

Dimension letters: N tokens, D features, E experts, G expert groups (E/G experts each), k experts per token.

Every expert gets an independent sigmoid score ``s = sigmoid(x W_router)`` (N, E), not a share of a softmax.
The choice is made on the *corrected* scores ``s + b`` (``b`` the correction bias, (E,), which a trainer moves
to balance the experts' load), in two stages::

    group score  = sum of the two largest corrected scores in the group          (N, G)
    kept groups  = the ``topk_groups`` groups of largest group score             (N, topk_groups)
    chosen       = the k experts of largest corrected score inside the kept groups  (N, k)

and the chosen experts are weighed by their *uncorrected* scores: ``w = s[chosen]``, divided by ``sum(w) +
1e-20`` when normalised, times ``scaling``. The choice is piecewise constant in x and W_router (and ``b`` acts
only through it), so the gradient reaches the router only through the k weights; ``b``'s gradient is zero.
"""
from __future__ import annotations

import numpy as np

__all__ = ["group_limited_route", "group_limited_route_backward"]

_NORM_EPS = 1e-20  # keeps an all-zero weight row finite, as transformers does


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` through tanh, which cannot overflow."""
    half = z.dtype.type(0.5)
    return half + half * np.tanh(half * z)


def group_limited_route(x: np.ndarray, w_router: np.ndarray, bias: np.ndarray, top_k: int, num_groups: int,
                        topk_groups: int, normalize: bool, scaling: float):
    """The k chosen experts per token and their weights.

    Parameters
    ----------
    x : (N, D)
    w_router : (D, E)
    bias : (E,)
        The correction added to the scores for choosing only.
    top_k, num_groups, topk_groups : int
        k, G (dividing E, at least two experts per group) and the groups kept per token.
    normalize : bool
        Divide the chosen scores by their sum (+ 1e-20).
    scaling : float
        Multiplies the weights (``routed_scaling_factor``).

    Returns
    -------
    chosen : int64 (N, k), by decreasing corrected score
    weights : (N, k) in ``x``'s dtype
    scores : (N, k), the chosen experts' uncorrected sigmoid scores (what the backward needs)
    """
    n, e = x.shape[0], w_router.shape[1]
    scores = _sigmoid(x @ w_router)  # (N, E)
    corrected = scores + bias.astype(scores.dtype, copy=False)  # (N, E)
    grouped = corrected.reshape(n, num_groups, e // num_groups)  # (N, G, E/G)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (N, G): its two best experts
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_groups]  # (N, topk_groups)
    in_kept = np.zeros((n, num_groups), dtype=bool)  # (N, G)
    np.put_along_axis(in_kept, kept, True, axis=-1)
    candidates = np.where(np.repeat(in_kept, e // num_groups, axis=-1), corrected, -np.inf)  # (N, E)
    # a stable sort keeps the lower expert first on ties, as torch.topk does on CPU
    chosen = np.argsort(-candidates, axis=-1, kind="stable")[:, :top_k].astype(np.int64)  # (N, k)
    top = np.take_along_axis(scores, chosen, axis=-1)  # (N, k)
    weights = top / (top.sum(axis=-1, keepdims=True) + _NORM_EPS) if normalize else top  # (N, k)
    return chosen, weights * weights.dtype.type(scaling), top


def group_limited_route_backward(grad_weights: np.ndarray, x: np.ndarray, chosen: np.ndarray, top: np.ndarray,
                                 w_router: np.ndarray, normalize: bool, scaling: float):
    """Gradients of :func:`group_limited_route`'s weights into x and ``w_router`` (the choice held fixed).

    Parameters
    ----------
    grad_weights : (N, k)
    x : (N, D)
    chosen, top : (N, k), from the forward (``top`` its uncorrected chosen scores)
    w_router : (D, E)

    Returns
    -------
    grad_x : (N, D)
    grad_w_router : (D, E)
    """
    g = grad_weights * grad_weights.dtype.type(scaling)  # (N, k)
    if normalize:
        total = top.sum(axis=-1, keepdims=True) + _NORM_EPS  # (N, 1)
        # w_j = s_j / total: dw_j/ds_i = [i == j] / total - s_j / total^2
        g = (g - np.sum(g * top, axis=-1, keepdims=True) / total) / total  # (N, k)
    grad_logits = np.zeros((x.shape[0], w_router.shape[1]), dtype=x.dtype)  # (N, E)
    np.put_along_axis(grad_logits, chosen, g * top * (1 - top), axis=-1)  # sigmoid' = s (1 - s)
    return grad_logits @ w_router.T, x.T @ grad_logits  # (N, D), (D, E)

"""The routers of a mixture of experts, chosen by name, and their gradients (unchecked kernels).

Dimension letters: N tokens, E experts, k experts per token, G expert groups (E/G experts each).

A router turns each token's logits ``x W_router (+ b_router)`` (N, E) into the k experts it goes to and the
weights of their outputs. :data:`ROUTERS` names the three rules the open checkpoints use:

``"softmax_topk"`` (Mixtral, Qwen3-MoE, Qwen3-Next)
    ``p = softmax(logits)`` over all E; the k experts of largest p, weighted by their p, divided by the k's sum
    when ``normalize`` (``norm_topk_prob``; the softmax over the k chosen logits alone).
``"topk_softmax"`` (gpt-oss)
    The k largest logits, weighted by the softmax over those k alone: ``"softmax_topk"`` normalised, computed
    as gpt-oss computes it (its rounding differs in the last bits).
``"topk_sigmoid"`` (Llama 4)
    The k largest logits, each weighted by its own sigmoid (no normalisation).
``"sigmoid_group_topk"`` (DeepSeek-V3)
    ``s = sigmoid(logits)``, each expert scored alone. The choice is made on the corrected scores ``s + b``
    (``b`` the ``e_score_correction_bias``, (E,), which a trainer moves to balance the experts' load):

    =============  ================================================================  ==============
    group score    sum of the two largest corrected scores in the group                (N, G)
    kept groups    the ``topk_group`` groups of largest group score                    (N, topk_group)
    chosen         the k experts of largest corrected score in the kept groups         (N, k)
    =============  ================================================================  ==============

    and weighted by the uncorrected ``s``, divided by ``sum + 1e-20`` when ``normalize``.

Every rule then multiplies the weights by ``scaling`` (``routed_scaling_factor``). The choice is piecewise
constant in the logits (and ``b`` acts only through it), so the gradient reaches the logits only through the k
weights, at the chosen experts; ``b``'s gradient is zero. Ties are broken towards the lower expert, as
``torch.topk`` does on CPU.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ROUTERS", "route", "route_backward"]

ROUTERS = ("softmax_topk", "topk_softmax", "topk_sigmoid", "sigmoid_group_topk")

_NORM_EPS = 1e-20  # keeps an all-zero sigmoid weight row finite, as transformers does


def _top(scores: np.ndarray, top_k: int) -> np.ndarray:
    """The k experts of largest score per row, largest first, int64 (N, k)."""
    # a stable sort keeps the lower expert first on ties, as torch.topk does on CPU
    return np.argsort(-scores, axis=-1, kind="stable")[:, :top_k].astype(np.int64)


def _softmax_topk(logits, top_k, normalize, bias, n_group, topk_group):
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))  # (N, E)
    probs /= probs.sum(axis=-1, keepdims=True)
    chosen = _top(logits, top_k)  # (N, k)
    weights = np.take_along_axis(probs, chosen, axis=-1)  # (N, k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen, weights, probs


def _topk_softmax(logits, top_k, normalize, bias, n_group, topk_group):
    chosen = _top(logits, top_k)  # (N, k)
    top = np.take_along_axis(logits, chosen, axis=-1)  # (N, k)
    weights = np.exp(top - top[:, :1])  # (N, k): the first is the largest
    weights /= weights.sum(axis=-1, keepdims=True)
    return chosen, weights, None


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` through tanh, which cannot overflow."""
    half = z.dtype.type(0.5)
    return half + half * np.tanh(half * z)


def _topk_sigmoid(logits, top_k, normalize, bias, n_group, topk_group):
    chosen = _top(logits, top_k)  # (N, k)
    weights = _sigmoid(np.take_along_axis(logits, chosen, axis=-1))  # (N, k)
    return chosen, weights, None


def _topk_sigmoid_backward(g, chosen, weights, saved, num_experts, normalize):
    grad_logits = np.zeros((g.shape[0], num_experts), dtype=g.dtype)  # (N, E)
    np.put_along_axis(grad_logits, chosen, g * weights * (1 - weights), axis=-1)  # sigmoid' = s (1 - s)
    return grad_logits


def _sigmoid_group_topk(logits, top_k, normalize, bias, n_group, topk_group):
    n, e = logits.shape
    scores = _sigmoid(logits)  # (N, E)
    corrected = scores + bias.astype(scores.dtype, copy=False)  # (N, E)
    grouped = corrected.reshape(n, n_group, e // n_group)  # (N, G, E/G)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)  # (N, G): its two best experts
    kept = _top(group_score, topk_group)  # (N, topk_group)
    in_kept = np.zeros((n, n_group), dtype=bool)  # (N, G)
    np.put_along_axis(in_kept, kept, True, axis=-1)
    candidates = np.where(np.repeat(in_kept, e // n_group, axis=-1), corrected, -np.inf)  # (N, E)
    chosen = _top(candidates, top_k)  # (N, k)
    top = np.take_along_axis(scores, chosen, axis=-1)  # (N, k)
    weights = top / (top.sum(axis=-1, keepdims=True) + _NORM_EPS) if normalize else top  # (N, k)
    return chosen, weights, top


def route(logits: np.ndarray, rule: str, top_k: int, *, normalize: bool = True, scaling: float = 1.0,
          bias: np.ndarray | None = None, n_group: int = 1, topk_group: int = 1):
    """The k chosen experts per token and their weights, by the router named ``rule``.

    Parameters
    ----------
    logits : (N, E)
        ``x W_router (+ b_router)``.
    rule : str
        One of :data:`ROUTERS`.
    top_k : int
        k.
    normalize : bool
        ``norm_topk_prob`` (``"topk_softmax"``'s weights are normalised by their making).
    scaling : float
        Multiplies the weights (``routed_scaling_factor``).
    bias : (E,), optional
        ``"sigmoid_group_topk"``'s correction, added to the scores for choosing only.
    n_group, topk_group : int
        ``"sigmoid_group_topk"``'s G (dividing E, at least two experts per group) and the groups kept per token.

    Returns
    -------
    chosen : int64 (N, k), by decreasing (corrected) score
    weights : (N, k) in ``logits``' dtype
    saved : what :func:`route_backward` needs: the weights before ``scaling`` and the softmax (N, E), the
        uncorrected chosen sigmoid scores (N, k) or None
    """
    chosen, weights, extra = _RULES[rule][0](logits, top_k, normalize, bias, n_group, topk_group)
    return chosen, weights * weights.dtype.type(scaling), (weights, extra)


def _softmax_over_chosen_backward(g, weights, chosen, num_experts):
    """The logits' gradient (N, E) of weights that are a softmax over the chosen logits."""
    grad_top = weights * (g - np.sum(g * weights, axis=-1, keepdims=True))  # (N, k)
    grad_logits = np.zeros((g.shape[0], num_experts), dtype=g.dtype)  # (N, E)
    np.put_along_axis(grad_logits, chosen, grad_top, axis=-1)
    return grad_logits


def _softmax_topk_backward(g, chosen, weights, probs, num_experts, normalize):
    if normalize:  # the softmax over the chosen logits: only they receive a gradient
        return _softmax_over_chosen_backward(g, weights, chosen, num_experts)
    grad_probs = np.zeros_like(probs)  # (N, E): the full softmax, every logit moves the chosen probabilities
    np.put_along_axis(grad_probs, chosen, g, axis=-1)
    return probs * (grad_probs - np.sum(grad_probs * probs, axis=-1, keepdims=True))  # (N, E)


def _topk_softmax_backward(g, chosen, weights, saved, num_experts, normalize):
    return _softmax_over_chosen_backward(g, weights, chosen, num_experts)


def _sigmoid_group_topk_backward(g, chosen, weights, top, num_experts, normalize):
    if normalize:
        total = top.sum(axis=-1, keepdims=True) + _NORM_EPS  # (N, 1)
        # w_j = s_j / total: dw_j/ds_i = [i == j] / total - s_j / total^2
        g = (g - np.sum(g * top, axis=-1, keepdims=True) / total) / total  # (N, k)
    grad_logits = np.zeros((g.shape[0], num_experts), dtype=g.dtype)  # (N, E)
    np.put_along_axis(grad_logits, chosen, g * top * (1 - top), axis=-1)  # sigmoid' = s (1 - s)
    return grad_logits


def route_backward(grad_weights: np.ndarray, chosen: np.ndarray, saved, rule: str, num_experts: int, *,
                   normalize: bool = True, scaling: float = 1.0) -> np.ndarray:
    """The logits' gradient (N, E) from the weights' (N, k), the choice held fixed.

    ``chosen`` and ``saved`` are :func:`route`'s; ``rule``, ``normalize`` and ``scaling`` as given to it.
    """
    weights, extra = saved  # (N, k) before scaling, and the rule's own
    g = grad_weights * grad_weights.dtype.type(scaling)  # (N, k)
    return _RULES[rule][1](g, chosen, weights, extra, num_experts, normalize)


_RULES = {"softmax_topk": (_softmax_topk, _softmax_topk_backward),
          "topk_softmax": (_topk_softmax, _topk_softmax_backward),
          "topk_sigmoid": (_topk_sigmoid, _topk_sigmoid_backward),
          "sigmoid_group_topk": (_sigmoid_group_topk, _sigmoid_group_topk_backward)}

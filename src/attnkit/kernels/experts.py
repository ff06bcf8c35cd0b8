"""Routed mixtures of experts and their gradients (unchecked): gpt-oss's clamped SwiGLU experts with a softmax
router, and plain gated experts (:func:`gated_experts_forward`, DeepSeek-V3's) for any router.

Dimension letters: N tokens, D features, E experts, k experts per token, F the experts' hidden size.

Routing: ``logits = x W_router + b_router`` (N, E); each token takes the k experts of largest logit and weighs
them by the softmax over those k logits only. Expert e computes, from ``gate = x W_gate[e] + b_gate[e]`` and
``up = x W_up[e] + b_up[e]``::

    g = min(gate, limit);  u = clip(up, -limit, limit)
    h = (u + 1) * g * sigmoid(alpha * g);  out = h W_down[e] + b_down[e]

and a token's output is the weighted sum of its experts' outputs. The choice of experts is piecewise constant,
so the gradient flows into the router only through the k softmax weights. The experts run one after another
over the tokens routed to them (each a pair of matrix products over its own group of tokens), never over all
N tokens times E experts.

Qwen3-Next routes differently and its experts are plain: :func:`route_softmax` takes the top k of a softmax
over all E logits (renormalised over the k with ``norm_topk_prob``), and its experts are
:func:`gated_experts_forward`'s bias-free SwiGLU MLPs without clamps.
"""
from __future__ import annotations

import numpy as np

from .gated_mlp import gated_mlp_backward, gated_mlp_forward
from .packed import expert_product

__all__ = ["experts_backward", "experts_forward", "gated_experts_backward", "gated_experts_forward", "route",
           "route_backward", "route_softmax", "route_softmax_backward"]


def route(x: np.ndarray, w_router: np.ndarray, b_router: np.ndarray, top_k: int):
    """The k chosen experts per token, largest logit first, and their softmax weights.

    Parameters
    ----------
    x : (N, D)
    w_router : (D, E)
    b_router : (E,)
    top_k : int

    Returns
    -------
    chosen : int64 (N, k)
    weights : (N, k) in ``x``'s dtype, each row summing to 1.
    """
    logits = x @ w_router + b_router  # (N, E)
    # a stable sort keeps the lower expert first on ties, as torch.topk does on CPU
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]  # (N, k)
    top = np.take_along_axis(logits, chosen, axis=-1)  # (N, k)
    weights = np.exp(top - top[:, :1])  # (N, k): the first is the largest
    weights /= weights.sum(axis=-1, keepdims=True)
    return chosen.astype(np.int64), weights


def _groups(chosen: np.ndarray, num_experts: int):
    """For every expert with tokens: (expert, token indices (n,), slot of that expert in each token's k)."""
    n, k = chosen.shape
    flat = chosen.ravel()  # (N*k,)
    order = np.argsort(flat, kind="stable")  # (N*k,): grouped by expert, tokens ascending within each
    ends = np.cumsum(np.bincount(flat, minlength=num_experts))  # (E,)
    start = 0
    for expert, end in enumerate(ends.tolist()):  # one matrix product pair per expert, over its own tokens
        if end > start:
            picked = order[start:end]  # (n_e,)
            yield expert, picked // k, picked % k
        start = end


def experts_forward(x, chosen, weights, w_gate, w_up, w_down, b_gate, b_up, b_down, alpha: float, limit: float):
    """The weighted sum of each token's chosen experts.

    Parameters
    ----------
    x : (N, D)
    chosen, weights : (N, k) from :func:`route`.
    w_gate, w_up : (E, D, F); w_down : (E, F, D); b_gate, b_up : (E, F); b_down : (E, D).
    alpha, limit : float

    Returns
    -------
    y : (N, D)
    saved : list of what :func:`experts_backward` needs, one entry per expert with tokens.
    """
    y = np.zeros_like(x)  # (N, D)
    saved = []
    one, half = x.dtype.type(1), x.dtype.type(0.5)
    for expert, tokens, slot in _groups(chosen, w_gate.shape[0]):
        xe = x[tokens]  # (n, D)
        gate = expert_product(xe, w_gate, expert) + b_gate[expert]  # (n, F)
        up = expert_product(xe, w_up, expert) + b_up[expert]  # (n, F)
        g = np.minimum(gate, limit)  # (n, F)
        u = np.clip(up, -limit, limit)  # (n, F)
        # sigmoid(alpha * g) through tanh, which cannot overflow for a very negative gate
        s = half + half * np.tanh((half * alpha) * g)  # (n, F)
        glu = g * s  # (n, F)
        hidden = (u + one) * glu  # (n, F)
        out = expert_product(hidden, w_down, expert) + b_down[expert]  # (n, D)
        # a token picks an expert at most once, so these rows are distinct
        y[tokens] += out * weights[tokens, slot][:, None]  # (n, D)
        saved.append((expert, tokens, slot, gate, up, s, glu, hidden, out))
    return y, saved


def experts_backward(grad_y, x, weights, w_gate, w_up, w_down, saved, alpha: float, limit: float,
                     need_weights: bool = True):
    """Gradients of :func:`experts_forward` with respect to x, the routing weights and every expert parameter.

    With ``need_weights=False`` only x's and the routing weights' are formed (the expert matrices may then be
    packed, :func:`~attnkit.kernels.packed.expert_product`).

    Returns
    -------
    grad_x : (N, D)
    grad_weights : (N, k)
    grads : dict with ``W_gate``, ``W_up``, ``W_down``, ``b_gate``, ``b_up``, ``b_down`` (experts without
    tokens get zeros); empty with ``need_weights=False``.
    """
    grad_x = np.zeros_like(x)  # (N, D)
    grad_weights = np.zeros_like(weights)  # (N, k)
    grads = {} if not need_weights else {
        "W_gate": np.zeros(w_gate.shape, w_gate.dtype), "W_up": np.zeros(w_up.shape, w_up.dtype),
        "W_down": np.zeros(w_down.shape, w_down.dtype),
        "b_gate": np.zeros(w_gate.shape[::2], x.dtype), "b_up": np.zeros(w_up.shape[::2], x.dtype),
        "b_down": np.zeros((w_down.shape[0], w_down.shape[2]), x.dtype)}
    one = x.dtype.type(1)
    for expert, tokens, slot, gate, up, s, glu, hidden, out in saved:
        ge = grad_y[tokens]  # (n, D)
        grad_weights[tokens, slot] = np.einsum("nd,nd->n", ge, out)  # (n,)
        grad_out = ge * weights[tokens, slot][:, None]  # (n, D)
        grad_hidden = expert_product(grad_out, w_down, expert, transpose=True)  # (n, F)
        g = np.minimum(gate, limit)  # (n, F)
        u = np.clip(up, -limit, limit)  # (n, F)
        # torch's clamp passes the gradient where the input lies within the bounds, ends included
        grad_up = np.where((up >= -limit) & (up <= limit), grad_hidden * glu, 0)  # (n, F)
        grad_g = grad_hidden * (u + one) * (s + alpha * g * s * (one - s))  # (n, F)
        grad_gate = np.where(gate <= limit, grad_g, 0)  # (n, F)
        if need_weights:
            xe = x[tokens]  # (n, D)
            grads["W_down"][expert] = hidden.T @ grad_out  # (F, D)
            grads["b_down"][expert] = grad_out.sum(axis=0)  # (D,)
            grads["W_gate"][expert] = xe.T @ grad_gate  # (D, F)
            grads["W_up"][expert] = xe.T @ grad_up  # (D, F)
            grads["b_gate"][expert] = grad_gate.sum(axis=0)  # (F,)
            grads["b_up"][expert] = grad_up.sum(axis=0)  # (F,)
        grad_x[tokens] += (expert_product(grad_gate, w_gate, expert, transpose=True)
                           + expert_product(grad_up, w_up, expert, transpose=True))  # (n, D)
    return grad_x, grad_weights, grads


def route_backward(grad_weights, x, chosen, weights, w_router, num_experts: int):
    """Gradients through the softmax over the chosen logits into x and the router.

    Returns
    -------
    grad_x : (N, D)
    grad_w_router : (D, E)
    grad_b_router : (E,)
    """
    grad_top = weights * (grad_weights - np.sum(grad_weights * weights, axis=-1, keepdims=True))  # (N, k)
    grad_logits = np.zeros((x.shape[0], num_experts), dtype=x.dtype)  # (N, E)
    np.put_along_axis(grad_logits, chosen, grad_top, axis=-1)
    return grad_logits @ w_router.T, x.T @ grad_logits, grad_logits.sum(axis=0)  # (N, D), (D, E), (E,)


# ----------------------------------------------------------------------------------------------------------
# Softmax routing over every expert (Qwen3-Next / Qwen3-MoE)
# ----------------------------------------------------------------------------------------------------------
def route_softmax(x: np.ndarray, w_router: np.ndarray, top_k: int, normalize: bool):
    """The k experts of largest probability under a softmax over all E router logits, and their weights.

    With ``normalize`` (``norm_topk_prob``) the k probabilities are divided by their sum, which is the softmax
    over the k chosen logits alone (what :func:`route` computes); without it they are the full softmax's.

    Returns
    -------
    chosen : int64 (N, k); weights : (N, k); probs : (N, E), what :func:`route_softmax_backward` needs.
    """
    logits = x @ w_router  # (N, E)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))  # (N, E)
    probs /= probs.sum(axis=-1, keepdims=True)
    # a stable sort keeps the lower expert first on ties, as torch.topk does on CPU
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]  # (N, k)
    weights = np.take_along_axis(probs, chosen, axis=-1)  # (N, k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen.astype(np.int64), weights, probs


def route_softmax_backward(grad_weights, x, chosen, weights, probs, w_router, normalize: bool):
    """Gradients of :func:`route_softmax` into x (N, D) and the router (D, E)."""
    if normalize:  # the softmax over the chosen logits: only they receive a gradient
        grad_top = weights * (grad_weights - np.sum(grad_weights * weights, axis=-1, keepdims=True))  # (N, k)
        grad_logits = np.zeros_like(probs)  # (N, E)
        np.put_along_axis(grad_logits, chosen, grad_top, axis=-1)
    else:  # the full softmax: every logit moves the chosen probabilities
        grad_probs = np.zeros_like(probs)  # (N, E)
        np.put_along_axis(grad_probs, chosen, grad_weights, axis=-1)
        grad_logits = probs * (grad_probs - np.sum(grad_probs * probs, axis=-1, keepdims=True))  # (N, E)
    return grad_logits @ w_router.T, x.T @ grad_logits  # (N, D), (D, E)


def gated_experts_forward(x, chosen, weights, w_gate, w_up, w_down, activation: str = "silu"):
    """The weighted sum of each token's chosen experts, each a gated MLP without biases.

    Expert e maps its tokens to ``(act(x W_gate[e]) * (x W_up[e])) W_down[e]`` (SwiGLU for silu).

    Parameters
    ----------
    x : (N, D)
    chosen, weights : (N, k), from a router.
    w_gate, w_up : (E, D, F); w_down : (E, F, D).
    activation : str

    Returns
    -------
    y : (N, D)
    saved : list of what :func:`gated_experts_backward` needs, one entry per expert with tokens.
    """
    y = np.zeros_like(x)  # (N, D)
    saved = []
    for expert, tokens, slot in _groups(chosen, w_gate.shape[0]):
        xe = x[tokens]  # (n, D)
        out, parts = gated_mlp_forward(xe, w_gate[expert], w_up[expert], w_down[expert],
                                       activation=activation)  # (n, D)
        y[tokens] += out * weights[tokens, slot][:, None]  # (n, D): a token picks an expert at most once
        saved.append((expert, tokens, slot, out, parts))
    return y, saved


def gated_experts_backward(grad_y, x, weights, w_gate, w_up, w_down, saved, activation: str = "silu"):
    """Gradients of :func:`gated_experts_forward` with respect to x, the routing weights and the experts.

    Returns
    -------
    grad_x : (N, D)
    grad_weights : (N, k)
    grads : dict with ``W_gate``, ``W_up``, ``W_down`` (experts without tokens get zeros).
    """
    grad_x = np.zeros_like(x)  # (N, D)
    grad_weights = np.zeros_like(weights)  # (N, k)
    grads = {"W_gate": np.zeros_like(w_gate), "W_up": np.zeros_like(w_up), "W_down": np.zeros_like(w_down)}
    for expert, tokens, slot, out, parts in saved:
        ge = grad_y[tokens]  # (n, D)
        grad_weights[tokens, slot] = np.einsum("nd,nd->n", ge, out)  # (n,)
        grad_out = ge * weights[tokens, slot][:, None]  # (n, D)
        grad_xe, expert_grads = gated_mlp_backward(grad_out, x[tokens], w_gate[expert], w_up[expert],
                                                   w_down[expert], parts, activation)  # (n, D)
        for name, value in expert_grads.items():
            grads[name][expert] = value
        grad_x[tokens] += grad_xe
    return grad_x, grad_weights, grads

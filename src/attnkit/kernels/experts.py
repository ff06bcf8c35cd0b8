"""The routed experts of a mixture of experts, stacked, and their gradients (unchecked kernels).

Dimension letters: N tokens, D features, E experts, k experts per token, F an expert's hidden width.

Every expert is a gated MLP; ``params`` holds them stacked: ``W_gate``, ``W_up`` (E, D, F), ``W_down`` (E, F, D)
and, when the experts have biases, ``b_gate``, ``b_up`` (E, F) and ``b_down`` (E, D). From ``gate = x W_gate[e]
(+ b_gate[e])`` and ``up = x W_up[e] (+ b_up[e])`` an expert computes ``hidden`` and ``out = hidden W_down[e]
(+ b_down[e])``, with one of two gatings (every product through :func:`~attnkit.kernels.linear.product`, so a
stack of packed expert weights, :class:`~attnkit.kernels.packed.PackedWeight`, works unchanged):

- ``limit`` None: ``hidden = act(gate) * up`` (SwiGLU for silu; :mod:`attnkit.kernels.gated_mlp`);
- ``limit`` a number (gpt-oss's clamped SwiGLU)::

      g = min(gate, limit);  u = clip(up, -limit, limit)
      hidden = (u + 1) * g * sigmoid(alpha * g)

A token's output is the weighted sum of its k chosen experts' outputs (:mod:`attnkit.kernels.routing` chooses
and weighs); with ``weigh_inputs`` each weight scales its expert's input instead, ``expert(w x)`` (Llama 4).
The experts run one after another over the tokens routed to them (each a few matrix products over its own group
of tokens), never over all N tokens times E experts.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .activations import activation_forward
from .decode_step import silu_product_into
from .gated_mlp import gated_mlp_backward, gated_mlp_forward
from .linear import linear, product

__all__ = ["experts_backward", "experts_forward", "experts_step"]

_BIASES = ("b_gate", "b_up", "b_down")


def _groups(chosen: np.ndarray):
    """For every expert with tokens, in increasing order: (expert, token indices (n,), slot of that expert in each
    token's k). Only the experts chosen are visited (a decoding step's k of E)."""
    k = chosen.shape[1]
    flat = chosen.ravel()  # (N*k,)
    order = np.argsort(flat, kind="stable")  # (N*k,): grouped by expert, tokens ascending within each
    ordered = flat[order]  # (N*k,)
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))  # (distinct experts,)
    ends = np.append(starts[1:], flat.size)  # (distinct experts,)
    for expert, start, end in zip(ordered[starts].tolist(), starts.tolist(), ends.tolist()):
        picked = order[start:end]  # (n_e,): one matrix product pair per expert, over its own tokens
        yield expert, picked // k, picked % k


def _expert(params: Mapping[str, np.ndarray], expert: int) -> tuple[np.ndarray, ...]:
    """One expert's W_gate, W_up, W_down and its biases (None without them)."""
    biases = [params[name][expert] if name in params else None for name in _BIASES]
    return (params["W_gate"][expert], params["W_up"][expert], params["W_down"][expert], *biases)


def _gated_forward(xe, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, limit, alpha):
    return gated_mlp_forward(xe, w_gate, w_up, w_down, b_gate, b_up, b_down, activation)  # (n, D)


def _gated_backward(grad_out, xe, w_gate, w_up, w_down, parts, has_bias, activation, limit, alpha, need_weights):
    grad_xe, grads = gated_mlp_backward(grad_out, xe, w_gate, w_up, w_down, parts, activation, has_bias,
                                        need_weights)  # (n, D)
    return grad_xe, {name: value for name, value in grads.items() if value is not None}


def _plus(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    return y if b is None else y + b


def _clamped_forward(xe, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, limit, alpha):
    one, half = xe.dtype.type(1), xe.dtype.type(0.5)
    gate = _plus(product(xe, w_gate), b_gate)  # (n, F)
    up = _plus(product(xe, w_up), b_up)  # (n, F)
    g = np.minimum(gate, limit)  # (n, F)
    u = np.clip(up, -limit, limit)  # (n, F)
    # sigmoid(alpha * g) through tanh, which cannot overflow for a very negative gate
    s = half + half * np.tanh((half * alpha) * g)  # (n, F)
    glu = g * s  # (n, F)
    hidden = (u + one) * glu  # (n, F)
    return _plus(product(hidden, w_down), b_down), (gate, up, s, glu, hidden)  # (n, D)


def _clamped_backward(grad_out, xe, w_gate, w_up, w_down, parts, has_bias, activation, limit, alpha, need_weights):
    gate, up, s, glu, hidden = parts
    one = xe.dtype.type(1)
    grad_hidden = product(grad_out, w_down.T)  # (n, F)
    g = np.minimum(gate, limit)  # (n, F)
    u = np.clip(up, -limit, limit)  # (n, F)
    # torch's clamp passes the gradient where the input lies within the bounds, ends included
    grad_up = np.where((up >= -limit) & (up <= limit), grad_hidden * glu, 0)  # (n, F)
    grad_g = grad_hidden * (u + one) * (s + alpha * g * s * (one - s))  # (n, F)
    grad_gate = np.where(gate <= limit, grad_g, 0)  # (n, F)
    grads = {}
    if need_weights:
        grads.update(W_down=hidden.T @ grad_out, W_gate=xe.T @ grad_gate, W_up=xe.T @ grad_up)  # (F, D), (D, F)
        if has_bias:
            grads.update(b_gate=grad_gate.sum(axis=0), b_up=grad_up.sum(axis=0), b_down=grad_out.sum(axis=0))
    return product(grad_gate, w_gate.T) + product(grad_up, w_up.T), grads  # (n, D)


def experts_forward(x: np.ndarray, chosen: np.ndarray, weights: np.ndarray, params: Mapping[str, np.ndarray],
                    activation: str = "silu", limit: float | None = None, alpha: float = 1.702, *,
                    weigh_inputs: bool = False):
    """The weighted sum of each token's chosen experts.

    Parameters
    ----------
    x : (N, D)
    chosen, weights : (N, k), from a router (a token picks an expert at most once).
    params : mapping
        ``W_gate``, ``W_up``, ``W_down`` and optionally ``b_gate``, ``b_up``, ``b_down`` (see above).
    activation : str
        The gate's activation without ``limit``.
    limit, alpha : float
        gpt-oss's clamped SwiGLU when ``limit`` is given.
    weigh_inputs : bool
        Each weight scales its expert's input rather than its output.

    Returns
    -------
    y : (N, D)
    saved : list of what :func:`experts_backward` needs, one entry per expert with tokens.
    """
    forward = _gated_forward if limit is None else _clamped_forward
    y = np.zeros_like(x)  # (N, D)
    saved = []
    for expert, tokens, slot in _groups(chosen):
        w = weights[tokens, slot][:, None]  # (n, 1)
        xe = x[tokens] * w if weigh_inputs else x[tokens]  # (n, D)
        out, parts = forward(xe, *_expert(params, expert), activation, limit, alpha)  # (n, D)
        y[tokens] += out if weigh_inputs else out * w  # (n, D): the rows are distinct
        saved.append((expert, tokens, slot, out, parts, xe))
    return y, saved


def _gated_step(xe, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, limit, alpha):
    """:func:`_gated_forward`'s numbers with nothing kept: ``act(gate) * up``, SiLU in place in one buffer
    (``(gate * sigmoid(gate)) * up``, the order its SiLU blocks multiply in)."""
    gate = linear(xe, w_gate, b_gate)  # (n, F), the step's own array
    up = linear(xe, w_up, b_up)  # (n, F)
    if activation == "silu" and gate.dtype == up.dtype:
        hidden = silu_product_into(gate, up, np.empty_like(gate))  # (n, F)
    else:
        hidden = activation_forward(gate, activation) * up  # (n, F)
    return linear(hidden, w_down, b_down)  # (n, D)


def _clamped_step(xe, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, limit, alpha):
    return _clamped_forward(xe, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, limit, alpha)[0]  # (n, D)


def experts_step(x: np.ndarray, chosen: np.ndarray, weights: np.ndarray, params: Mapping[str, np.ndarray],
                 activation: str = "silu", limit: float | None = None, alpha: float = 1.702, *,
                 weigh_inputs: bool = False) -> np.ndarray:
    """:func:`experts_forward` of a decoding step's rows: only the chosen experts run, in the forward's order
    (increasing expert, each over its rows), so the sums are the forward's; nothing is kept for a backward.

    Shapes
    ------
    x (B, D); chosen, weights (B, k) -> y (B, D).
    """
    step = _gated_step if limit is None else _clamped_step
    y = np.zeros_like(x)  # (B, D)
    for expert, rows, slot in _groups(chosen):
        w = weights[rows, slot][:, None]  # (n, 1)
        xe = x[rows] * w if weigh_inputs else x[rows]  # (n, D)
        out = step(xe, *_expert(params, expert), activation, limit, alpha)  # (n, D)
        y[rows] += out if weigh_inputs else out * w  # (n, D): the rows are distinct
    return y


def experts_backward(grad_y: np.ndarray, x: np.ndarray, weights: np.ndarray, params: Mapping[str, np.ndarray],
                     saved: list, activation: str = "silu", limit: float | None = None, alpha: float = 1.702,
                     need_weights: bool = True, weigh_inputs: bool = False):
    """Gradients of :func:`experts_forward` with respect to x, the routing weights and every expert parameter.

    Returns
    -------
    grad_x : (N, D)
    grad_weights : (N, k)
    grads : dict with a gradient for each of ``params`` (experts without tokens get zeros); empty with
        ``need_weights=False`` (an inputs-only backward, or packed weights, which have no gradient).
    """
    backward = _gated_backward if limit is None else _clamped_backward
    has_bias = "b_gate" in params
    grad_x = np.zeros_like(x)  # (N, D)
    grad_weights = np.zeros_like(weights)  # (N, k)
    grads = {name: np.zeros(value.shape, value.dtype) for name, value in params.items()} if need_weights else {}
    for expert, tokens, slot, out, parts, xe in saved:
        ge = grad_y[tokens]  # (n, D)
        w = weights[tokens, slot][:, None]  # (n, 1)
        if not weigh_inputs:
            grad_weights[tokens, slot] = np.einsum("nd,nd->n", ge, out)  # (n,)
            ge = ge * w  # (n, D)
        w_gate, w_up, w_down = _expert(params, expert)[:3]
        grad_xe, expert_grads = backward(ge, xe, w_gate, w_up, w_down, parts, has_bias, activation,
                                         limit, alpha, need_weights)  # (n, D)
        for name, value in expert_grads.items():
            grads[name][expert] = value
        if weigh_inputs:  # xe = w x
            grad_weights[tokens, slot] = np.einsum("nd,nd->n", grad_xe, x[tokens])  # (n,)
            grad_xe = grad_xe * w  # (n, D)
        grad_x[tokens] += grad_xe
    return grad_x, grad_weights, grads

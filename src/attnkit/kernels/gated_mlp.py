"""Gated MLP ``(act(x W_gate + b_gate) * (x W_up + b_up)) W_down + b_down`` and its gradient (unchecked).

With ``act = silu`` this is SwiGLU, the MLP of Llama, Mistral and Qwen2 (``gelu``: GeGLU). Biases may be None.
"""
from __future__ import annotations

import numpy as np

from ._threads import default_num_threads, run_tasks
from .activations import _sigmoid, activation_backward, activation_forward
from .linear import linear, linear_backward

__all__ = ["gated_mlp_backward", "gated_mlp_forward"]

# SiLU and the gating run in blocks of rows of about this many elements (256 KiB of float32), spread over the
# thread pool: the five elementwise passes then stay in cache, as the float32 GELU's chunks do.
_SILU_CHUNK = 65536


def _silu_gate(gate_pre: np.ndarray, up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``gate = silu(gate_pre)`` and ``hidden = gate * up`` (each (..., F)), bit for bit the one-shot expressions
    (``activation_forward`` then a product), in blocks of rows on attnkit's threads when long."""
    f = gate_pre.shape[-1]
    pre, up2 = gate_pre.reshape(-1, f), up.reshape(-1, f)  # (N, F): views of the fused product's halves
    gate = np.empty(pre.shape, np.result_type(gate_pre.dtype, up.dtype))  # (N, F)
    hidden = np.empty(pre.shape, gate.dtype)  # (N, F)
    rows = max(1, _SILU_CHUNK // max(f, 1))
    starts = list(range(0, pre.shape[0], rows))

    def block(start: int, _worker: int) -> None:
        part = slice(start, start + rows)
        x = pre[part]
        np.multiply(x, _sigmoid(x), out=gate[part])
        np.multiply(gate[part], up2[part], out=hidden[part])

    if len(starts) > 1:
        run_tasks(starts, block, default_num_threads())
    else:
        block(0, 0)
    return gate.reshape(gate_pre.shape), hidden.reshape(gate_pre.shape)


def gated_mlp_forward(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, activation: str = "silu",
                      w_gate_up=None, b_gate_up=None):
    """Returns ``y (..., D)`` and ``(gate_pre, gate, up, hidden)`` (each (..., F)), what backward needs.

    ``w_gate_up`` (D, 2F) = ``[w_gate w_up]`` (and ``b_gate_up`` (2F,) with biases), when the caller keeps them
    side by side, computes both branches in one product: one read of the weights in a decoding step.
    """
    if w_gate_up is not None:
        both = linear(x, w_gate_up, b_gate_up)  # (..., 2F)
        gate_pre, up = both[..., :w_gate.shape[-1]], both[..., w_gate.shape[-1]:]  # (..., F) each
    else:
        gate_pre = linear(x, w_gate, b_gate)  # (..., F)
        up = linear(x, w_up, b_up)  # (..., F)
    if activation == "silu" and gate_pre.dtype == up.dtype:
        gate, hidden = _silu_gate(gate_pre, up)  # (..., F) each
    else:
        gate = activation_forward(gate_pre, activation)  # (..., F)
        hidden = gate * up  # (..., F)
    return linear(hidden, w_down, b_down), (gate_pre, gate, up, hidden)  # (..., D)


def gated_mlp_backward(grad_y, x, w_gate, w_up, w_down, saved, activation: str = "silu", need_bias: bool = False,
                       need_weights: bool = True):
    """Returns ``grad_x (..., D)`` and the gradients ``{'W_gate', 'W_up', 'W_down'}`` (+ ``b_*`` if need_bias;
    each None with ``need_weights=False``)."""
    gate_pre, gate, up, hidden = saved
    grad_hidden, grad_w_down, grad_b_down = linear_backward(grad_y, hidden, w_down, need_bias,
                                                            need_weights)  # (..., F)
    grad_gate_pre = activation_backward(grad_hidden * up, gate_pre, gate, activation)  # (..., F)
    grad_x_gate, grad_w_gate, grad_b_gate = linear_backward(grad_gate_pre, x, w_gate, need_bias,
                                                            need_weights)  # (..., D)
    grad_x_up, grad_w_up, grad_b_up = linear_backward(grad_hidden * gate, x, w_up, need_bias,
                                                      need_weights)  # (..., D)
    grads = {"W_gate": grad_w_gate, "W_up": grad_w_up, "W_down": grad_w_down}
    if need_bias:
        grads.update(b_gate=grad_b_gate, b_up=grad_b_up, b_down=grad_b_down)
    return grad_x_gate + grad_x_up, grads

"""Root-mean-square normalisation over the last axis and its gradient (unchecked kernels).

``y = gamma * x / sqrt(mean(x^2) + eps)``: LayerNorm without centring or shift (Llama, Mistral, Qwen2).
Half-precision inputs are normalised in float32 (their squares overflow or lose too many digits otherwise)
and the normalised value is cast back before the gain is applied, as Hugging Face's ``LlamaRMSNorm`` does.
"""
from __future__ import annotations

import numpy as np

from .activations import _sigmoid, activation_backward, activation_forward

__all__ = ["gated_rms_norm_backward", "gated_rms_norm_forward", "rms_norm_backward", "rms_norm_forward"]


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    if dtype == np.float32 or dtype == np.float64:  # the common cases, without result_type's cost per call
        return dtype
    return np.result_type(dtype, np.float32)


def rms_norm_forward(x: np.ndarray, gamma: np.ndarray, eps: float):
    """``gamma * x / sqrt(mean(x^2) + eps)``.

    Returns
    -------
    y : (..., D) in ``x``'s dtype
    x_hat : (..., D) normalised input and rstd : (..., 1), both in the compute dtype (float32 at least):
    what backward needs.
    """
    xc = x.astype(_compute_dtype(x.dtype), copy=False)
    # sum / D is what np.mean computes, without its Python-level overhead (a decoding step calls this 60 times)
    rstd = 1.0 / np.sqrt((xc * xc).sum(axis=-1, keepdims=True) / xc.shape[-1] + eps)  # (..., 1)
    x_hat = xc * rstd  # (..., D)
    y = gamma.astype(x.dtype, copy=False) * x_hat.astype(x.dtype, copy=False)  # (..., D)
    return y, x_hat, rstd


def rms_norm_backward(grad_y: np.ndarray, x_hat: np.ndarray, rstd: np.ndarray, gamma: np.ndarray):
    """Gradients of :func:`rms_norm_forward` from the ``x_hat`` and ``rstd`` its forward returned.

    Returns
    -------
    grad_x : (..., D) in ``grad_y``'s dtype, grad_gamma : (D,)
    """
    d = x_hat.shape[-1]
    g = grad_y.astype(x_hat.dtype, copy=False)
    grad_gamma = np.einsum("nd,nd->d", g.reshape(-1, d), x_hat.reshape(-1, d))  # (D,)
    g_hat = g * gamma.astype(x_hat.dtype, copy=False)  # (..., D)
    grad_x = rstd * (g_hat - x_hat * np.mean(g_hat * x_hat, axis=-1, keepdims=True))  # (..., D)
    return grad_x.astype(grad_y.dtype, copy=False), grad_gamma


GATES = ("silu", "sigmoid")


def gated_rms_norm_forward(x: np.ndarray, gate: np.ndarray, gamma: np.ndarray, eps: float, activation: str = "silu"):
    """``gamma * x / sqrt(mean(x^2) + eps) * act(gate)``: normalise first, then gate. ``activation`` "silu" is
    Gated DeltaNet's output norm (Hugging Face's ``Qwen3NextRMSNormGated``), "sigmoid" Kimi Delta Attention's
    (``KimiLinearRMSNormGated``).

    Returns
    -------
    y : (..., D) in ``x``'s dtype, and ``saved`` for :func:`gated_rms_norm_backward`.
    """
    if activation not in GATES:
        raise ValueError(f"activation must be one of {GATES}, got {activation!r}")
    normed, x_hat, rstd = rms_norm_forward(x, gamma, eps)  # (..., D)
    act = activation_forward(gate, "silu") if activation == "silu" else _sigmoid(gate)  # (..., D)
    return normed * act.astype(normed.dtype, copy=False), (normed, x_hat, rstd, gate, act, activation)


def gated_rms_norm_backward(grad_y: np.ndarray, saved, gamma: np.ndarray):
    """Gradients of :func:`gated_rms_norm_forward`: ``grad_x``, ``grad_gate`` (..., D) and ``grad_gamma`` (D,)."""
    normed, x_hat, rstd, gate, act, activation = saved
    if activation == "silu":
        grad_gate = activation_backward(grad_y * normed, gate, act, "silu")  # (..., D)
    else:
        grad_gate = grad_y * normed * act * (1.0 - act)  # (..., D): sigmoid' = s (1 - s)
    grad_x, grad_gamma = rms_norm_backward(grad_y * act, x_hat, rstd, gamma)  # (..., D), (D,)
    return grad_x, grad_gate, grad_gamma

"""The short causal depthwise convolution of Gated DeltaNet, Mamba and LFM2, and its gradient (unchecked).

Dimension letters: B batch, L length, C channels, K kernel size (4 in Qwen3-Next / Qwen3.5, 3 in LFM2).
Channel c at position t is ``act(sum_j w[c, j] x[t - K + 1 + j, c] + bias[c])``: each channel sees its own
last K inputs, itself included, and nothing from the future. ``act`` is SiLU (Gated DeltaNet, Mamba) or none
(LFM2's gated short convolution, ``activation=None``); the bias is optional. ``state`` (B, K - 1, C) holds the
K - 1 inputs before position 0 (zeros at the start of a sequence); the forward returns the K - 1 inputs a next
call needs, which is the whole of what decoding keeps for the convolution. The weight is ``(C, K)``: a
``torch.nn.Conv1d(C, C, K, groups=C)``'s ``weight[:, 0, :]``.
"""
from __future__ import annotations

import numpy as np

from .activations import activation_backward, activation_forward

__all__ = ["causal_conv_backward", "causal_conv_forward", "causal_conv_step"]


def causal_conv_forward(x: np.ndarray, weight: np.ndarray, state: np.ndarray | None = None, *,
                        bias: np.ndarray | None = None, activation: str | None = "silu"):
    """``act(causal_conv(x) + bias)`` over the length axis.

    Shapes
    ------
    x (B, L, C); weight (C, K); state (B, K - 1, C) or None (zeros); bias (C,) or None; ``activation``
    ``"silu"`` or None (the identity).

    Returns
    -------
    y : (B, L, C) in ``x``'s dtype
    new_state : (B, K - 1, C), the last K - 1 inputs (of ``state`` and ``x`` together), a fresh array
    saved : ``(padded, pre, y, activation)``, what :func:`causal_conv_backward` needs
    """
    taps = weight.shape[-1]
    if state is None:
        state = np.zeros(x.shape[:-2] + (taps - 1, x.shape[-1]), x.dtype)
    padded = np.concatenate([state.astype(x.dtype, copy=False), x], axis=-2)  # (B, K - 1 + L, C)
    length, w = x.shape[-2], weight.astype(x.dtype, copy=False)
    pre = padded[..., :length, :] * w[:, 0]  # (B, L, C)
    for j in range(1, taps):  # K taps (3 or 4), each a whole-array product
        pre += padded[..., j:j + length, :] * w[:, j]
    if bias is not None:
        pre += bias.astype(x.dtype, copy=False)
    y = pre if activation is None else activation_forward(pre, activation)  # (B, L, C)
    return y, padded[..., length:, :].copy(), (padded, pre, y, activation)  # (B, K - 1, C)


def causal_conv_step(x: np.ndarray, weight: np.ndarray, state: np.ndarray, *, bias: np.ndarray | None = None,
                     activation: str | None = "silu"):
    """:func:`causal_conv_forward` of one new position per row (a decoding step): the same taps in the same order,
    so the same numbers, without a length axis and keeping nothing for a backward.

    Shapes
    ------
    x (B, C); weight (C, K); state (B, K - 1, C); bias (C,) or None.

    Returns
    -------
    y : (B, C) in ``x``'s dtype
    new_state : (B, K - 1, C), the last K - 1 inputs, a fresh array
    """
    window = np.concatenate([state.astype(x.dtype, copy=False), x[:, None]], axis=1)  # (B, K, C)
    w = weight.astype(x.dtype, copy=False)
    pre = window[:, 0] * w[:, 0]  # (B, C)
    for j in range(1, weight.shape[-1]):
        pre += window[:, j] * w[:, j]
    if bias is not None:
        pre += bias.astype(x.dtype, copy=False)
    y = pre if activation is None else activation_forward(pre, activation)  # (B, C)
    return y, window[:, 1:].copy()  # (B, K - 1, C)


def causal_conv_backward(grad_y: np.ndarray, weight: np.ndarray, saved):
    """Gradients of :func:`causal_conv_forward`.

    Returns
    -------
    grad_x : (B, L, C); grad_weight : (C, K); grad_state : (B, K - 1, C); grad_bias : (C,) (whether or not the
    forward had a bias: it is the pre-activation gradient summed, which costs one pass)
    """
    padded, pre, y, activation = saved
    taps, length = weight.shape[-1], pre.shape[-2]
    d_pre = grad_y.astype(pre.dtype, copy=False)  # (B, L, C)
    if activation is not None:
        d_pre = activation_backward(d_pre, pre, y, activation)
    flat = d_pre.reshape(-1, length, d_pre.shape[-1])  # (N, L, C)
    grad_padded = np.zeros_like(padded)  # (B, K - 1 + L, C)
    grad_weight = np.empty(weight.shape, pre.dtype)  # (C, K)
    w = weight.astype(pre.dtype, copy=False)
    for j in range(taps):
        window = padded[..., j:j + length, :].reshape(flat.shape)  # (N, L, C)
        grad_weight[:, j] = np.einsum("nlc,nlc->c", flat, window)
        grad_padded[..., j:j + length, :] += d_pre * w[:, j]
    grad_bias = flat.sum(axis=(0, 1))  # (C,)
    return grad_padded[..., taps - 1:, :], grad_weight, grad_padded[..., :taps - 1, :], grad_bias

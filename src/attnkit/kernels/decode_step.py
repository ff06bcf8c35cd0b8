"""In-place kernels of one decoding step: a norm, a gated activation and one query per row against a KV cache.

Dimension letters: B rows, D features, F MLP width, Hkv key/value heads, G query heads per key/value head,
S cached slots, Dh head features.

A decoding step at batch 1 is a chain of matrix-vector products whose cost is reading the weights; everything
between them works on a few thousand numbers, where each NumPy call's fixed cost (allocating the result,
dispatch) is most of the time. These kernels write into buffers the caller keeps from step to step and do each
piece in as few calls as the arithmetic allows, in the same order of operations as the general kernels
(:func:`attnkit.kernels.rms_norm.rms_norm_forward`, SiLU as :func:`attnkit.kernels.activations.activation_forward`
computes it, the softmax normalised before its product with the values as the reference attention kernel
does). Nothing is saved for a backward: a cached step is
inference.
"""
from __future__ import annotations

import numpy as np

__all__ = ["rms_norm_into", "silu_gate_into", "one_query_attention"]


def rms_norm_into(x: np.ndarray, gain: np.ndarray, eps: float, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``gain * x / sqrt(mean(x^2) + eps)`` over the last axis, written into ``out``.

    Shapes
    ------
    x, out, scratch : (B, D) float32 or float64 (``scratch`` is overwritten); gain : (D,) -> ``out``.
    """
    np.multiply(x, x, out=scratch)  # (B, D)
    rstd = scratch.sum(axis=-1, keepdims=True)  # (B, 1)
    rstd /= x.shape[-1]
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    np.multiply(x, rstd, out=out)  # (B, D)
    out *= gain
    return out


def silu_gate_into(gate_up: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` of the side-by-side ``[gate up]`` projections, written into ``out``.

    Shapes
    ------
    gate_up : (B, 2F), ``width`` = F; out : (B, F) -> ``out``.
    """
    gate, up = gate_up[:, :width], gate_up[:, width:]  # (B, F) each
    np.negative(gate, out=out)
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf below about -88: the sigmoid's limit 0
        np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)  # sigmoid(gate)
    out *= gate
    out *= up
    return out


def one_query_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """Softmax attention of one query per row and head over every cached key: two batched products.

    The G query heads of a key/value head are the rows of one product with that head's keys, so the cache is
    read once per key/value head, and no mask is needed: the one query sits after every key it may see.

    Shapes
    ------
    q : (B, Hkv, G, Dh); k, v : (B, Hkv, S, Dh) (views of the cache are fine); out : (B, Hkv, G, Dh) -> ``out``.
    """
    scores = q @ k.swapaxes(-1, -2)  # (B, Hkv, G, S)
    scores *= scale
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)  # (B, Hkv, G, S)
    return np.matmul(scores, v, out=out)  # (B, Hkv, G, Dh)

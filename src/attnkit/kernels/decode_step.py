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

from .activations import activation_forward
from .linear import product

__all__ = ["rms_norm_into", "head_norms_into", "silu_gate_into", "silu_product_into", "gated_mlp_step",
           "one_query_attention", "one_query_forward", "one_query_backward", "OneQueryContext"]


def rms_norm_into(x: np.ndarray, gain: np.ndarray, eps: float, out: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """``gain * x / sqrt(mean(x^2) + eps)`` over the last axis, written into ``out`` (which may be ``x``):
    :func:`~attnkit.kernels.rms_norm.rms_norm_forward`'s numbers bit for bit. Half-precision rows are
    normalised in float32 as there (their squares overflow float16 from 256 on), the gain applied in their dtype.

    Shapes
    ------
    x, out, scratch : (..., D) (``scratch`` is overwritten; unused for float16); gain : (D,) or broadcasting
    to x -> ``out``.
    """
    if x.dtype == np.float16:
        x = x.astype(np.float32)  # (..., D): a copy, so out may be the caller's x
        scratch = np.empty_like(x)
    np.multiply(x, x, out=scratch)  # (..., D)
    rstd = np.add.reduce(scratch, axis=-1, keepdims=True)  # (..., 1): sum's reduction without its Python wrapper
    rstd /= x.shape[-1]
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    np.multiply(x, rstd, out=out)  # (..., D): x_hat, rounded to out's dtype
    out *= gain
    return out


def head_norms_into(qk: np.ndarray, num_q: int, q_gain: np.ndarray, k_gain: np.ndarray, eps: float) -> np.ndarray:
    """The per-head RMS norms of query and key heads side by side, written over them in one pass: the first
    ``num_q`` heads with ``q_gain``, the rest with ``k_gain`` (each head normalised alone, as two calls of
    :func:`rms_norm_into` would).

    Shapes
    ------
    qk : (B, Hq + Hkv, L, Dh) writable (the step's own projection); q_gain, k_gain : (Dh,) -> ``qk``.
    """
    gains = np.empty((qk.shape[1], 1, qk.shape[-1]), qk.dtype)  # (Hq + Hkv, 1, Dh)
    gains[:num_q], gains[num_q:] = q_gain, k_gain
    return rms_norm_into(qk, gains, eps, qk, np.empty(qk.shape, qk.dtype))


def silu_gate_into(gate_up: np.ndarray, width: int, out: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` of the side-by-side ``[gate up]`` projections, written into ``out``.

    Shapes
    ------
    gate_up : (B, 2F), ``width`` = F; out : (B, F) -> ``out``.
    """
    return silu_product_into(gate_up[:, :width], gate_up[:, width:], out)  # (B, F)


def silu_product_into(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``(gate * sigmoid(gate)) * up``, written into ``out`` (an array of its own: both inputs are read after it
    is first written).

    Shapes
    ------
    gate, up, out : (B, F) -> ``out``.
    """
    np.negative(gate, out=out)
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf below about -88: the sigmoid's limit 0
        np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)  # sigmoid(gate)
    out *= gate
    out *= up
    return out


def gated_mlp_step(x: np.ndarray, w_gate_up: np.ndarray, b_gate_up: np.ndarray | None, w_down: np.ndarray,
                   b_down: np.ndarray | None, activation: str) -> np.ndarray:
    """``(act(x W_gate + b_gate) * (x W_up + b_up)) W_down + b_down`` of one position per row, gate and up from
    one product of their side-by-side weights (one read of them), SiLU in place.

    Shapes
    ------
    x : (B, D); w_gate_up : (D, 2F) = ``[W_gate W_up]``, b_gate_up : (2F,) or None; w_down : (F, D) (an array
    or packed), b_down : (D,) or None -> (B, D).
    """
    both = x @ w_gate_up  # (B, 2F)
    if b_gate_up is not None:
        both += b_gate_up
    width = w_down.shape[0]
    if activation == "silu":
        hidden = silu_gate_into(both, width, np.empty((x.shape[0], width), both.dtype))  # (B, F)
    else:
        hidden = activation_forward(both[:, :width], activation) * both[:, width:]  # (B, F)
    y = product(hidden, w_down)  # (B, D)
    if b_down is not None:
        y += b_down
    return y


def one_query_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, out: np.ndarray | None = None, *,
                        key_mask: np.ndarray | None = None, score_mod=None, sinks: np.ndarray | None = None
                        ) -> np.ndarray:
    """Softmax attention of one query per row and head over every cached key: two batched products.

    The G query heads of a key/value head are the rows of one product with that head's keys, so the cache is
    read once per key/value head, and no causal mask is needed: the one query sits after every key it may see.
    The variants of the decoder layers are the flex kernel's, in its order: ``score_mod`` on the scaled scores
    (called as flex calls it on a tile of one query row: ``q_idx`` 0, ``kv_idx`` the key's index), then the
    key mask, then the softmax with a sink logit per query head in its denominator. A row with no key to
    attend to (and no sink) gets zeros, as in the other kernels.

    Shapes
    ------
    q : (B, Hkv, G, Dh); k, v : (B, Hkv, S, Dh) (views of the cache are fine); key_mask : (B, S) bool,
    ``True`` = may attend, or None; sinks : (Hkv * G,) or None; out : (B, Hkv, G, Dh) or None -> ``out``.
    """
    b, hkv, group, _ = q.shape
    slots = k.shape[2]
    scores = q @ k.swapaxes(-1, -2)  # (B, Hkv, G, S)
    scores *= scale
    if score_mod is not None:
        heads = np.arange(hkv * group).reshape(1, -1, 1, 1)  # (1, Hq, 1, 1)
        modified = score_mod(scores.reshape(b, hkv * group, 1, slots), np.arange(b).reshape(-1, 1, 1, 1), heads,
                             np.zeros((1, 1, 1, 1), np.int64), np.arange(slots).reshape(1, 1, 1, -1))  # (B, Hq, 1, S)
        scores = np.asarray(modified, dtype=scores.dtype).reshape(b, hkv, group, slots)  # (B, Hkv, G, S)
    if key_mask is not None:
        scores = np.where(key_mask[:, None, None, :], scores, -np.inf)  # (B, Hkv, G, S)
    peak = np.maximum.reduce(scores, axis=-1, keepdims=True, initial=-np.inf)  # (B, Hkv, G, 1)
    sink = None if sinks is None else sinks.astype(scores.dtype).reshape(1, hkv, group, 1)  # (1, Hkv, G, 1)
    if sink is not None:
        peak = np.maximum(peak, sink)
    if key_mask is not None or sink is not None:
        peak = np.where(np.isfinite(peak), peak, 0)  # a fully masked row: exp(-inf) = 0 everywhere
    scores -= peak
    np.exp(scores, out=scores)
    total = np.add.reduce(scores, axis=-1, keepdims=True)  # (B, Hkv, G, 1)
    if sink is not None:
        total += np.exp(sink - peak)
    if key_mask is not None:
        total[total == 0] = 1  # nothing to attend to: zero weights, zero output
    scores /= total  # (B, Hkv, G, S)
    return np.matmul(scores, v, out=out)  # (B, Hkv, G, Dh)


class OneQueryContext:
    """What :func:`one_query_forward` keeps for a backward: nothing (a decoding step is inference)."""


def one_query_forward(q, k, v, *, mask=None, causal: bool = False, scale=None, bias=None, dropout_p: float = 0.0,
                      dropout_seed=None, window: int | None = None, score_mod=None, sinks=None, out=None):
    """:func:`one_query_attention` with :mod:`attnkit.kernels.registry`'s signature (its ``"one_query"`` entry).

    Every query row is a decoding step's query, placed after every key: ``causal`` is taken for one query row
    (it hides nothing there) and refused for more (the rows would hide keys from each other), ``window`` keeps
    the last ``window`` keys, ``mask`` (``True`` = may attend) must broadcast to (..., Lq, Lk) with one
    row for all queries, ``bias`` is added to the scaled scores. Dropout is refused (an inference kernel).

    Shapes
    ------
    q (B, H, Lq, Dh) (the G query heads of a key/value head as its Lq rows), k, v (B, H, Lk, Dh), mask
    (B, 1, 1, Lk) or (B, H, 1, Lk) bool -> ``(out (B, H, Lq, Dh), None, OneQueryContext())``.
    """
    if dropout_p:
        raise ValueError(f"the one_query kernel is for inference: dropout_p must be 0, got {dropout_p!r}")
    if causal and q.shape[2] != 1:
        raise ValueError(f"the one_query kernel places every query row after every key: causal=True needs one "
                         f"query row, got {q.shape[2]} (q: {q.shape})")
    key_mask = None
    if mask is not None:
        rows = np.broadcast_to(np.asarray(mask, dtype=bool), q.shape[:2] + (1, k.shape[2]))  # (B, H, 1, Lk)
        if not (rows == rows[:, :1]).all():
            raise ValueError("the one_query kernel takes one key mask per row, shared by the heads")
        key_mask = rows[:, 0, 0]  # (B, Lk)
    if window is not None and k.shape[2] > window:
        k, v = k[:, :, -window:], v[:, :, -window:]  # (B, H, W, Dh)
        key_mask = None if key_mask is None else key_mask[:, -window:]  # (B, W)
    if bias is not None:  # (B, H, Lq, Lk) as the scores the modifier sees, (B, H * Lq, 1, Lk)
        b, h, rows, keys = q.shape[:3] + (k.shape[2],)
        bias = np.broadcast_to(np.asarray(bias)[..., -keys:], (b, h, rows, keys)).reshape(b, h * rows, 1, keys)
        score_mod = _added(bias, score_mod)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return one_query_attention(q, k, v, scale, out, key_mask=key_mask, score_mod=score_mod, sinks=sinks), None, \
        OneQueryContext()


def _added(bias: np.ndarray, then):
    """A score modifier adding ``bias`` (the scores' shape) to the scores, then applying ``then`` if given."""
    def modified(score, b, h, q_idx, kv_idx):
        score = score + bias
        return score if then is None else then(score, b, h, q_idx, kv_idx)
    return modified


def one_query_backward(grad_out, ctx):
    """Refused: :func:`one_query_forward` keeps nothing (run a forward without a cache to train)."""
    raise ValueError("the one_query kernel is for decoding steps (inference) and has no backward; use the "
                     "'reference' or 'tiled' kernel for a forward that a backward follows")

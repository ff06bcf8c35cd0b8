"""``AdditiveAttention``: Bahdanau's attention head, ``score(q_i, k_j) = v . tanh(q_i W_q + k_j W_k)``.

Dimension letters: ``...`` leading dims ((B,) or (B, H) under ``MultiHeadAttention``), Lq/Lk query/key
length, Dq/Dk query/key features, Dv value features, A the attention (hidden) size ``d_attn``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import (
    as_bool_mask,
    as_float_array,
    check_mask,
    check_positive_int,
    check_qkv,
    returns_input_precision,
)
from ..core.base_attention import BaseAttention
from ..init import as_generator, uniform_fan_in, xavier_uniform
from ..kernels import reference as _ref

__all__ = ["AdditiveAttention"]


class AdditiveAttention(BaseAttention):
    """Additive (Bahdanau) attention with learnable ``W_q``, ``W_k`` and ``v``.

    ``weights = softmax_j(v . tanh(q_i W_q + k_j W_k))`` (no scaling), ``output = weights @ values``.
    Queries and keys may have different sizes. Memory is ``O(Lq * Lk * A)`` per leading index: every
    query-key pair gets its own tanh features, which forward saves for backward.

    Parameters
    ----------
    d_q : int
        Query features Dq (``Dh`` under ``MultiHeadAttention``).
    d_k : int
        Key features Dk (``Dh`` under ``MultiHeadAttention``).
    d_attn : int
        Hidden size A of the tanh layer.
    rng : numpy.random.Generator or int, optional
        Source of the initial weights: Glorot-uniform ``W_q``, ``W_k``; ``v`` uniform in
        ``[-1/sqrt(A), 1/sqrt(A)]``.

    Attributes
    ----------
    W_q : (Dq, A), W_k : (Dk, A), v : (A,)
        Parameters; their gradients are in ``grads['W_q']``, ``grads['W_k']``, ``grads['v']``.

    Shapes
    ------
    q : (..., Lq, Dq), k : (..., Lk, Dk), v : (..., Lk, Dv), leading dims broadcasting.
    mask : bool, broadcastable to (..., Lq, Lk), ``True`` = may attend; ``is_causal=True`` ANDs the
        bottom-right-aligned causal mask (query i sees keys ``j <= i + Lk - Lq``).
    output : (..., Lq, Dv), weights : (..., Lq, Lk), in the inputs' float dtype (parameters are cast to
        it; gradients accumulate in the parameters' dtype). Fully masked queries get zero weights/output.

    Examples
    --------
    >>> head = AdditiveAttention(d_q=3, d_k=5, d_attn=4, rng=0)
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = rng.normal(size=(2, 2, 3)), rng.normal(size=(2, 6, 5)), rng.normal(size=(2, 6, 7))
    >>> out, w = head(q, k, v)
    >>> out.shape, w.shape, np.allclose(w.sum(-1), 1)
    ((2, 2, 7), (2, 2, 6), True)
    >>> grad_q, grad_k, grad_v = head.backward(np.ones_like(out))
    >>> {name: g.shape for name, g in head.grads.items()}
    {'W_q': (3, 4), 'W_k': (5, 4), 'v': (4,)}
    """

    def __init__(self, d_q: int, d_k: int, d_attn: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.d_q = check_positive_int(d_q, "d_q")
        self.d_k = check_positive_int(d_k, "d_k")
        self.d_attn = check_positive_int(d_attn, "d_attn")
        gen = as_generator(rng)
        self.register_parameter("W_q", xavier_uniform(gen, self.d_q, self.d_attn))
        self.register_parameter("W_k", xavier_uniform(gen, self.d_k, self.d_attn))
        self.register_parameter("v", uniform_fan_in(gen, self.d_attn, self.d_attn))
        self.save_for_backward()

    def extra_repr(self) -> str:
        return f"d_q={self.d_q}, d_k={self.d_k}, d_attn={self.d_attn}"

    @returns_input_precision
    def forward(self, q: Any, k: Any, v: Any, mask: Any = None, *, is_causal: bool = False,
                need_weights: bool = True):
        """Attend; returns ``(output (..., Lq, Dv), weights (..., Lq, Lk) or None)``."""
        q, k, v, lead = check_qkv(q, k, v, "AdditiveAttention")
        if q.shape[-1] != self.d_q:
            raise ValueError(f"AdditiveAttention: q has {q.shape[-1]} features, expected d_q = {self.d_q} "
                             f"(q: {q.shape})")
        if k.shape[-1] != self.d_k:
            raise ValueError(f"AdditiveAttention: k has {k.shape[-1]} features, expected d_k = {self.d_k} "
                             f"(k: {k.shape})")
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        mask = check_mask(as_bool_mask(mask, "mask"), "mask", lead + (seq_q, seq_k), "(..., seq_q, seq_k) scores")
        mask = self.combine_masks(mask, is_causal, seq_q, seq_k)
        w_q, w_k, w_v = (self._parameters[n].astype(q.dtype, copy=False) for n in ("W_q", "W_k", "v"))
        out, weights, hidden = _ref.additive_forward(q, k, v, w_q, w_k, w_v, mask)  # (..., Lq, Dv), (..., Lq, Lk)
        self.save_for_backward(q, k, v, w_q, w_k, w_v, weights, hidden, out.shape)
        return out, (weights.copy() if need_weights else None)  # backward reads the cached weights

    @returns_input_precision
    def backward(self, grad_output: Any):
        """Return ``(grad_q, grad_k, grad_v)`` and add the gradients of ``W_q``, ``W_k``, ``v``."""
        if self.saved_tensors is None:
            raise RuntimeError("AdditiveAttention.backward called before forward")
        q, k, v, w_q, w_k, w_v, weights, hidden, expected = self.saved_tensors
        g = as_float_array(grad_output, "grad_output")
        if g.shape != expected:
            raise ValueError(f"grad_output has shape {g.shape}, expected the output shape {expected}")
        dq, dk, dv, dw_q, dw_k, dw_v = _ref.additive_backward(g.astype(q.dtype, copy=False), q, k, v, w_q, w_k,
                                                              w_v, weights, hidden)
        self.grads["W_q"] += dw_q
        self.grads["W_k"] += dw_k
        self.grads["v"] += dw_v
        return dq, dk, dv

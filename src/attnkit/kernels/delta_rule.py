"""The gated delta rule (Gated DeltaNet's and Kimi Delta Attention's linear attention) and its gradient
(unchecked kernels).

Dimension letters: ``...`` leading batch/head dims (B, H), L sequence length, Dk query/key features, Dv value
features, C chunk size, N number of chunks, Dg the gate's width (1 or Dk). Every head keeps a state ``S``
(Dk, Dv); at step t, with the decay ``a_t = exp(g_t)`` (``g_t <= 0``, the log-decay) and the write strength
``beta_t`` in (0, 1):

    S_t = diag(a_t) S_{t-1} + beta_t k_t (v_t - (diag(a_t) S_{t-1})^T k_t)^T        o_t = S_t^T (scale q_t)

the old state decays, then what it predicts for ``k_t`` is moved a fraction ``beta_t`` of the way to
``v_t`` (the delta rule). The log-decay ``g`` is either one number per step and head, ``(..., L)`` (Gated
DeltaNet: every key channel decays alike), or one per key channel, ``(..., L, Dk)`` (Kimi Delta Attention,
KDA: ``diag(a_t)`` a real diagonal); the gradient ``dg`` has ``g``'s shape. Hugging Face's
``torch_recurrent_gated_delta_rule`` (Qwen3-Next) and ``recurrent_kimi_delta_attention`` (Kimi Linear) compute
exactly this (with ``scale = Dk ** -0.5``; their optional L2 normalisation of q and k is
:func:`l2_normalize_forward` here, run by the caller first).

Two forms compute the same thing:

* :func:`recurrent_forward` loops over the L steps: the decoding form, the state in and out.
* :func:`chunked_forward` (prefill and training) writes the C steps of a chunk as one triangular system
  (the WY/UT representation): with ``G`` the cumulative log-decay inside the chunk (..., C, Dg),
  ``Gamma_ijd = exp(G_id - G_jd)`` (i >= j, else 0) and the decayed products
  ``(A . B)_ij = sum_d A_id B_jd Gamma_ijd`` (with a scalar gate simply ``A B^T * Gamma``),
  ``T = (I + strict_lower(diag(beta) (K . K)))^{-1}``, ``U = T diag(beta) V`` and
  ``W = T diag(beta) (exp(G) * K)``, the chunk's corrected values are ``V' = U - W S``, its outputs
  ``(exp(G) * Q) S + (Q . K) V'`` and the state it leaves ``exp(G_C) * S + (exp(G_C - G) * K)^T V'``.
  Only the N chunk steps remain a loop. A channel-wise gate keeps Gamma as (..., N, C, C, Dk): C Dk
  numbers per pair of positions where a scalar gate needs one.

:func:`chunked_backward` is the exact gradient of the chunked form, from the states entering each chunk that
the forward kept; :func:`recurrent_backward` that of the recurrent form, from every step's state.
Arrays are computed in the inputs' float dtype (float16 in float32); float32 in gives float32 out.

From a zero state the output is linear in the values: ``out = A V`` with the (L, L) lower-triangular
``A = (Q . K) T diag(beta)`` of the chunked form taken as one chunk of the whole sequence.
:func:`token_weights` returns A, what a Gated DeltaNet layer has in place of an attention matrix: row t
says how much of each earlier value reaches output t. Unlike softmax weights, its entries may be negative
and its rows need not sum to one (the delta rule subtracts what the state already predicts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ChunkedContext", "RecurrentContext", "chunked_backward", "chunked_forward", "l2_normalize_backward",
           "l2_normalize_forward", "recurrent_backward", "recurrent_forward", "recurrent_step", "token_weights"]

CHUNK_SIZE = 64


def _compute_dtype(*arrays: np.ndarray) -> np.dtype:
    return np.result_type(*arrays, np.float32)


def _gate(g: np.ndarray, k: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The log-decay as (..., L, Dg): a scalar gate (..., L) gains a unit axis, a channel-wise one (..., L, Dk)
    is kept."""
    g = np.asarray(g)
    if g.shape == k.shape:
        return g.astype(dtype, copy=False)  # (..., L, Dk)
    if g.shape == k.shape[:-1]:
        return g.astype(dtype, copy=False)[..., None]  # (..., L, 1)
    raise ValueError(f"g must have shape {k.shape[:-1]} (one log-decay per step) or {k.shape} (one per key "
                     f"channel), got {g.shape}")


def _to_gate_width(x: np.ndarray, width: int) -> np.ndarray:
    """Sum a per-channel gradient (..., Dk) down to the gate's width Dg (keeping the axis)."""
    return x if x.shape[-1] == width else x.sum(axis=-1, keepdims=True)  # (..., Dg)


def _decayed_products(a: np.ndarray, b: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    """``P_ij = sum_d a_id b_jd gamma_ijd`` (..., C, C) from a, b (..., C, D) and gamma (..., C, C, Dg)."""
    if gamma.shape[-1] == 1:
        return (a @ b.swapaxes(-1, -2)) * gamma[..., 0]  # (..., C, C)
    return np.einsum("...id,...jd,...ijd->...ij", a, b, gamma, optimize=True)  # (..., C, C)


def _decayed_products_backward(grad: np.ndarray, a: np.ndarray, b: np.ndarray, gamma: np.ndarray,
                               products: np.ndarray):
    """Gradients of :func:`_decayed_products` (whose result was ``products``) w.r.t. a, b (..., C, D), and its
    flow ``F_ijd = grad_ij a_id b_jd gamma_ijd`` (..., C, C, Dg; summed over d for a scalar gate, where it is
    ``grad * products``): the cumulative log-decay G that ``gamma_ijd = exp(G_id - G_jd)`` is made of has the
    gradient ``sum_j F_ijd - sum_j F_jid``. The caller adds the flows of every product before those sums: the
    terms cancel heavily, and one subtraction of summed flows rounds least."""
    if gamma.shape[-1] == 1:
        weighted = grad * gamma[..., 0]  # (..., C, C)
        da, db = weighted @ b, weighted.swapaxes(-1, -2) @ a  # (..., C, D)
        return da, db, (grad * products)[..., None]  # (..., C, C, 1)
    weighted = grad[..., None] * gamma  # (..., C, C, Dk)
    da = np.einsum("...ijd,...jd->...id", weighted, b)  # (..., C, Dk)
    db = np.einsum("...ijd,...id->...jd", weighted, a)  # (..., C, Dk)
    return da, db, weighted * a[..., :, None, :] * b[..., None, :, :]  # (..., C, C, Dk)


def _relative_decays(cum: np.ndarray) -> np.ndarray:
    """``exp(G_i - G_j)`` for i >= j, else 0: (..., C, C, Dg) from the cumulative log-decay G (..., C, Dg)."""
    c = cum.shape[-2]
    lower = np.tril(np.ones((c, c), bool))[:, :, None]  # (C, C, 1), i >= j
    # G_i - G_j <= 0 on and below the diagonal; above it (never used) it could overflow, so it is -inf there
    return np.exp(np.where(lower, cum[..., :, None, :] - cum[..., None, :, :], -np.inf))  # (..., C, C, Dg)


def l2_normalize_forward(x: np.ndarray, eps: float = 1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (FLA's and Hugging Face's ``l2norm``).

    Returns ``y (..., D)`` and ``rstd (..., 1)``, what :func:`l2_normalize_backward` needs.
    """
    rstd = 1.0 / np.sqrt(np.einsum("...d,...d->...", x, x)[..., None] + eps)  # (..., 1)
    return x * rstd, rstd  # (..., D)


def l2_normalize_backward(grad_y: np.ndarray, y: np.ndarray, rstd: np.ndarray) -> np.ndarray:
    """Gradient of :func:`l2_normalize_forward`: ``rstd (dy - y (y . dy))`` (the radial part removed)."""
    return rstd * (grad_y - y * np.einsum("...d,...d->...", y, grad_y)[..., None])  # (..., D)


# ----------------------------------------------------------------------------------------------------------
# The recurrent form
# ----------------------------------------------------------------------------------------------------------
@dataclass
class RecurrentContext:
    """What :func:`recurrent_backward` reads: the scaled queries, the inputs and every step's state.

    ``states`` (..., L + 1, Dk, Dv) holds the state before step 0 and after each step: L Dk Dv numbers per
    head, which is why training uses the chunked form (one state per chunk).
    """

    q: np.ndarray  # (..., L, Dk), scaled
    k: np.ndarray  # (..., L, Dk)
    v: np.ndarray  # (..., L, Dv)
    decay: np.ndarray  # (..., L, Dg) exp(g)
    beta: np.ndarray  # (..., L)
    states: np.ndarray  # (..., L + 1, Dk, Dv)
    scale: float
    gate_shape: tuple  # g's shape, which dg takes


def recurrent_forward(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                      keep_states: bool = False):
    """The gated delta rule one step at a time.

    Shapes
    ------
    q, k (..., L, Dk); v (..., L, Dv); g (..., L) or (..., L, Dk); beta (..., L); initial_state (..., Dk, Dv)
    or None (zeros). ``scale`` multiplies q, default ``Dk ** -0.5``.

    Returns
    -------
    out : (..., L, Dv)
    state : (..., Dk, Dv), the state after the last step
    ctx : :class:`RecurrentContext` with ``keep_states=True`` (for :func:`recurrent_backward`), else None
    """
    dtype = _compute_dtype(q, k, v, g, beta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q.astype(dtype) * dtype.type(scale)  # (..., L, Dk), a fresh array: the caller's q is never aliased
    k, v, beta = k.astype(dtype, copy=False), v.astype(dtype, copy=False), beta.astype(dtype, copy=False)
    decay = np.exp(_gate(g, k, dtype))  # (..., L, Dg)
    lead, length = k.shape[:-2], k.shape[-2]
    state = (np.zeros(lead + (k.shape[-1], v.shape[-1]), dtype) if initial_state is None
             else initial_state.astype(dtype))  # (..., Dk, Dv), a copy the loop may overwrite
    out = np.empty(lead + (length, v.shape[-1]), dtype)  # (..., L, Dv)
    states = np.empty(lead + (length + 1,) + state.shape[-2:], dtype) if keep_states else None  # (..., L+1, Dk, Dv)
    for t in range(length):  # a decoding step each: the recurrence is sequential
        if keep_states:
            states[..., t, :, :] = state
        out[..., t, :], state = _advance(state, q[..., t, :], k[..., t, :], v[..., t, :], decay[..., t, :],
                                         beta[..., t])  # (..., Dv), (..., Dk, Dv)
    if keep_states:
        states[..., length, :, :] = state
    ctx = RecurrentContext(q, k, v, decay, beta, states, scale, np.shape(g)) if keep_states else None
    return out, state, ctx


def _advance(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray):
    """One step of the recurrence from ``state`` (..., Dk, Dv), which is read, never written: the output
    ``S_t^T q`` (..., Dv) and the new state S_t (..., Dk, Dv), a fresh array. q (scaled), k (..., Dk); v (..., Dv);
    decay ``exp(g)`` (..., Dg); beta (...)."""
    state = state * decay[..., :, None]  # (..., Dk, Dv), each key row by its own decay
    predicted = np.einsum("...kv,...k->...v", state, k)  # (..., Dv)
    delta = beta[..., None] * (v - predicted)  # (..., Dv)
    state += k[..., :, None] * delta[..., None, :]
    return np.einsum("...kv,...k->...v", state, q), state  # (..., Dv), (..., Dk, Dv)


def recurrent_step(q, k, v, g, beta, state, *, scale: float | None = None):
    """One decoding step of the gated delta rule: :func:`recurrent_forward` of one position, the same operations
    in the same order, without the length axis and keeping nothing for a backward.

    Shapes
    ------
    q, k (..., Dk); v (..., Dv); g (...) or (..., Dk); beta (...); state (..., Dk, Dv), read and never written.
    ``scale`` multiplies q, default ``Dk ** -0.5``.

    Returns
    -------
    out : (..., Dv)
    state : (..., Dk, Dv), the state after the step, a fresh array
    """
    dtype = _compute_dtype(q, k, v, g, beta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q.astype(dtype, copy=False) * dtype.type(scale)  # (..., Dk), a fresh array
    k, v, beta = k.astype(dtype, copy=False), v.astype(dtype, copy=False), beta.astype(dtype, copy=False)
    decay = np.exp(_gate(g, k, dtype))  # (..., Dg)
    return _advance(state.astype(dtype, copy=False), q, k, v, decay, beta)  # (..., Dv), (..., Dk, Dv)


def recurrent_backward(grad_out, ctx: RecurrentContext, grad_state=None):
    """Gradients of :func:`recurrent_forward` (run with ``keep_states=True``), the steps read backwards.

    ``grad_state`` (..., Dk, Dv) is the gradient of the final state (None: zero).

    Returns
    -------
    dq, dk (..., L, Dk); dv (..., L, Dv); dg (g's shape); dbeta (..., L); d_initial_state (..., Dk, Dv)
    """
    q, k, v, decay, beta, states = ctx.q, ctx.k, ctx.v, ctx.decay, ctx.beta, ctx.states
    dtype, width = states.dtype, decay.shape[-1]
    grad_out = grad_out.astype(dtype, copy=False)
    ds = np.zeros(states.shape[:-3] + states.shape[-2:], dtype) if grad_state is None \
        else grad_state.astype(dtype)  # (..., Dk, Dv), a fresh array the loop accumulates into
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    dg, dbeta = np.empty_like(decay), np.empty_like(beta)
    for t in reversed(range(q.shape[-2])):
        prev, new = states[..., t, :, :], states[..., t + 1, :, :]  # (..., Dk, Dv)
        k_t, decayed = k[..., t, :], prev * decay[..., t, :, None]  # (..., Dk), (..., Dk, Dv)
        residual = v[..., t, :] - np.einsum("...kv,...k->...v", decayed, k_t)  # (..., Dv)
        ds += q[..., t, :, None] * grad_out[..., t, None, :]
        dq[..., t, :] = np.einsum("...kv,...v->...k", new, grad_out[..., t, :])
        d_delta = np.einsum("...kv,...k->...v", ds, k_t)  # (..., Dv)
        d_residual = beta[..., t, None] * d_delta  # (..., Dv)
        dv[..., t, :] = d_residual
        dbeta[..., t] = np.einsum("...v,...v->...", d_delta, residual)
        dk[..., t, :] = (np.einsum("...kv,...v->...k", ds, beta[..., t, None] * residual)
                         - np.einsum("...kv,...v->...k", decayed, d_residual))  # (..., Dk)
        # the decayed state reaches S_t directly and through -beta k^T decayed: ds becomes its gradient
        ds -= k_t[..., :, None] * d_residual[..., None, :]
        dg[..., t, :] = _to_gate_width(np.einsum("...kv,...kv->...k", ds, decayed), width)  # (..., Dg)
        ds *= decay[..., t, :, None]
    return dq * dtype.type(ctx.scale), dk, dv, dg.reshape(ctx.gate_shape), dbeta, ds


# ----------------------------------------------------------------------------------------------------------
# The chunked form
# ----------------------------------------------------------------------------------------------------------
@dataclass
class ChunkedContext:
    """What :func:`chunked_backward` reads: the chunked inputs, the chunks' triangular systems, the state
    entering each chunk and each chunk's corrected values. Arrays are (..., N, C, ...), padded to N C."""

    q: np.ndarray  # (..., N, C, Dk), scaled
    k: np.ndarray  # (..., N, C, Dk)
    v: np.ndarray  # (..., N, C, Dv)
    beta: np.ndarray  # (..., N, C)
    decay_in: np.ndarray  # (..., N, C, Dg) exp(G): the decay from the chunk's start to each position
    decay_out: np.ndarray  # (..., N, C, Dg) exp(G_C - G): from each position to the chunk's end
    gamma: np.ndarray  # (..., N, C, C, Dg) exp(G_i - G_j) for i >= j, else 0
    kk: np.ndarray  # (..., N, C, C) K . K, the decayed Gram matrix
    attn: np.ndarray  # (..., N, C, C) Q . K
    qd: np.ndarray  # (..., N, C, Dk) exp(G) * Q
    kd: np.ndarray  # (..., N, C, Dk) exp(G_C - G) * K
    t: np.ndarray  # (..., N, C, C) (I + strict_lower(diag(beta) (K . K)))^{-1}
    w: np.ndarray  # (..., N, C, Dk) T diag(beta) (exp(G) * K)
    states: np.ndarray  # (..., N, Dk, Dv) the state entering each chunk
    v_new: np.ndarray  # (..., N, C, Dv) U - W S
    length: int
    scale: float
    gate_shape: tuple  # g's shape, which dg takes


def _chunk(x: np.ndarray, chunk_size: int, axis_from_end: int) -> np.ndarray:
    """Pad the length axis (``-1`` for (..., L), ``-2`` for (..., L, D)) with zeros to N C and split it."""
    length = x.shape[x.ndim - axis_from_end]
    n = -(-length // chunk_size)
    pad = [(0, 0)] * x.ndim
    pad[x.ndim - axis_from_end] = (0, n * chunk_size - length)
    x = np.pad(x, pad)  # zero keys, values and betas, and zero log-decays, leave the state unchanged
    lead = x.shape[:x.ndim - axis_from_end]
    return x.reshape(lead + (n, chunk_size) + x.shape[x.ndim - axis_from_end + 1:])  # (..., N, C[, D])


def chunked_forward(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                    chunk_size: int = CHUNK_SIZE):
    """The gated delta rule, C steps at a time (the WY/UT representation; module docstring).

    Shapes
    ------
    q, k (..., L, Dk); v (..., L, Dv); g (..., L) or (..., L, Dk); beta (..., L); initial_state (..., Dk, Dv)
    or None (zeros). ``scale`` multiplies q, default ``Dk ** -0.5``. L need not be a multiple of ``chunk_size``.

    Returns
    -------
    out : (..., L, Dv)
    state : (..., Dk, Dv), the state after the last step
    ctx : :class:`ChunkedContext`, for :func:`chunked_backward`
    """
    dtype = _compute_dtype(q, k, v, g, beta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    length, c = k.shape[-2], chunk_size
    qc = _chunk(q.astype(dtype, copy=False) * dtype.type(scale), c, 2)  # (..., N, C, Dk)
    kc, vc = _chunk(k.astype(dtype, copy=False), c, 2), _chunk(v.astype(dtype, copy=False), c, 2)
    betac = _chunk(beta.astype(dtype, copy=False), c, 1)  # (..., N, C)
    cum = np.cumsum(_chunk(_gate(g, k, dtype), c, 2), axis=-2)  # (..., N, C, Dg) G
    gamma = _relative_decays(cum)  # (..., N, C, C, Dg)
    kk = _decayed_products(kc, kc, gamma)  # (..., N, C, C)
    eye = np.eye(c, dtype=dtype)
    t = np.linalg.inv(eye + np.tril(betac[..., :, None] * kk, -1))  # (..., N, C, C)
    decay_in = np.exp(cum)  # (..., N, C, Dg)
    decay_out = np.exp(cum[..., -1:, :] - cum)  # (..., N, C, Dg)
    u = t @ (betac[..., None] * vc)  # (..., N, C, Dv)
    w = t @ (betac[..., None] * decay_in * kc)  # (..., N, C, Dk)
    attn = _decayed_products(qc, kc, gamma)  # (..., N, C, C), causal inside the chunk (gamma is 0 above)
    qd, kd = qc * decay_in, kc * decay_out  # (..., N, C, Dk)
    chunk_decay = decay_in[..., -1, :, None]  # (..., N, Dg, 1)
    n = kc.shape[-3]
    state = (np.zeros(kc.shape[:-3] + (k.shape[-1], v.shape[-1]), dtype) if initial_state is None
             else initial_state.astype(dtype))  # (..., Dk, Dv)
    states = np.empty(kc.shape[:-3] + (n,) + state.shape[-2:], dtype)  # (..., N, Dk, Dv)
    v_new, out = np.empty_like(vc), np.empty_like(vc)  # (..., N, C, Dv)
    for i in range(n):  # the chunks are sequential: each starts from the state the last one left
        states[..., i, :, :] = state
        v_new[..., i, :, :] = u[..., i, :, :] - w[..., i, :, :] @ state
        out[..., i, :, :] = qd[..., i, :, :] @ state + attn[..., i, :, :] @ v_new[..., i, :, :]
        state = chunk_decay[..., i, :, :] * state + kd[..., i, :, :].swapaxes(-1, -2) @ v_new[..., i, :, :]
    out = out.reshape(out.shape[:-3] + (n * c, v.shape[-1]))[..., :length, :]  # (..., L, Dv)
    ctx = ChunkedContext(qc, kc, vc, betac, decay_in, decay_out, gamma, kk, attn, qd, kd, t, w, states, v_new,
                         length, scale, np.shape(g))
    return out, state, ctx


def _chunk_steps_backward(grad_out, grad_state, ctx: ChunkedContext):
    """The loop of :func:`chunked_backward`: the chunks read backwards, each one's gradients kept.

    Returns the gradients of ``V'``'s parts ``U`` and ``W`` (..., N, C, D), of the decayed queries and keys
    ``exp(G) * Q``, ``exp(G_C - G) * K`` (..., N, C, Dk), of ``Q . K`` (..., N, C, C), of each chunk's total
    decay ``exp(G_C)`` (..., N, Dg) and of the initial state (..., Dk, Dv).
    """
    qd, kd, attn = ctx.qd, ctx.kd, ctx.attn
    chunk_decay = ctx.decay_in[..., -1, :]  # (..., N, Dg)
    width = chunk_decay.shape[-1]
    du, d_attn = np.empty_like(ctx.v_new), np.empty_like(attn)
    dw, dqd, dkd = np.empty_like(ctx.w), np.empty_like(qd), np.empty_like(kd)
    d_chunk_decay = np.empty_like(chunk_decay)
    ds = grad_state
    for i in reversed(range(ctx.states.shape[-3])):
        s_in, v_new, g_out = ctx.states[..., i, :, :], ctx.v_new[..., i, :, :], grad_out[..., i, :, :]
        dv_new = attn[..., i, :, :].swapaxes(-1, -2) @ g_out + kd[..., i, :, :] @ ds  # (..., C, Dv)
        dqd[..., i, :, :] = g_out @ s_in.swapaxes(-1, -2)
        d_attn[..., i, :, :] = g_out @ v_new.swapaxes(-1, -2)
        dkd[..., i, :, :] = v_new @ ds.swapaxes(-1, -2)
        d_chunk_decay[..., i, :] = _to_gate_width(np.einsum("...kv,...kv->...k", s_in, ds), width)  # (..., Dg)
        du[..., i, :, :] = dv_new
        dw[..., i, :, :] = -dv_new @ s_in.swapaxes(-1, -2)
        ds = (qd[..., i, :, :].swapaxes(-1, -2) @ g_out + chunk_decay[..., i, :, None] * ds
              - ctx.w[..., i, :, :].swapaxes(-1, -2) @ dv_new)  # (..., Dk, Dv)
    return du, dw, dqd, dkd, d_attn, d_chunk_decay, ds


def chunked_backward(grad_out, ctx: ChunkedContext, grad_state=None):
    """Gradients of :func:`chunked_forward`.

    ``grad_out`` (..., L, Dv); ``grad_state`` (..., Dk, Dv) the gradient of the final state (None: zero).

    Returns
    -------
    dq, dk (..., L, Dk); dv (..., L, Dv); dg (g's shape); dbeta (..., L); d_initial_state (..., Dk, Dv)
    """
    dtype, c, length = ctx.k.dtype, ctx.k.shape[-2], ctx.length
    go = _chunk(grad_out.astype(dtype, copy=False), c, 2)  # (..., N, C, Dv)
    gs = np.zeros(ctx.states.shape[:-3] + ctx.states.shape[-2:], dtype) if grad_state is None \
        else grad_state.astype(dtype, copy=False)  # (..., Dk, Dv)
    du, dw, dqd, dkd, d_attn, d_chunk_decay, d_initial = _chunk_steps_backward(go, gs, ctx)
    q, k, v, beta, t, gamma = ctx.q, ctx.k, ctx.v, ctx.beta, ctx.t, ctx.gamma
    decay_in, decay_out, width = ctx.decay_in, ctx.decay_out, ctx.decay_in.shape[-1]
    kb = beta[..., None] * decay_in * k  # (..., N, C, Dk)
    # U = T diag(beta) V and W = T diag(beta) (exp(G) * K), with T = M^{-1}: dM = -T^T dT T^T
    dt = du @ (beta[..., None] * v).swapaxes(-1, -2) + dw @ kb.swapaxes(-1, -2)  # (..., N, C, C)
    t_t = t.swapaxes(-1, -2)  # (..., N, C, C)
    dvb, dkb = t_t @ du, t_t @ dw  # (..., N, C, Dv), (..., N, C, Dk)
    da = np.tril(-(t_t @ dt @ t_t), -1)  # (..., N, C, C), M's strictly lower part is diag(beta) (K . K)
    dq_attn, dk_attn, flow_attn = _decayed_products_backward(d_attn, q, k, gamma, ctx.attn)
    dk_left, dk_right, flow_kk = _decayed_products_backward(beta[..., :, None] * da, k, k, gamma, ctx.kk)
    dq = dq_attn + decay_in * dqd  # (..., N, C, Dk)
    dk = dk_attn + dk_left + dk_right + beta[..., None] * decay_in * dkb + decay_out * dkd  # (..., N, C, Dk)
    dv = beta[..., None] * dvb  # (..., N, C, Dv)
    dbeta = (np.einsum("...cd,...cd->...c", dvb, v) + np.einsum("...cd,...cd->...c", dkb, decay_in * k)
             + np.einsum("...ij,...ij->...i", da, ctx.kk))  # (..., N, C)
    # the cumulative log-decay G reaches everything through exp(G_i - G_j), exp(G), exp(G_C - G), exp(G_C)
    out_part = _to_gate_width(dkd * k, width) * decay_out  # (..., N, C, Dg)
    flow = flow_attn + flow_kk  # (..., N, C, C, Dg): through exp(G_i - G_j)
    d_cum = (flow.sum(axis=-2) - flow.sum(axis=-3) + _to_gate_width(dkb * kb, width)
             + _to_gate_width(dqd * q, width) * decay_in - out_part)  # (..., N, C, Dg)
    d_cum[..., -1, :] += out_part.sum(axis=-2) + d_chunk_decay * decay_in[..., -1, :]
    dg = np.flip(np.cumsum(np.flip(d_cum, -2), axis=-2), -2)  # (..., N, C, Dg): G is a cumulative sum of g

    def unchunk(x):  # (..., N, C, D) -> (..., L, D), the padding dropped
        return x.reshape(x.shape[:-3] + (-1, x.shape[-1]))[..., :length, :]

    return (unchunk(dq) * dtype.type(ctx.scale), unchunk(dk), unchunk(dv), unchunk(dg).reshape(ctx.gate_shape),
            unchunk(dbeta[..., None])[..., 0], d_initial)


def token_weights(q, k, g, beta, *, scale: float | None = None) -> np.ndarray:
    """The effective token-to-token weights A of the gated delta rule from a zero state: ``out = A v``.

    The chunked form with the whole sequence as one chunk (module docstring): ``A = (Q . K) T diag(beta)``,
    lower-triangular. It costs O(L^2 Dk + L^3) and is meant for reading a layer (drawing it, attributing
    through it), not for running it.

    Shapes
    ------
    q, k (..., L, Dk); g (..., L) or (..., L, Dk); beta (..., L) -> A (..., L, L), row t the weights of values
    0..t in output t.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 2, 5, 4))
    >>> g, beta = -rng.random((2, 5)), rng.random((2, 5))
    >>> a = token_weights(q, k, g, beta)
    >>> bool(np.allclose(a @ v, chunked_forward(q, k, v, g, beta)[0])), bool(np.allclose(np.triu(a, 1), 0))
    (True, True)
    """
    dtype = _compute_dtype(q, k, g, beta)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = q.astype(dtype, copy=False) * dtype.type(scale), k.astype(dtype, copy=False)  # (..., L, Dk)
    beta, length = beta.astype(dtype, copy=False), k.shape[-2]
    gamma = _relative_decays(np.cumsum(_gate(g, k, dtype), axis=-2))  # (..., L, L, Dg)
    system = np.eye(length, dtype=dtype) + np.tril(beta[..., :, None] * _decayed_products(k, k, gamma), -1)
    attn = _decayed_products(q, k, gamma)  # (..., L, L)
    # attn T = (T^T attn^T)^T, and T^T is the inverse of system^T: one solve instead of an inverse
    solved = np.linalg.solve(system.swapaxes(-1, -2), attn.swapaxes(-1, -2)).swapaxes(-1, -2)  # (..., L, L)
    return solved * beta[..., None, :]  # (..., L, L)

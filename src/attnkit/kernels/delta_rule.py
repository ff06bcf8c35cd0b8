"""The gated delta rule (Gated DeltaNet's linear attention) and its gradient (unchecked kernels).

Dimension letters: ``...`` leading batch/head dims (B, H), L sequence length, Dk query/key features, Dv value
features, C chunk size, N number of chunks. Every head keeps a state ``S`` (Dk, Dv); at step t, with the
decay ``a_t = exp(g_t)`` (``g_t <= 0``, the log-decay) and the write strength ``beta_t`` in (0, 1):

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T        o_t = S_t^T (scale q_t)

the old state decays, then what it predicts for ``k_t`` is moved a fraction ``beta_t`` of the way to
``v_t`` (the delta rule). Hugging Face's ``torch_recurrent_gated_delta_rule`` computes exactly this (with
``scale = Dk ** -0.5``; its optional L2 normalisation of q and k is :func:`l2_normalize_forward` here, run
by the caller first).

Two forms compute the same thing:

* :func:`recurrent_forward` loops over the L steps: the decoding form, the state in and out.
* :func:`chunked_forward` (prefill and training) writes the C steps of a chunk as one triangular system
  (the WY/UT representation): with ``G`` the cumulative log-decay inside the chunk,
  ``Gamma_ij = exp(G_i - G_j)`` (i >= j), ``T = (I + strict_lower(diag(beta) K K^T * Gamma))^{-1}``,
  ``U = T diag(beta) V`` and ``W = T diag(beta exp(G)) K``, the chunk's corrected values are
  ``V' = U - W S``, its outputs ``diag(exp(G)) Q S + (Q K^T * Gamma) V'`` and the state it leaves
  ``exp(G_C) S + (diag(exp(G_C - G)) K)^T V'``. Only the N chunk steps remain a loop.

:func:`chunked_backward` is the exact gradient of the chunked form, from the states entering each chunk that
the forward kept; :func:`recurrent_backward` that of the recurrent form, from every step's state.
Arrays are computed in the inputs' float dtype (float16 in float32); float32 in gives float32 out.

From a zero state the output is linear in the values: ``out = A V`` with the (L, L) lower-triangular
``A = (Q K^T * Gamma) T diag(beta)`` of the chunked form taken as one chunk of the whole sequence.
:func:`token_weights` returns A, what a Gated DeltaNet layer has in place of an attention matrix: row t
says how much of each earlier value reaches output t. Unlike softmax weights, its entries may be negative
and its rows need not sum to one (the delta rule subtracts what the state already predicts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ChunkedContext", "RecurrentContext", "chunked_backward", "chunked_forward", "l2_normalize_backward",
           "l2_normalize_forward", "recurrent_backward", "recurrent_forward", "token_weights"]

CHUNK_SIZE = 64


def _compute_dtype(*arrays: np.ndarray) -> np.dtype:
    return np.result_type(*arrays, np.float32)


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
    decay: np.ndarray  # (..., L) exp(g)
    beta: np.ndarray  # (..., L)
    states: np.ndarray  # (..., L + 1, Dk, Dv)
    scale: float


def recurrent_forward(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                      keep_states: bool = False):
    """The gated delta rule one step at a time.

    Shapes
    ------
    q, k (..., L, Dk); v (..., L, Dv); g, beta (..., L); initial_state (..., Dk, Dv) or None (zeros).
    ``scale`` multiplies q, default ``Dk ** -0.5``.

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
    decay = np.exp(g.astype(dtype, copy=False))  # (..., L)
    lead, length = k.shape[:-2], k.shape[-2]
    state = (np.zeros(lead + (k.shape[-1], v.shape[-1]), dtype) if initial_state is None
             else initial_state.astype(dtype))  # (..., Dk, Dv), a copy the loop may overwrite
    out = np.empty(lead + (length, v.shape[-1]), dtype)  # (..., L, Dv)
    states = np.empty(lead + (length + 1,) + state.shape[-2:], dtype) if keep_states else None  # (..., L+1, Dk, Dv)
    for t in range(length):  # a decoding step each: the recurrence is sequential
        if keep_states:
            states[..., t, :, :] = state
        state = state * decay[..., t, None, None]  # (..., Dk, Dv)
        predicted = np.einsum("...kv,...k->...v", state, k[..., t, :])  # (..., Dv)
        delta = beta[..., t, None] * (v[..., t, :] - predicted)  # (..., Dv)
        state += k[..., t, :, None] * delta[..., None, :]
        out[..., t, :] = np.einsum("...kv,...k->...v", state, q[..., t, :])
    if keep_states:
        states[..., length, :, :] = state
    ctx = RecurrentContext(q, k, v, decay, beta, states, scale) if keep_states else None
    return out, state, ctx


def recurrent_backward(grad_out, ctx: RecurrentContext, grad_state=None):
    """Gradients of :func:`recurrent_forward` (run with ``keep_states=True``), the steps read backwards.

    ``grad_state`` (..., Dk, Dv) is the gradient of the final state (None: zero).

    Returns
    -------
    dq, dk (..., L, Dk); dv (..., L, Dv); dg, dbeta (..., L); d_initial_state (..., Dk, Dv)
    """
    q, k, v, decay, beta, states = ctx.q, ctx.k, ctx.v, ctx.decay, ctx.beta, ctx.states
    dtype = states.dtype
    grad_out = grad_out.astype(dtype, copy=False)
    ds = np.zeros(states.shape[:-3] + states.shape[-2:], dtype) if grad_state is None \
        else grad_state.astype(dtype)  # (..., Dk, Dv), a fresh array the loop accumulates into
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    dg, dbeta = np.empty_like(decay), np.empty_like(beta)
    for t in reversed(range(q.shape[-2])):
        prev, new = states[..., t, :, :], states[..., t + 1, :, :]  # (..., Dk, Dv)
        k_t, decayed = k[..., t, :], prev * decay[..., t, None, None]  # (..., Dk), (..., Dk, Dv)
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
        dg[..., t] = np.einsum("...kv,...kv->...", ds, decayed)
        ds *= decay[..., t, None, None]
    return dq * dtype.type(ctx.scale), dk, dv, dg, dbeta, ds


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
    decay_in: np.ndarray  # (..., N, C) exp(G): the decay from the chunk's start to each position
    decay_out: np.ndarray  # (..., N, C) exp(G_C - G): from each position to the chunk's end
    gamma: np.ndarray  # (..., N, C, C) exp(G_i - G_j) for i >= j, else 0
    kk: np.ndarray  # (..., N, C, C) K K^T
    qk: np.ndarray  # (..., N, C, C) Q K^T
    attn: np.ndarray  # (..., N, C, C) Q K^T * Gamma
    qd: np.ndarray  # (..., N, C, Dk) diag(exp(G)) Q
    kd: np.ndarray  # (..., N, C, Dk) diag(exp(G_C - G)) K
    t: np.ndarray  # (..., N, C, C) (I + strict_lower(diag(beta) K K^T * Gamma))^{-1}
    w: np.ndarray  # (..., N, C, Dk) T diag(beta exp(G)) K
    states: np.ndarray  # (..., N, Dk, Dv) the state entering each chunk
    v_new: np.ndarray  # (..., N, C, Dv) U - W S
    length: int
    scale: float


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
    q, k (..., L, Dk); v (..., L, Dv); g, beta (..., L); initial_state (..., Dk, Dv) or None (zeros).
    ``scale`` multiplies q, default ``Dk ** -0.5``. L need not be a multiple of ``chunk_size``.

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
    cum = np.cumsum(_chunk(g.astype(dtype, copy=False), c, 1), axis=-1)  # (..., N, C) G
    lower = np.tril(np.ones((c, c), bool))  # (C, C), i >= j
    # G_i - G_j <= 0 on and below the diagonal; above it (never used) it could overflow, so it is -inf there
    gamma = np.exp(np.where(lower, cum[..., :, None] - cum[..., None, :], -np.inf))  # (..., N, C, C)
    kk = kc @ kc.swapaxes(-1, -2)  # (..., N, C, C)
    eye = np.eye(c, dtype=dtype)
    t = np.linalg.inv(eye + np.tril(betac[..., :, None] * kk * gamma, -1))  # (..., N, C, C)
    decay_in = np.exp(cum)  # (..., N, C)
    decay_out = np.exp(cum[..., -1:] - cum)  # (..., N, C)
    u = t @ (betac[..., None] * vc)  # (..., N, C, Dv)
    w = t @ ((betac * decay_in)[..., None] * kc)  # (..., N, C, Dk)
    qk = qc @ kc.swapaxes(-1, -2)  # (..., N, C, C)
    attn = qk * gamma  # (..., N, C, C), causal inside the chunk (gamma is 0 above the diagonal)
    qd, kd = qc * decay_in[..., None], kc * decay_out[..., None]  # (..., N, C, Dk)
    chunk_decay = decay_in[..., -1, None, None]  # (..., N, 1, 1)
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
    ctx = ChunkedContext(qc, kc, vc, betac, decay_in, decay_out, gamma, kk, qk, attn, qd, kd, t, w, states, v_new,
                         length, scale)
    return out, state, ctx


def _chunk_steps_backward(grad_out, grad_state, ctx: ChunkedContext):
    """The loop of :func:`chunked_backward`: the chunks read backwards, each one's gradients kept.

    Returns the gradients of ``V'``'s parts ``U`` and ``W`` (..., N, C, D), of the decayed queries and keys
    ``diag(exp(G)) Q``, ``diag(exp(G_C - G)) K`` (..., N, C, Dk), of ``Q K^T * Gamma`` (..., N, C, C), of
    each chunk's total decay ``exp(G_C)`` (..., N) and of the initial state (..., Dk, Dv).
    """
    qd, kd, attn = ctx.qd, ctx.kd, ctx.attn
    chunk_decay = ctx.decay_in[..., -1]  # (..., N)
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
        d_chunk_decay[..., i] = np.einsum("...kv,...kv->...", s_in, ds)
        du[..., i, :, :] = dv_new
        dw[..., i, :, :] = -dv_new @ s_in.swapaxes(-1, -2)
        ds = (qd[..., i, :, :].swapaxes(-1, -2) @ g_out + chunk_decay[..., i, None, None] * ds
              - ctx.w[..., i, :, :].swapaxes(-1, -2) @ dv_new)  # (..., Dk, Dv)
    return du, dw, dqd, dkd, d_attn, d_chunk_decay, ds


def chunked_backward(grad_out, ctx: ChunkedContext, grad_state=None):
    """Gradients of :func:`chunked_forward`.

    ``grad_out`` (..., L, Dv); ``grad_state`` (..., Dk, Dv) the gradient of the final state (None: zero).

    Returns
    -------
    dq, dk (..., L, Dk); dv (..., L, Dv); dg, dbeta (..., L); d_initial_state (..., Dk, Dv)
    """
    dtype, c, length = ctx.k.dtype, ctx.k.shape[-2], ctx.length
    go = _chunk(grad_out.astype(dtype, copy=False), c, 2)  # (..., N, C, Dv)
    gs = np.zeros(ctx.states.shape[:-3] + ctx.states.shape[-2:], dtype) if grad_state is None \
        else grad_state.astype(dtype, copy=False)  # (..., Dk, Dv)
    du, dw, dqd, dkd, d_attn, d_chunk_decay, d_initial = _chunk_steps_backward(go, gs, ctx)
    q, k, v, beta, t, gamma = ctx.q, ctx.k, ctx.v, ctx.beta, ctx.t, ctx.gamma
    decay_in, decay_out = ctx.decay_in, ctx.decay_out
    kb = (beta * decay_in)[..., None] * k  # (..., N, C, Dk)
    # U = T diag(beta) V and W = T diag(beta exp(G)) K, with T = M^{-1}: dM = -T^T dT T^T
    dt = du @ (beta[..., None] * v).swapaxes(-1, -2) + dw @ kb.swapaxes(-1, -2)  # (..., N, C, C)
    t_t = t.swapaxes(-1, -2)  # (..., N, C, C)
    dvb, dkb = t_t @ du, t_t @ dw  # (..., N, C, Dv), (..., N, C, Dk)
    da = np.tril(-(t_t @ dt @ t_t), -1)  # (..., N, C, C), M's strictly lower part is diag(beta) K K^T * Gamma
    da_gamma = da * gamma  # (..., N, C, C)
    dkk = beta[..., :, None] * da_gamma  # (..., N, C, C)
    dqk = d_attn * gamma  # (..., N, C, C)
    dq = dqk @ k + decay_in[..., None] * dqd  # (..., N, C, Dk)
    dk = ((dkk + dkk.swapaxes(-1, -2)) @ k + dqk.swapaxes(-1, -2) @ q
          + (beta * decay_in)[..., None] * dkb + decay_out[..., None] * dkd)  # (..., N, C, Dk)
    dv = beta[..., None] * dvb  # (..., N, C, Dv)
    dbeta = (np.einsum("...cd,...cd->...c", dvb, v) + np.einsum("...cd,...cd->...c", dkb, k) * decay_in
             + np.einsum("...ij,...ij->...i", da_gamma, ctx.kk))  # (..., N, C)
    # the cumulative log-decay G reaches everything through exp(G_i - G_j), exp(G), exp(G_C - G), exp(G_C)
    dp = (d_attn * ctx.qk + beta[..., :, None] * da * ctx.kk) * gamma  # (..., N, C, C)
    out_part = np.einsum("...cd,...cd->...c", dkd, k) * decay_out  # (..., N, C)
    d_cum = (dp.sum(axis=-1) - dp.sum(axis=-2) + np.einsum("...cd,...cd->...c", dkb, kb)
             + np.einsum("...cd,...cd->...c", dqd, q) * decay_in - out_part)  # (..., N, C)
    d_cum[..., -1] += out_part.sum(axis=-1) + d_chunk_decay * decay_in[..., -1]
    dg = np.flip(np.cumsum(np.flip(d_cum, -1), axis=-1), -1)  # (..., N, C): G is a cumulative sum of g

    def unchunk(x, vector=True):  # (..., N, C[, D]) -> (..., L[, D]), the padding dropped
        lead = x.shape[:-3] if vector else x.shape[:-2]
        flat = x.reshape(lead + (-1,) + (x.shape[-1:] if vector else ()))
        return flat[..., :length, :] if vector else flat[..., :length]

    return (unchunk(dq) * dtype.type(ctx.scale), unchunk(dk), unchunk(dv), unchunk(dg, False),
            unchunk(dbeta, False), d_initial)


def token_weights(q, k, g, beta, *, scale: float | None = None) -> np.ndarray:
    """The effective token-to-token weights A of the gated delta rule from a zero state: ``out = A v``.

    The chunked form with the whole sequence as one chunk (module docstring): ``A = (Q K^T * Gamma) T
    diag(beta)``, lower-triangular. It costs O(L^2 Dk + L^3) and is meant for reading a layer (drawing it,
    attributing through it), not for running it.

    Shapes
    ------
    q, k (..., L, Dk); g, beta (..., L) -> A (..., L, L), row t the weights of values 0..t in output t.

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
    cum = np.cumsum(g.astype(dtype, copy=False), axis=-1)  # (..., L)
    lower = np.tril(np.ones((length, length), bool))  # (L, L)
    gamma = np.exp(np.where(lower, cum[..., :, None] - cum[..., None, :], -np.inf))  # (..., L, L)
    system = np.eye(length, dtype=dtype) + np.tril(beta[..., :, None] * (k @ k.swapaxes(-1, -2)) * gamma, -1)
    attn = (q @ k.swapaxes(-1, -2)) * gamma  # (..., L, L)
    # attn T = (T^T attn^T)^T, and T^T is the inverse of system^T: one solve instead of an inverse
    solved = np.linalg.solve(system.swapaxes(-1, -2), attn.swapaxes(-1, -2)).swapaxes(-1, -2)  # (..., L, L)
    return solved * beta[..., None, :]  # (..., L, L)

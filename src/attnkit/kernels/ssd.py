"""Mamba-2's state space duality (SSD): the selective scan with a scalar decay per head, in recurrent and chunked
forms, and the chunked form's exact backward.

Dimension letters: B batch, H heads, L length, N state size (the "keys" B and "queries" C), P head dim (the
values), C chunk size, Nc = ceil(L / C) chunks.

Per head, with the state S (N, P) starting at ``initial_state`` (zeros by default)::

    S_t = exp(g_t) S_{t-1} + k_t v_t^T        o_t = S_t^T q_t

Mamba-2 calls q the C projection, k the B projection, v the discretised input ``dt x`` and g ``dt A`` (A < 0,
so every ``g <= 0`` and the decays are at most 1); the skip ``D x`` and the gates are the layer's
(:mod:`attnkit.layers.mamba2`). This is linear attention with a scalar decay: within a chunk the output is
``((q k^T) * exp(G_i - G_j))_{i >= j} v`` plus the chunk's start state read through ``exp(G_i) q_i``, G the
within-chunk cumulative sum of g; between chunks only the states are carried, so a sequence costs Nc sequential
steps, not L. The two forms agree to rounding (float64: 1e-14); the recurrent form is the decoding step and the
reference the chunked one is tested against.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["ChunkedContext", "chunked_backward", "chunked_forward", "recurrent_forward", "recurrent_step"]


def recurrent_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                      initial_state: np.ndarray | None = None):
    """The scan one step at a time (decoding; the reference of :func:`chunked_forward`).

    Shapes
    ------
    q, k (B, H, L, N); v (B, H, L, P); g (B, H, L); initial_state (B, H, N, P) or None (zeros).

    Returns
    -------
    o : (B, H, L, P) and the final state (B, H, N, P), in q's dtype
    """
    state = (np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), q.dtype) if initial_state is None
             else initial_state.astype(q.dtype))  # (B, H, N, P), a fresh array
    out = np.empty(v.shape, q.dtype)  # (B, H, L, P)
    decay = np.exp(g)  # (B, H, L)
    for t in range(q.shape[2]):  # sequential by definition: each step reads the state the last one left
        out[:, :, t], state = _advance(state, q[:, :, t], k[:, :, t], v[:, :, t], decay[:, :, t])  # (B, H, P)
    return out, state


def _advance(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray):
    """One step of the scan from ``state`` (B, H, N, P), which is read, never written: the output (B, H, P) and the
    new state (B, H, N, P), a fresh array. q, k (B, H, N); v (B, H, P); decay ``exp(g)`` (B, H)."""
    state = state * decay[:, :, None, None]  # (B, H, N, P)
    state += k[:, :, :, None] * v[:, :, None, :]  # (B, H, N, P)
    return np.einsum("bhn,bhnp->bhp", q, state), state  # (B, H, P), (B, H, N, P)


def recurrent_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, state: np.ndarray):
    """One decoding step of the scan: :func:`recurrent_forward` of one position, the same operations in the same
    order, without the length axis.

    Shapes
    ------
    q, k (B, H, N); v (B, H, P); g (B, H); state (B, H, N, P), read and never written.

    Returns
    -------
    o : (B, H, P) and the new state (B, H, N, P), a fresh array, in q's dtype
    """
    return _advance(state.astype(q.dtype, copy=False), q, k, v, np.exp(g))  # (B, H, P), (B, H, N, P)


class ChunkedContext(NamedTuple):
    """What :func:`chunked_backward` reads: the chunked inputs, the within-chunk cumulative decays and the state at
    every chunk's start."""

    q: np.ndarray  # (B, H, Nc, C, N)
    k: np.ndarray  # (B, H, Nc, C, N)
    v: np.ndarray  # (B, H, Nc, C, P)
    cum: np.ndarray  # (B, H, Nc, C): G
    starts: np.ndarray  # (B, H, Nc, N, P): the state entering each chunk
    length: int


def _chunk(x: np.ndarray, chunk_size: int, trailing: int) -> np.ndarray:
    """Pad the length axis (the one before ``trailing`` feature axes) with zeros to Nc C and split it."""
    axis = x.ndim - 1 - trailing
    pad = (-x.shape[axis]) % chunk_size
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = np.pad(x, widths)  # zero inputs and log-decays leave the state as it is
    return x.reshape(x.shape[:axis] + (-1, chunk_size) + x.shape[axis + 1:])


def _decays(cum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``exp(G_i - G_j)`` for i >= j, else 0 (B, H, Nc, C, C), and ``exp(G_last - G_j)`` (B, H, Nc, C); every
    exponent is <= 0 where it is kept, and the others are never exponentiated."""
    c = cum.shape[-1]
    lower = np.tril(np.ones((c, c), dtype=bool))  # (C, C)
    diff = cum[..., :, None] - cum[..., None, :]  # (B, H, Nc, C, C)
    within = np.exp(np.where(lower, diff, 0.0)) * lower  # (B, H, Nc, C, C)
    to_end = np.exp(cum[..., -1:] - cum)  # (B, H, Nc, C)
    return within, to_end


def chunked_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
                    initial_state: np.ndarray | None = None, *, chunk_size: int = 64):
    """The scan, C steps at a time (module docstring).

    Shapes
    ------
    As :func:`recurrent_forward`.

    Returns
    -------
    o : (B, H, L, P), the final state (B, H, N, P), and a :class:`ChunkedContext` for :func:`chunked_backward`
    """
    length = q.shape[2]
    qc, kc, vc = _chunk(q, chunk_size, 1), _chunk(k, chunk_size, 1), _chunk(v, chunk_size, 1)  # (B, H, Nc, C, *)
    cum = np.cumsum(_chunk(g, chunk_size, 0), axis=-1)  # (B, H, Nc, C)
    within, to_end = _decays(cum)
    scores = (qc @ kc.swapaxes(-1, -2)) * within  # (B, H, Nc, C, C)
    out = scores @ vc  # (B, H, Nc, C, P): each chunk from a zero state
    local = (kc * to_end[..., None]).swapaxes(-1, -2) @ vc  # (B, H, Nc, N, P): what each chunk adds to the state
    chunk_decay = np.exp(cum[..., -1])  # (B, H, Nc)
    starts = np.empty(local.shape, q.dtype)  # (B, H, Nc, N, P)
    state = (np.zeros(local.shape[:2] + local.shape[3:], q.dtype) if initial_state is None
             else initial_state.astype(q.dtype))  # (B, H, N, P)
    for c in range(local.shape[2]):  # the chunks are sequential: each starts from the state the last one left
        starts[:, :, c] = state
        state = chunk_decay[:, :, c, None, None] * state + local[:, :, c]
    out += (qc * np.exp(cum)[..., None]) @ starts  # (B, H, Nc, C, P): the start states read
    o = out.reshape(out.shape[:2] + (-1, out.shape[-1]))[:, :, :length]  # (B, H, L, P)
    return o, state, ChunkedContext(qc, kc, vc, cum, starts, length)


def chunked_backward(grad_out: np.ndarray, ctx: ChunkedContext, grad_state: np.ndarray | None = None):
    """Gradients of :func:`chunked_forward` from ``grad_out`` (B, H, L, P) and the final state's ``grad_state``
    (B, H, N, P) or None.

    Returns
    -------
    dq, dk (B, H, L, N); dv (B, H, L, P); dg (B, H, L); d_initial_state (B, H, N, P)
    """
    qc, kc, vc, cum, starts, length = ctx
    do = _chunk(grad_out.astype(qc.dtype, copy=False), qc.shape[-2], 1)  # (B, H, Nc, C, P)
    within, to_end = _decays(cum)
    read = np.exp(cum)  # (B, H, Nc, C): how chunk position i reads the start state
    chunk_decay = np.exp(cum[..., -1])  # (B, H, Nc)
    # the gradient of each chunk's end state, chunks read backwards
    emitted = (qc * read[..., None]).swapaxes(-1, -2) @ do  # (B, H, Nc, N, P): d out / d start state
    ends = np.empty(starts.shape, qc.dtype)  # (B, H, Nc, N, P)
    d_state = np.zeros(starts.shape[:2] + starts.shape[3:], qc.dtype) if grad_state is None \
        else grad_state.astype(qc.dtype)  # (B, H, N, P)
    for c in range(starts.shape[2] - 1, -1, -1):
        ends[:, :, c] = d_state
        d_state = chunk_decay[:, :, c, None, None] * d_state + emitted[:, :, c]
    dov = do @ vc.swapaxes(-1, -2)  # (B, H, Nc, C, C): dO_i . v_j
    qk = qc @ kc.swapaxes(-1, -2)  # (B, H, Nc, C, C): q_i . k_j
    d_scores = dov * within  # (B, H, Nc, C, C)
    dq = d_scores @ kc + read[..., None] * (do @ starts.swapaxes(-1, -2))  # (B, H, Nc, C, N)
    d_end_v = vc @ ends.swapaxes(-1, -2)  # (B, H, Nc, C, N): dS_end v_j
    dk = d_scores.swapaxes(-1, -2) @ qc + to_end[..., None] * d_end_v  # (B, H, Nc, C, N)
    dv = (qk * within).swapaxes(-1, -2) @ do + to_end[..., None] * (kc @ ends)  # (B, H, Nc, C, P)
    # the cumulative decays' gradient: every exp(G_i - G_j) term gives +w to G_i and -w to G_j
    pair = qk * d_scores  # (B, H, Nc, C, C)
    reads = read * np.einsum("bhcin,bhcnp,bhcip->bhci", qc, starts, do)  # (B, H, Nc, C)
    carried = to_end * np.einsum("bhcjn,bhcjn->bhcj", kc, d_end_v)  # (B, H, Nc, C)
    kept = chunk_decay * np.einsum("bhcnp,bhcnp->bhc", starts, ends)  # (B, H, Nc)
    d_cum = pair.sum(axis=-1) - pair.sum(axis=-2) + reads - carried  # (B, H, Nc, C)
    d_cum[..., -1] += carried.sum(axis=-1) + kept
    dg = np.flip(np.cumsum(np.flip(d_cum, -1), axis=-1), -1)  # (B, H, Nc, C): G_i sums g_t for t <= i

    def unchunk(x: np.ndarray, trailing: int) -> np.ndarray:
        axis = x.ndim - 2 - trailing
        return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])[:, :, :length]

    return unchunk(dq, 1), unchunk(dk, 1), unchunk(dv, 1), unchunk(dg, 0), d_state

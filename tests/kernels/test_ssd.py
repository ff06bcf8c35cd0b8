"""Mamba-2's SSD scan: the chunked form equals the recurrent one to round-off in float64 (any chunk size, a
carried state, a length that is no multiple of the chunk), equals Hugging Face's ``mamba2_chunk_scan``, and its
backward passes float64 finite differences for every input and the initial state."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

import torch
from attnkit.kernels.ssd import chunked_backward, chunked_forward, recurrent_forward

from helpers import assert_gradient, make_rng, randn, to_numpy


def _inputs(rng, b=2, h=3, length=11, n=4, p=5, dtype=np.float64):
    q, k, v = randn(rng, b, h, length, n, dtype=dtype), randn(rng, b, h, length, n, dtype=dtype), \
        randn(rng, b, h, length, p, dtype=dtype)
    g = -np.abs(randn(rng, b, h, length, dtype=dtype)) * 0.7  # dt A: never positive
    return q, k, v, g, randn(rng, b, h, n, p, dtype=dtype)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 11, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_to_round_off(chunk_size, with_state):
    q, k, v, g, state = _inputs(make_rng(1, chunk_size))
    state = state if with_state else None
    o_ref, final_ref = recurrent_forward(q, k, v, g, state)
    o, final, _ = chunked_forward(q, k, v, g, state, chunk_size=chunk_size)
    np.testing.assert_allclose(o, o_ref, rtol=1e-13, atol=1e-13 * np.abs(o_ref).max())
    np.testing.assert_allclose(final, final_ref, rtol=1e-13, atol=1e-13 * np.abs(final_ref).max())


@pytest.mark.parametrize("chunk_size", [2, 4, 16])
def test_every_gradient_passes_finite_differences(chunk_size):
    q, k, v, g, state = _inputs(make_rng(2, chunk_size), b=1, h=2, length=7, n=3, p=2)
    rng = make_rng(3)
    grad_o, grad_final = randn(rng, 1, 2, 7, 2), randn(rng, 1, 2, 3, 2)
    _, _, ctx = chunked_forward(q, k, v, g, state, chunk_size=chunk_size)
    grads = chunked_backward(grad_o, ctx, grad_final)

    def loss():
        o, final, _ = chunked_forward(q, k, v, g, state, chunk_size=chunk_size)
        return np.sum(o * grad_o) + np.sum(final * grad_final)

    for name, array, grad in zip(("q", "k", "v", "g", "state"), (q, k, v, g, state), grads, strict=True):
        assert_gradient(loss, array, grad, name)


def test_without_a_final_state_gradient_and_from_zeros():
    q, k, v, g, _ = _inputs(make_rng(4), length=5)
    grad_o = randn(make_rng(5), *v.shape)
    _, _, ctx = chunked_forward(q, k, v, g, chunk_size=2)
    dq, dk, dv, dg, d_state = chunked_backward(grad_o, ctx)

    def loss():
        return np.sum(chunked_forward(q, k, v, g, chunk_size=2)[0] * grad_o)

    assert_gradient(loss, g, dg, "g")
    assert_gradient(loss, k, dk, "k")
    assert d_state.shape == (2, 3, 4, 5)


def test_equals_hugging_faces_chunk_scan():
    """transformers' scan takes x, dt (before its softplus), A and the B, C groups, and adds D x: the same scan
    with q = C, k = B, v = dt x and g = dt A."""
    rng = make_rng(6)
    b, length, h, p, n = 2, 13, 4, 3, 5
    x, dt_raw = randn(rng, b, length, h, p), randn(rng, b, length, h)
    bm, cm = randn(rng, b, length, 1, n), randn(rng, b, length, 1, n)  # one group for every head
    a = -np.exp(randn(rng, h) * 0.5)
    start = randn(rng, b, h, p, n)
    theirs, final = mamba2_chunk_scan(*(torch.tensor(t) for t in (x, dt_raw, a, bm, cm)), chunk_size=4,
                                      initial_states=torch.tensor(start), dt_softplus=True,
                                      return_final_states=True)
    dt = np.logaddexp(0.0, dt_raw).transpose(0, 2, 1)  # (B, H, L)
    heads = (0, 2, 1, 3)
    o, ours_final, _ = chunked_forward(np.repeat(cm, h, 2).transpose(heads), np.repeat(bm, h, 2).transpose(heads),
                                       x.transpose(heads) * dt[..., None], dt * a[:, None],
                                       start.swapaxes(-1, -2), chunk_size=5)
    np.testing.assert_allclose(o.transpose(heads), to_numpy(theirs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours_final.swapaxes(-1, -2), to_numpy(final), rtol=1e-5, atol=1e-5)

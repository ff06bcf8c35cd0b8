"""The gated delta rule: the chunked form equals the recurrent one to float64 round-off, both equal Hugging
Face's torch references (float32, which those compute in), and both backwards pass float64 finite differences
and equal torch autograd through the references."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

import torch
from attnkit.kernels import delta_rule as dr

from helpers import assert_close_rel, assert_gradient, make_rng, randn, to_numpy


def _inputs(rng, b, h, length, dk, dv, dtype=np.float64):
    """Keys of norm <= 1 (as after L2 normalisation) keep ``I - beta k k^T`` a contraction, so the state stays
    bounded over any length; log-decays in [-1, 0) and betas in (0, 1) as the layer produces them."""
    q = randn(rng, b, h, length, dk)
    k = randn(rng, b, h, length, dk) / np.sqrt(2.0 * dk)
    v = randn(rng, b, h, length, dv)
    g = -rng.uniform(0.0, 1.0, (b, h, length))
    beta = rng.uniform(0.0, 1.0, (b, h, length))
    s0 = randn(rng, b, h, dk, dv)
    return [x.astype(dtype) for x in (q, k, v, g, beta, s0)]


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("length, chunk", [(1, 64), (37, 64), (130, 64), (29, 8), (16, 4)])
def test_chunked_equals_recurrent_in_float64(length, chunk):
    q, k, v, g, beta, s0 = _inputs(make_rng(length, chunk), 2, 3, length, 6, 5)
    out_r, state_r, _ = dr.recurrent_forward(q, k, v, g, beta, initial_state=s0)
    out_c, state_c, _ = dr.chunked_forward(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert _rel(out_c, out_r) < 1e-12 and _rel(state_c, state_r) < 1e-12


def test_a_state_carried_between_calls_continues_the_sequence():
    q, k, v, g, beta, s0 = _inputs(make_rng(5), 1, 2, 50, 4, 3)
    whole, state, _ = dr.chunked_forward(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    first, mid, _ = dr.chunked_forward(q[..., :21, :], k[..., :21, :], v[..., :21, :], g[..., :21], beta[..., :21],
                                       initial_state=s0, chunk_size=16)
    rest, end, _ = dr.recurrent_forward(q[..., 21:, :], k[..., 21:, :], v[..., 21:, :], g[..., 21:], beta[..., 21:],
                                        initial_state=mid)
    assert _rel(np.concatenate([first, rest], axis=-2), whole) < 1e-12 and _rel(end, state) < 1e-12


def test_float32_in_float32_out_and_inputs_untouched():
    arrays = _inputs(make_rng(6), 1, 2, 9, 4, 3, np.float32)
    copies = [a.copy() for a in arrays]
    q, k, v, g, beta, s0 = arrays
    for forward in (dr.recurrent_forward, dr.chunked_forward):
        out, state, _ = forward(q, k, v, g, beta, initial_state=s0)
        assert out.dtype == np.float32 and state.dtype == np.float32
        out[...] = 0.0
        state[...] = 0.0
    assert all(np.array_equal(a, c) for a, c in zip(arrays, copies))


def _torch_reference(fn, q, k, v, g, beta, s0, l2norm, grad_out=None, grad_state=None):
    """Run a Hugging Face reference on our (B, H, L, D) arrays (it takes (B, L, H, D)), with autograd."""
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g, beta, s0)]
    tq, tk, tv = (t.transpose(1, 2) for t in ts[:3])
    tg, tb = ts[3].transpose(1, 2), ts[4].transpose(1, 2)
    out, state = fn(tq, tk, tv, g=tg, beta=tb, initial_state=ts[5], output_final_state=True,
                    use_qk_l2norm_in_kernel=l2norm)
    out = out.transpose(1, 2)
    if grad_out is not None:
        (out * torch.tensor(grad_out)).sum().add((state * torch.tensor(grad_state)).sum()).backward()
    return to_numpy(out), to_numpy(state), [to_numpy(t.grad) if t.grad is not None else None for t in ts]


def _ours(form, q, k, v, g, beta, s0, l2norm, grad_out, grad_state):
    """Our forward (after our L2 normalisation when asked) and every gradient."""
    qn, q_rstd = dr.l2_normalize_forward(q) if l2norm else (q, None)
    kn, k_rstd = dr.l2_normalize_forward(k) if l2norm else (k, None)
    if form == "chunked":
        out, state, ctx = dr.chunked_forward(qn, kn, v, g, beta, initial_state=s0)
        grads = list(dr.chunked_backward(grad_out, ctx, grad_state))
    else:
        out, state, ctx = dr.recurrent_forward(qn, kn, v, g, beta, initial_state=s0, keep_states=True)
        grads = list(dr.recurrent_backward(grad_out, ctx, grad_state))
    if l2norm:
        grads[0] = dr.l2_normalize_backward(grads[0], qn, q_rstd)
        grads[1] = dr.l2_normalize_backward(grads[1], kn, k_rstd)
    return out, state, grads


REFERENCES = {"chunked": torch_chunk_gated_delta_rule, "recurrent": torch_recurrent_gated_delta_rule}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_forward_and_gradients_equal_hugging_face(form, l2norm, dtype):
    """The references compute in float32 whatever the input, so the bound is float32's (1e-5 relative)."""
    rng = make_rng(7, l2norm, form == "chunked")
    q, k, v, g, beta, s0 = _inputs(rng, 2, 2, 70, 8, 6)  # two chunks of 64, the second one padded
    grad_out, grad_state = randn(rng, 2, 2, 70, 6), randn(rng, 2, 2, 8, 6)
    ref_out, ref_state, ref_grads = _torch_reference(REFERENCES[form], q, k, v, g, beta, s0, l2norm,
                                                      grad_out, grad_state)
    cast = [x.astype(dtype) for x in (q, k, v, g, beta, s0, grad_out, grad_state)]
    out, state, grads = _ours(form, *cast[:6], l2norm, *cast[6:])
    assert out.dtype == dtype and all(x.dtype == dtype for x in grads)
    assert_close_rel(out, ref_out, np.float32, f"{form} out")
    assert_close_rel(state, ref_state, np.float32, f"{form} state")
    for name, ours, ref in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, ref_grads):
        assert_close_rel(ours, ref, np.float32, f"{form} grad {name}")


@pytest.mark.parametrize("form, length, chunk", [("chunked", 7, 3), ("chunked", 6, 6), ("recurrent", 5, None)])
def test_every_gradient_passes_finite_differences(form, length, chunk):
    q, k, v, g, beta, s0 = args = _inputs(make_rng(8, length), 1, 2, length, 3, 2)
    rng = make_rng(9)
    grad_out, grad_state = randn(rng, 1, 2, length, 2), randn(rng, 1, 2, 3, 2)

    def run():
        if form == "chunked":
            return dr.chunked_forward(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
        return dr.recurrent_forward(q, k, v, g, beta, initial_state=s0, keep_states=True)

    def loss():
        out, state, _ = run()
        return np.sum(out * grad_out) + np.sum(state * grad_state)

    _, _, ctx = run()
    backward = dr.chunked_backward if form == "chunked" else dr.recurrent_backward
    grads = backward(grad_out, ctx, grad_state)
    for name, x, grad in zip(("q", "k", "v", "g", "beta", "initial_state"), args, grads):
        assert_gradient(loss, x, grad, name)


def test_l2_normalize_gradient_passes_finite_differences():
    rng = make_rng(10)
    x, grad_y = randn(rng, 3, 4, 5), randn(rng, 3, 4, 5)
    y, rstd = dr.l2_normalize_forward(x)
    assert_gradient(lambda: np.sum(dr.l2_normalize_forward(x)[0] * grad_y), x,
                    dr.l2_normalize_backward(grad_y, y, rstd), "x")

"""The gated delta rule, with a scalar gate (Gated DeltaNet) and a channel-wise one (Kimi Delta Attention): the
chunked form equals the recurrent one to float64 round-off, both equal Hugging Face's torch references (float32,
which those compute in), and both backwards pass float64 finite differences and equal torch autograd through the
references."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

import torch
from attnkit.kernels import delta_rule as dr

from helpers import assert_close_rel, assert_gradient, make_rng, randn, to_numpy

GATES = ("scalar", "channel")


def _inputs(rng, b, h, length, dk, dv, dtype=np.float64, gate="scalar"):
    """Keys of norm <= 1 (as after L2 normalisation) keep ``I - beta k k^T`` a contraction, so the state stays
    bounded over any length; log-decays in [-1, 0) and betas in (0, 1) as the layers produce them: one per step
    and head (``gate="scalar"``) or one per key channel too (``"channel"``)."""
    q = randn(rng, b, h, length, dk)
    k = randn(rng, b, h, length, dk) / np.sqrt(2.0 * dk)
    v = randn(rng, b, h, length, dv)
    g = -rng.uniform(0.0, 1.0, (b, h, length) + ((dk,) if gate == "channel" else ()))
    beta = rng.uniform(0.0, 1.0, (b, h, length))
    s0 = randn(rng, b, h, dk, dv)
    return [x.astype(dtype) for x in (q, k, v, g, beta, s0)]


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("length, chunk", [(1, 64), (37, 64), (130, 64), (29, 8), (16, 4)])
def test_chunked_equals_recurrent_in_float64(length, chunk, gate):
    q, k, v, g, beta, s0 = _inputs(make_rng(length, chunk), 2, 3, length, 6, 5, gate=gate)
    out_r, state_r, _ = dr.recurrent_forward(q, k, v, g, beta, initial_state=s0)
    out_c, state_c, _ = dr.chunked_forward(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    assert _rel(out_c, out_r) < 1e-12 and _rel(state_c, state_r) < 1e-12


@pytest.mark.parametrize("gate", GATES)
def test_a_state_carried_between_calls_continues_the_sequence(gate):
    args = _inputs(make_rng(5), 1, 2, 50, 4, 3, gate=gate)
    q, k, v, g, beta, s0 = args
    whole, state, _ = dr.chunked_forward(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    # the time axis is the last of beta, the one before the features of q, k, v and a channel-wise g
    first = [x[..., :21, :] if x.ndim == 4 else x[..., :21] for x in args[:5]]
    rest = [x[..., 21:, :] if x.ndim == 4 else x[..., 21:] for x in args[:5]]
    head, mid, _ = dr.chunked_forward(*first, initial_state=s0, chunk_size=16)
    tail, end, _ = dr.recurrent_forward(*rest, initial_state=mid)
    assert _rel(np.concatenate([head, tail], axis=-2), whole) < 1e-12 and _rel(end, state) < 1e-12


@pytest.mark.parametrize("gate", GATES)
def test_float32_in_float32_out_and_inputs_untouched(gate):
    arrays = _inputs(make_rng(6), 1, 2, 9, 4, 3, np.float32, gate)
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


REFERENCES = {("scalar", "chunked"): torch_chunk_gated_delta_rule,
              ("scalar", "recurrent"): torch_recurrent_gated_delta_rule,
              ("channel", "chunked"): chunk_kimi_delta_attention,
              ("channel", "recurrent"): recurrent_kimi_delta_attention}


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_forward_and_gradients_equal_hugging_face(form, l2norm, dtype, gate):
    """Qwen3-Next's references for the scalar gate, Kimi Linear's for the channel-wise one. The references
    compute in float32 whatever the input, so the bound is float32's (1e-5 relative)."""
    rng = make_rng(7, l2norm, form == "chunked", gate == "channel")
    q, k, v, g, beta, s0 = _inputs(rng, 2, 2, 70, 8, 6, gate=gate)  # two chunks of 64, the second one padded
    grad_out, grad_state = randn(rng, 2, 2, 70, 6), randn(rng, 2, 2, 8, 6)
    ref_out, ref_state, ref_grads = _torch_reference(REFERENCES[gate, form], q, k, v, g, beta, s0, l2norm,
                                                      grad_out, grad_state)
    cast = [x.astype(dtype) for x in (q, k, v, g, beta, s0, grad_out, grad_state)]
    out, state, grads = _ours(form, *cast[:6], l2norm, *cast[6:])
    assert out.dtype == dtype and all(x.dtype == dtype for x in grads)
    assert_close_rel(out, ref_out, np.float32, f"{form} out")
    assert_close_rel(state, ref_state, np.float32, f"{form} state")
    for name, ours, ref in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, ref_grads):
        assert_close_rel(ours, ref, np.float32, f"{form} grad {name}")


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("form, length, chunk", [("chunked", 7, 3), ("chunked", 6, 6), ("recurrent", 5, None)])
def test_every_gradient_passes_finite_differences(form, length, chunk, gate):
    q, k, v, g, beta, s0 = args = _inputs(make_rng(8, length), 1, 2, length, 3, 2, gate=gate)
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


@pytest.mark.parametrize("gate", GATES)
def test_token_weights_reproduce_the_output_from_a_zero_state(gate):
    q, k, v, g, beta, _ = _inputs(make_rng(11), 2, 2, 13, 4, 3, gate=gate)
    weights = dr.token_weights(q, k, g, beta)
    out, _, _ = dr.chunked_forward(q, k, v, g, beta, chunk_size=4)
    assert _rel(weights @ v, out) < 1e-12 and np.all(np.triu(weights, 1) == 0.0)


def test_a_channel_gate_equal_across_channels_is_the_scalar_gate():
    """The two gate kinds are one rule: a channel-wise log-decay that is the same on every key channel gives
    the scalar gate's outputs and a gradient whose channel sum is the scalar gate's."""
    q, k, v, g, beta, s0 = _inputs(make_rng(12), 1, 2, 11, 4, 3)
    wide = np.repeat(g[..., None], 4, axis=-1)  # (B, H, L, Dk)
    grad_out = randn(make_rng(13), 1, 2, 11, 3)
    for forward, backward, kwargs in ((dr.chunked_forward, dr.chunked_backward, {"chunk_size": 4}),
                                      (dr.recurrent_forward, dr.recurrent_backward, {"keep_states": True})):
        out, state, ctx = forward(q, k, v, g, beta, initial_state=s0, **kwargs)
        out_w, state_w, ctx_w = forward(q, k, v, wide, beta, initial_state=s0, **kwargs)
        dg, dg_w = backward(grad_out, ctx)[3], backward(grad_out, ctx_w)[3]
        assert _rel(out_w, out) < 1e-13 and _rel(state_w, state) < 1e-13
        assert dg.shape == g.shape and dg_w.shape == wide.shape and _rel(dg_w.sum(axis=-1), dg) < 1e-12


def test_a_gate_of_another_shape_is_refused():
    q, k, v, g, beta, _ = _inputs(make_rng(14), 1, 2, 5, 4, 3)
    with pytest.raises(ValueError, match=r"g must have shape \(1, 2, 5\).*or \(1, 2, 5, 4\).*got \(1, 2, 5, 3\)"):
        dr.chunked_forward(q, k, v, np.zeros((1, 2, 5, 3)), beta)

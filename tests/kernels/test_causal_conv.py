"""The short causal depthwise convolution, with SiLU or none and with or without a bias: its gradients pass
float64 finite differences, it equals Hugging Face's ``causal_conv1d_fn`` / ``causal_conv1d_update`` (Qwen3-Next's
and LFM2's), and a carried state continues a sequence."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn as lfm2_conv_fn
from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_update as lfm2_conv_update
from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, causal_conv1d_update

import torch
from attnkit.kernels.causal_conv import causal_conv_backward, causal_conv_forward

from helpers import assert_close_rel, assert_gradient, make_rng, randn, to_numpy


def test_gradients_pass_finite_differences():
    rng = make_rng(1)
    x, w, state, grad_y = randn(rng, 2, 6, 3), randn(rng, 3, 4), randn(rng, 2, 3, 3), randn(rng, 2, 6, 3)
    y, _, saved = causal_conv_forward(x, w, state)
    grad_x, grad_w, grad_state, _ = causal_conv_backward(grad_y, w, saved)

    def loss():
        return np.sum(causal_conv_forward(x, w, state)[0] * grad_y)

    for name, arr, grad in (("x", x, grad_x), ("weight", w, grad_w), ("state", state, grad_state)):
        assert_gradient(loss, arr, grad, name)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_gradients_with_a_bias_pass_finite_differences(activation):
    rng = make_rng(4)
    x, w, b, state = randn(rng, 2, 5, 3), randn(rng, 3, 3), randn(rng, 3), randn(rng, 2, 2, 3)
    grad_y = randn(rng, 2, 5, 3)
    _, _, saved = causal_conv_forward(x, w, state, bias=b, activation=activation)
    grad_x, grad_w, grad_state, grad_b = causal_conv_backward(grad_y, w, saved)

    def loss():
        return np.sum(causal_conv_forward(x, w, state, bias=b, activation=activation)[0] * grad_y)

    for name, arr, grad in (("x", x, grad_x), ("weight", w, grad_w), ("state", state, grad_state), ("bias", b, grad_b)):
        assert_gradient(loss, arr, grad, name)


def test_without_activation_equals_lfm2s_convolution_whole_and_step_by_step():
    rng = make_rng(5)
    x, w, b = randn(rng, 2, 7, 4, dtype=np.float32), randn(rng, 4, 3, dtype=np.float32), randn(rng, 4, dtype=np.float32)
    ref = lfm2_conv_fn(torch.tensor(x).transpose(1, 2), torch.tensor(w), torch.tensor(b)).transpose(1, 2)
    y, _, _ = causal_conv_forward(x, w, bias=b, activation=None)
    assert_close_rel(y, to_numpy(ref), np.float32, "lfm2 conv y")
    hf_state, ours_state = torch.zeros(2, 4, 3), np.zeros((2, 2, 4), np.float32)
    for t in range(7):
        hf_y = lfm2_conv_update(torch.tensor(x[:, t:t + 1]).transpose(1, 2), hf_state, torch.tensor(w), torch.tensor(b))
        y_t, ours_state, _ = causal_conv_forward(x[:, t:t + 1], w, ours_state, bias=b, activation=None)
        assert_close_rel(y_t, to_numpy(hf_y.transpose(1, 2)), np.float32, "lfm2 conv step")


def test_equals_hugging_face_whole_and_step_by_step():
    rng = make_rng(2)
    x, w = randn(rng, 2, 9, 5, dtype=np.float32), randn(rng, 5, 4, dtype=np.float32)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ref = causal_conv1d_fn(tx.transpose(1, 2), tw, None, activation="silu").transpose(1, 2)  # HF is channels first
    grad_y = randn(rng, 2, 9, 5, dtype=np.float32)
    ref.backward(torch.tensor(grad_y))
    y, state, saved = causal_conv_forward(x, w)
    grad_x, grad_w, _, _ = causal_conv_backward(grad_y, w, saved)
    assert y.dtype == np.float32 and grad_x.dtype == np.float32
    assert_close_rel(y, to_numpy(ref), np.float32, "conv y")
    assert_close_rel(grad_x, to_numpy(tx.grad), np.float32, "conv grad x")
    assert_close_rel(grad_w, to_numpy(tw.grad), np.float32, "conv grad weight")
    # HF's decoding state is the last K inputs (channels first); ours is the last K - 1
    hf_state = torch.zeros(2, 5, 4)
    steps, ours_state = [], np.zeros((2, 3, 5), np.float32)
    for t in range(9):
        hf_y = causal_conv1d_update(torch.tensor(x[:, t:t + 1]).transpose(1, 2), hf_state, torch.tensor(w), None,
                                    "silu")
        y_t, ours_state, _ = causal_conv_forward(x[:, t:t + 1], w, ours_state)
        assert_close_rel(y_t, to_numpy(hf_y.transpose(1, 2)), np.float32, "conv step")
        steps.append(y_t)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(state, ours_state)


def test_a_carried_state_continues_the_sequence_and_nothing_is_aliased():
    rng = make_rng(3)
    x, w = randn(rng, 1, 10, 4), randn(rng, 4, 3)
    whole, end, _ = causal_conv_forward(x, w)
    first, mid, _ = causal_conv_forward(x[:, :1], w)  # shorter than the kernel: the state keeps zeros
    rest, end2, _ = causal_conv_forward(x[:, 1:], w, mid)
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), whole, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(end, end2)
    end[...] = 1.0
    assert not np.any(x[:, -2:] == 1.0)

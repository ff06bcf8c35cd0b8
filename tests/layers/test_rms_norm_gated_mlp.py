"""RMSNorm and GatedMLP: exact gradients (float64 finite differences) and parity with Hugging Face/torch."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import torch
from attnkit.layers.gated_mlp import GatedMLP
from attnkit.layers.rms_norm import RMSNorm
from decoder_cases import HF_ACT, copy_gated_mlp, hf_config, tiny_config

from helpers import assert_close_rel, assert_gradient, make_rng, randn


def test_rms_norm_gradients_by_finite_differences():
    rng = make_rng(1)
    norm = RMSNorm(5, eps=1e-5)
    norm.gamma = randn(rng, 5)
    x, g = randn(rng, 2, 3, 5), randn(rng, 2, 3, 5)
    norm(x)
    grad_x = norm.backward(g)
    assert_gradient(lambda: np.sum(norm(x) * g), x, grad_x, "x")
    norm.zero_grad()
    norm(x)
    norm.backward(g)
    assert_gradient(lambda: np.sum(norm(x) * g), norm.gamma, norm.grads["gamma"], "gamma")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rms_norm_matches_torch(dtype):
    rng = make_rng(2)
    x, g, gamma = randn(rng, 3, 4, 16, scale=3.0), randn(rng, 3, 4, 16), randn(rng, 16)
    ours = RMSNorm(16, eps=1e-6).astype(dtype)
    ours.gamma = gamma
    y = ours(x.astype(dtype))
    grad_x = ours.backward(g.astype(dtype))
    tx = torch.tensor(x.astype(dtype), requires_grad=True)
    if dtype == np.float32:  # HF's module (it computes in float32 whatever the input)
        theirs = LlamaRMSNorm(16, eps=1e-6)
        with torch.no_grad():
            theirs.weight.copy_(torch.from_numpy(gamma.astype(np.float32)))
        weight = theirs.weight
        ty = theirs(tx)
    else:  # HF would round a float64 input to float32; torch's own RMSNorm keeps float64
        weight = torch.tensor(gamma, requires_grad=True)
        ty = torch.nn.functional.rms_norm(tx, (16,), weight, eps=1e-6)
    ty.backward(torch.from_numpy(g.astype(dtype)))
    assert y.dtype == dtype and grad_x.dtype == dtype
    assert_close_rel(y, ty.detach().numpy(), dtype, "rms_norm y")
    assert_close_rel(grad_x, tx.grad.numpy(), dtype, "rms_norm grad_x")
    assert_close_rel(ours.grads["gamma"], weight.grad.numpy(), dtype, "rms_norm grad_gamma")


def test_rms_norm_float16_statistics_in_float32():
    x = np.full((1, 4), 300.0, dtype=np.float16)  # x^2 = 90000 overflows float16
    y = RMSNorm(4).astype(np.float16)(x)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float64), 1.0, rtol=1e-3)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_gradients_by_finite_differences(activation, bias):
    rng = make_rng(3, bias)
    mlp = GatedMLP(4, 5, activation, bias, rng=rng)
    for name, p in mlp.named_parameters():
        setattr(mlp, name, randn(rng, *p.shape, scale=0.7))
    x, g = randn(rng, 2, 3, 4), randn(rng, 2, 3, 4)
    mlp(x)
    grad_x = mlp.backward(g)
    assert_gradient(lambda: np.sum(mlp(x) * g), x, grad_x, "x")
    for name, p in mlp.named_parameters():
        assert_gradient(lambda: np.sum(mlp(x) * g), p, mlp.grads[name], name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_matches_hugging_face(dtype, activation, bias):
    rng = make_rng(4, bias)
    cfg = tiny_config(mlp=dict(activation=activation, bias=bias))
    ours = GatedMLP(cfg.hidden_size, cfg.mlp.intermediate_size, activation, bias, rng=rng).astype(dtype)
    for name, p in ours.named_parameters():
        setattr(ours, name, randn(rng, *p.shape, scale=0.3))
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    theirs = LlamaMLP(hf_config(cfg)).to(tdtype)
    copy_gated_mlp(ours, theirs, tdtype)
    x, g = randn(rng, 2, 5, 16, dtype=dtype), randn(rng, 2, 5, 16, dtype=dtype)
    y = ours(x)
    grad_x = ours.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    ty = theirs(tx)
    ty.backward(torch.from_numpy(g))
    assert y.dtype == dtype
    assert HF_ACT[activation]
    assert_close_rel(y, ty.detach().numpy(), dtype, "gated_mlp y")
    assert_close_rel(grad_x, tx.grad.numpy(), dtype, "gated_mlp grad_x")
    for name, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        assert_close_rel(ours.grads[f"W_{name}"], getattr(theirs, proj).weight.grad.numpy().T, dtype, name)
        if bias:
            assert_close_rel(ours.grads[f"b_{name}"], getattr(theirs, proj).bias.grad.numpy(), dtype, name)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="hidden_size"):
        GatedMLP(4, 6)(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="normalized_shape"):
        RMSNorm(4)(np.zeros((2, 3)))
    with pytest.raises(RuntimeError, match="before forward"):
        RMSNorm(4).backward(np.zeros((1, 4)))

"""MixtureOfExperts as Qwen3-Next's sparse MLP (softmax then top-k, a shared expert with a sigmoid gate): parity
with transformers' Qwen3NextSparseMoeBlock forward and backward with and without ``norm_topk_prob``, and every
gradient by float64 finite differences."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

import torch
from attnkit.layers import MixtureOfExperts
from attnkit.models import DecoderConfig, ExpertsConfig, MLPConfig

from helpers import assert_close_rel, assert_gradient, make_rng, randn

D, F, FS, E = 8, 6, 5, 5


def _part(num_experts, top_k, width, shared_width, normalise=True, layers=(0,)):
    return ExpertsConfig(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                         layers=layers, norm_topk_prob=normalise, shared_expert_intermediate_size=shared_width,
                         shared_expert_gate=True)


def _moe(top_k, normalise, rng, dtype=np.float64):
    cfg = DecoderConfig(family="qwen3_next", vocab_size=4, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=D, mlp=MLPConfig(7), experts=_part(E, top_k, F, FS, normalise))
    moe = MixtureOfExperts(cfg.hidden_size, cfg.experts, cfg.mlp.activation)
    for _, p in moe.named_parameters():
        p[...] = 0.5 * rng.standard_normal(p.shape)
    return moe.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("top_k, normalise", [(1, True), (2, True), (2, False), (5, False)])
def test_matches_transformers_sparse_moe_block(top_k, normalise, dtype):
    rng = make_rng(top_k, int(normalise))
    moe = _moe(top_k, normalise, rng, dtype)
    theirs = Qwen3NextSparseMoeBlock(Qwen3NextConfig(hidden_size=D, num_experts=E, num_experts_per_tok=top_k,
                                                     moe_intermediate_size=F, shared_expert_intermediate_size=FS,
                                                     norm_topk_prob=normalise))
    theirs = theirs.to(torch.float64 if dtype == np.float64 else torch.float32)
    p = {name: torch.tensor(np.asarray(value)) for name, value in moe.named_parameters()}
    with torch.no_grad():
        theirs.gate.weight.copy_(p["router.W_router"].T)
        theirs.experts.gate_up_proj.copy_(torch.cat([p["W_gate"], p["W_up"]], dim=-1).transpose(1, 2))
        theirs.experts.down_proj.copy_(p["W_down"].transpose(1, 2))
        for name in ("gate", "up", "down"):
            getattr(theirs.shared_expert, f"{name}_proj").weight.copy_(p[f"shared_expert.W_{name}"].T)
        theirs.shared_expert_gate.weight.copy_(p["shared_expert.W_shared_gate"].T)
    x, g = randn(rng, 3, 7, D, scale=2.0).astype(dtype), randn(rng, 3, 7, D).astype(dtype)
    y = moe(x)
    grad_x = moe.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    (theirs(tx) * torch.tensor(g)).sum().backward()
    assert y.dtype == dtype and grad_x.dtype == dtype
    # transformers takes the router's softmax in float32 whatever the dtype: float32 agreement at best
    tol = np.float32
    assert_close_rel(y, theirs(tx).detach().numpy(), tol, "y")
    assert_close_rel(grad_x, tx.grad.numpy(), tol, "grad_x")
    gate_up = theirs.experts.gate_up_proj.grad.transpose(1, 2)  # (E, D, 2F)
    expected = {"router.W_router": theirs.gate.weight.grad.T, "W_gate": gate_up[..., :F], "W_up": gate_up[..., F:],
                "W_down": theirs.experts.down_proj.grad.transpose(1, 2),
                "shared_expert.W_shared_gate": theirs.shared_expert_gate.weight.grad.T,
                **{f"shared_expert.W_{n}": getattr(theirs.shared_expert, f"{n}_proj").weight.grad.T
                   for n in ("gate", "up", "down")}}
    grads = dict(moe.named_gradients())
    assert set(expected) == set(grads)
    if top_k == 1 and normalise:  # one expert renormalised weighs exactly 1: the router learns nothing
        np.testing.assert_array_equal(grads["router.W_router"], 0.0)
        noise = np.max(np.abs(expected.pop("router.W_router").numpy()))  # transformers' float32 rounding of 1 - 1
        assert noise < 1e-6 * np.max(np.abs(grads["W_gate"])), noise
    for name, value in expected.items():
        assert_close_rel(grads[name], value.numpy(), tol, name)


@pytest.mark.parametrize("normalise", [True, False])
def test_every_gradient_passes_finite_differences(normalise):
    rng = make_rng(3, int(normalise))
    moe = _moe(2, normalise, rng)
    x, g = randn(rng, 2, 5, D), randn(rng, 2, 5, D)
    moe(x)
    grad_x = moe.backward(g)
    grads = dict(moe.named_gradients())

    def loss():
        return np.sum(moe(x) * g)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in moe.named_parameters():
        assert_gradient(loss, value, grads[name], name)


def test_the_config_refuses_what_no_model_has():
    with pytest.raises(ValueError, match="num_experts_per_tok \\(3\\) must be at most experts.num_experts \\(2\\)"):
        _part(2, 3, 4, 4)
    with pytest.raises(ValueError, match="distinct non-negative layer indices"):
        _part(2, 1, 4, 4, layers=(1, 1))
    with pytest.raises(ValueError, match="below num_layers"):
        DecoderConfig(family="qwen3_next", vocab_size=4, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=D, mlp=MLPConfig(7), experts=_part(2, 1, 4, 4, layers=(1,)))

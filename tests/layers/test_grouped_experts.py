"""MixtureOfExperts and Router as DeepSeek-V3's MLP (group-limited sigmoid routing, shared experts): parity with
transformers' DeepseekV3MoE forward and backward, every gradient by float64 finite differences, the routing rule
itself (correction bias for choosing only, groups limiting the choice), and the configuration's refusals."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek

import torch
from attnkit.layers import MixtureOfExperts, Router
from attnkit.models import DecoderConfig, ExpertsConfig, MLPConfig

from helpers import assert_close_rel, assert_gradient, make_rng, randn

D, F, E = 8, 5, 8

# (top_k, num_groups, topk_groups, normalize, scaling, shared)
SETTINGS = [(3, 4, 2, True, 2.5, 2), (2, 1, 1, False, 1.0, 1), (4, 2, 1, True, 0.7, 1)]


def _part(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, layers=(0,), **settings):
    return ExpertsConfig(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                         moe_intermediate_size=moe_intermediate_size, layers=layers, router="sigmoid_group_topk",
                         **settings)


def _moe(top_k, groups, topk_groups, normalize, scaling, shared, rng):
    part = _part(num_experts_per_tok=top_k, shared_expert_intermediate_size=shared * F, n_group=groups,
                 topk_group=topk_groups, norm_topk_prob=normalize, routed_scaling_factor=scaling)
    cfg = DecoderConfig(family="deepseek_v3", vocab_size=4, hidden_size=D, num_layers=1, num_heads=1,
                        num_kv_heads=1, head_dim=D, mlp=MLPConfig(6), experts=part)
    moe = MixtureOfExperts(cfg.hidden_size, cfg.experts, cfg.mlp.activation)
    for _, p in moe.named_parameters():
        p[...] = 0.5 * rng.standard_normal(p.shape)
    return moe


def _transformers_moe(moe: MixtureOfExperts, setting, dtype):
    top_k, groups, topk_groups, normalize, scaling, shared = setting
    theirs = hf_deepseek.DeepseekV3MoE(DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=top_k, n_group=groups,
        topk_group=topk_groups, norm_topk_prob=normalize, routed_scaling_factor=scaling, n_shared_experts=shared))
    theirs = theirs.to(torch.float64 if dtype == np.float64 else torch.float32)
    p = {name: torch.tensor(np.asarray(value)) for name, value in moe.named_parameters()}
    with torch.no_grad():
        theirs.gate.weight.copy_(p["router.W_router"].T)
        theirs.gate.e_score_correction_bias.copy_(p["router.e_score_correction_bias"])
        theirs.experts.gate_up_proj.copy_(torch.cat([p["W_gate"], p["W_up"]], dim=-1).transpose(1, 2))
        theirs.experts.down_proj.copy_(p["W_down"].transpose(1, 2))
        for name in ("gate", "up", "down"):
            getattr(theirs.shared_experts, f"{name}_proj").weight.copy_(p[f"shared_expert.W_{name}"].T)
    return theirs


class _Float64Router:
    """transformers' module namespace with ``torch.float32`` read as float64: its router computes in float32
    whatever the model's dtype (to keep bfloat16 checkpoints' routing stable), which would bound a float64
    comparison by float32's rounding; with this the same code runs in float64."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("setting", SETTINGS)
def test_matches_transformers_deepseek_v3_moe_forward_and_backward(setting, dtype, monkeypatch):
    if dtype == np.float64:
        monkeypatch.setattr(hf_deepseek, "torch", _Float64Router())
    rng = make_rng(*[int(v * 10) for v in setting])
    moe = _moe(*setting, rng).astype(dtype)
    moe.router.e_score_correction_bias[...] = 0.3 * rng.standard_normal(E)
    theirs = _transformers_moe(moe, setting, dtype)
    x, g = randn(rng, 3, 7, D, scale=2.0).astype(dtype), randn(rng, 3, 7, D).astype(dtype)
    y = moe(x)
    grad_x = moe.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    ty = theirs(tx)
    (ty * torch.tensor(g)).sum().backward()
    assert y.dtype == dtype and grad_x.dtype == dtype
    assert_close_rel(y, ty.detach().numpy(), dtype, "y")
    assert_close_rel(grad_x, tx.grad.numpy(), dtype, "grad_x")
    gate_up = theirs.experts.gate_up_proj.grad.transpose(1, 2)  # (E, D, 2F)
    torch_grads = {"router.W_router": theirs.gate.weight.grad.T, "W_gate": gate_up[..., :F], "W_up": gate_up[..., F:],
                   "W_down": theirs.experts.down_proj.grad.transpose(1, 2)}
    for name in ("gate", "up", "down"):
        torch_grads[f"shared_expert.W_{name}"] = getattr(theirs.shared_experts, f"{name}_proj").weight.grad.T
    ours = dict(moe.named_gradients())
    for name, expected in torch_grads.items():
        assert_close_rel(ours[name], expected.numpy(), dtype, name)
    assert not ours["router.e_score_correction_bias"].any()  # a buffer in torch: it only chooses


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_gradient_by_finite_differences(setting):
    rng = make_rng(21, setting[0])
    moe = _moe(*setting, rng)
    x, g = randn(rng, 2, 5, D), randn(rng, 2, 5, D)
    moe(x)
    grad_x = moe.backward(g)
    assert_gradient(lambda: np.sum(moe(x) * g), x, grad_x, "x")
    for name, value in list(moe.named_parameters()):
        moe.zero_grad()
        moe(x)
        moe.backward(g)
        assert_gradient(lambda: np.sum(moe(x) * g), value, dict(moe.named_gradients())[name], name)


def test_the_bias_only_chooses_and_the_groups_limit_the_choice():
    rng = make_rng(31)
    router = Router(D, _part(n_group=4, topk_group=1, norm_topk_prob=False))
    router.W_router[...] = rng.standard_normal((D, E))
    x = randn(rng, 40, D)
    scores = 1 / (1 + np.exp(-(x @ router.W_router)))  # (N, E)
    chosen, weights = router(x)
    # without a bias and without normalising, the weights are the chosen experts' sigmoid scores
    np.testing.assert_allclose(weights, np.take_along_axis(scores, chosen, -1), rtol=1e-12)
    # one kept group of two: both experts of the group whose two scores sum highest
    best_group = scores.reshape(40, 4, 2).sum(-1).argmax(-1)  # (N,)
    np.testing.assert_array_equal(np.sort(chosen, -1), np.stack([2 * best_group, 2 * best_group + 1], -1))
    assert (np.sort(chosen, -1) != np.sort(np.argsort(-scores, -1)[:, :2], -1)).any(), "the groups never acted"
    # a large bias on expert 7 makes every token choose it, but its weight stays its uncorrected score
    router.e_score_correction_bias[7] = 10.0
    chosen, weights = router(x)
    assert (chosen == 7).any(-1).all()
    np.testing.assert_allclose(weights, np.take_along_axis(scores, chosen, -1), rtol=1e-12)


def test_normalised_weights_sum_to_the_scaling_factor():
    rng = make_rng(32)
    router = Router(D, _part(num_experts_per_tok=3, n_group=2, topk_group=2, routed_scaling_factor=2.5), rng=rng)
    _, weights = router(randn(rng, 4, 6, D))
    assert weights.shape == (4, 6, 3)
    np.testing.assert_allclose(weights.sum(-1), 2.5, rtol=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_group=3), "must divide experts.num_experts"),
    (dict(n_group=8), "at least two experts"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "must fit in the kept groups"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(layers=(-1,)), "experts.layers"),
])
def test_config_refuses_routing_that_cannot_work(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _part(**kwargs)


def test_the_part_needs_a_gated_mlp():
    with pytest.raises(ValueError, match="the other layers' mlp.kind 'gated'"):
        DecoderConfig(family="deepseek_v3", vocab_size=4, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=D, mlp=MLPConfig(6, kind="plain"), experts=_part())


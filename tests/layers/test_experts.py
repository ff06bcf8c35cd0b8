"""MixtureOfExperts as gpt-oss's routed MLP (top-k then softmax, clamped SwiGLU experts with biases): parity with
transformers' GptOssMLP forward and backward, exact gradients by finite differences (clamps active), routing that
only ever runs the chosen experts."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

import torch
from attnkit.layers import MixtureOfExperts
from attnkit.models import DecoderConfig, ExpertsConfig, MLPConfig

from helpers import assert_close_rel, assert_gradient, make_rng, randn

D, F, E = 8, 6, 5


def _config(top_k=2, limit=0.7, alpha=1.3):
    return DecoderConfig(family="gpt_oss", vocab_size=4, hidden_size=D, num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=D, mlp=MLPConfig(F),
                         experts=ExpertsConfig(num_experts=E, num_experts_per_tok=top_k, moe_intermediate_size=F,
                                               layers=(0,), router="topk_softmax", router_bias=True, expert_bias=True,
                                               swiglu_limit=limit, swiglu_alpha=alpha))


def _randomised(moe, rng):
    for _, p in moe.named_parameters():
        p[...] = 0.5 * rng.standard_normal(p.shape)
    return moe


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_matches_transformers_gpt_oss_mlp_forward_and_backward(dtype, top_k):
    rng = make_rng(top_k, 7)
    moe = _randomised(MixtureOfExperts(D, _config(top_k).experts), rng).astype(dtype)
    theirs = GptOssMLP(GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                    num_experts_per_tok=top_k, swiglu_limit=0.7, swiglu_alpha=1.3))
    theirs = theirs.to(torch.float64 if dtype == np.float64 else torch.float32)
    p = {name: torch.tensor(np.asarray(value)) for name, value in moe.named_parameters()}
    with torch.no_grad():
        theirs.router.weight.copy_(p["router.W_router"].T)
        theirs.router.bias.copy_(p["router.b_router"])
        gate_up = torch.stack([p["W_gate"], p["W_up"]], dim=-1).reshape(E, D, 2 * F)  # gate, up alternating
        theirs.experts.gate_up_proj.copy_(gate_up)
        theirs.experts.gate_up_proj_bias.copy_(torch.stack([p["b_gate"], p["b_up"]], dim=-1).reshape(E, 2 * F))
        theirs.experts.down_proj.copy_(p["W_down"])
        theirs.experts.down_proj_bias.copy_(p["b_down"])
    x, g = randn(rng, 3, 7, D, scale=2.0).astype(dtype), randn(rng, 3, 7, D).astype(dtype)
    y = moe(x)
    grad_x = moe.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    ty, _ = theirs(tx)
    (ty * torch.tensor(g)).sum().backward()
    assert y.dtype == dtype and grad_x.dtype == dtype
    assert_close_rel(y, ty.detach().numpy(), dtype, "y")
    assert_close_rel(grad_x, tx.grad.numpy(), dtype, "grad_x")
    torch_grads = {"router.W_router": theirs.router.weight.grad.T, "router.b_router": theirs.router.bias.grad,
                   "W_gate": theirs.experts.gate_up_proj.grad[..., ::2],
                   "W_up": theirs.experts.gate_up_proj.grad[..., 1::2],
                   "b_gate": theirs.experts.gate_up_proj_bias.grad[..., ::2],
                   "b_up": theirs.experts.gate_up_proj_bias.grad[..., 1::2],
                   "W_down": theirs.experts.down_proj.grad, "b_down": theirs.experts.down_proj_bias.grad}
    ours = dict(moe.named_gradients())
    for name, expected in torch_grads.items():
        assert_close_rel(ours[name], expected.numpy(), dtype, name)


def test_every_gradient_by_finite_differences():
    rng = make_rng(11)
    moe = _randomised(MixtureOfExperts(D, _config(top_k=3, limit=0.8).experts), rng)
    x, g = randn(rng, 2, 5, D), randn(rng, 2, 5, D)
    grad_x = moe.backward(g) if moe(x) is not None else None
    gate = np.einsum("btd,edf->btef", x, moe.W_gate) + moe.b_gate  # (B, T, E, F)
    assert np.mean(gate > 0.8) > 0.1  # the clamp acts on a good share of the units being checked
    assert_gradient(lambda: np.sum(moe(x) * g), x, grad_x, "x")
    for name, value in list(moe.named_parameters()):
        moe.zero_grad()
        moe(x)
        moe.backward(g)
        assert_gradient(lambda: np.sum(moe(x) * g), value, dict(moe.named_gradients())[name], name)


def test_only_the_chosen_experts_run_and_weights_are_a_softmax_over_them():
    rng = make_rng(12)
    moe = _randomised(MixtureOfExperts(D, _config(top_k=2).experts), rng)
    x = randn(rng, 4, 3, D)
    chosen, weights = moe.router(x)
    assert chosen.shape == weights.shape == (4, 3, 2)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-12)
    logits = x @ moe.router.W_router + moe.router.b_router  # (4, 3, E)
    np.testing.assert_array_equal(chosen, np.argsort(-logits, axis=-1)[..., :2])
    unused = sorted(set(range(E)) - set(chosen.ravel().tolist()))
    before = moe(x)
    for e in unused:  # an expert no token picked cannot change any output, whatever its weights
        moe.W_down[e] = 1e6
    np.testing.assert_array_equal(moe(x), before)


def test_config_refuses_more_experts_per_token_than_experts():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(6\) must be at most experts.num_experts \(5\)"):
        _config(top_k=E + 1)


def _every_part(**settings):
    """A mixture with a router bias and a gated shared expert: every parameter name a mixture can have."""
    part = ExpertsConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, layers=(0,),
                         router="topk_softmax", router_bias=True, shared_expert_intermediate_size=3,
                         shared_expert_gate=True, **settings)
    return MixtureOfExperts(D, part)


# gpt-oss's router, Qwen3-Next's shared expert gate and DeepSeek-V3's shared experts had other names
@pytest.mark.parametrize("earlier, current", [("W_router", "router.W_router"), ("b_router", "router.b_router"),
                                              ("W_shared_gate", "shared_expert.W_shared_gate"),
                                              ("shared_experts.W_up", "shared_expert.W_up")])
def test_a_state_dict_of_the_earlier_names_loads(earlier, current):
    moe = _every_part()
    state = {name: np.full(value.shape, i + 1.0) for i, (name, value) in enumerate(moe.state_dict().items())}
    expected = state[current]
    state[earlier] = state.pop(current)
    moe.load_state_dict(state)
    np.testing.assert_array_equal(dict(moe.named_parameters())[current], expected)


@pytest.mark.parametrize("settings, match", [
    (dict(router="softmax"), "experts.router must be one of 'softmax_topk', 'topk_softmax', 'topk_sigmoid', "
                               "'sigmoid_group_topk'"),
    (dict(n_group=2), "n_group and experts.topk_group are the 'sigmoid_group_topk' router's"),
    (dict(norm_topk_prob=False), "'topk_softmax' router's weights are a softmax over the chosen k"),
    (dict(swiglu_limit=0.0), "experts.swiglu_limit must be a finite positive number"),
    (dict(routed_scaling_factor=float("inf")), "experts.routed_scaling_factor"),
    (dict(layers=()), r"experts.layers must list distinct non-negative layer indices \(at least one\)"),
])
def test_the_config_refuses_what_no_mixture_has(settings, match):
    base = dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, layers=(0,), router="topk_softmax")
    with pytest.raises(ValueError, match=match):
        ExpertsConfig(**{**base, **settings})
    with pytest.raises(ValueError, match="shared_expert_gate gates a shared expert"):
        ExpertsConfig(**base, shared_expert_gate=True)

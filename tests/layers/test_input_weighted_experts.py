"""MixtureOfExperts as Llama 4's routed MLP: the ``topk_sigmoid`` router (the top k logits, each weighed by its
own sigmoid) and ``weigh_inputs`` (the weight scales the expert's input, ``expert(w x)``), beside an ungated shared
expert. Parity with transformers' Llama4TextMoe forward and backward, every gradient by finite differences in
float64, and the rule that sets these experts apart from the output-weighted ones."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import Llama4TextConfig
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

import torch
from attnkit.kernels import routing
from attnkit.layers import MixtureOfExperts
from attnkit.models import DecoderConfig, ExpertsConfig, MLPConfig

from helpers import assert_close_rel, assert_gradient, make_rng, randn

D, F, E = 8, 6, 5


def _config(top_k=2, weigh_inputs=True, shared=F):
    part = ExpertsConfig(num_experts=E, num_experts_per_tok=top_k, moe_intermediate_size=F, layers=(0,),
                         router="topk_sigmoid", norm_topk_prob=False, shared_expert_intermediate_size=shared,
                         weigh_inputs=weigh_inputs)
    return DecoderConfig(family="llama4_text", vocab_size=4, hidden_size=D, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=D, mlp=MLPConfig(F), experts=part)


def _randomised(moe, rng):
    for _, p in moe.named_parameters():
        p[...] = 0.5 * rng.standard_normal(p.shape)
    return moe


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("top_k", [1, 2, 5])
def test_matches_transformers_llama4_moe_forward_and_backward(dtype, top_k):
    rng = make_rng(top_k, 41)
    moe = _randomised(MixtureOfExperts(D, _config(top_k).experts), rng).astype(dtype)
    theirs = Llama4TextMoe(Llama4TextConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                                            num_experts_per_tok=top_k))
    theirs = theirs.to(torch.float64 if dtype == np.float64 else torch.float32)
    p = {name: torch.tensor(np.asarray(value)) for name, value in moe.named_parameters()}
    with torch.no_grad():
        theirs.router.weight.copy_(p["router.W_router"].T)
        theirs.experts.gate_up_proj.copy_(torch.cat([p["W_gate"], p["W_up"]], dim=-1))  # gate columns first
        theirs.experts.down_proj.copy_(p["W_down"])
        for name in ("gate", "up", "down"):
            getattr(theirs.shared_expert, f"{name}_proj").weight.copy_(p[f"shared_expert.W_{name}"].T)
    x, g = randn(rng, 3, 7, D, scale=2.0).astype(dtype), randn(rng, 3, 7, D).astype(dtype)
    y = moe(x)
    grad_x = moe.backward(g)
    tx = torch.tensor(x, requires_grad=True)
    ty, _ = theirs(tx)
    (ty.reshape(x.shape) * torch.tensor(g)).sum().backward()
    assert y.dtype == dtype and grad_x.dtype == dtype
    # transformers takes the router's sigmoid in float32 whatever the module's dtype, so a float64 module agrees to
    # float32's rounding (the float64 gradients are checked by finite differences below)
    assert_close_rel(y, ty.detach().reshape(x.shape).numpy(), np.float32, "y")
    assert_close_rel(grad_x, tx.grad.numpy(), np.float32, "grad_x")
    f = F
    torch_grads = {"router.W_router": theirs.router.weight.grad.T,
                   "W_gate": theirs.experts.gate_up_proj.grad[..., :f],
                   "W_up": theirs.experts.gate_up_proj.grad[..., f:], "W_down": theirs.experts.down_proj.grad,
                   **{f"shared_expert.W_{n}": getattr(theirs.shared_expert, f"{n}_proj").weight.grad.T
                      for n in ("gate", "up", "down")}}
    ours = dict(moe.named_gradients())
    for name, expected in torch_grads.items():
        assert_close_rel(ours[name], expected.numpy(), np.float32, name)


@pytest.mark.parametrize("weigh_inputs", [True, False])
def test_every_gradient_by_finite_differences(weigh_inputs):
    rng = make_rng(42, int(weigh_inputs))
    moe = _randomised(MixtureOfExperts(D, _config(top_k=2, weigh_inputs=weigh_inputs).experts), rng)
    x, g = randn(rng, 2, 5, D), randn(rng, 2, 5, D)
    grad_x = moe.backward(g) if moe(x) is not None else None
    assert_gradient(lambda: np.sum(moe(x) * g), x, grad_x, "x")
    for name, value in list(moe.named_parameters()):
        moe.zero_grad()
        moe(x)
        moe.backward(g)
        assert_gradient(lambda: np.sum(moe(x) * g), value, dict(moe.named_gradients())[name], name)


def test_the_weight_scales_the_input_not_the_output():
    """SwiGLU is not linear, so expert(w x) and w expert(x) differ; with one expert per token and no shared expert
    the mixture is exactly the chosen expert on its scaled input."""
    rng = make_rng(43)
    moe = _randomised(MixtureOfExperts(D, _config(top_k=1, shared=0).experts), rng)
    plain = _randomised(MixtureOfExperts(D, _config(top_k=1, shared=0, weigh_inputs=False).experts), make_rng(43))
    x = randn(rng, 4, D)
    logits = x @ moe.router.W_router  # (4, E)
    chosen = np.argmax(logits, axis=-1)  # (4,)
    w = 1 / (1 + np.exp(-logits[np.arange(4), chosen]))[:, None]  # (4, 1)
    h = w * x  # (4, D)
    gate = np.einsum("nd,ndf->nf", h, moe.W_gate[chosen])  # (4, F)
    up = np.einsum("nd,ndf->nf", h, moe.W_up[chosen])  # (4, F)
    expected = np.einsum("nf,nfd->nd", gate / (1 + np.exp(-gate)) * up, moe.W_down[chosen])  # (4, D)
    np.testing.assert_allclose(moe(x), expected, rtol=1e-12, atol=1e-12)
    assert np.max(np.abs(plain(x) - moe(x))) > 1e-3  # the output-weighted mixture is another function


def test_topk_sigmoid_router_weighs_each_chosen_logit_alone():
    logits = np.array([[0.5, -1.0, 2.0, 2.0], [-3.0, -2.0, -1.0, -4.0]])
    chosen, weights, saved = routing.route(logits, "topk_sigmoid", 2, normalize=False)
    np.testing.assert_array_equal(chosen, [[2, 3], [2, 1]])  # a tie goes to the lower expert, as torch.topk
    np.testing.assert_allclose(weights, 1 / (1 + np.exp(-np.take_along_axis(logits, chosen, -1))), rtol=1e-15)
    g = np.array([[1.0, 2.0], [0.5, -1.0]])
    grad = routing.route_backward(g, chosen, saved, "topk_sigmoid", 4, normalize=False)
    expected = np.zeros_like(logits)
    np.put_along_axis(expected, chosen, g * weights * (1 - weights), axis=-1)
    np.testing.assert_allclose(grad, expected, rtol=1e-15)


def test_the_config_refuses_a_normalised_topk_sigmoid_router():
    with pytest.raises(ValueError, match="'topk_sigmoid' router weighs each chosen expert by its own sigmoid"):
        ExpertsConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, layers=(0,),
                      router="topk_sigmoid")
    with pytest.raises(TypeError, match="experts.weigh_inputs must be True or False"):
        ExpertsConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, layers=(0,),
                      router="topk_sigmoid", norm_topk_prob=False, weigh_inputs=1)

"""A mixture of experts' hook points (``blocks.{i}.mlp.hook_expert_indices`` and ``hook_router_weights``) against
transformers' Qwen3-MoE router on the same tiny model in float64: the values, the gradient at the weights, and
the same interventions (weights replaced, tokens routed elsewhere) made on both sides. transformers takes the
router's softmax in float32 whatever the model's dtype, so the router's numbers agree to float32 rounding
(``hf_models.TOL``)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from attnkit.explain import hook_names, hooks, run_with_cache  # noqa: E402
from hf_models import TOL, float64_pair  # noqa: E402

IDS = np.array([[5, 17, 3, 60, 42, 9, 77, 21]])
POINTS = ("blocks.0.mlp.hook_expert_indices", "blocks.0.mlp.hook_router_weights")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    lm, hf = float64_pair("qwen3_moe", tmp_path_factory.mktemp("hf_hooks_experts"))
    hf.set_experts_implementation("eager")  # transformers' grouped products run in float32 only
    return lm, hf


def hf_logits(hf, replace=None, seen=None):
    """transformers' logits (1, L, V) with layer 0's router output (logits, weights, indices) seen and replaced."""
    def hook(module, args, out):
        if seen is not None:
            seen["weights"] = out[1]
            out[1].retain_grad()
            seen["indices"] = out[2]
        return out if replace is None else replace(out)

    handle = hf.model.layers[0].mlp.gate.register_forward_hook(hook)
    try:
        return hf(torch.from_numpy(IDS), position_ids=torch.arange(IDS.shape[1])[None]).logits
    finally:
        handle.remove()


def test_the_points_are_the_mixtures_in_forward_order(pair):
    lm, _ = pair
    names = hook_names(lm)
    for layer in (0, 2):  # layer 1 is dense: no points there
        at = names.index(f"blocks.{layer}.hook_mlp_out")
        assert names[at - 2:at] == [f"blocks.{layer}.mlp.{point}"
                                    for point in ("hook_expert_indices", "hook_router_weights")]
    assert not any(name.startswith("blocks.1.mlp.") for name in names)


def test_the_routing_and_its_gradient_equal_transformers(pair):
    lm, hf = pair
    grads = {}
    _, cache = run_with_cache(lm, IDS, names=list(POINTS))
    with hooks(lm, backward={POINTS[1]: lambda g, n: grads.__setitem__(n, np.array(g))}):
        logits = lm(IDS)
        lm.backward(np.ones_like(logits))
    lm.zero_grad()
    seen = {}
    hf_logits(hf, seen=seen).sum().backward()
    hf.zero_grad()
    chosen, weights = cache[POINTS[0]], cache[POINTS[1]]
    assert chosen.shape == weights.shape == (1, 8, 2) and chosen.dtype == np.int64
    np.testing.assert_array_equal(chosen[0], seen["indices"].numpy())
    np.testing.assert_allclose(weights[0], seen["weights"].detach().numpy(), atol=TOL)
    np.testing.assert_allclose(grads[POINTS[1]][0], seen["weights"].grad.numpy(), atol=TOL)
    assert np.abs(grads[POINTS[1]]).min() > 0


def test_replaced_weights_are_a_constant_and_transformers_agrees(pair):
    lm, hf = pair
    fixed = np.tile([0.9, -0.4], (1, 8, 1))  # (1, L, k): the first expert up, the second against
    with hooks(lm, {POINTS[1]: lambda w, n: fixed}):
        logits = lm(IDS)
        lm.backward(np.ones_like(logits))
    ours = {name: g.copy() for name, g in lm.named_gradients()}
    lm.zero_grad()
    replaced = torch.from_numpy(fixed[0].copy())
    out = hf_logits(hf, replace=lambda out: (out[0], replaced, out[2]))
    out.sum().backward()
    np.testing.assert_allclose(logits, out.detach().numpy(), atol=TOL)
    assert not np.allclose(logits, lm(IDS), atol=1e-3)  # the replacement changed something
    experts = hf.model.layers[0].mlp.experts
    np.testing.assert_allclose(ours["layers.0.mlp.W_down"], experts.down_proj.grad.transpose(1, 2).numpy(), rtol=TOL,
                               atol=TOL)
    # the router chose, but its weights were a constant: neither model gives it a gradient
    np.testing.assert_array_equal(ours["layers.0.mlp.router.W_router"], 0.0)
    assert hf.model.layers[0].mlp.gate.weight.grad is None
    assert np.abs(ours["layers.2.mlp.router.W_router"]).max() > 0
    hf.zero_grad()


def test_rerouted_tokens_equal_transformers_with_the_same_choice(pair):
    lm, hf = pair
    choice = np.tile([3, 1], (1, 8, 1))  # every token to experts 3 and 1, with the router's weights
    with hooks(lm, {POINTS[0]: lambda c, n: choice}):
        logits = lm(IDS)
    with torch.no_grad():
        out = hf_logits(hf, replace=lambda out: (out[0], out[1], torch.from_numpy(choice[0].copy())))
    np.testing.assert_allclose(logits, out.numpy(), atol=TOL)
    assert not np.allclose(logits, lm(IDS), atol=1e-3)


@pytest.mark.parametrize("choice", [[[0, 0]], [[0, 4]], [[-1, 2]]])
def test_a_rerouting_must_name_distinct_experts_that_exist(pair, choice):
    lm, _ = pair
    with pytest.raises(ValueError, match=r"must choose 2 distinct experts in \[0, 4\) per token"):
        with hooks(lm, {POINTS[0]: lambda c, n: np.broadcast_to(choice, c.shape)}):
            lm(IDS)


def test_the_chosen_experts_take_forward_hooks_only(pair):
    lm, _ = pair
    with pytest.raises(ValueError, match="hook_expert_indices takes forward hooks only"):
        with hooks(lm, backward={POINTS[0]: lambda g, n: g}):
            pass

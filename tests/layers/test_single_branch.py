"""Nemotron-H's parts: the squared ReLU, the ungated MLP (equal to transformers' NemotronHMLP forward and backward,
float64 finite differences with and without biases) and the one-branch blocks (a mixer alone, an MLP alone), whose
backward passes finite differences and whose steps equal their forward."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.kernels.activations import activation_backward, activation_forward
from attnkit.layers import Mamba2Config
from attnkit.layers.identity import Identity
from attnkit.layers.lm_block import MixerOnlyBlock, MLPOnlyBlock, make_block
from attnkit.layers.ungated_mlp import UngatedMLP
from attnkit.models import DecoderConfig, MLPConfig, RotaryConfig

from helpers import assert_gradient, make_rng, randn, to_numpy


def _config(**overrides) -> DecoderConfig:
    base = dict(family="nemotron_h", vocab_size=11, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1,
                head_dim=4, mlp=MLPConfig(6, kind="ungated", activation="relu2"), residual="single",
                rotary=RotaryConfig(skip_layers=(0, 1, 2)), layer_types=("mamba2", "full_attention", "mlp"),
                mixer_parts=(Mamba2Config(num_heads=2, head_dim=8, state_size=3, n_groups=2, conv_kernel_size=3,
                                          chunk_size=2, time_step_min=0.3),))
    base.update(overrides)
    return DecoderConfig(**base)


def _moved(module, rng):
    for name, p in module.named_parameters():  # away from the initial ones and zeros, so every term counts
        p[...] = (1.0 if name.endswith("gamma") else 0.0) + 0.4 * rng.standard_normal(p.shape)
    return module


def test_relu2_is_the_square_of_relu_and_its_derivative_twice_relu():
    x = np.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    np.testing.assert_array_equal(activation_forward(x, "relu2"), [0.0, 0.0, 0.0, 0.25, 9.0])
    np.testing.assert_array_equal(activation_backward(np.ones(5), x, None, "relu2"), [0.0, 0.0, 0.0, 1.0, 6.0])
    y32 = activation_forward(x.astype(np.float32), "relu2")
    assert y32.dtype == np.float32


@pytest.mark.parametrize("bias, activation", [(False, "relu2"), (True, "relu2"), (True, "silu")])
def test_ungated_mlp_passes_finite_differences(bias, activation):
    rng = make_rng(3)
    mlp = _moved(UngatedMLP(8, 6, activation, bias, rng=0), rng)
    x, g = randn(rng, 2, 5, 8), randn(rng, 2, 5, 8)
    mlp(x)
    grad_x = mlp.backward(g)
    assert sorted(mlp.grads) == sorted(["W_up", "W_down"] + (["b_up", "b_down"] if bias else []))

    def loss():
        return np.sum(mlp(x) * g)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in mlp.named_parameters():
        assert_gradient(loss, value, mlp.grads[name], name)
    np.testing.assert_array_equal(mlp.step(x[:, 0]), mlp(x)[:, 0])


@pytest.mark.parametrize("bias", [False, True])
def test_ungated_mlp_equals_nemotron_h_mlp_forward_and_backward(bias):
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMLP

    torch.manual_seed(0)
    hf = NemotronHMLP(NemotronHConfig(hidden_size=8, intermediate_size=6, mlp_bias=bias,
                                      layers_block_type=["mlp"])).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.5)
    ours = UngatedMLP(8, 6, "relu2", bias, rng=0)
    weights = {"W_up": hf.up_proj.weight.T, "W_down": hf.down_proj.weight.T}
    if bias:
        weights.update(b_up=hf.up_proj.bias, b_down=hf.down_proj.bias)
    ours.load_state_dict({k: to_numpy(v) for k, v in weights.items()})
    rng = make_rng(4)
    x, g = randn(rng, 2, 5, 8), randn(rng, 2, 5, 8)
    tx = torch.tensor(x, requires_grad=True)
    ty = hf(tx)
    ty.backward(torch.tensor(g))
    np.testing.assert_allclose(ours(x), to_numpy(ty), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.backward(g), to_numpy(tx.grad), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.grads["W_up"], to_numpy(hf.up_proj.weight.grad).T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layer, kind", [(0, MixerOnlyBlock), (1, MixerOnlyBlock), (2, MLPOnlyBlock)])
def test_one_branch_blocks_pass_finite_differences(layer, kind):
    rng = make_rng(5, layer)
    cfg = _config()
    block = _moved(make_block(cfg, layer, rng=0), rng)
    assert type(block) is kind
    absent = (block.mlp, block.mlp_norm) if kind is MixerOnlyBlock else (block.attention, block.attn_norm)
    assert all(isinstance(part, Identity) for part in absent)
    mask = np.array([[True] * 5, [False, False, True, True, True]])
    x, g = randn(rng, 2, 5, 8), randn(rng, 2, 5, 8)
    g[~mask] = 0

    def loss():
        return np.sum(block(x, attention_mask=mask) * g)

    loss()
    grad_x = block.backward(g)
    assert_gradient(loss, x, grad_x, "x")
    grads = dict(block.named_gradients())
    for name, p in block.named_parameters():
        assert_gradient(loss, p, grads[name], name)


def test_an_mlp_layer_needs_the_single_branch_residual():
    with pytest.raises(ValueError, match="only residual='single' builds"):
        _config(residual="sequential")
    specs = _config().layers
    assert [s.block for s in specs] == ["mixer_only", "mixer_only", "mlp_only"]
    assert [(s.mixer, s.mlp, s.cache) for s in specs] == [("mamba2", None, "state"), ("full_attention", None,
                                                          "keys_values"), (None, "ungated", "none")]

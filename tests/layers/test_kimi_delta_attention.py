"""KimiDeltaAttention: equals Hugging Face's Kimi Linear layer forward and backward (every parameter's gradient),
passes float64 finite differences for every parameter and the input, and its cached decoding (prefill, steps,
a reordered cache) equals the whole-sequence forward."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

import torch
from attnkit.layers.kimi_delta_attention import KimiDeltaAttention, KimiDeltaAttentionConfig

from helpers import assert_gradient, make_rng, randn, to_numpy

D, H, DH = 16, 2, 6


def _hf_layer():
    config = KimiLinearConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=DH, linear_conv_kernel_dim=4,
                              num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2,
                              vocab_size=10, intermediate_size=8)
    torch.manual_seed(0)
    layer = KimiLinearDeltaAttention(config, 0)
    with torch.no_grad():  # weights large enough that every part of the layer matters
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def _ours_from(named: dict) -> dict:
    """attnkit's names for Hugging Face's tensors: the map of the layer's module docstring."""
    return {"W_q": named["q_proj.weight"].T, "W_k": named["k_proj.weight"].T, "W_v": named["v_proj.weight"].T,
            "W_fa": named["forget_gate.f_a_proj.weight"].T, "W_b": named["b_proj.weight"].T,
            "W_ga": named["g_a_proj.weight"].T, "conv_weight": named["conv1d.weight"].reshape(3, H * DH, -1),
            "W_fb": named["forget_gate.f_b_proj.weight"].T, "dt_bias": named["forget_gate.dt_bias"],
            "A_log": named["forget_gate.A_log"].reshape(-1), "W_gb": named["g_b_proj.weight"].T,
            "norm_gamma": named["o_norm.weight"], "W_out": named["o_proj.weight"].T}


def _layer(chunk_size: int = 64, dtype=np.float64, rng=0) -> KimiDeltaAttention:
    return KimiDeltaAttention(D, H, DH, chunk_size=chunk_size, rng=rng).astype(dtype)


def _run_ours(params: dict, x, grad_y, dtype, mask=None):
    ours = _layer(dtype=dtype)
    ours.load_state_dict({n: a.astype(dtype) for n, a in params.items()})
    y = ours(x.astype(dtype), attention_mask=mask)
    grad_x = ours.backward(grad_y.astype(dtype))
    return {"y": y, "grad x": grad_x, **{f"grad {n}": g for n, g in ours.grads.items()}}


# Hugging Face runs the delta rule in float32 whatever the input (as for Gated DeltaNet); the bound is Gated
# DeltaNet's layer bound (tests/layers/test_gated_deltanet.py::LAYER_TOL).
LAYER_TOL = 3e-5


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_equals_hugging_face_forward_and_backward(dtype, padded):
    hf = _hf_layer()
    params = _ours_from({n: to_numpy(p) for n, p in hf.named_parameters()})
    rng = make_rng(1, padded)
    x, grad_y = randn(rng, 2, 70, D), randn(rng, 2, 70, D)  # two chunks, the second one padded
    mask = None
    if padded:
        mask = np.ones((2, 70), bool)
        mask[1, :5] = False
    tx = torch.tensor(x.astype(np.float32), requires_grad=True)
    ty = hf(tx, attention_mask=None if mask is None else torch.tensor(mask))
    ty.backward(torch.tensor(grad_y.astype(np.float32)))
    hf_grads = _ours_from({n: to_numpy(p.grad) for n, p in hf.named_parameters()})
    theirs = {"y": to_numpy(ty), "grad x": to_numpy(tx.grad), **{f"grad {n}": g for n, g in hf_grads.items()}}
    exact = _run_ours(params, x, grad_y, np.float64, mask)
    ours = _run_ours(params, x, grad_y, dtype, mask)
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        assert ours[name].dtype == dtype, name
        scale = float(np.max(np.abs(exact[name])))
        error = float(np.max(np.abs(ours[name] - ref))) / scale
        assert error < LAYER_TOL, f"{name}: {error:.2e} from Hugging Face"
        own = float(np.max(np.abs(ours[name] - exact[name]))) / scale
        assert own < LAYER_TOL, f"{name}: {own:.2e} from the float64 result"


@pytest.mark.parametrize("padded", [False, True])
def test_every_gradient_passes_finite_differences(padded):
    layer = KimiDeltaAttention(6, 2, 3, conv_kernel_size=3, chunk_size=2, rng=2)
    for name, value in layer.named_parameters():  # away from the initial ones and zeros, so every term counts
        value += 0.3 * make_rng(len(name), padded).standard_normal(value.shape)
    rng = make_rng(3, padded)
    x, grad_y = randn(rng, 2, 5, 6), randn(rng, 2, 5, 6)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool) if padded else None
    layer(x, attention_mask=mask)
    grad_x = layer.backward(grad_y)
    params = dict(layer.named_parameters())

    def loss():
        return np.sum(layer(x, attention_mask=mask) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in params.items():
        assert_gradient(loss, value, layer.grads[name], name)


@pytest.mark.parametrize("prefill", [0, 1, 5, 70])
def test_cached_decoding_equals_the_whole_forward(prefill):
    layer, rng = _layer(chunk_size=16), make_rng(5, prefill)
    x = randn(rng, 2, 75, D)
    whole = layer(x)
    cache = layer.new_cache(2)
    parts = [layer(x[:, :prefill], cache=cache)] if prefill else []
    parts += [layer(x[:, t:t + 1], cache=cache) for t in range(prefill, 75)]
    assert cache.length == 75 and layer.saved_tensors is None
    assert cache.recurrent_state.shape == (2, H, DH, DH) and cache.conv_state.shape == (2, 3, 3 * H * DH)
    assert layer.conv_weight.shape == (3, H * DH, 4)
    steps = np.concatenate(parts, axis=1)
    assert float(np.max(np.abs(steps - whole)) / np.max(np.abs(whole))) < 1e-12


def test_a_reordered_cache_continues_the_rows_it_copied_and_a_copy_rolls_back():
    layer, rng = _layer(chunk_size=4), make_rng(7)
    x = randn(rng, 2, 9, D)
    index = np.array([1, 1, 0])
    whole = layer(x[index])
    cache = layer.new_cache(2)
    layer(x[:, :6], cache=cache)
    cache.reorder(index)
    kept = cache.copy()
    steps = np.concatenate([layer(x[index, t:t + 1], cache=cache) for t in range(6, 9)], axis=1)
    np.testing.assert_allclose(steps, whole[:, 6:], rtol=1e-12, atol=1e-14)
    again = np.concatenate([layer(x[index, t:t + 1], cache=kept) for t in range(6, 9)], axis=1)
    np.testing.assert_array_equal(again, steps)


def test_float32_in_float32_out_and_the_input_untouched():
    layer, rng = _layer(dtype=np.float32), make_rng(6)
    x = randn(rng, 1, 9, D, dtype=np.float32)
    kept = x.copy()
    y = layer(x)
    grad_x = layer.backward(np.ones_like(y))
    assert y.dtype == np.float32 and grad_x.dtype == np.float32
    assert all(g.dtype == np.float32 for g in layer.grads.values())
    np.testing.assert_array_equal(x, kept)
    cache = layer.new_cache(1)
    step = layer(x[:, :1], cache=cache)
    assert step.dtype == np.float32 and cache.recurrent_state.dtype == np.float32


def test_token_weights_times_the_values_are_the_layers_core_output():
    """Each head's (L, L) weights reproduce the channel-gated delta rule's output from the values."""
    from attnkit.kernels import delta_rule

    layer, rng = _layer(chunk_size=4), make_rng(10)
    x = randn(rng, 2, 9, D)
    weights, values = layer.token_weights(x)
    (q, k, v, g, beta), _, _, _ = layer._delta_inputs(x, None)
    assert weights.shape == (2, H, 9, 9) and g.shape == (2, H, 9, DH)
    core, _, _ = delta_rule.recurrent_forward(q, k, v, g, beta)
    np.testing.assert_allclose(weights @ values, core, rtol=1e-10, atol=1e-13)


def test_errors_say_what_was_wrong():
    with pytest.raises(ValueError, match="head_dim"):
        KimiDeltaAttention(8, 2, 0)
    with pytest.raises(ValueError, match="num_heads"):
        KimiDeltaAttentionConfig(num_heads=-1, head_dim=4)
    layer = _layer()
    with pytest.raises(ValueError, match="expected hidden_size = 16"):
        layer(np.zeros((1, 3, 8)))
    with pytest.raises(ValueError, match="holds 2 sequences but x has 1"):
        layer(np.zeros((1, 1, D)), cache=layer.new_cache(2))

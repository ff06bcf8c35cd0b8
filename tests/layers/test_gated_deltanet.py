"""GatedDeltaNet: equals Hugging Face's Qwen3.5 and Qwen3-Next layers forward and backward (every parameter's
gradient), passes float64 finite differences for every parameter and the input, and its cached decoding equals
the whole-sequence forward."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

import torch
from attnkit.layers import GatedDeltaNet

from helpers import assert_gradient, make_rng, randn, to_numpy

D, HK, HV, DK, DV = 16, 2, 4, 8, 6
SIZES = dict(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
             linear_value_head_dim=DV, linear_conv_kernel_dim=4, num_hidden_layers=1,
             layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=8,
             vocab_size=10, intermediate_size=8)


def _hf_layer(kind: str):
    torch.manual_seed(0)
    layer = (Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**SIZES), 0) if kind == "qwen3_5"
             else Qwen3NextGatedDeltaNet(Qwen3NextConfig(**SIZES), 0))
    with torch.no_grad():  # weights large enough that every part of the layer matters
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def _qwen3_next_inputs(qkvz: np.ndarray, ba: np.ndarray):
    """Qwen3-Next's fused rows, grouped per key head as (q, k, v, z) and (b, a), as Qwen3.5's four maps."""
    r = HV // HK
    rows = qkvz.reshape(HK, 2 * DK + 2 * r * DV, D)
    q, k = rows[:, :DK].reshape(-1, D), rows[:, DK:2 * DK].reshape(-1, D)
    v, z = rows[:, 2 * DK:2 * DK + r * DV].reshape(-1, D), rows[:, 2 * DK + r * DV:].reshape(-1, D)
    ba = ba.reshape(HK, 2 * r, D)
    return {"in_proj_qkv": np.concatenate([q, k, v]), "in_proj_z": z,
            "in_proj_b": ba[:, :r].reshape(-1, D), "in_proj_a": ba[:, r:].reshape(-1, D)}


def _as_qwen3_5(kind: str, tensors: dict) -> dict:
    """Hugging Face's parameters (or gradients) under Qwen3.5's names."""
    out = {name: tensors[name] for name in ("dt_bias", "A_log", "conv1d.weight", "norm.weight", "out_proj.weight")}
    if kind == "qwen3_5":
        out.update({name: tensors[f"{name}.weight"] for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")})
    else:
        out.update(_qwen3_next_inputs(tensors["in_proj_qkvz.weight"], tensors["in_proj_ba.weight"]))
    return out


def _ours_from(named: dict) -> dict:
    """attnkit's names for Qwen3.5's tensors: the map of the layer's docstring."""
    return {"W_qkv": named["in_proj_qkv"].T, "W_z": named["in_proj_z"].T, "W_b": named["in_proj_b"].T,
            "W_a": named["in_proj_a"].T, "conv_weight": named["conv1d.weight"][:, 0, :],
            "dt_bias": named["dt_bias"], "A_log": named["A_log"], "norm_gamma": named["norm.weight"],
            "W_out": named["out_proj.weight"].T}


def _layer(chunk_size: int = 64, dtype=np.float64, rng=0) -> GatedDeltaNet:
    return GatedDeltaNet(D, HK, HV, DK, DV, chunk_size=chunk_size, rng=rng).astype(dtype)


def _run_ours(params: dict, x, grad_y, dtype):
    ours = _layer(dtype=dtype)
    ours.load_state_dict({n: a.astype(dtype) for n, a in _ours_from(params).items()})
    y = ours(x.astype(dtype))
    grad_x = ours.backward(grad_y.astype(dtype))
    return {"y": y, "grad x": grad_x, **{f"grad {n}": g for n, g in ours.grads.items()}}


# Hugging Face runs the delta rule in float32 whatever the input, and the gradients of A_log, dt_bias, W_a and W_b
# are sums over every position with cancellation. Against our float64 result (which finite differences check),
# over 24 seeds of this test its float32 error reached 1.1e-5 and ours 1.5e-5 (relative to each array's largest
# entry), up and down at random; elsewhere both stay near 1e-6. The bound is twice the larger.
LAYER_TOL = 3e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_equals_hugging_face_forward_and_backward(kind, dtype):
    hf = _hf_layer(kind)
    params = _as_qwen3_5(kind, {n: to_numpy(p) for n, p in hf.named_parameters()})
    rng = make_rng(1)
    x, grad_y = randn(rng, 2, 70, D), randn(rng, 2, 70, D)  # two chunks, the second one padded
    tx = torch.tensor(x.astype(np.float32), requires_grad=True)
    ty = hf(tx)
    ty.backward(torch.tensor(grad_y.astype(np.float32)))
    hf_grads = _ours_from(_as_qwen3_5(kind, {n: to_numpy(p.grad) for n, p in hf.named_parameters()}))
    theirs = {"y": to_numpy(ty), "grad x": to_numpy(tx.grad), **{f"grad {n}": g for n, g in hf_grads.items()}}
    exact = _run_ours(params, x, grad_y, np.float64)
    ours = _run_ours(params, x, grad_y, dtype)
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        assert ours[name].dtype == dtype, name
        scale = float(np.max(np.abs(exact[name])))
        error = float(np.max(np.abs(ours[name] - ref))) / scale
        assert error < LAYER_TOL, f"{kind} {name}: {error:.2e} from Hugging Face"
        own = float(np.max(np.abs(ours[name] - exact[name]))) / scale
        assert own < LAYER_TOL, f"{kind} {name}: {own:.2e} from the float64 result"


def test_every_gradient_passes_finite_differences():
    layer = GatedDeltaNet(6, 1, 2, 3, 2, conv_kernel_size=3, chunk_size=2, rng=2)
    for name, value in layer.named_parameters():  # away from the initial ones and zeros, so every term counts
        value += 0.3 * make_rng(len(name)).standard_normal(value.shape)
    rng = make_rng(3)
    x, grad_y = randn(rng, 2, 5, 6), randn(rng, 2, 5, 6)
    layer(x)
    grad_x = layer.backward(grad_y)
    params = dict(layer.named_parameters())

    def loss():
        return np.sum(layer(x) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in params.items():
        assert_gradient(loss, value, layer.grads[name], name)


def test_gradients_accumulate():
    layer, rng = _layer(chunk_size=4), make_rng(4)
    x, grad_y = randn(rng, 1, 6, D), randn(rng, 1, 6, D)
    layer(x)
    layer.backward(grad_y)
    once = {n: g.copy() for n, g in layer.grads.items()}
    layer(x)
    layer.backward(grad_y)
    for name, grad in layer.grads.items():
        np.testing.assert_allclose(grad, 2 * once[name], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("prefill", [0, 1, 5, 70])
def test_cached_decoding_equals_the_whole_forward(prefill):
    layer, rng = _layer(chunk_size=16), make_rng(5, prefill)
    x = randn(rng, 2, 75, D)
    whole = layer(x)
    cache = layer.new_cache(2)
    parts = [layer(x[:, :prefill], cache=cache)] if prefill else []
    parts += [layer(x[:, t:t + 1], cache=cache) for t in range(prefill, 75)]
    assert cache.length == 75 and layer.saved_tensors is None
    steps = np.concatenate(parts, axis=1)
    assert float(np.max(np.abs(steps - whole)) / np.max(np.abs(whole))) < 1e-12


def test_a_reordered_cache_continues_the_rows_it_copied():
    layer, rng = _layer(chunk_size=4), make_rng(7)
    x = randn(rng, 2, 9, D)
    index = np.array([1, 1, 0])
    whole = layer(x[index])
    cache = layer.new_cache(2)
    layer(x[:, :6], cache=cache)
    cache.reorder(index)
    steps = np.concatenate([layer(x[index, t:t + 1], cache=cache) for t in range(6, 9)], axis=1)
    np.testing.assert_allclose(steps, whole[:, 6:], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"rows in \[0, 3\)"):
        cache.reorder(np.array([3]))


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


def test_errors_say_what_was_wrong():
    with pytest.raises(ValueError, match="multiple of num_key_heads"):
        GatedDeltaNet(8, 3, 4, 2, 2)
    layer = _layer()
    with pytest.raises(ValueError, match="expected hidden_size = 16"):
        layer(np.zeros((1, 3, 8)))
    with pytest.raises(ValueError, match=r"\(B, L, hidden_size\)"):
        layer(np.zeros((3, D)))
    with pytest.raises(RuntimeError, match="before a forward without a cache"):
        layer.backward(np.zeros((1, 3, D)))
    with pytest.raises(ValueError, match="holds 2 sequences but x has 1"):
        layer(np.zeros((1, 1, D)), cache=layer.new_cache(2))
    layer(np.zeros((1, 3, D)))
    with pytest.raises(ValueError, match="grad_output has shape"):
        layer.backward(np.zeros((1, 4, D)))


def test_a_left_padded_row_equals_the_row_alone_and_its_pads_get_no_gradient():
    """Padded positions are zeroed before the projections (as Hugging Face does), so the state a left-padded
    row builds is the state of its real tokens alone, whatever tokens fill the padding."""
    layer, rng = _layer(chunk_size=4), make_rng(8)
    x = randn(rng, 2, 7, D)
    mask = np.ones((2, 7), bool)
    mask[1, :3] = False  # row 1: three pads, then four real tokens
    y = layer(x, attention_mask=mask)
    grad_x = layer.backward(np.ones_like(y))
    alone = layer(x[1:, 3:])
    np.testing.assert_allclose(y[1, 3:], alone[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(grad_x[1, :3], 0.0)
    np.testing.assert_array_equal(y[1, :3], 0.0)  # the pads' gate z is zero: silu(0) = 0
    cache = layer.new_cache(2)
    layer(x[:, :5], cache=cache, attention_mask=mask[:, :5])
    step = layer(x[:, 5:6], cache=cache)
    np.testing.assert_allclose(step, y[:, 5:6], rtol=1e-12, atol=1e-14)


def test_padded_gradients_pass_finite_differences():
    layer = GatedDeltaNet(6, 1, 2, 3, 2, conv_kernel_size=3, chunk_size=2, rng=4)
    for name, value in layer.named_parameters():
        value += 0.3 * make_rng(len(name), 1).standard_normal(value.shape)
    rng = make_rng(9)
    x, grad_y = randn(rng, 2, 5, 6), randn(rng, 2, 5, 6)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    layer(x, attention_mask=mask)
    grad_x = layer.backward(grad_y)

    def loss():
        return np.sum(layer(x, attention_mask=mask) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in layer.named_parameters():
        assert_gradient(loss, value, layer.grads[name], name)


def test_token_weights_times_the_values_are_the_layers_core_output():
    """The effective (B, Hv, L, L) weights reproduce the delta rule's output from the values; through the gated
    norm and W_out that is the layer's output."""
    from attnkit.kernels.rms_norm import gated_rms_norm_forward

    layer, rng = _layer(chunk_size=4), make_rng(10)
    x = randn(rng, 2, 9, D)
    mask = np.ones((2, 9), bool)
    mask[0, :2] = False
    weights, values = layer.token_weights(x, attention_mask=mask)
    assert weights.shape == (2, HV, 9, 9) and values.shape == (2, HV, 9, DV)
    np.testing.assert_array_equal(np.triu(weights, 1), 0.0)
    core = (weights @ values).transpose(0, 2, 1, 3)  # (B, L, Hv, Dv)
    z = (x * mask[..., None]) @ layer.W_z  # (B, L, Vd)
    normed, _ = gated_rms_norm_forward(core, z.reshape(core.shape), layer.norm_gamma, layer.eps)
    y = normed.reshape(2, 9, HV * DV) @ layer.W_out
    np.testing.assert_allclose(y, layer(x, attention_mask=mask), rtol=1e-10, atol=1e-13)
    assert np.any(weights < 0)  # not a softmax: the delta rule subtracts what the state already predicts


def test_token_weights_draw_on_a_scale_centred_on_zero():
    pytest.importorskip("matplotlib")
    from attnkit.viz import plot_attention

    layer, rng = _layer(chunk_size=4), make_rng(11)
    weights, _ = layer.token_weights(randn(rng, 1, 5, D))
    largest = float(np.abs(weights).max())
    fig = plot_attention(weights[0], cmap="RdBu_r", vmin=-largest, vmax=largest)
    image = fig.axes[0].images[0]
    np.testing.assert_allclose(image.get_array(), weights[0, 0])
    assert image.get_clim() == (-largest, largest) and weights.min() < 0


def test_input_projections_out_of_their_group_take_a_product_each():
    """A projection given storage of its own (set_parameter: a loader's, or a packed weight) ends the fused W_in;
    forward and backward then take a product per projection (the backward used to concatenate the four weights)
    and agree with the fused layer's."""
    rng = make_rng(7)
    fused, split = _layer(rng=3), _layer(rng=3)
    split.set_parameter("W_z", split.W_z.copy())
    assert fused.fused_parameter("W_in") is not None and split.fused_parameter("W_in") is None
    x, g = randn(rng, 2, 5, D), randn(rng, 2, 5, D)
    np.testing.assert_allclose(split(x), fused(x), rtol=0, atol=1e-12)
    np.testing.assert_allclose(split.backward(g), fused.backward(g), rtol=0, atol=1e-12)
    for name in ("W_qkv", "W_z", "W_b", "W_a"):
        np.testing.assert_allclose(split.grads[name], fused.grads[name], rtol=0, atol=1e-12)
    fused(x)
    with fused.input_gradients_only():
        grad_x = fused.backward(g)
    split(x)
    with split.input_gradients_only():
        np.testing.assert_allclose(split.backward(g), grad_x, rtol=0, atol=1e-12)


def test_a_packed_input_projection_gives_the_exact_input_gradient():
    """A packed (quantized) W_z has no storage to concatenate with the others: the forward and the input gradient
    take its product alone and equal a dense layer holding its dequantized values."""
    gguf = pytest.importorskip("gguf")
    from attnkit.kernels.packed import PackedWeight

    width = 32  # rows of whole Q8_0 blocks
    dense, packed = (GatedDeltaNet(width, HK, HV, DK, DV, rng=4).astype(np.float64) for _ in range(2))
    blocks = gguf.quants.quantize(np.ascontiguousarray(dense.W_z.T, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    packed.set_parameter("W_z", PackedWeight(blocks, "Q8_0", width, transposed=True))
    dense.W_z = packed.W_z.dequantize()
    rng = make_rng(8)
    x, g = randn(rng, 2, 5, width), randn(rng, 2, 5, width)
    np.testing.assert_allclose(packed(x), dense(x), rtol=0, atol=1e-12)
    with packed.input_gradients_only():
        np.testing.assert_allclose(packed.backward(g), dense.backward(g), rtol=0, atol=1e-12)

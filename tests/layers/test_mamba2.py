"""Mamba2: equals Hugging Face's Granite 4 hybrid Mamba-2 layer (its PyTorch path) forward and backward on a
padded batch (every parameter's gradient), passes float64 finite differences for every parameter and the input,
its steps and cached chunks equal the whole forward, and its cache goes back to a marked length."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

import torch
from attnkit.decoding.cache import KVCache
from attnkit.layers import Mamba2, Mamba2Config

from helpers import assert_gradient, make_rng, randn, to_numpy

D = 12


def _hf_layer(groups: int, bias: bool):
    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(hidden_size=D, mamba_n_heads=4, mamba_n_groups=groups, mamba_d_state=5,
                                    mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4, mamba_proj_bias=bias,
                                    mamba_conv_bias=True, num_hidden_layers=1, num_attention_heads=2,
                                    vocab_size=10, layer_types=["mamba"])
    layer = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():  # weights large enough that every part of the layer matters
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.A_log.uniform_(-1.0, 1.0)
    return layer, Mamba2Config(num_heads=4, head_dim=6, state_size=5, n_groups=groups, conv_kernel_size=3,
                               proj_bias=bias, chunk_size=5)


def _ours_from(named: dict) -> dict:
    """attnkit's names for Hugging Face's tensors: the map of the layer's docstring."""
    out = {"W_in": named["in_proj.weight"].T, "conv_weight": named["conv1d.weight"][:, 0, :],
           "conv_bias": named["conv1d.bias"], "dt_bias": named["dt_bias"], "A_log": named["A_log"],
           "D_skip": named["D"], "norm_gamma": named["norm.weight"], "W_out": named["out_proj.weight"].T}
    if "in_proj.bias" in named:
        out.update(b_in=named["in_proj.bias"], b_out=named["out_proj.bias"])
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("groups, bias", [(1, False), (2, True)])
def test_equals_hugging_face_forward_and_backward_on_a_padded_batch(groups, bias, dtype):
    hf, shape = _hf_layer(groups, bias)
    rng = make_rng(1)
    x, grad_y = randn(rng, 3, 9, D), randn(rng, 3, 9, D)
    mask = np.ones((3, 9), bool)
    mask[1, :4] = mask[2, :1] = False  # left padding
    grad_y[~mask] = 0
    tx = torch.tensor(x.astype(np.float32), requires_grad=True)
    ty = hf(tx, attention_mask=torch.from_numpy(mask.astype(np.int64)))
    ty.backward(torch.tensor(grad_y.astype(np.float32)))
    hf_grads = _ours_from({n: to_numpy(p.grad) for n, p in hf.named_parameters()})
    theirs = {"y": to_numpy(ty), "grad x": to_numpy(tx.grad), **{f"grad {n}": g for n, g in hf_grads.items()}}
    layer = Mamba2(D, shape).astype(dtype)
    layer.load_state_dict({n: a.astype(dtype) for n, a in
                           _ours_from({n: to_numpy(p) for n, p in hf.named_parameters()}).items()})
    y = layer(x.astype(dtype), attention_mask=mask)
    ours = {"y": y, "grad x": layer.backward(grad_y.astype(dtype)),
            **{f"grad {n}": g for n, g in layer.grads.items()}}
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        assert ours[name].dtype == dtype, name
        got = ours[name][mask] if name == "y" else ours[name]  # a padded position's output is no one's
        ref = ref[mask] if name == "y" else ref
        error = float(np.max(np.abs(got - ref))) / float(np.max(np.abs(ref)))
        assert error < 2e-5, f"{name}: {error:.2e} from Hugging Face"


def _layer(groups=2, bias=True, dtype=np.float64, chunk_size=3, rng=2) -> Mamba2:
    layer = Mamba2(6, Mamba2Config(num_heads=2, head_dim=3, state_size=2, n_groups=groups, conv_kernel_size=3,
                                   proj_bias=bias, chunk_size=chunk_size), rng=rng).astype(dtype)
    for name, value in layer.named_parameters():  # away from the initial ones and zeros, so every term counts
        value += (0.3 * make_rng(len(name)).standard_normal(value.shape)).astype(dtype)
    return layer


@pytest.mark.parametrize("groups, bias", [(1, False), (2, True)])
def test_every_gradient_passes_finite_differences_with_padding(groups, bias):
    layer, rng = _layer(groups, bias), make_rng(3)
    x, grad_y = randn(rng, 2, 7, 6), randn(rng, 2, 7, 6)
    mask = np.array([[True] * 7, [False, False, True, True, True, True, True]])
    layer(x, attention_mask=mask)
    grad_x = layer.backward(grad_y)

    def loss():
        return np.sum(layer(x, attention_mask=mask) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in layer.named_parameters():
        assert_gradient(loss, value, layer.grads[name], name)


def test_a_replaced_hook_value_is_a_constant_for_the_gradient():
    """A forward hook that replaces the scan's output cuts the gradient there: what backward returns is the
    gradient of the hooked function (finite differences through the same hook), and a backward hook sees it."""
    layer, rng = _layer(), make_rng(6)
    x, grad_y = randn(rng, 2, 5, 6), randn(rng, 2, 5, 6)
    constant, seen = randn(rng, 2, 5, 2, 3), []
    layer.add_hook("hook_ssm_out", lambda value, name: constant, full_name="ssm_out")
    layer.add_hook("hook_conv_out", lambda grad, name: seen.append(grad.shape), full_name="conv_out",
                   direction="backward")
    layer(x)
    grad_x = layer.backward(grad_y)
    assert seen == [(2, 5, layer.conv_dim)]

    def loss():
        return np.sum(layer(x) * grad_y)

    assert_gradient(loss, x, grad_x, "x")  # only the gate z still depends on x
    assert_gradient(loss, layer.W_in, layer.grads["W_in"], "W_in")
    assert not layer.grads["A_log"].any()


@pytest.mark.parametrize("prefill", [0, 1, 5])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_steps_and_cached_chunks_equal_the_whole_forward(prefill, dtype):
    layer, rng = _layer(dtype=dtype), make_rng(4, prefill)
    x = randn(rng, 2, 12, 6, dtype=dtype)
    whole = layer(x)
    cache = layer.new_cache(2)
    parts = [layer(x[:, :prefill], cache)] if prefill else []
    parts += [layer.step(x[:, t], cache=cache)[:, None] for t in range(prefill, 8)]
    parts.append(layer(x[:, 8:], cache))  # a chunk after steps
    got = np.concatenate(parts, axis=1)
    assert got.dtype == dtype and cache.length == 12 and layer.saved_tensors is None
    tolerance = 1e-12 if dtype == np.float64 else 3e-6
    np.testing.assert_allclose(got, whole, rtol=tolerance, atol=tolerance * np.abs(whole).max())


def test_the_cache_goes_back_to_a_marked_length():
    layer, rng = _layer(), make_rng(5)
    x, other = randn(rng, 2, 9, 6), randn(rng, 2, 3, 6)
    cache = KVCache(1, 2, 1, 2, np.float64, states={0: layer.new_cache(2)})
    layer(x[:, :5], cache.state(0))
    assert cache.mark() == 5
    layer(x[:, 5:], cache.state(0))  # 4 tokens past the mark, then back: a rejected draft
    cache.crop(5)
    resumed = layer(other, cache.state(0))
    expected = layer(np.concatenate([x[:, :5], other], axis=1))[:, 5:]
    np.testing.assert_allclose(resumed, expected, rtol=1e-12, atol=1e-12)
    state = cache.state(0).ssm_state.copy()
    cache.reorder(np.array([1, 0]))
    np.testing.assert_array_equal(cache.state(0).ssm_state, state[[1, 0]])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"n_groups \(3\) must divide num_heads \(4\)"):
        Mamba2Config(num_heads=4, head_dim=2, state_size=2, n_groups=3)
    with pytest.raises(TypeError, match="shape must be a Mamba2Config"):
        Mamba2(6, dict(num_heads=2))
    layer = _layer()
    with pytest.raises(ValueError, match="cache holds 2 sequences but x has 3"):
        layer(np.ones((3, 2, 6)), layer.new_cache(2))
    with pytest.raises(RuntimeError, match="before a forward without a cache"):
        _layer().backward(np.ones((1, 2, 6)))


# -- Falcon-H1's options: the norm before the gate or none, the projection's per-slice factors, the output bias --
FALCON_OPTIONS = [dict(norm="before_gate", projection_multipliers=(0.5, 1.5, 0.75, 1.25, 2.0)),
                  dict(norm=None, out_bias=True, projection_multipliers=(1.2, 0.6, 1.4, 0.9, 0.7)),
                  dict(norm="after_gate", proj_bias=True, out_bias=False)]


def _falcon_hf_layer(groups: int, options: dict):
    from transformers.models.falcon_h1.configuration_falcon_h1 import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector

    torch.manual_seed(0)
    config = FalconH1Config(hidden_size=D, mamba_d_ssm=24, mamba_n_heads=4, mamba_n_groups=groups, mamba_d_state=5,
                            mamba_d_conv=3, mamba_chunk_size=4, mamba_proj_bias=options.get("proj_bias", False),
                            projectors_bias=bool(options.get("out_bias", options.get("proj_bias", False))),
                            mamba_rms_norm=options["norm"] is not None,
                            mamba_norm_before_gate=options["norm"] == "before_gate",
                            ssm_multipliers=list(options.get("projection_multipliers", (1.0,) * 5)),
                            num_hidden_layers=1, num_attention_heads=2, vocab_size=10)
    layer = FalconH1Mixer(config, 0).eval()
    layer.register_buffer("mup_vector", compute_mup_vector(config), persistent=False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.A_log.uniform_(-1.0, 1.0)
    return layer, Mamba2Config(num_heads=4, head_dim=6, state_size=5, n_groups=groups, conv_kernel_size=3,
                               chunk_size=5, **options)


@pytest.mark.parametrize("options", FALCON_OPTIONS)
@pytest.mark.parametrize("groups", [1, 2])
def test_equals_falcon_h1s_mixer_forward_and_backward_on_a_padded_batch(groups, options):
    """Each option as transformers' FalconH1Mixer computes it (its PyTorch path), every gradient included."""
    hf, shape = _falcon_hf_layer(groups, options)
    rng = make_rng(7)
    x, grad_y = randn(rng, 3, 9, D), randn(rng, 3, 9, D)
    mask = np.ones((3, 9), bool)
    mask[1, :4] = mask[2, :1] = False
    grad_y[~mask] = 0
    tx = torch.tensor(x.astype(np.float32), requires_grad=True)
    ty = hf(tx, attention_mask=torch.from_numpy(mask.astype(np.int64)))
    ty.backward(torch.tensor(grad_y.astype(np.float32)))
    named = {n: to_numpy(p) for n, p in hf.named_parameters()}
    layer = Mamba2(D, shape, eps=hf.layer_norm_epsilon).astype(np.float32)
    assert ("norm_gamma" in layer._parameters) == ("norm.weight" in named)
    plain = {n: v for n, v in named.items() if not n.endswith(".bias") or n == "conv1d.bias"}
    ours_from = {k: v for k, v in _ours_from({**plain, "norm.weight": named.get("norm.weight")}).items()
                 if k in layer._parameters}
    ours_from.update({k: named[n] for k, n in (("b_in", "in_proj.bias"), ("b_out", "out_proj.bias"))
                      if k in layer._parameters})
    layer.load_state_dict(ours_from)
    y = layer(x.astype(np.float32), attention_mask=mask)
    grad_x = layer.backward(grad_y.astype(np.float32))
    hf_grads = {n: to_numpy(p.grad) for n, p in hf.named_parameters()}
    theirs = {"y": to_numpy(ty)[mask], "grad x": to_numpy(tx.grad)}
    ours = {"y": y[mask], "grad x": grad_x}
    names = {"W_in": "in_proj.weight", "W_out": "out_proj.weight", "A_log": "A_log", "dt_bias": "dt_bias",
             "D_skip": "D", "norm_gamma": "norm.weight", "conv_bias": "conv1d.bias", "b_in": "in_proj.bias",
             "b_out": "out_proj.bias"}
    for ours_name, hf_name in names.items():
        if ours_name in layer._parameters:
            grad = hf_grads[hf_name]
            theirs["grad " + ours_name] = grad.T if ours_name.startswith("W_") else grad
            ours["grad " + ours_name] = layer.grads[ours_name]
    assert len(ours) == len(layer._parameters) + 2 - 1  # every parameter but the convolution's weight by name
    for name, ref in theirs.items():
        error = float(np.max(np.abs(ours[name] - ref))) / float(np.max(np.abs(ref)))
        assert error < 2e-5, f"{name}: {error:.2e} from Hugging Face"


@pytest.mark.parametrize("options", FALCON_OPTIONS)
def test_falcon_h1s_options_pass_finite_differences_with_padding(options):
    layer = Mamba2(6, Mamba2Config(num_heads=2, head_dim=3, state_size=2, n_groups=2, conv_kernel_size=3,
                                   chunk_size=3, **options), rng=2)
    for name, value in layer.named_parameters():
        value += 0.3 * make_rng(len(name)).standard_normal(value.shape)
    rng = make_rng(8)
    x, grad_y = randn(rng, 2, 7, 6), randn(rng, 2, 7, 6)
    mask = np.array([[True] * 7, [False, False, True, True, True, True, True]])
    layer(x, attention_mask=mask)
    grad_x = layer.backward(grad_y)

    def loss():
        return np.sum(layer(x, attention_mask=mask) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in layer.named_parameters():
        assert_gradient(loss, value, layer.grads[name], name)


@pytest.mark.parametrize("options", FALCON_OPTIONS[:2])
def test_falcon_h1s_options_step_as_the_whole_forward(options):
    layer = Mamba2(6, Mamba2Config(num_heads=2, head_dim=3, state_size=2, chunk_size=3, **options), rng=3)
    x = randn(make_rng(9), 2, 8, 6)
    whole = layer(x)
    cache = layer.new_cache(2)
    got = np.concatenate([layer(x[:, :3], cache)] + [layer.step(x[:, t], cache=cache)[:, None] for t in range(3, 8)],
                         axis=1)
    np.testing.assert_allclose(got, whole, rtol=1e-12, atol=1e-12 * np.abs(whole).max())


def test_falcon_h1s_bad_options_are_refused():
    with pytest.raises(ValueError, match="norm must be one of"):
        Mamba2Config(num_heads=2, head_dim=2, state_size=2, norm="after")
    with pytest.raises(ValueError, match=r"projection_multipliers must be 5 factors \(z, x, B, C, dt\)"):
        Mamba2Config(num_heads=2, head_dim=2, state_size=2, projection_multipliers=(1.0, 2.0))
    with pytest.raises(TypeError, match="out_bias must be True, False or None"):
        Mamba2Config(num_heads=2, head_dim=2, state_size=2, out_bias=1)


def _nemotron_h_layer(floor: float):
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    torch.manual_seed(0)
    config = NemotronHConfig(hidden_size=D, mamba_num_heads=4, mamba_head_dim=6, n_groups=2, ssm_state_size=5,
                             conv_kernel=3, chunk_size=4, use_bias=True, time_step_min=floor, vocab_size=10,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=6,
                             layers_block_type=["linear_attention"])
    layer = NemotronHMamba2Mixer(config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.A_log.uniform_(-1.0, 1.0)
    return layer, Mamba2Config(num_heads=4, head_dim=6, state_size=5, n_groups=2, conv_kernel_size=3,
                               proj_bias=True, chunk_size=5, time_step_min=floor)


def test_the_step_floor_equals_nemotron_h_forward_and_backward():
    """Nemotron-H clamps dt below at time_step_min (0.7 here: softplus(0) = 0.69, so about half the steps are held
    up): forward and every gradient equal its layer's on a padded batch."""
    hf, shape = _nemotron_h_layer(0.7)
    rng = make_rng(7)
    x, grad_y = randn(rng, 3, 9, D), randn(rng, 3, 9, D)
    mask = np.ones((3, 9), bool)
    mask[1, :4] = False
    grad_y[~mask] = 0
    tx = torch.tensor(x, requires_grad=True)
    hf = hf.double()
    ty = hf(tx, attention_mask=torch.from_numpy(mask.astype(np.int64)))
    ty.backward(torch.tensor(grad_y))
    layer = Mamba2(D, shape, eps=1e-5)  # its gated norm's eps is layer_norm_epsilon
    layer.load_state_dict(_ours_from({n: to_numpy(p) for n, p in hf.named_parameters()}))
    y = layer(x, attention_mask=mask)
    ours = {"y": y[mask], "grad x": layer.backward(grad_y), **layer.grads}
    theirs = {"y": to_numpy(ty)[mask], "grad x": to_numpy(tx.grad),
              **_ours_from({n: to_numpy(p.grad) for n, p in hf.named_parameters()})}
    for name, ref in theirs.items():  # transformers scans in float32 whatever the dtype
        assert np.max(np.abs(ours[name] - ref)) <= 2e-5 * np.max(np.abs(ref)), name
    unfloored = Mamba2(D, replace(shape, time_step_min=0.0), eps=1e-5)
    unfloored.load_state_dict(layer.state_dict())
    assert np.max(np.abs(unfloored(x, attention_mask=mask) - y)) > 1e-3  # the floor changes the output


@pytest.mark.parametrize("quantile", [0.3, 0.7])
def test_the_step_floor_passes_finite_differences(quantile):
    layer, rng = _layer(), make_rng(8)
    x, grad_y = randn(rng, 2, 7, 6), randn(rng, 2, 7, 6)
    layer(x)
    steps = np.logaddexp(0, layer.saved_tensors[3][4])  # (B, L, H): dt without a floor
    floor = float(np.quantile(steps, quantile))
    layer.shape = replace(layer.shape, time_step_min=floor)
    layer(x)
    held = steps < floor
    assert 0 < held.mean() < 1  # some steps held up by the floor, some not
    grad_x = layer.backward(grad_y)

    def loss():
        return np.sum(layer(x) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in layer.named_parameters():
        assert_gradient(loss, value, layer.grads[name], name)

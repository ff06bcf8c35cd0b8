"""AttentionMamba2Mixer (Falcon-H1's layer) and ScaledGatedMLP: every gradient passes float64 finite differences
(each factor away from 1), a factor of 1 is an identity part, the hook points are the two mixers' and a hook reaches
the one that owns it; the layer's cache entry is the pair of its mixers' caches: steps equal the whole forward,
and marks, crops, beam reorders and saved arrays move the keys and values with the Mamba-2 state."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.decoding.cache import KVCache
from attnkit.layers import AttentionMamba2Config, AttentionMamba2Mixer, Identity, Mamba2Config, Scale, ScaledGatedMLP
from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, MLPConfig, ScalesConfig

from helpers import assert_gradient, make_rng, randn

SHAPE = Mamba2Config(num_heads=2, head_dim=4, state_size=3, chunk_size=3, norm="before_gate",
                     projection_multipliers=(0.5, 1.5, 0.75, 1.25, 2.0))
FACTORS = AttentionMamba2Config(SHAPE, attention_in=0.6, attention_out=1.5, mamba_in=1.3, mamba_out=0.7)


def _config(factors=FACTORS, mlp=None, **overrides) -> DecoderConfig:
    base = dict(family="falcon_h1", vocab_size=17, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=4, layer_types=("attention_mamba2",) * 2, attention=AttentionConfig(scale=0.4),
                mlp=MLPConfig(10, **{"kind": "scaled_gated", **(mlp or {})}),
                scales=ScalesConfig(mlp_gate=0.8, mlp_output=1.4),
                mixer_parts=() if factors is None else (factors,))
    base.update(overrides)
    return DecoderConfig(**base)


def _bumped(module, scale=0.3):
    for name, value in module.named_parameters():  # away from the initial ones and zeros
        value += scale * make_rng(len(name)).standard_normal(value.shape)
    return module


def test_the_mixer_passes_finite_differences_with_padding():
    mixer = _bumped(AttentionMamba2Mixer(_config(), 0, rng=0))
    rng = make_rng(1)
    x, grad_y = randn(rng, 2, 6, 8), randn(rng, 2, 6, 8)
    mask = np.array([[True] * 6, [False, False, True, True, True, True]])

    def loss():
        return np.sum(mixer(x, attention_mask=mask)[mask] * grad_y[mask])

    grad_y[~mask] = 0  # a padded query's output is no one's
    mixer(x, attention_mask=mask)
    grad_x = mixer.backward(grad_y)
    assert_gradient(loss, x, grad_x, "x")
    for name, value in mixer.named_parameters():
        assert_gradient(loss, value, dict(mixer.named_gradients())[name], name)


def test_each_factor_scales_its_branch_and_a_factor_of_one_is_an_identity():
    """The output is attn_out * attention(attn_in * x) + mamba_out * mamba(mamba_in * x), term by term."""
    mixer = _bumped(AttentionMamba2Mixer(_config(), 0, rng=0))
    plain = AttentionMamba2Mixer(_config(AttentionMamba2Config(SHAPE)), 0, rng=0)
    plain.load_state_dict(dict(mixer.named_parameters()))
    assert [type(m) for m in (mixer.attn_in, mixer.mamba_out)] == [Scale, Scale]
    assert [type(m) for m in (plain.attn_in, plain.attn_out, plain.mamba_in, plain.mamba_out)] == [Identity] * 4
    x = randn(make_rng(2), 2, 5, 8)
    expected = 1.5 * plain.attn(0.6 * x) + 0.7 * plain.mamba(1.3 * x)
    np.testing.assert_allclose(mixer(x), expected, rtol=1e-12, atol=1e-12)


def test_the_scaled_gated_mlp_passes_finite_differences_and_scales_as_transformers_does():
    cfg = _config(mlp=dict(bias=True))
    mlp = _bumped(ScaledGatedMLP(cfg.hidden_size, cfg.mlp.intermediate_size, cfg.mlp.activation, True,
                                 gate_scale=cfg.scales.mlp_gate, output_scale=cfg.scales.mlp_output, rng=0))
    rng = make_rng(3)
    x, grad_y = randn(rng, 2, 3, 8), randn(rng, 2, 3, 8)
    mlp(x)
    grad_x = mlp.backward(grad_y)

    def loss():
        return np.sum(mlp(x) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in mlp.named_parameters():
        assert_gradient(loss, value, mlp.grads[name], name)
    p = dict(mlp.named_parameters())
    gate = (x @ p["W_gate"] + p["b_gate"]) * 0.8
    hidden = gate / (1 + np.exp(-gate)) * (x @ p["W_up"] + p["b_up"])
    np.testing.assert_allclose(mlp(x), (hidden @ p["W_down"] + p["b_down"]) * 1.4, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mlp.step(x[:, 0]), mlp(x)[:, 0], rtol=1e-12, atol=1e-12)


def test_mlp_multipliers_need_the_scaled_gated_mlp():
    with pytest.raises(ValueError, match="scale the 'scaled_gated' MLP only; mlp.kind is 'gated'"):
        _config(mlp=dict(kind="gated"))
    with pytest.raises(ValueError, match=r"layer_types has attention_mamba2 layers, so mixer_parts needs an "
                                         r"AttentionMamba2Config \(their shape\)"):
        _config(factors=None)
    with pytest.raises(TypeError, match="attention_mamba2.mamba2 must be a Mamba2Config, got NoneType"):
        AttentionMamba2Config(None)


def test_hooks_reach_the_mixer_that_owns_the_point():
    mixer = AttentionMamba2Mixer(_config(), 0, rng=0)
    assert mixer.hook_points() == (*mixer.attn.hook_points(), "hook_conv_out", "hook_ssm_out")
    seen = []
    for point in ("hook_q", "hook_ssm_out"):
        mixer.add_hook(point, lambda value, name: seen.append((name, value.shape)), full_name=point)
    mixer(np.ones((1, 3, 8)))
    assert seen == [("hook_q", (1, 3, 2, 4)), ("hook_ssm_out", (1, 3, 2, 4))]
    assert mixer.attn._hook_table is not None and mixer.mamba._hook_table is not None
    with pytest.raises(ValueError, match="has no hook point 'hook_nowhere'"):
        mixer.add_hook("hook_nowhere", print, full_name="x")


def _lm():
    return _bumped(CausalLM(_config(), rng=0), 0.2)


def test_the_cache_holds_both_halves_and_steps_equal_the_whole_forward():
    lm = _lm()
    ids = make_rng(4).integers(0, 17, size=(2, 7))
    whole = lm(ids)
    cache = lm.new_cache(2)
    assert isinstance(cache.state(0).ssm_state, np.ndarray)
    parts = [lm(ids[:, :3], cache=cache)] + [lm(ids[:, t:t + 1], cache=cache) for t in range(3, 7)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, rtol=1e-10, atol=1e-10)
    arrays = cache.arrays()  # the attention's keys and values and the Mamba-2 state, of both layers
    assert {"layers.0.keys", "layers.0.values", "layers.0.state.ssm_state", "layers.1.state.conv_state"} <= set(arrays)
    assert arrays["layers.1.keys"].shape == (2, 1, 7, 4)


def test_a_crop_to_a_mark_takes_both_halves_back_and_a_reorder_moves_both():
    lm = _lm()
    ids = make_rng(5).integers(0, 17, size=(2, 9))
    cache = lm.new_cache(2)
    lm(ids[:, :4], cache=cache)
    assert cache.mark() == 4
    lm(ids[:, 4:7], cache=cache)  # a rejected draft
    with pytest.raises(ValueError, match="layer 0 keeps a recurrent state"):
        cache.crop(5)
    cache.crop(4)
    resumed = lm(ids[:, 4:], cache=cache)
    np.testing.assert_allclose(resumed, lm(ids)[:, 4:], rtol=1e-10, atol=1e-10)
    swapped = lm.new_cache(2)
    lm(ids[:, :5], cache=swapped)
    swapped.reorder(np.array([1, 0]))
    np.testing.assert_allclose(lm(ids[::-1, 5:], cache=swapped), lm(ids[::-1])[:, 5:], rtol=1e-10, atol=1e-10)


def test_a_saved_cache_loads_back_with_both_halves():
    lm = _lm()
    ids = make_rng(6).integers(0, 17, size=(1, 6))
    cache = lm.new_cache(1)
    lm(ids[:, :4], cache=cache)
    loaded = lm.new_cache(1)
    loaded.load_arrays(cache.arrays())
    np.testing.assert_allclose(lm(ids[:, 4:], cache=loaded), lm(ids)[:, 4:], rtol=1e-10, atol=1e-10)


def test_a_paired_layer_must_have_a_state():
    with pytest.raises(ValueError, match=r"paired layers \[1\] have no state"):
        KVCache(2, 1, 1, 2, paired=[1])

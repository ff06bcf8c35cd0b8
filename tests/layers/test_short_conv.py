"""ShortConv (LFM2's gated short convolution): equals Hugging Face's ``Lfm2ShortConv`` forward and backward on a
padded batch (every parameter's gradient), passes float64 finite differences for every parameter and the input
(with a mask, and with a hook that replaces a value), its one-token steps and cached chunks equal the whole
forward, and its cache goes back to a marked length through the model cache's rollback."""
from __future__ import annotations

import numpy as np
import pytest
from transformers.models.lfm2.configuration_lfm2 import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

import torch
from attnkit.decoding.cache import KVCache
from attnkit.layers import ShortConv, ShortConvConfig, ShortConvMixer
from attnkit.models import DecoderConfig, MLPConfig

from helpers import assert_gradient, make_rng, randn, to_numpy

D = 12


def _hf_layer(bias: bool, kernel: int):
    torch.manual_seed(0)
    config = Lfm2Config(hidden_size=D, conv_bias=bias, conv_L_cache=kernel, num_hidden_layers=1,
                        layer_types=["conv"], num_attention_heads=2, num_key_value_heads=1, vocab_size=10)
    layer = Lfm2ShortConv(config, 0)
    with torch.no_grad():  # weights large enough that every part of the layer matters
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


def _ours_from(named: dict, bias: bool) -> dict:
    """attnkit's names for Hugging Face's tensors: the map of the layer's docstring."""
    out = {"W_in": named["in_proj.weight"].T, "conv_weight": named["conv.weight"][:, 0, :],
           "W_out": named["out_proj.weight"].T}
    if bias:
        out.update(b_in=named["in_proj.bias"], conv_bias=named["conv.bias"], b_out=named["out_proj.bias"])
    return out


def _layer(bias: bool = True, kernel: int = 3, dtype=np.float64, rng=0) -> ShortConv:
    layer = ShortConv(D, kernel_size=kernel, bias=bias, rng=rng).astype(dtype)
    for name, value in layer.named_parameters():  # away from the initial zeros, so every term counts
        value += (0.3 * make_rng(len(name)).standard_normal(value.shape)).astype(dtype)
    return layer


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias, kernel", [(False, 3), (True, 4)])
def test_equals_hugging_face_forward_and_backward_on_a_padded_batch(bias, kernel, dtype):
    hf = _hf_layer(bias, kernel)
    rng = make_rng(1)
    x, grad_y = randn(rng, 3, 9, D), randn(rng, 3, 9, D)
    mask = np.ones((3, 9), bool)
    mask[1, :4] = mask[2, :1] = False  # left padding
    grad_y[~mask] = 0
    tx = torch.tensor(x.astype(np.float32), requires_grad=True)
    ty = hf(tx, attention_mask=torch.from_numpy(mask.astype(np.int64)))
    ty.backward(torch.tensor(grad_y.astype(np.float32)))
    theirs = {"y": to_numpy(ty), "grad x": to_numpy(tx.grad),
              **{f"grad {n}": g for n, g in _ours_from({n: to_numpy(p.grad) for n, p in hf.named_parameters()},
                                                       bias).items()}}
    ours_layer = ShortConv(D, kernel_size=kernel, bias=bias).astype(dtype)
    ours_layer.load_state_dict({n: a.astype(dtype) for n, a in
                                _ours_from({n: to_numpy(p) for n, p in hf.named_parameters()}, bias).items()})
    y = ours_layer(x.astype(dtype), attention_mask=mask)
    ours = {"y": y, "grad x": ours_layer.backward(grad_y.astype(dtype)),
            **{f"grad {n}": g for n, g in ours_layer.grads.items()}}
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        assert ours[name].dtype == dtype, name
        got = ours[name][mask] if name == "y" else ours[name]  # a padded position's output is no one's
        ref = ref[mask] if name == "y" else ref
        error = float(np.max(np.abs(got - ref))) / float(np.max(np.abs(ref)))
        assert error < 2e-6, f"{name}: {error:.2e} from Hugging Face"


@pytest.mark.parametrize("bias", [False, True])
def test_every_gradient_passes_finite_differences_with_padding(bias):
    layer = _layer(bias, kernel=3, rng=2)
    rng = make_rng(3)
    x, grad_y = randn(rng, 2, 6, D), randn(rng, 2, 6, D)
    mask = np.array([[True] * 6, [False, False, True, True, True, True]])
    layer(x, attention_mask=mask)
    grad_x = layer.backward(grad_y)
    assert np.all(grad_x[1, :2] == 0)  # a zeroed input has no gradient

    def loss():
        return np.sum(layer(x, attention_mask=mask) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    for name, value in layer.named_parameters():
        assert_gradient(loss, value, layer.grads[name], name)


def test_a_replaced_hook_value_is_a_constant_for_the_gradient():
    """A forward hook that replaces the convolution's input cuts the gradient there: what backward returns is
    the gradient of the hooked function (finite differences through the same hook)."""
    layer, rng = _layer(rng=4), make_rng(5)
    x, grad_y = randn(rng, 2, 5, D), randn(rng, 2, 5, D)
    constant = randn(rng, 2, 5, D)
    seen = []
    layer.add_hook("hook_conv_in", lambda value, name: constant, full_name="conv_in")
    layer.add_hook("hook_conv_out", lambda grad, name: seen.append(grad.shape), full_name="conv_out",
                   direction="backward")
    layer(x)
    grad_x = layer.backward(grad_y)
    assert seen == [(2, 5, D)]

    def loss():
        return np.sum(layer(x) * grad_y)

    assert_gradient(loss, x, grad_x, "x")
    assert_gradient(loss, layer.W_out, layer.grads["W_out"], "W_out")
    assert np.abs(grad_x).max() > 0  # the output gate's path still carries a gradient


def test_gradients_accumulate():
    layer, rng = _layer(), make_rng(6)
    x, grad_y = randn(rng, 1, 6, D), randn(rng, 1, 6, D)
    layer(x)
    layer.backward(grad_y)
    once = {n: g.copy() for n, g in layer.grads.items()}
    layer(x)
    layer.backward(grad_y)
    for name, grad in layer.grads.items():
        np.testing.assert_allclose(grad, 2 * once[name], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("prefill", [0, 1, 2, 6])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_steps_and_cached_chunks_equal_the_whole_forward(prefill, dtype):
    layer, rng = _layer(kernel=4, dtype=dtype), make_rng(7, prefill)
    x = randn(rng, 2, 11, D, dtype=dtype)
    whole = layer(x)
    cache = layer.new_cache(2)
    parts = [layer(x[:, :prefill], cache)] if prefill else []
    parts += [layer.step(x[:, t], cache=cache)[:, None] for t in range(prefill, 8)]
    parts.append(layer(x[:, 8:], cache))  # a chunk after steps
    got = np.concatenate(parts, axis=1)
    assert got.dtype == dtype and cache.length == 11 and layer.saved_tensors is None
    tolerance = 1e-13 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(got, whole, rtol=tolerance, atol=tolerance * np.abs(whole).max())


def _mixer_and_cache(batch: int):
    cfg = DecoderConfig(family="lfm2", vocab_size=8, hidden_size=D, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=6, mlp=MLPConfig(8), layer_types=("full_attention", "short_conv"),
                        mixer_parts=(ShortConvConfig(3, bias=True),))
    mixer = ShortConvMixer(cfg, 1, rng=8)
    return mixer, KVCache(2, batch, 1, 6, np.float64, states={1: mixer.new_cache(batch)})


def test_the_cache_goes_back_to_a_marked_length_and_follows_beam_reordering():
    mixer, cache = _mixer_and_cache(2)
    rng = make_rng(9)
    x, other = randn(rng, 2, 9, D), randn(rng, 2, 3, D)
    cache.update(0, np.zeros((2, 1, 5, 6)), np.zeros((2, 1, 5, 6)))  # the attention layer's first 5 slots
    mixer(x[:, :5], cache=cache)
    assert cache.mark() == 5
    cache.update(0, np.zeros((2, 1, 4, 6)), np.zeros((2, 1, 4, 6)))
    mixer(x[:, 5:], cache=cache)  # 4 tokens past the mark, then back: a rejected draft
    cache.crop(5)
    assert cache.length == 5 and cache.state(1).length == 5
    resumed = np.stack([mixer.step(other[:, t], cache=cache) for t in range(3)], axis=1)
    fresh_mixer, fresh = _mixer_and_cache(2)
    fresh_mixer.load_state_dict(dict(mixer.named_parameters()))
    expected = fresh_mixer(np.concatenate([x[:, :5], other], axis=1))[:, 5:]
    np.testing.assert_allclose(resumed, expected, rtol=1e-13, atol=1e-13)
    # beam search: row r continues row index[r]
    state = cache.state(1).conv_state.copy()
    cache.reorder(np.array([1, 1]))
    np.testing.assert_array_equal(cache.state(1).conv_state, state[[1, 1]])


def test_bad_arguments_are_refused():
    mixer, cache = _mixer_and_cache(2)
    x = np.ones((3, 4, D))
    with pytest.raises(ValueError, match="cache holds 2 sequences but x has 3"):
        mixer(x, cache=cache)
    with pytest.raises(ValueError, match="short convolution: it has no attention weights"):
        mixer(x, output_attentions=True)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, L\)"):
        ShortConv(D)(x, attention_mask=np.ones((3, 5), bool) & (np.arange(5) > 0))
    with pytest.raises(ValueError, match="hidden_size"):
        ShortConv(D)(np.ones((1, 2, D + 1)))
    with pytest.raises(TypeError, match="bias must be True or False"):
        ShortConvConfig(3, bias=1)
    with pytest.raises(RuntimeError, match="before a forward without a cache"):
        ShortConv(D).backward(np.ones((1, 2, D)))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_step_is_the_one_position_forward_bit_for_bit(dtype, bias):
    """The step's convolution takes the forward's taps in the forward's order: equal to a cached forward of one
    position exactly, a padded row's zeroed input included."""
    layer = ShortConv(D, kernel_size=3, bias=bias, rng=4).astype(dtype)
    rng = make_rng(11, int(bias))
    x = randn(rng, 2, 7, D, dtype=dtype)
    mask = np.ones((2, 7), dtype=bool)
    mask[1, :2] = False  # a left-padded row
    by_step, by_forward = layer.new_cache(2), layer.new_cache(2)
    layer(x[:, :3], by_step, attention_mask=mask[:, :3])
    layer(x[:, :3], by_forward, attention_mask=mask[:, :3])
    for t in range(3, 7):
        step = layer.step(x[:, t], cache=by_step, attention_mask=mask[:, :t + 1])
        forward = layer(x[:, t:t + 1], by_forward, attention_mask=mask[:, t:t + 1])[:, 0]
        np.testing.assert_array_equal(step, forward)
        np.testing.assert_array_equal(by_step.conv_state, by_forward.conv_state)

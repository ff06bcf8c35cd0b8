"""The in-place kernels of a decoding step against the general kernels they stand in for."""
import numpy as np
import pytest

from attnkit.flex import (
    and_masks,
    causal_lower_right,
    create_block_mask,
    flex_attention,
    padding_mask,
    sliding_window_mask,
    softcap,
)
from attnkit.kernels import ATTENTION_KERNELS, attention_backward, attention_forward
from attnkit.kernels.activations import activation_forward
from attnkit.kernels.decode_step import gated_mlp_step, one_query_attention, rms_norm_into, silu_gate_into
from attnkit.kernels.reference import attention_forward as reference_forward
from attnkit.kernels.rms_norm import rms_norm_forward


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rms_norm_into_is_the_general_norm_bit_for_bit(rng, dtype):
    x = (rng.standard_normal((3, 40)) * 4).astype(dtype)
    gain = rng.standard_normal(40).astype(dtype)
    out, scratch = np.empty_like(x), np.empty_like(x)
    before = x.copy()
    assert rms_norm_into(x, gain, 1e-5, out, scratch) is out
    np.testing.assert_array_equal(out, rms_norm_forward(x, gain, 1e-5)[0])
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_gate_into_is_silu_times_up_bit_for_bit(rng, dtype):
    gate_up = (rng.standard_normal((2, 24)) * 50).astype(dtype)  # exp overflows in some entries: no warning
    out = np.empty((2, 12), dtype)
    with np.errstate(all="raise"):
        silu_gate_into(gate_up, 12, out)
    np.testing.assert_array_equal(out, activation_forward(gate_up[:, :12], "silu") * gate_up[:, 12:])
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_query_attention_equals_the_reference_kernel_over_a_cache_view(rng, dtype):
    rows, hkv, group, slots, dh = 2, 3, 4, 9, 8
    q = rng.standard_normal((rows, hkv, group, dh)).astype(dtype)
    storage = rng.standard_normal((2, rows, hkv, 16, dh)).astype(dtype)  # a cache with spare capacity
    k, v = storage[0, :, :, :slots], storage[1, :, :, :slots]  # (B, Hkv, S, Dh) views
    out = np.empty_like(q)
    one_query_attention(q, k, v, 0.3, out)
    want, _, _ = reference_forward(q[:, :, :, None], k[:, :, None], v[:, :, None], causal=True, scale=0.3)
    tolerance = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(out, want[:, :, :, 0], rtol=tolerance, atol=tolerance)
    assert out.dtype == dtype


def _flex_one_query(q, k, v, *, key_mask=None, window=None, score_mod=None, sinks=None, scale=0.3):
    """The flex kernel's answer for the same step: queries (B, Hq, 1, Dh) over every key, as a layer's
    forward asks it (bottom-right causal, the window, the padding)."""
    b, hkv, group, dh = q.shape
    slots = k.shape[2]
    mask = sliding_window_mask(window, offset=slots - 1) if window else causal_lower_right(1, slots)
    if key_mask is not None:
        mask = and_masks(mask, padding_mask(key_mask))
    block_mask = create_block_mask(mask, b if key_mask is not None else None, None, 1, slots)
    out, _ = flex_attention(q.reshape(b, hkv * group, 1, dh), k, v, score_mod, block_mask, scale=scale,
                            enable_gqa=True, sinks=sinks)  # (B, Hq, 1, Dh)
    return out.reshape(q.shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["mask", "window", "softcap", "sinks", "everything"])
def test_one_query_attention_equals_flex_with_the_layers_variants(rng, dtype, variant):
    b, hkv, group, slots, dh = 3, 2, 3, 10, 8
    q = rng.standard_normal((b, hkv, group, dh)).astype(dtype)
    k, v = (rng.standard_normal((b, hkv, slots, dh)).astype(dtype) for _ in range(2))
    key_mask = np.ones((b, slots), bool)
    key_mask[1, :4] = key_mask[2, :9] = False  # left padding; row 2 sees only its newest key
    options = dict(mask=dict(key_mask=key_mask), window=dict(window=4), softcap=dict(score_mod=softcap(1.5)),
                   sinks=dict(sinks=rng.standard_normal(hkv * group).astype(dtype)))
    chosen = options if variant == "everything" else {variant: options[variant]}
    kwargs = {key: value for option in chosen.values() for key, value in option.items()}
    window = kwargs.pop("window", None)
    kept = slice(-window, None) if window else slice(None)
    mask = kwargs.get("key_mask")
    got = one_query_attention(q, k[:, :, kept], v[:, :, kept], 0.3, None,
                              **dict(kwargs, key_mask=None if mask is None else mask[:, kept]))
    want = _flex_one_query(q, k, v, window=window, **kwargs)
    tolerance = 2e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    assert got.dtype == dtype


def test_a_row_with_no_key_to_attend_to_gets_zeros(rng):
    q = rng.standard_normal((2, 1, 2, 4))
    k, v = rng.standard_normal((2, 1, 5, 4)), rng.standard_normal((2, 1, 5, 4))
    key_mask = np.array([[False] * 5, [True] * 5])
    with np.errstate(all="raise"):
        out = one_query_attention(q, k, v, 0.5, key_mask=key_mask)
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_allclose(out[1], one_query_attention(q[1:], k[1:], v[1:], 0.5)[0])


def test_the_registered_kernel_takes_the_registrys_arguments_and_refuses_a_backward(rng):
    q = rng.standard_normal((2, 3, 1, 4))  # one query row: a plain decoding step in the registry's layout
    k, v = rng.standard_normal((2, 3, 7, 4)), rng.standard_normal((2, 3, 7, 4))
    mask = np.array([[True] * 7, [False] * 2 + [True] * 5])[:, None, None, :]  # (B, 1, 1, Lk)
    bias = rng.standard_normal((1, 3, 1, 7))
    for kwargs in (dict(mask=mask, causal=True), dict(bias=bias, scale=0.7), dict(mask=mask, window=3, causal=True)):
        got, weights, ctx = attention_forward(q, k, v, kernel="one_query", need_weights=False, **kwargs)
        want, _, _ = reference_forward(q, k, v, **kwargs)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
        assert weights is None
    with pytest.raises(ValueError, match="no backward"):
        attention_backward(np.ones_like(got), ctx)
    with pytest.raises(ValueError, match="causal=True needs one query row"):
        ATTENTION_KERNELS["one_query"].forward(np.ones((1, 1, 2, 4)), k[:1], v[:1], causal=True)
    with pytest.raises(ValueError, match="dropout_p must be 0"):
        ATTENTION_KERNELS["one_query"].forward(q, k, v, dropout_p=0.1)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_step_is_the_gated_mlp_kernel(rng, activation, bias):
    from attnkit.kernels.gated_mlp import gated_mlp_forward

    d, f = 6, 10
    x = rng.standard_normal((3, d))
    w_gate, w_up, w_down = rng.standard_normal((d, f)), rng.standard_normal((d, f)), rng.standard_normal((f, d))
    b_gate, b_up, b_down = (rng.standard_normal(n) if bias else None for n in (f, f, d))
    want, _ = gated_mlp_forward(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation=activation)
    fused_bias = np.concatenate([b_gate, b_up]) if bias else None
    got = gated_mlp_step(x, np.concatenate([w_gate, w_up], axis=1), fused_bias, w_down, b_down, activation)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)

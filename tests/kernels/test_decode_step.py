"""The in-place kernels of a decoding step against the general kernels they stand in for."""
import numpy as np
import pytest

from attnkit.kernels.activations import activation_forward
from attnkit.kernels.decode_step import one_query_attention, rms_norm_into, silu_gate_into
from attnkit.kernels.reference import attention_forward
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
    want, _, _ = attention_forward(q[:, :, :, None], k[:, :, None], v[:, :, None], causal=True, scale=0.3)
    tolerance = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(out, want[:, :, :, 0], rtol=tolerance, atol=tolerance)
    assert out.dtype == dtype

"""Positional-bias heads: T5 buckets, ALiBi slopes, physics priors, alignment, dtype.

Dimension letters: B batch, H heads, Lq/Lk query/key length, D head features, NB buckets.
Query i sits at key position ``i + Lk - Lq`` (bottom-right alignment) in every bias.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnkit.attention import LearnedBiasAttention, PhysicsGuidedAttention, ScaledDotProductAttention
from attnkit.attention.learned_bias import alibi_slopes, t5_relative_position_bucket
from attnkit.flex import RelativePositionBias

from head_cases import HEADS, modifier_values, t5_bucket_reference
from helpers import make_rng, randn

REL = np.arange(-400, 401)  # relative positions key - query


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 6), (6, 5), (33, 100), (64, 1000), (4, 3)])
def test_t5_buckets_match_reference_transcription(bidirectional, num_buckets, max_distance):
    """Our buckets equal a direct transcription of HuggingFace's T5 formula (torch, float32 log)."""
    ours = t5_relative_position_bucket(REL, bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(ours, t5_bucket_reference(REL, bidirectional, num_buckets, max_distance))
    assert ours.min() == 0 and ours.max() < num_buckets


@given(bidirectional=st.booleans(), num_buckets=st.integers(4, 80), extra=st.integers(1, 300),
       rel=st.lists(st.integers(-2000, 2000), min_size=1, max_size=20))
def test_t5_buckets_match_reference_random_configs(bidirectional, num_buckets, extra, rel):
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    max_distance = max_exact + extra
    np.testing.assert_array_equal(t5_relative_position_bucket(np.array(rel), bidirectional, num_buckets, max_distance),
                                  t5_bucket_reference(rel, bidirectional, num_buckets, max_distance))


def test_t5_tile_is_bottom_right_aligned():
    """bias[h, i, j] = table[bucket(j - (i + Lk - Lq)), h], for Lq < Lk and Lq > Lk."""
    table = make_rng(1).normal(size=(8, 3))  # (NB, H)
    for seq_q, seq_k in ((2, 7), (6, 3)):
        bias = RelativePositionBias(table, max_distance=10, offset=seq_k - seq_q)
        i, j = np.meshgrid(np.arange(seq_q), np.arange(seq_k), indexing="ij")  # (Lq, Lk)
        expected = table[t5_bucket_reference(j - (i + seq_k - seq_q), True, 8, 10)]  # (Lq, Lk, H)
        np.testing.assert_array_equal(modifier_values(bias, 3, seq_q, seq_k), expected.transpose(2, 0, 1))


def _paper_alibi_slopes(n):
    """Transcription of get_slopes from the ALiBi paper's reference code."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest_power_of_2) + _paper_alibi_slopes(2 * closest_power_of_2)[0::2][
        :n - closest_power_of_2]


@pytest.mark.parametrize("num_heads", range(1, 17))
def test_alibi_init_slopes(num_heads):
    """Initial slopes: 2^(-8 (h + 1) / H) for a power of two H, the paper's interpolation otherwise."""
    head = LearnedBiasAttention(num_heads, mode="alibi")
    np.testing.assert_allclose(head.slopes, _paper_alibi_slopes(num_heads), rtol=1e-14)
    np.testing.assert_allclose(alibi_slopes(num_heads), head.slopes, rtol=0)
    if num_heads in (1, 2, 4, 8, 16):
        np.testing.assert_allclose(head.slopes, 2.0 ** (-8.0 / num_heads * np.arange(1, num_heads + 1)), rtol=1e-14)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_alibi_tile(bidirectional):
    """bias[h, i, j] = -slope_h * |pos(i) - j| (or the paper's one-sided -slope_h * (pos(i) - j), for use with
    the causal mask), pos(i) = i + Lk - Lq."""
    head = LearnedBiasAttention(4, mode="alibi", bidirectional=bidirectional)
    i = np.arange(3)[:, None] + 2  # (Lq, 1)
    j = np.arange(5)[None, :]  # (1, Lk)
    dist = np.abs(i - j) if bidirectional else i - j
    np.testing.assert_array_equal(modifier_values(head.score_mod_for(3, 5), 4, 3, 5),
                                  -head.slopes[:, None, None] * dist)


def test_zero_bias_heads_equal_plain_attention():
    """A zero-initialised T5 table, or a zero strength, leaves scaled dot-product attention unchanged."""
    rng = make_rng(2)
    q, k, v = randn(rng, 2, 3, 4, 5), randn(rng, 2, 3, 6, 5), randn(rng, 2, 3, 6, 2)
    plain, _ = ScaledDotProductAttention()(q, k, v)
    t5, _ = LearnedBiasAttention(3)(q, k, v)
    phys, _ = PhysicsGuidedAttention(strength_init=0.0)(q, k, v)
    np.testing.assert_array_equal(t5, plain)
    np.testing.assert_array_equal(phys, plain)


@pytest.mark.parametrize("name", ["t5_causal", "alibi_causal", "physics_gauss_heads", "physics_callable"])
def test_incremental_decoding_equals_last_rows(name):
    """Bottom-right alignment: the last queries alone (Lq < Lk, a key/value cache) give the last rows of the
    full causal pass."""
    head = HEADS[name][0](0).eval()
    rng = make_rng(3)
    q, k, v = randn(rng, 2, 2, 6, 3), randn(rng, 2, 2, 6, 3), randn(rng, 2, 2, 6, 2)
    full, w_full = head(q, k, v, is_causal=True)
    last, w_last = head(q[..., 4:, :], k, v, is_causal=True)
    np.testing.assert_allclose(last, full[..., 4:, :], rtol=0, atol=1e-14)
    np.testing.assert_allclose(w_last, w_full[..., 4:, :], rtol=0, atol=1e-14)


def test_physics_priors_by_formula():
    """Built-in priors over positions, a 1-D coordinate grid and 2-D points, against their formulas."""
    x = np.array([0.0, 0.5, 2.0, 3.5, 7.0])  # (N,)
    head = PhysicsGuidedAttention("distance_decay", strength_init=1.5, length_scale=2.0, coordinates=x)
    tile = modifier_values(head.score_mod_for(2, 4), 1, 2, 4)[0]  # queries at positions 2, 3
    np.testing.assert_allclose(tile, -1.5 * np.abs(x[[2, 3]][:, None] - x[None, :4]) / 2.0)
    pts = make_rng(4).normal(size=(4, 3))  # (N, d)
    head = PhysicsGuidedAttention("gaussian", strength_init=[1.0, -2.0], length_scale=0.7, coordinates=pts,
                                  num_heads=2)
    d2 = ((pts[:, None] - pts[None]) ** 2).sum(-1)  # (N, N)
    np.testing.assert_allclose(modifier_values(head.score_mod_for(4, 4), 2, 4, 4),
                               np.array([1.0, -2.0])[:, None, None] * -d2 / (2 * 0.49), rtol=1e-14)
    head = PhysicsGuidedAttention("gaussian", length_scale=3.0)
    np.testing.assert_allclose(modifier_values(head.score_mod_for(3, 3), 1, 3, 3)[0],
                               -(np.arange(3)[:, None] - np.arange(3)[None]) ** 2 / 18.0)


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_heads_preserve_dtype_and_inputs(name, dtype):
    """float32 in -> float32 out, weights and input gradients; parameter gradients stay in the parameters'
    dtype; the caller's arrays are not modified."""
    head = HEADS[name][0](0)
    rng = make_rng(5)
    lead = (2, 2) if HEADS[name][1] else (2,)
    q, k, v = randn(rng, *lead, 3, 3, dtype=dtype), randn(rng, *lead, 5, 3, dtype=dtype), \
        randn(rng, *lead, 5, 2, dtype=dtype)
    mask = np.ones(lead + (3, 5), bool)  # (..., Lq, Lk)
    copies = [a.copy() for a in (q, k, v, mask)]
    out, w = head(q, k, v, mask)
    grads = head.backward(np.ones_like(out))
    assert out.dtype == w.dtype == dtype
    assert [g.dtype for g in grads] == [dtype] * 3
    assert all(head.grads[n].dtype == p.dtype == np.float64 for n, p in head.named_parameters())
    for before, after in zip(copies, (q, k, v, mask), strict=False):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("name", ["t5", "alibi_causal", "physics_points", "physics_gauss_heads", "physics_callable"])
def test_biases_in_the_tiled_kernel_equal_the_reference(name):
    """Twin test: the same score modifier asked tile by tile (tiled kernel, 2 threads) gives the reference
    kernel's output, input gradients and parameter gradients."""
    tiled = pytest.importorskip("attnkit.kernels.tiled")
    from attnkit.kernels import reference as ref
    head = HEADS[name][0](0)
    rng = make_rng(6)
    q, k, v, G = randn(rng, 2, 2, 5, 3), randn(rng, 2, 2, 7, 3), randn(rng, 2, 2, 7, 2), randn(rng, 2, 2, 5, 2)
    out, _, ctx = ref.attention_forward(q, k, v, causal=True, score_mod=head.score_mod_for(5, 7))
    grads = ref.attention_backward(G, ctx)[:3]
    param_grads = {n: g.copy() for n, g in head.grads.items()}
    head.zero_grad()
    out_t, _, ctx_t = tiled.flash_attention_forward(q, k, v, causal=True, score_mod=head.score_mod_for(5, 7),
                                                    block_q=2, block_k=3, num_threads=2)
    grads_t = tiled.flash_attention_backward(G, ctx_t)[:3]
    np.testing.assert_allclose(out_t, out, rtol=0, atol=1e-13)
    for a, b in zip(grads_t, grads, strict=False):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)
    for n, g in head.grads.items():
        np.testing.assert_allclose(g, param_grads[n], rtol=0, atol=1e-12)

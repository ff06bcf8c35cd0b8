"""Rotary kernel: the rotation is orthogonal, its backward is exact, both layouts agree up to a permutation."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.kernels.rotary import (
    rotary_apply,
    rotary_apply_in_place,
    rotary_backward,
    rotary_cos_sin,
    rotary_frequencies,
)

from helpers import assert_gradient, make_rng, numerical_gradient, randn

B, H, L = 2, 3, 5


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dh, r", [(8, 8), (8, 4), (6, 2)])
def test_backward_matches_finite_differences(interleaved, dh, r):
    rng = make_rng(dh, r, interleaved)
    x = randn(rng, B, H, L, dh)
    pos = rng.integers(0, 50, size=(B, L))
    cos, sin = rotary_cos_sin(pos, rotary_frequencies(r, 100.0)[0], 1.3, interleaved=interleaved,
                              dtype=np.float64)
    g = randn(rng, B, H, L, dh)
    analytic = rotary_backward(g, cos, sin, interleaved)
    numeric = numerical_gradient(lambda: np.sum(rotary_apply(x, cos, sin, interleaved) * g), x)
    assert_gradient(lambda: np.sum(rotary_apply(x, cos, sin, interleaved) * g), x, analytic, "x")
    np.testing.assert_allclose(analytic, numeric, atol=1e-7)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_keeps_norms_and_passes_the_rest(interleaved):
    rng = make_rng(3)
    x = randn(rng, B, H, L, 8)
    cos, sin = rotary_cos_sin(rng.integers(0, 1000, (B, L)), rotary_frequencies(4, 10000.0)[0],
                              interleaved=interleaved, dtype=np.float64)
    y = rotary_apply(x, cos, sin, interleaved)
    np.testing.assert_allclose(np.linalg.norm(y[..., :4], axis=-1), np.linalg.norm(x[..., :4], axis=-1), rtol=1e-13)
    np.testing.assert_array_equal(y[..., 4:], x[..., 4:])


def test_scores_depend_only_on_relative_position():
    rng = make_rng(4)
    q, k = randn(rng, 1, 1, 1, 8), randn(rng, 1, 1, 1, 8)
    inv = rotary_frequencies(8, 10000.0)[0]

    def score(pq, pk):
        cq, sq = rotary_cos_sin(np.array([[pq]]), inv, dtype=np.float64)
        ck, sk = rotary_cos_sin(np.array([[pk]]), inv, dtype=np.float64)
        return float(np.sum(rotary_apply(q, cq, sq) * rotary_apply(k, ck, sk)))

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-12)


def test_interleaved_is_the_half_split_layout_permuted():
    rng = make_rng(5)
    x = randn(rng, B, H, L, 8)
    pos = rng.integers(0, 100, (B, L))
    inv = rotary_frequencies(8, 500.0)[0]
    perm = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved pair i -> half-split pair i
    half = rotary_apply(x[..., perm], *rotary_cos_sin(pos, inv, dtype=np.float64))
    inter = rotary_apply(x, *rotary_cos_sin(pos, inv, interleaved=True, dtype=np.float64), interleaved=True)
    np.testing.assert_allclose(inter[..., perm], half, rtol=1e-13, atol=1e-14)


def test_float32_in_float32_out():
    rng = make_rng(6)
    x = randn(rng, B, H, L, 8, dtype=np.float32)
    cos, sin = rotary_cos_sin(rng.integers(0, 9, (B, L)), rotary_frequencies(8, 1e4)[0])
    assert rotary_apply(x, cos, sin).dtype == np.float32
    assert rotary_backward(x, cos, sin).dtype == np.float32


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dh, r", [(8, 8), (8, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_rotation_in_place_is_rotary_apply_bit_for_bit(interleaved, dh, r, dtype):
    """The decoding step's in-place rotation writes exactly rotary_apply's numbers (a cos - b sin and
    a cos + (-b) sin round alike), on a view of a wider array too (the queries and keys of one projection)."""
    rng = make_rng(dh, r, 7)
    wide = rng.standard_normal((B, 2 * H * dh + 3)).astype(dtype)  # (B, W): queries and keys, then more
    x = wide[:, :2 * H * dh].reshape(B, 2 * H, 1, dh)  # (B, 2H, 1, Dh) view
    cos, sin = rotary_cos_sin(rng.integers(0, 500, (B, 1)), rotary_frequencies(r, 100.0)[0], 1.3,
                              interleaved=interleaved, dtype=np.float32)  # (B, 1, R)
    want = rotary_apply(x, cos, sin, interleaved)
    rest = wide[:, 2 * H * dh:].copy()
    assert rotary_apply_in_place(x, cos, sin, interleaved) is x
    assert x.dtype == dtype
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(wide[:, 2 * H * dh:], rest)  # nothing past the view is written

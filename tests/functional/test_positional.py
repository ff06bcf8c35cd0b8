"""Positional encodings and masks against their explicit formulas.

PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)) (odd d_model too);
add_positional_encoding(x, pe) = x + pe[:seq_len]; causal masks are lower triangular; padding masks are
True on the first ``length`` positions.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from attnkit.attention_core import scaled_dot_product_attention
from attnkit.positional import (
    add_positional_encoding,
    create_causal_mask,
    create_padding_mask,
    learned_positional_encoding,
    sinusoidal_encoding,
)

from helpers import make_rng, randn


def explicit_sinusoidal(max_length: int, d_model: int) -> np.ndarray:
    """Scalar-by-scalar evaluation of the formula of "Attention Is All You Need"."""
    pe = np.zeros((max_length, d_model))
    for pos in range(max_length):
        for col in range(d_model):
            i = col // 2
            angle = pos / math.pow(10000.0, 2 * i / d_model)
            pe[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return pe


@pytest.mark.parametrize("max_length,d_model", [(1, 1), (3, 1), (7, 4), (10, 5), (50, 16), (100, 33), (20, 512)])
def test_sinusoidal_encoding_matches_formula(max_length, d_model):
    """Every entry equals sin/cos(pos / 10000^(2i/d)), including odd d_model (the last column is a sine)."""
    pe = sinusoidal_encoding(max_length, d_model)
    assert pe.shape == (max_length, d_model)
    np.testing.assert_allclose(pe, explicit_sinusoidal(max_length, d_model), rtol=0, atol=1e-12)


def test_sinusoidal_encoding_known_values():
    """Position 0 is [0, 1, 0, 1, ...]; position 1 starts with sin(1), cos(1); entries lie in [-1, 1]."""
    pe = sinusoidal_encoding(100, 512)
    np.testing.assert_array_equal(pe[0, 0::2], 0.0)
    np.testing.assert_array_equal(pe[0, 1::2], 1.0)
    np.testing.assert_allclose(pe[1, :2], [math.sin(1.0), math.cos(1.0)], rtol=1e-15)
    np.testing.assert_allclose(pe[1, 2], math.sin(1.0 / 10000 ** (2 / 512)), rtol=1e-14)
    assert np.all(np.abs(pe) <= 1.0)
    # Relative positions: PE[p + k] is a fixed rotation of PE[p] in each (sin, cos) pair.
    k, i = 5, 3
    w = 1.0 / 10000 ** (2 * i / 512)
    rot = np.array([[math.cos(k * w), -math.sin(k * w)], [math.sin(k * w), math.cos(k * w)]])
    np.testing.assert_allclose(pe[10, 2 * i:2 * i + 2] @ rot, pe[10 + k, 2 * i:2 * i + 2], atol=1e-12)


@pytest.mark.parametrize("L", [1, 4, 9])
def test_add_positional_encoding_adds_the_first_rows(L):
    """add_positional_encoding(x, pe) = x + pe[:L] for every batch entry (L = max_len included)."""
    rng = make_rng(1, L)
    x = randn(rng, 3, L, 6)
    pe = sinusoidal_encoding(9, 6)
    out = add_positional_encoding(x, pe)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, x + pe[None, :L], rtol=0, atol=1e-15)
    learned = learned_positional_encoding(9, 6, rng=make_rng(2))
    np.testing.assert_allclose(add_positional_encoding(x, learned), x + learned[:L], rtol=0, atol=1e-15)


def test_learned_positional_encoding_shape_and_reproducibility():
    """learned_positional_encoding: (max_length, d_model), finite, random, reproducible from the rng seed."""
    a = learned_positional_encoding(16, 8, rng=np.random.default_rng(3))
    b = learned_positional_encoding(16, 8, rng=np.random.default_rng(3))
    c = learned_positional_encoding(16, 8, rng=np.random.default_rng(4))
    assert a.shape == (16, 8) and np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert np.std(a) > 0 and len(np.unique(a)) == a.size
    assert learned_positional_encoding(5, 3).shape == (5, 3)


@pytest.mark.parametrize("n", [1, 2, 4, 17])
def test_create_causal_mask_is_lower_triangular(n):
    """create_causal_mask(n) is the boolean lower-triangular matrix (True on and below the diagonal)."""
    m = create_causal_mask(n)
    assert m.dtype == np.bool_ and m.shape == (n, n)
    np.testing.assert_array_equal(m, np.tril(np.ones((n, n), dtype=bool)))


def test_create_causal_mask_spec_example():
    """The seed's docstring example for n = 4."""
    np.testing.assert_array_equal(create_causal_mask(4), [[True, False, False, False], [True, True, False, False],
                                                          [True, True, True, False], [True, True, True, True]])


def test_causal_mask_zeroes_future_weights():
    """Used in attention, the causal mask gives row i weight 0 on keys j > i and a distribution on j <= i."""
    rng = make_rng(5)
    x = randn(rng, 2, 6, 3)
    _, w = scaled_dot_product_attention(x, x, x, mask=create_causal_mask(6))
    assert np.all(w[:, ~create_causal_mask(6)] == 0)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(w[:, 0, 0], 1.0)


def test_create_padding_mask_spec_example():
    """The seed's docstring example: lengths [3, 2], max_length 4."""
    m = create_padding_mask(np.array([3, 2]), max_length=4)
    assert m.dtype == np.bool_
    np.testing.assert_array_equal(m, [[True, True, True, False], [True, True, False, False]])


@pytest.mark.parametrize("lengths,max_length", [([0, 4, 1], 4), ([5], 5), ([0], 3), ([2, 2], 2)])
def test_create_padding_mask_matches_formula(lengths, max_length):
    """mask[b, t] = t < lengths[b], for lengths 0 and max_length too."""
    m = create_padding_mask(np.array(lengths), max_length)
    assert m.shape == (len(lengths), max_length) and m.dtype == np.bool_
    np.testing.assert_array_equal(m, np.arange(max_length)[None, :] < np.array(lengths)[:, None])


def test_padding_mask_used_in_attention_ignores_padded_keys():
    """A padding mask reshaped to (B, 1, Lk) makes padded keys irrelevant: changing them changes nothing."""
    rng = make_rng(6)
    lengths = np.array([2, 4])
    mask = create_padding_mask(lengths, 4)[:, None, :]  # (B, 1, Lk)
    Q, K, V = randn(rng, 2, 3, 5), randn(rng, 2, 4, 5), randn(rng, 2, 4, 2)
    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    K2, V2 = K.copy(), V.copy()
    K2[0, 2:] += 100.0
    V2[0, 2:] -= 50.0
    out2, _ = scaled_dot_product_attention(Q, K2, V2, mask=mask)
    np.testing.assert_allclose(out2, out, rtol=1e-13, atol=1e-13)
    assert np.all(w[0, :, 2:] == 0)

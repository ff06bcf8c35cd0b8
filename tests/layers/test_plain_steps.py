"""GPT-2's and GPT-NeoX's parts on the decoding path, LayerNorm and the plain FeedForward: a step is the forward's
numbers on one position per row, bit for bit, and keeps nothing (a step between a forward and its backward leaves
the backward's saved arrays alone)."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.layers.feed_forward import FeedForward
from attnkit.layers.layer_norm import LayerNorm

from helpers import make_rng, randn


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_step_is_its_forward_on_the_rows(dtype):
    rng = make_rng(11)
    norm = LayerNorm(8, eps=1e-5)
    norm.gamma, norm.beta = randn(rng, 8) + 1.0, randn(rng, 8)
    norm.astype(dtype)
    x = randn(rng, 3, 4, 8).astype(dtype)  # (B, L, D)
    want = norm(x)  # (B, L, D)
    saved = norm.saved_tensors
    got = norm.step(x[:, 2])  # (B, D)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want[:, 2])
    assert norm.saved_tensors is saved


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu"])
def test_feed_forward_step_is_its_forward_on_the_rows(activation):
    rng = make_rng(12)
    mlp = FeedForward(8, 16, activation, rng=0)
    mlp.b1, mlp.b2 = randn(rng, 16), randn(rng, 8)
    x = randn(rng, 3, 4, 8)  # (B, L, D)
    want = mlp(x)  # (B, L, D)
    saved = mlp.saved_tensors
    np.testing.assert_array_equal(mlp.step(x[:, 1]), want[:, 1])
    assert mlp.saved_tensors is saved

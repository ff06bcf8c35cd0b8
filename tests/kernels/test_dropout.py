"""Dropout, for the ``Dropout`` layer and the attention weights of ``ScaledDotProductAttention(dropout=p,
seed=...)`` (also inside ``MultiHeadAttention``): p = 0 is bitwise the same as no dropout; the same seed
gives the same result; over >= 1e5 entries the dropped fraction is within 0.01 of p; eval mode turns it off;
backward uses the forward's mask (finite differences with a fixed seed); inverted scaling keeps the mean.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention import MultiHeadAttention, ScaledDotProductAttention
from attnkit.layers import Dropout

from helpers import assert_gradient, make_rng, randn


# --------------------------------------------------------------------------------------------------------
# Dropout layer
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_layer_p0_is_bitwise_identity(dtype):
    x = randn(make_rng(1), 4, 5, 6, dtype=dtype)
    layer = Dropout(0.0, seed=1)
    y = layer(x)
    assert y.dtype == dtype and np.array_equal(y, x)
    G = randn(make_rng(2), 4, 5, 6, dtype=dtype)
    assert np.array_equal(layer.backward(G), G)


def test_dropout_layer_same_seed_same_result_different_seed_different():
    x = np.ones((50, 40))
    a, b, c = Dropout(0.3, seed=5), Dropout(0.3, seed=5), Dropout(0.3, seed=6)
    ya, yb, yc = a(x), b(x), c(x)
    assert np.array_equal(ya, yb) and not np.array_equal(ya, yc)
    assert np.array_equal(a(x), b(x))  # the streams stay in step call after call
    assert not np.array_equal(a(x), ya)  # while successive calls draw new masks


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_layer_dropped_fraction_and_scaling(p):
    x = np.ones((400, 500))  # 2e5 entries
    y = Dropout(p, seed=7)(x)
    dropped = np.mean(y == 0)
    assert abs(dropped - p) < 0.01
    assert np.all((y == 0) | np.isclose(y, 1.0 / (1.0 - p)))
    assert abs(y.mean() - 1.0) < 0.05  # inverted scaling keeps the expectation


def test_dropout_layer_eval_mode_is_off_and_train_turns_it_back_on():
    x = randn(make_rng(3), 20, 30)
    layer = Dropout(0.5, seed=0).eval()
    assert np.array_equal(layer(x), x)
    assert np.array_equal(layer.backward(x), x)
    layer.train()
    assert np.count_nonzero(layer(x) == 0) > 0


def test_dropout_layer_backward_uses_forward_mask():
    x = randn(make_rng(4), 6, 7)
    layer = Dropout(0.4, seed=9)
    y = layer(x)
    g = layer.backward(np.ones_like(x))
    np.testing.assert_array_equal(g == 0, y == 0)
    G = randn(make_rng(5), 6, 7)
    assert_gradient(lambda: float(np.sum(Dropout(0.4, seed=9)(x) * G)), x, layer.backward(G), "x")


def test_dropout_layer_keeps_dtype_and_does_not_modify_input():
    x = randn(make_rng(6), 3, 4, dtype=np.float32)
    x_copy = x.copy()
    y = Dropout(0.5, seed=0)(x)
    assert y.dtype == np.float32 and np.array_equal(x, x_copy)


# --------------------------------------------------------------------------------------------------------
# Attention-weight dropout
# --------------------------------------------------------------------------------------------------------
def qkv(seed=0, B=2, Lq=5, Lk=6, D=4, Dv=3):
    rng = make_rng(seed)
    return randn(rng, B, Lq, D), randn(rng, B, Lk, D), randn(rng, B, Lk, Dv)


def test_sdpa_p0_is_bitwise_the_same_as_no_dropout():
    q, k, v = qkv()
    plain = ScaledDotProductAttention()
    zero = ScaledDotProductAttention(dropout=0.0, seed=3)
    out_a, w_a = plain(q, k, v)
    out_b, w_b = zero(q, k, v)
    G = randn(make_rng(1), *out_a.shape)
    assert np.array_equal(out_a, out_b) and np.array_equal(w_a, w_b)
    for a, b in zip(plain.backward(G), zero.backward(G)):
        assert np.array_equal(a, b)


def test_mha_p0_is_bitwise_the_same_as_no_dropout():
    x = randn(make_rng(2), 2, 5, 8)
    a, b = MultiHeadAttention(8, 2, rng=0), MultiHeadAttention(8, 2, dropout=0.0, rng=0)
    assert np.array_equal(a(x, x, x)[0], b(x, x, x)[0])


def test_sdpa_dropout_same_seed_same_result():
    q, k, v = qkv()
    a, b = ScaledDotProductAttention(dropout=0.3, seed=4), ScaledDotProductAttention(dropout=0.3, seed=4)
    out_a, w_a = a(q, k, v)
    out_b, w_b = b(q, k, v)
    assert np.array_equal(out_a, out_b) and np.array_equal(w_a, w_b)
    G = np.ones_like(out_a)
    for ga, gb in zip(a.backward(G), b.backward(G)):
        assert np.array_equal(ga, gb)
    c = ScaledDotProductAttention(dropout=0.3, seed=5)
    assert not np.array_equal(c(q, k, v)[0], out_a)


def test_sdpa_dropped_fraction_over_1e5_weights():
    """With identity values the output *is* the dropped, rescaled weight matrix."""
    p = 0.2
    B, L = 10, 100  # 1e5 weights
    q, k = randn(make_rng(7), B, L, 8), randn(make_rng(8), B, L, 8)
    v = np.broadcast_to(np.eye(L), (B, L, L))
    out, w = ScaledDotProductAttention(dropout=p, seed=11)(q, k, v)
    assert np.all(w > 0)
    dropped = np.mean(out == 0)
    assert abs(dropped - p) < 0.01
    kept = out != 0
    np.testing.assert_allclose(out[kept], w[kept] / (1 - p), rtol=1e-12)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)  # returned weights are before dropout


def test_sdpa_eval_mode_turns_dropout_off():
    q, k, v = qkv()
    head = ScaledDotProductAttention(dropout=0.5, seed=0)
    plain_out, _ = ScaledDotProductAttention()(q, k, v)
    head.eval()
    assert np.array_equal(head(q, k, v)[0], plain_out)
    head.train()
    assert not np.array_equal(head(q, k, v)[0], plain_out)


def test_mha_eval_mode_turns_head_dropout_off():
    x = randn(make_rng(9), 2, 6, 8)
    mha = MultiHeadAttention(8, 2, attention=ScaledDotProductAttention(dropout=0.5, seed=1), rng=0)
    ref = MultiHeadAttention(8, 2, rng=0)
    assert not np.array_equal(mha(x, x, x)[0], ref(x, x, x)[0])
    mha.eval()  # propagates to the head
    assert not mha.attention.training
    assert np.array_equal(mha(x, x, x)[0], ref(x, x, x)[0])


@pytest.mark.parametrize("wrt", ["q", "k", "v"])
def test_sdpa_dropout_gradient_with_fixed_seed(wrt):
    q, k, v = qkv(seed=12)
    G = randn(make_rng(13), 2, 5, 3)
    head = ScaledDotProductAttention(dropout=0.3, seed=21)
    head(q, k, v)
    grads = dict(zip("qkv", head.backward(G)))
    arrays = {"q": q, "k": k, "v": v}
    loss = lambda: float(np.sum(ScaledDotProductAttention(dropout=0.3, seed=21)(q, k, v)[0] * G))  # noqa: E731
    assert_gradient(loss, arrays[wrt], grads[wrt], wrt)

"""Hypothesis property tests (deterministic profile ``attnkit`` registered in conftest).

- weights are non-negative and sum to 1 on every row that may attend, and are exactly 0 on rows that may not;
- the output shape is always (..., Lq, d_v), for any leading dims;
- permuting the keys together with the values (and the mask columns) leaves the output unchanged.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from attnkit.attention_core import additive_attention, attention_weights, scaled_dot_product_attention
from attnkit.multi_head import multi_head_attention_forward

MASK_KINDS = ("none", "random", "row_broadcast", "key_broadcast", "key_vector", "causal")


@st.composite
def attention_problem(draw, max_lead=3):
    """Random (Q, K, V, mask) with 0-3 leading dims, lengths 1-6, features 1-5 and any mask kind."""
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=max_lead)))
    Lq, Lk = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    D, Dv = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0, 100.0]))
    kind = draw(st.sampled_from(MASK_KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    Q = scale * rng.standard_normal(lead + (Lq, D))
    K = scale * rng.standard_normal(lead + (Lk, D))
    V = rng.standard_normal(lead + (Lk, Dv))
    if kind == "none":
        mask = None
    elif kind == "random":  # may contain fully masked rows
        mask = rng.random(lead + (Lq, Lk)) < draw(st.sampled_from([0.2, 0.5, 0.9]))
    elif kind == "row_broadcast":
        mask = rng.random((Lq, Lk)) < 0.5
    elif kind == "key_broadcast":
        mask = rng.random((1,) * len(lead) + (1, Lk)) < 0.6
    elif kind == "key_vector":  # 1-D (Lk,): broadcasts to every query row
        mask = rng.random(Lk) < 0.6
    else:
        mask = np.tril(np.ones((Lq, Lk), bool))
    return Q, K, V, mask


def allowed_rows(mask, shape):
    """(..., Lq) True where the row may attend at least one key."""
    if mask is None:
        return np.ones(shape[:-1], bool)
    return np.broadcast_to(mask, shape).any(axis=-1)


@given(attention_problem())
def test_weights_are_a_distribution_on_rows_that_may_attend(problem):
    """Weights >= 0, rows that may attend sum to 1, masked entries and rows that may not are exactly 0."""
    Q, K, V, mask = problem
    _, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    shape = w.shape
    assert np.all(np.isfinite(w)) and np.all(w >= 0)
    live = allowed_rows(mask, shape)
    np.testing.assert_allclose(w.sum(axis=-1)[live], 1.0, rtol=0, atol=1e-12)
    assert np.all(w[~live] == 0)
    if mask is not None:
        assert np.all(w[~np.broadcast_to(mask, shape)] == 0)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 2**32 - 1),
       st.sampled_from([1.0, 1e2, 1e4]))
def test_attention_weights_sum_to_one_any_axis(shape, seed, scale):
    """The plain softmax sums to 1 along the chosen axis, is non-negative and finite, even for 1e4 logits."""
    rng = np.random.default_rng(seed)
    s = scale * rng.standard_normal(shape)
    for axis in range(-len(shape), len(shape)):
        w = attention_weights(s, axis=axis)
        assert w.shape == s.shape and np.all(np.isfinite(w)) and np.all(w >= 0)
        np.testing.assert_allclose(w.sum(axis=axis), 1.0, rtol=0, atol=1e-12)


@given(attention_problem())
def test_output_shape_is_leading_dims_lq_dv(problem):
    """scaled_dot_product_attention returns (..., Lq, d_v) outputs and (..., Lq, Lk) weights."""
    Q, K, V, mask = problem
    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    assert out.shape == Q.shape[:-1] + (V.shape[-1],)
    assert w.shape == Q.shape[:-1] + (K.shape[-2],)
    assert np.all(np.isfinite(out))


@given(attention_problem(), st.integers(1, 4))
def test_additive_output_shape(problem, d_attn):
    """additive_attention also returns (..., Lq, d_v) for any leading dims and (..., Lq, Lk) weights."""
    Q, K, V, mask = problem
    rng = np.random.default_rng(0)
    W_q, W_k, v = (rng.standard_normal((Q.shape[-1], d_attn)), rng.standard_normal((K.shape[-1], d_attn)),
                   rng.standard_normal(d_attn))
    out, w = additive_attention(Q, K, V, W_q, W_k, v, mask=mask)
    assert out.shape == Q.shape[:-1] + (V.shape[-1],)
    assert w.shape == Q.shape[:-1] + (K.shape[-2],)
    live = allowed_rows(mask, w.shape)
    np.testing.assert_allclose(w.sum(axis=-1)[live], 1.0, rtol=0, atol=1e-12)
    assert np.all(w[~live] == 0) and np.all(out[~live] == 0)


@given(attention_problem(), st.randoms(use_true_random=False))
def test_permuting_keys_with_values_leaves_output_unchanged(problem, random):
    """Attention is a set operation over keys: permute K, V (and the mask columns) together, same output."""
    Q, K, V, mask = problem
    Lk = K.shape[-2]
    perm = np.array(random.sample(range(Lk), Lk))
    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    pmask = None if mask is None else mask[..., perm]
    out_p, w_p = scaled_dot_product_attention(Q, K[..., perm, :], V[..., perm, :], mask=pmask)
    np.testing.assert_allclose(out_p, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w_p, w[..., perm], rtol=1e-12, atol=1e-12)


@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 4)]),
       st.integers(0, 2**32 - 1), st.randoms(use_true_random=False))
def test_multi_head_key_permutation_invariance_and_shape(B, Lq, Lk, dims, seed, random):
    """Multi-head output is (B, Lq, D) and unchanged by permuting key/value positions (with the mask)."""
    D, H = dims
    rng = np.random.default_rng(seed)
    Q, K, V = rng.standard_normal((B, Lq, D)), rng.standard_normal((B, Lk, D)), rng.standard_normal((B, Lk, D))
    W = [rng.standard_normal((D, D)) for _ in range(4)]
    mask = rng.random((B, 1, 1, Lk)) < 0.7
    perm = np.array(random.sample(range(Lk), Lk))
    out, cache = multi_head_attention_forward(Q, K, V, *W, H, mask=mask)
    assert out.shape == (B, Lq, D) and cache["weights"].shape == (B, H, Lq, Lk)
    out_p, _ = multi_head_attention_forward(Q, K[:, perm], V[:, perm], *W, H, mask=mask[..., perm])
    np.testing.assert_allclose(out_p, out, rtol=1e-12, atol=1e-12)

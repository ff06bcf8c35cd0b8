"""Numeric edge cases, each a named test.

Fully masked rows, very negative but unmasked logits, logits and input scales of +-1e4, the smallest
sizes (Lq = Lk = d = 1), zero-length sequences, the causal receptive field checked through gradients,
dtype preservation, no in-place modification of inputs, and NaN propagation.
"""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.attention_core import (
    additive_attention,
    additive_attention_backward,
    apply_attention_mask,
    attention_weights,
    attention_weights_backward,
    compute_attention_scores,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnkit.multi_head import (
    MultiHeadAttention,
    merge_heads,
    multi_head_attention_backward,
    multi_head_attention_forward,
    split_heads,
)
from attnkit.positional import add_positional_encoding, create_causal_mask, sinusoidal_encoding
from attnkit.transformer_block import (
    TransformerEncoderBlock,
    feed_forward,
    feed_forward_backward,
    layer_norm,
    layer_norm_backward,
    stack_encoder_blocks,
)

from helpers import make_rng, randn, torch_sdpa


def stable_softmax(s: np.ndarray) -> np.ndarray:
    """Independent float64 reference softmax over the last axis."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def all_finite(*arrays) -> bool:
    return all(np.all(np.isfinite(a)) for a in arrays)


# --------------------------------------------------------------------------------------------------------
# Fully masked rows
# --------------------------------------------------------------------------------------------------------
def test_fully_masked_rows_sdpa_zero_output_zero_gradient_no_nan():
    """A query row whose mask allows no key: zero weights, zero output, zero grad_Q, nothing NaN."""
    rng = make_rng(1)
    Q, K, V = randn(rng, 2, 4, 3), randn(rng, 2, 5, 3), randn(rng, 2, 5, 2)
    mask = rng.random((2, 4, 5)) < 0.7
    mask[0, 1] = False
    mask[1, 3] = False
    mask[0, 0, 0] = mask[1, 0, 0] = True
    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    G = randn(rng, 2, 4, 2)
    dQ, dK, dV = scaled_dot_product_attention_backward(G, Q, K, V, w)
    assert all_finite(out, w, dQ, dK, dV)
    for b, i in ((0, 1), (1, 3)):
        assert np.all(w[b, i] == 0) and np.all(out[b, i] == 0) and np.all(dQ[b, i] == 0)
    # Live rows still sum to one.
    np.testing.assert_allclose(w[0, [0, 2, 3]].sum(-1), 1.0, atol=1e-12)
    # The dead rows' upstream gradient reaches nothing.
    G_dead = np.zeros_like(G)
    G_dead[0, 1] = G_dead[1, 3] = 1.0
    for g in scaled_dot_product_attention_backward(G_dead, Q, K, V, w):
        assert np.all(g == 0)


def test_fully_masked_everything_sdpa():
    """A mask that is False everywhere gives all-zero weights, outputs and gradients."""
    rng = make_rng(2)
    Q, K, V = randn(rng, 3, 4), randn(rng, 6, 4), randn(rng, 6, 2)
    out, w = scaled_dot_product_attention(Q, K, V, mask=np.zeros((3, 6), bool))
    grads = scaled_dot_product_attention_backward(randn(rng, 3, 2), Q, K, V, w)
    assert np.all(out == 0) and np.all(w == 0)
    assert all(np.all(g == 0) for g in grads)


def test_fully_masked_rows_additive_attention():
    """Additive attention gives zero weights, output and gradients on a fully masked row, without NaN."""
    rng = make_rng(3)
    Q, K, V = randn(rng, 2, 3, 4), randn(rng, 2, 5, 2), randn(rng, 2, 5, 3)
    W_q, W_k, v = randn(rng, 4, 6), randn(rng, 2, 6), randn(rng, 6)
    mask = np.ones((2, 3, 5), bool)
    mask[1, 2] = False
    out, w = additive_attention(Q, K, V, W_q, W_k, v, mask=mask)
    dQ, dK, dV, dp = additive_attention_backward(randn(rng, 2, 3, 3), Q, K, V, W_q, W_k, v, w)
    assert all_finite(out, w, dQ, dK, dV, *dp.values())
    assert np.all(w[1, 2] == 0) and np.all(out[1, 2] == 0) and np.all(dQ[1, 2] == 0)


def test_fully_masked_rows_multi_head_and_block():
    """MultiHeadAttention and the encoder block stay finite; the masked query's attention output is zero."""
    rng = make_rng(4)
    B, L, D, H = 2, 4, 8, 2
    x = randn(rng, B, L, D)
    mask = np.ones((B, 1, L, L), bool)
    mask[0, 0, 2] = False  # query 2 of batch 0 may attend nothing (all heads)
    mha = MultiHeadAttention(D, H, rng=make_rng(40))
    out, w = mha.forward(x, x, x, mask=mask)
    assert np.all(w[0, :, 2] == 0) and np.all(out[0, 2] == 0)
    grads = mha.backward(randn(rng, B, L, D))
    assert all_finite(out, w, *grads, *mha.grads.values())
    assert np.all(grads[0][0, 2] == 0)  # grad_Q of the masked query

    block = TransformerEncoderBlock(D, H, d_ff=16, rng=make_rng(41))
    y = block.forward(x, mask=mask)
    dx = block.backward(randn(rng, B, L, D))
    assert all_finite(y, dx, *(g for _, g in block.named_gradients()))


# --------------------------------------------------------------------------------------------------------
# Very negative, large and scaled logits
# --------------------------------------------------------------------------------------------------------
def test_very_negative_unmasked_logits_get_stable_softmax_not_zero():
    """Rows whose every logit is <= -1e5 but unmasked get the proper softmax: a row is dead only by mask."""
    scores = np.array([[-1e5, -1e5 - 1.0, -1e5 - 2.0], [-3e5, -3e5, -3e5]])
    w = attention_weights(scores)
    np.testing.assert_allclose(w, stable_softmax(scores), rtol=1e-12)
    np.testing.assert_allclose(w[1], 1.0 / 3.0, rtol=1e-12)
    # Through scaled dot-product attention: d = 1, q = 1e3, keys about -100 -> scores about -1e5.
    Q = np.array([[1e3]])
    K = np.array([[-100.0], [-100.001], [-101.0]])
    V = np.array([[1.0], [2.0], [3.0]])
    for mask in (None, np.array([[True, True, True]]), np.array([[True, True, False]])):
        out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
        s = Q @ K.T
        if mask is not None:
            s = np.where(mask, s, -np.inf)
        ref = stable_softmax(s)
        assert w.sum() > 0.999
        np.testing.assert_allclose(w, ref, rtol=1e-9, atol=1e-300)
        np.testing.assert_allclose(out, ref @ V, rtol=1e-9)


def test_very_negative_unmasked_additive_scores_are_uniform():
    """Additive scores of exactly -1e5 on every key (saturated tanh) give uniform weights, not zeros."""
    Q, K, V = np.ones((1, 2, 1)), np.ones((1, 3, 1)), np.arange(3.0).reshape(1, 3, 1)
    W_q, W_k, v = np.full((1, 2), 50.0), np.full((1, 2), 50.0), np.full(2, -5e4)
    out, w = additive_attention(Q, K, V, W_q, W_k, v)
    np.testing.assert_allclose(w, 1.0 / 3.0, rtol=1e-12)
    np.testing.assert_allclose(out, 1.0, rtol=1e-12)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_logits_of_1e4_are_finite_and_correct(sign):
    """attention_weights on logits of +-1e4 equals the exact softmax (no overflow, no all-zero rows)."""
    scores = sign * 1e4 + np.array([[0.0, -np.log(3.0)], [0.0, 0.0], [-1.0, 1.0]])
    w = attention_weights(scores)
    assert all_finite(w)
    np.testing.assert_allclose(w[0], [0.75, 0.25], rtol=1e-9)
    np.testing.assert_allclose(w[1], [0.5, 0.5], rtol=1e-12)
    np.testing.assert_allclose(w[2], stable_softmax(np.array([-1.0, 1.0])), rtol=1e-9)
    g = attention_weights_backward(np.ones_like(w), w)
    assert all_finite(g)
    np.testing.assert_allclose(g, 0.0, atol=1e-12)  # softmax rows sum to 1: d(sum)/ds = 0
    w32 = attention_weights(scores.astype(np.float32))
    assert w32.dtype == np.float32 and all_finite(w32)
    np.testing.assert_allclose(w32[1], [0.5, 0.5], rtol=1e-6)


@pytest.mark.parametrize("scale", [1e4, -1e4])
def test_input_scale_1e4_sdpa_finite_and_matches_torch(scale):
    """Q and K of magnitude 1e4 (scores ~1e8, one-hot softmax): finite output and grads equal to torch."""
    rng = make_rng(5, int(scale > 0))
    Q, K, V = scale * randn(rng, 2, 4, 3), scale * randn(rng, 2, 6, 3), randn(rng, 2, 6, 2)
    G = randn(rng, 2, 4, 2)
    mask = np.tril(np.ones((4, 6), bool))
    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    grads = scaled_dot_product_attention_backward(G, Q, K, V, w)
    assert all_finite(out, w, *grads)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-12)
    ref = torch_sdpa(Q, K, V, mask, G)
    np.testing.assert_allclose(out, ref[0], rtol=0, atol=1e-10)
    for ours, theirs in zip(grads, ref[1:], strict=False):
        scale_ref = max(np.abs(theirs).max(), 1.0)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-10 * scale_ref)


def test_apply_attention_mask_keeps_mask_value_fill():
    """apply_attention_mask writes mask_value at False positions, leaves True positions, supports a custom fill."""
    scores = np.arange(6.0).reshape(2, 3)
    mask = np.array([True, False, True])
    np.testing.assert_array_equal(apply_attention_mask(scores, mask), [[0, -1e9, 2], [3, -1e9, 5]])
    out = apply_attention_mask(scores, np.zeros((2, 3), bool), mask_value=-7.0)
    np.testing.assert_array_equal(out, np.full((2, 3), -7.0))
    # The documented consequence: a fully masked row is uniform under the plain softmax.
    np.testing.assert_allclose(attention_weights(out), 1.0 / 3.0)


# --------------------------------------------------------------------------------------------------------
# Smallest sizes and zero-length sequences
# --------------------------------------------------------------------------------------------------------
def test_single_query_single_key_single_feature():
    """Lq = Lk = d = 1: weight 1, output = V, grad_Q = grad_K = 0, grad_V = upstream gradient."""
    Q, K, V, G = np.array([[[2.0]]]), np.array([[[-3.0]]]), np.array([[[5.0]]]), np.array([[[0.7]]])
    out, w = scaled_dot_product_attention(Q, K, V)
    np.testing.assert_array_equal(w, [[[1.0]]])
    np.testing.assert_array_equal(out, V)
    dQ, dK, dV = scaled_dot_product_attention_backward(G, Q, K, V, w)
    np.testing.assert_array_equal(dQ, 0.0)
    np.testing.assert_array_equal(dK, 0.0)
    np.testing.assert_array_equal(dV, G)
    out, w = additive_attention(Q, K, V, np.ones((1, 1)), np.ones((1, 1)), np.ones(1))
    np.testing.assert_array_equal(w, [[[1.0]]])
    np.testing.assert_array_equal(out, V)
    # Multi-head with d_model = heads = length = 1: out = x W_V W_O.
    W = {n: np.array([[c]]) for n, c in (("W_Q", 0.5), ("W_K", -2.0), ("W_V", 3.0), ("W_O", 0.25))}
    out, cache = multi_head_attention_forward(Q, K, V, W["W_Q"], W["W_K"], W["W_V"], W["W_O"], 1)
    np.testing.assert_allclose(out, 5.0 * 3.0 * 0.25)
    dQ, dK, dV, dp = multi_head_attention_backward(G, cache)
    np.testing.assert_allclose(dV, 0.7 * 3.0 * 0.25)
    np.testing.assert_allclose(dp["W_O"], 5.0 * 3.0 * 0.7)
    np.testing.assert_array_equal(dQ, 0.0)
    np.testing.assert_array_equal(dK, 0.0)


def test_zero_length_queries_give_empty_output():
    """Lq = 0: output (..., 0, d_v), weights (..., 0, Lk); the backward gives empty grad_Q, zero grad_K/V."""
    rng = make_rng(6)
    Q, K, V = np.zeros((2, 0, 3)), randn(rng, 2, 4, 3), randn(rng, 2, 4, 5)
    out, w = scaled_dot_product_attention(Q, K, V)
    assert out.shape == (2, 0, 5) and w.shape == (2, 0, 4)
    dQ, dK, dV = scaled_dot_product_attention_backward(np.zeros((2, 0, 5)), Q, K, V, w)
    assert dQ.shape == (2, 0, 3) and dK.shape == K.shape and dV.shape == V.shape
    assert np.all(dK == 0) and np.all(dV == 0)
    out, w = additive_attention(Q, K, V, randn(rng, 3, 2), randn(rng, 3, 2), randn(rng, 2))
    assert out.shape == (2, 0, 5) and w.shape == (2, 0, 4)


def test_zero_length_keys_mean_every_row_is_fully_masked():
    """Lk = 0: zero output (..., Lq, d_v), zero-size weights (..., Lq, 0), zero grad_Q, no NaN."""
    rng = make_rng(7)
    Q, K, V = randn(rng, 2, 3, 4), np.zeros((2, 0, 4)), np.zeros((2, 0, 5))
    out, w = scaled_dot_product_attention(Q, K, V)
    assert out.shape == (2, 3, 5) and w.shape == (2, 3, 0)
    assert np.all(out == 0)
    dQ, dK, dV = scaled_dot_product_attention_backward(randn(rng, 2, 3, 5), Q, K, V, w)
    assert dQ.shape == Q.shape and np.all(dQ == 0)
    assert dK.shape == (2, 0, 4) and dV.shape == (2, 0, 5)
    out, w = additive_attention(Q, K, V, randn(rng, 4, 2), randn(rng, 4, 2), randn(rng, 2))
    assert out.shape == (2, 3, 5) and w.shape == (2, 3, 0) and np.all(out == 0)


def test_zero_length_sequences_multi_head():
    """multi_head_attention_forward: Lq = 0 gives (B, 0, D); Lk = 0 gives a zero (B, Lq, D) output."""
    rng = make_rng(8)
    W = [randn(rng, 4, 4) for _ in range(4)]
    out, cache = multi_head_attention_forward(np.zeros((2, 0, 4)), randn(rng, 2, 3, 4), randn(rng, 2, 3, 4), *W, 2)
    assert out.shape == (2, 0, 4) and cache["weights"].shape == (2, 2, 0, 3)
    out, cache = multi_head_attention_forward(randn(rng, 2, 3, 4), np.zeros((2, 0, 4)), np.zeros((2, 0, 4)), *W, 2)
    assert out.shape == (2, 3, 4) and np.all(out == 0) and cache["weights"].shape == (2, 2, 3, 0)
    dQ, dK, dV, dp = multi_head_attention_backward(randn(rng, 2, 3, 4), cache)
    assert np.all(dQ == 0) and dK.shape == (2, 0, 4) and all(np.all(g == 0) for g in dp.values())


# --------------------------------------------------------------------------------------------------------
# Causal receptive field through gradients
# --------------------------------------------------------------------------------------------------------
def grad_of_output_row(forward_backward, x, i):
    """Gradient of output row i (upstream = 1 on row i of batch 0, 0 elsewhere) w.r.t. x."""
    G = np.zeros_like(x)
    G[0, i] = 1.0
    return forward_backward(G)


@pytest.mark.parametrize("H", [1, 2])
def test_causal_receptive_field_multi_head_attention(H):
    """With create_causal_mask, output i of MultiHeadAttention has exactly zero gradient from positions > i."""
    rng = make_rng(9, H)
    L, D = 6, 4
    x = randn(rng, 1, L, D)
    mha = MultiHeadAttention(D, H, rng=make_rng(90))
    for mask, causal in ((create_causal_mask(L), True), (None, False)):
        for i in range(L):
            def fb(G, mask=mask):
                mha.forward(x, x, x, mask=mask)
                return sum(mha.backward(G))  # self-attention: the three input grads add up
            g = grad_of_output_row(fb, x, i)
            assert np.any(g[0, i] != 0), f"output {i} does not depend on its own position"
            if causal:
                assert np.all(g[0, i + 1:] == 0), f"output {i} depends on a later position"
                if i > 0:
                    assert np.any(g[0, :i] != 0), f"output {i} does not depend on earlier positions"
            elif i < L - 1:
                assert np.any(g[0, i + 1:] != 0), "without the mask, later positions must matter"


def test_causal_receptive_field_encoder_block_and_stack():
    """Through one and two stacked encoder blocks, output i has exactly zero gradient from positions > i."""
    rng = make_rng(10)
    L, D, H = 6, 8, 2
    x = randn(rng, 1, L, D)
    blocks = [TransformerEncoderBlock(D, H, d_ff=16, rng=make_rng(100 + k)) for k in range(2)]
    mask = create_causal_mask(L)
    # stack_encoder_blocks agrees with chaining forward() by hand, so chaining backward() is its gradient.
    np.testing.assert_array_equal(stack_encoder_blocks(x, blocks, mask=mask),
                                  blocks[1].forward(blocks[0].forward(x, mask=mask), mask=mask))
    for n_blocks in (1, 2):
        for i in range(L):
            def fb(G, n_blocks=n_blocks):
                h = x
                for b in blocks[:n_blocks]:
                    h = b.forward(h, mask=mask)
                for b in reversed(blocks[:n_blocks]):
                    G = b.backward(G)
                return G
            g = grad_of_output_row(fb, x, i)
            assert np.all(g[0, i + 1:] == 0), f"{n_blocks} block(s): output {i} depends on a later position"
            assert np.any(g[0, : i + 1] != 0)
    # Control: without the mask the future does matter.
    def fb_open(G):
        blocks[0].forward(x)
        return blocks[0].backward(G)
    assert np.any(grad_of_output_row(fb_open, x, 0)[0, 1:] != 0)


# --------------------------------------------------------------------------------------------------------
# dtype preservation
# --------------------------------------------------------------------------------------------------------
def _dtype_cases(rng, dt):
    """(name, callable returning a tuple of arrays) for every function, all inputs of dtype dt."""
    def a(*shape):
        if np.dtype(dt).kind == "i":
            return rng.integers(-3, 4, size=shape).astype(dt)
        return rng.standard_normal(shape).astype(dt)

    Q, K, V = a(2, 3, 4), a(2, 5, 4), a(2, 5, 2)
    G = a(2, 3, 2)
    mask = np.ones((3, 5), bool)
    W = [a(4, 4) for _ in range(4)]
    x = a(2, 3, 4)
    gamma, beta = a(4), a(4)
    W1, b1, W2, b2 = a(4, 6), a(6), a(6, 4), a(4)
    Wq, Wk, v = a(4, 3), a(4, 3), a(3)

    def sdpa_bwd():
        _, w = scaled_dot_product_attention(Q, K, V, mask=mask)
        return scaled_dot_product_attention_backward(G, Q, K, V, w)

    def additive_bwd():
        _, w = additive_attention(Q, K, V, Wq, Wk, v, mask=mask)
        dq, dk, dv, dp = additive_attention_backward(G, Q, K, V, Wq, Wk, v, w)
        return (dq, dk, dv, *dp.values())

    def mha_both():
        out, cache = multi_head_attention_forward(x, x, x, *W, 2)
        dq, dk, dv, dp = multi_head_attention_backward(a(2, 3, 4), cache)
        return (out, cache["weights"], dq, dk, dv, *dp.values())

    def ffn_bwd():
        dx, dp = feed_forward_backward(a(2, 3, 4), x, W1, b1, W2)
        return (dx, *dp.values())

    def weights_bwd():
        s = a(2, 3)
        return (attention_weights_backward(a(2, 3), attention_weights(s)),)

    return [
        ("compute_attention_scores", lambda: (compute_attention_scores(Q, K),)),
        ("apply_attention_mask", lambda: (apply_attention_mask(a(3, 5), mask),)),
        ("attention_weights", lambda: (attention_weights(a(3, 5)),)),
        ("attention_weights_backward", weights_bwd),
        ("scaled_dot_product_attention", lambda: scaled_dot_product_attention(Q, K, V, mask=mask)),
        ("scaled_dot_product_attention_backward", sdpa_bwd),
        ("additive_attention", lambda: additive_attention(Q, K, V, Wq, Wk, v, mask=mask)),
        ("additive_attention_backward", additive_bwd),
        ("split_heads/merge_heads", lambda: (split_heads(x, 2), merge_heads(a(2, 2, 3, 2)))),
        ("multi_head_attention_forward/backward", mha_both),
        ("layer_norm", lambda: (layer_norm(x, gamma, beta),)),
        ("layer_norm_backward", lambda: layer_norm_backward(a(2, 3, 4), x, gamma)),
        ("feed_forward", lambda: (feed_forward(x, W1, b1, W2, b2),)),
        ("feed_forward_backward", ffn_bwd),
        ("add_positional_encoding", lambda: (add_positional_encoding(x, sinusoidal_encoding(5, 4).astype(x.dtype)),)),
    ]


CASE_NAMES = [name for name, _ in _dtype_cases(np.random.default_rng(0), np.float64)]


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("dt,expected", [(np.float32, np.float32), (np.float64, np.float64), (np.int64, np.float64),
                                         (np.int32, np.float64)], ids=["float32", "float64", "int64", "int32"])
def test_dtype_preservation(dt, expected, case):
    """float32 in -> float32 out, float64 -> float64, integers -> float64 (every returned array)."""
    fn = dict(_dtype_cases(make_rng(11), dt))[case]
    outs = fn()
    got = [np.asarray(o).dtype for o in outs]
    assert all(g == expected for g in got), f"{case} with {np.dtype(dt)} inputs returned {got}"


def test_integer_inputs_give_the_float_result():
    """Integer inputs compute the same values as their float64 conversion."""
    Q = np.array([[[1, 0], [0, 2]]])
    out_i, w_i = scaled_dot_product_attention(Q, Q, Q)
    out_f, w_f = scaled_dot_product_attention(Q.astype(float), Q.astype(float), Q.astype(float))
    np.testing.assert_array_equal(out_i, out_f)
    np.testing.assert_array_equal(w_i, w_f)


# --------------------------------------------------------------------------------------------------------
# No in-place modification
# --------------------------------------------------------------------------------------------------------
def _snapshot(arrays):
    return [np.array(a, copy=True) for a in arrays]


def _assert_unchanged(before, arrays, what):
    for i, (b, a) in enumerate(zip(before, arrays, strict=False)):
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: argument {i} was modified in place")


def test_inputs_not_modified_in_place_attention_core():
    """No function of attention_core writes into its arguments (inputs, masks, weights, upstream grads)."""
    rng = make_rng(12)
    Q, K, V = randn(rng, 2, 3, 4), randn(rng, 2, 5, 4), randn(rng, 2, 5, 2)
    mask = rng.random((2, 3, 5)) < 0.6
    mask[0, 0] = False
    G = randn(rng, 2, 3, 2)
    Wq, Wk, v = randn(rng, 4, 3), randn(rng, 4, 3), randn(rng, 3)
    scores = randn(rng, 2, 3, 5)
    args = [Q, K, V, mask, G, Wq, Wk, v, scores]
    before = _snapshot(args)
    compute_attention_scores(Q, K)
    apply_attention_mask(scores, mask)
    w0 = attention_weights(scores)
    attention_weights_backward(scores, w0)
    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    w_before = w.copy()
    scaled_dot_product_attention_backward(G, Q, K, V, w)
    np.testing.assert_array_equal(w, w_before)
    out, w = additive_attention(Q, K, V, Wq, Wk, v, mask=mask)
    w_before = w.copy()
    additive_attention_backward(G, Q, K, V, Wq, Wk, v, w)
    np.testing.assert_array_equal(w, w_before)
    _assert_unchanged(before, args, "attention_core")


def test_inputs_not_modified_in_place_multi_head_and_layers():
    """Multi-head, layer-norm, feed-forward, positional and the classes leave their arguments intact."""
    rng = make_rng(13)
    B, L, D, H = 2, 4, 8, 2
    x, y, G = randn(rng, B, L, D), randn(rng, B, L + 1, D), randn(rng, B, L, D)
    W = [randn(rng, D, D) for _ in range(4)]
    mask = np.tril(np.ones((L, L + 1), bool))
    gamma, beta = randn(rng, D), randn(rng, D)
    W1, b1, W2, b2 = randn(rng, D, 5), randn(rng, 5), randn(rng, 5, D), randn(rng, D)
    pe = sinusoidal_encoding(10, D)
    args = [x, y, G, *W, mask, gamma, beta, W1, b1, W2, b2, pe]
    before = _snapshot(args)

    split_heads(x, H)
    merge_heads(split_heads(x, H))
    out, cache = multi_head_attention_forward(x, y, y, *W, H, mask=mask)
    multi_head_attention_backward(G, cache)
    layer_norm(x, gamma, beta)
    layer_norm_backward(G, x, gamma)
    feed_forward(x, W1, b1, W2, b2)
    feed_forward_backward(G, x, W1, b1, W2)
    add_positional_encoding(x, pe)

    mha = MultiHeadAttention(D, H, rng=make_rng(130))
    params = {n: w for n, w in zip(("W_Q", "W_K", "W_V", "W_O"), W, strict=False)}
    mha.set_params(params)
    mha.forward(x, y, y, mask=mask)
    mha.backward(G)
    block = TransformerEncoderBlock(D, H, d_ff=6, rng=make_rng(131))
    causal = create_causal_mask(L)
    causal_before = causal.copy()
    block.forward(x, mask=causal)
    block.backward(G)
    stack_encoder_blocks(x, [block], mask=causal)
    np.testing.assert_array_equal(causal, causal_before)
    _assert_unchanged(before, args, "multi_head/layers")


def test_set_and_get_params_copy():
    """set_params copies in (later edits of the source do not leak) and get_params returns copies."""
    D = 4
    mha = MultiHeadAttention(D, 2, rng=make_rng(14))
    src = {n: np.full((D, D), float(k)) for k, n in enumerate(("W_Q", "W_K", "W_V", "W_O"))}
    mha.set_params(src)
    src["W_Q"][...] = 99.0
    np.testing.assert_array_equal(mha.W_Q, 0.0)
    got = mha.get_params()
    got["W_K"][...] = -5.0
    np.testing.assert_array_equal(mha.W_K, 1.0)
    np.testing.assert_array_equal(mha.get_params()["W_O"], 3.0)


# --------------------------------------------------------------------------------------------------------
# NaN propagation
# --------------------------------------------------------------------------------------------------------
def test_nan_in_unmasked_input_propagates():
    """NaN in a query, or in a key/value some query may attend, reaches that query's output (not hidden)."""
    rng = make_rng(15)
    Q, K, V = randn(rng, 3, 2), randn(rng, 4, 2), randn(rng, 4, 3)
    Qn = Q.copy()
    Qn[1, 0] = np.nan
    out, w = scaled_dot_product_attention(Qn, K, V)
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(w[1]))
    assert all_finite(out[[0, 2]])
    mask = np.array([[True, False, False, False], [True, True, True, True], [False, True, True, False]])
    Kn = K.copy()
    Kn[2, 1] = np.nan
    out, _ = scaled_dot_product_attention(Q, Kn, V, mask=mask)
    assert np.all(np.isnan(out[1])) and np.all(np.isnan(out[2]))  # both may attend key 2
    assert all_finite(out[0])  # query 0 may not
    Vn = V.copy()
    Vn[0, 2] = np.nan
    out, _ = scaled_dot_product_attention(Q, K, Vn, mask=mask)
    assert np.isnan(out[0, 2]) and np.isnan(out[1, 2])


def test_nan_propagates_through_softmax_layer_norm_and_layers():
    """attention_weights, layer_norm, feed_forward and MultiHeadAttention propagate NaN rather than hide it."""
    s = np.array([[0.0, np.nan, 1.0], [0.0, 1.0, 2.0]])
    w = attention_weights(s)
    assert np.all(np.isnan(w[0])) and all_finite(w[1])
    x = np.ones((1, 2, 4))
    x[0, 0, 1] = np.nan
    y = layer_norm(x, np.ones(4), np.zeros(4))
    assert np.all(np.isnan(y[0, 0])) and all_finite(y[0, 1])
    f = feed_forward(x, np.eye(4), np.zeros(4), np.eye(4), np.zeros(4))
    assert np.isnan(f[0, 0, 1])
    mha = MultiHeadAttention(4, 2, rng=make_rng(16))
    out, _ = mha.forward(x, x, x)
    assert np.all(np.isnan(out))  # every query may attend the NaN position
    G = np.ones((2, 3))
    w = attention_weights(np.array([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]))
    Gn = G.copy()
    Gn[0, 0] = np.nan
    g = attention_weights_backward(Gn, w)
    assert np.all(np.isnan(g[0])) and all_finite(g[1])


def test_torch_reference_is_finite_on_large_inputs():
    """Sanity check of the reference itself: torch's F.sdpa is finite on the scaled inputs used above."""
    q = torch.full((1, 2, 3), 1e4, dtype=torch.float64)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.isfinite(out).all()

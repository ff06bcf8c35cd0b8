"""Forward values of every function and layer against explicit formulas, and the layers' bookkeeping.

Explicit formulas are written here with per-head / per-row Python loops on purpose: they are slow and
obviously right, the opposite of the vectorised code under test.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention_core import (
    additive_attention,
    apply_attention_mask,
    attention_weights,
    attention_weights_backward,
    compute_attention_scores,
    scaled_dot_product_attention,
)
from attnkit.multi_head import (
    MultiHeadAttention,
    merge_heads,
    multi_head_attention_backward,
    multi_head_attention_forward,
    split_heads,
)
from attnkit.positional import create_causal_mask
from attnkit.transformer_block import (
    TransformerEncoderBlock,
    feed_forward,
    feed_forward_backward,
    layer_norm,
    layer_norm_backward,
    stack_encoder_blocks,
)

from helpers import make_rng, randn

WEIGHT_NAMES = ("W_Q", "W_K", "W_V", "W_O")


def softmax_rows(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# --------------------------------------------------------------------------------------------------------
# Attention core
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [True, False])
def test_compute_attention_scores_formula(scale):
    """scores = Q K^T / sqrt(d_k) (or unscaled), d_k = Q.shape[-1], over leading dims."""
    rng = make_rng(1)
    Q, K = randn(rng, 2, 3, 4, 5), randn(rng, 2, 3, 6, 5)
    s = compute_attention_scores(Q, K, scale=scale)
    ref = np.einsum("bhqd,bhkd->bhqk", Q, K) / (np.sqrt(5) if scale else 1.0)
    assert s.shape == (2, 3, 4, 6)
    np.testing.assert_allclose(s, ref, rtol=1e-13, atol=1e-13)


def test_compute_attention_scores_spec_example():
    """The seed's example shape: (2, 4, 64) with (2, 4, 64) gives (2, 4, 4)."""
    rng = make_rng(2)
    assert compute_attention_scores(randn(rng, 2, 4, 64), randn(rng, 2, 4, 64)).shape == (2, 4, 4)


def test_attention_weights_formula_and_axis():
    """attention_weights is exp(s - max) / sum along the given axis."""
    rng = make_rng(3)
    s = randn(rng, 3, 4, 5, scale=3.0)
    np.testing.assert_allclose(attention_weights(s), softmax_rows(s), rtol=1e-13)
    ref0 = np.moveaxis(softmax_rows(np.moveaxis(s, 0, -1)), -1, 0)
    np.testing.assert_allclose(attention_weights(s, axis=0), ref0, rtol=1e-13)


def test_attention_weights_backward_is_the_softmax_jacobian():
    """grad_scores = J^T grad_weights with J = diag(w) - w w^T, row by row."""
    rng = make_rng(4)
    s, G = randn(rng, 3, 5), randn(rng, 3, 5)
    w = attention_weights(s)
    got = attention_weights_backward(G, w)
    for r in range(3):
        J = np.diag(w[r]) - np.outer(w[r], w[r])
        np.testing.assert_allclose(got[r], J.T @ G[r], rtol=1e-12, atol=1e-14)


def test_apply_attention_mask_formula():
    """apply_attention_mask = where(mask, scores, mask_value), broadcasting the mask; default -1e9."""
    rng = make_rng(5)
    s = randn(rng, 2, 3, 4)
    mask = rng.random((3, 4)) < 0.5
    np.testing.assert_array_equal(apply_attention_mask(s, mask), np.where(mask, s, -1e9))
    np.testing.assert_array_equal(apply_attention_mask(s, mask, mask_value=-3.5), np.where(mask, s, -3.5))


@pytest.mark.parametrize("with_mask", [False, True])
def test_scaled_dot_product_attention_formula(with_mask):
    """output = softmax(Q K^T / sqrt(d_k) masked) V, with weights returned, any leading dims."""
    rng = make_rng(6, with_mask)
    Q, K, V = randn(rng, 2, 2, 3, 4), randn(rng, 2, 2, 5, 4), randn(rng, 2, 2, 5, 3)
    mask = (rng.random((2, 1, 3, 5)) < 0.6) | np.eye(3, 5, dtype=bool) if with_mask else None
    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    s = Q @ np.swapaxes(K, -1, -2) / 2.0
    if with_mask:
        s = np.where(mask, s, -np.inf)
    ref_w = softmax_rows(s)
    np.testing.assert_allclose(w, ref_w, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out, ref_w @ V, rtol=1e-12, atol=1e-14)


def test_scaled_dot_product_attention_spec_docstring_case():
    """Identity queries with a causal mask: row 0 attends only key 0; row 1 has weights (1, e^{1/sqrt 2})."""
    Q = np.eye(2)
    out, w = scaled_dot_product_attention(Q, Q, np.array([[1.0], [2.0]]), mask=create_causal_mask(2))
    e = np.exp(1 / np.sqrt(2))
    np.testing.assert_allclose(w, [[1.0, 0.0], [1 / (1 + e), e / (1 + e)]], rtol=1e-14)
    np.testing.assert_allclose(out[:, 0], [1.0, (1 + 2 * e) / (1 + e)], rtol=1e-14)


def test_additive_attention_formula():
    """score(q_i, k_j) = v . tanh(q_i W_q + k_j W_k), unscaled, softmax over j, then weights @ V."""
    rng = make_rng(7)
    Q, K, V = randn(rng, 2, 3, 4), randn(rng, 2, 5, 6), randn(rng, 2, 5, 2)
    W_q, W_k, v = randn(rng, 4, 3), randn(rng, 6, 3), randn(rng, 3)
    mask = np.ones((2, 3, 5), bool)
    mask[0, 1, 2:] = False
    out, w = additive_attention(Q, K, V, W_q, W_k, v, mask=mask)
    scores = np.empty((2, 3, 5))
    for b in range(2):
        for i in range(3):
            for j in range(5):
                scores[b, i, j] = v @ np.tanh(Q[b, i] @ W_q + K[b, j] @ W_k)
    ref_w = softmax_rows(np.where(mask, scores, -np.inf))
    np.testing.assert_allclose(w, ref_w, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out, ref_w @ V, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------------------
# Heads and multi-head attention
# --------------------------------------------------------------------------------------------------------
def test_split_heads_layout():
    """split_heads(x)[b, h, l] = x[b, l, h*Dh:(h+1)*Dh]; merge_heads inverts it exactly."""
    rng = make_rng(8)
    x = randn(rng, 2, 5, 12)
    s = split_heads(x, 3)
    assert s.shape == (2, 3, 5, 4)
    for h in range(3):
        np.testing.assert_array_equal(s[:, h], x[:, :, 4 * h:4 * h + 4])
    np.testing.assert_array_equal(merge_heads(s), x)
    y = randn(rng, 2, 4, 5, 3)
    m = merge_heads(y)
    assert m.shape == (2, 5, 12)
    np.testing.assert_array_equal(m[:, :, 6:9], y[:, 2])


def test_split_heads_spec_example():
    """(2, 10, 512) into 8 heads gives (2, 8, 10, 64)."""
    assert split_heads(np.zeros((2, 10, 512)), num_heads=8).shape == (2, 8, 10, 64)


def explicit_mha(Q, K, V, W, H, mask=None):
    """Per-head loop: head i uses columns i*Dh:(i+1)*Dh of x @ W, scale 1/sqrt(Dh), concat, then @ W_O."""
    B, Lq, D = Q.shape
    Dh = D // H
    q, k, v = Q @ W["W_Q"], K @ W["W_K"], V @ W["W_V"]
    heads, weights = [], []
    for i in range(H):
        cols = slice(i * Dh, (i + 1) * Dh)
        s = q[:, :, cols] @ np.swapaxes(k[:, :, cols], 1, 2) / np.sqrt(Dh)  # (B, Lq, Lk)
        if mask is not None:
            m = np.broadcast_to(mask, (B, H) + s.shape[1:])[:, i]
            s = np.where(m, s, -np.inf)
        w = softmax_rows(s)
        heads.append(w @ v[:, :, cols])
        weights.append(w)
    return np.concatenate(heads, axis=-1) @ W["W_O"], np.stack(weights, axis=1)


@pytest.mark.parametrize("H", [1, 2, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_multi_head_attention_forward_formula(H, masked):
    """multi_head_attention_forward equals the per-head loop; cache['weights'] are the per-head weights."""
    rng = make_rng(9, H, masked)
    B, Lq, Lk, D = 2, 3, 5, 8
    Q, K, V = randn(rng, B, Lq, D), randn(rng, B, Lk, D), randn(rng, B, Lk, D)
    W = {n: randn(rng, D, D) for n in WEIGHT_NAMES}
    mask = np.tril(np.ones((Lq, Lk), bool)) if masked else None
    out, cache = multi_head_attention_forward(Q, K, V, *(W[n] for n in WEIGHT_NAMES), H, mask=mask)
    ref_out, ref_w = explicit_mha(Q, K, V, W, H, mask)
    assert out.shape == (B, Lq, D) and cache["weights"].shape == (B, H, Lq, Lk)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cache["weights"], ref_w, rtol=1e-12, atol=1e-15)


def test_multi_head_attention_class_attributes_and_forward():
    """MultiHeadAttention has d_model, num_heads, d_k and (D, D) weights; forward equals the functional form."""
    rng = make_rng(10)
    mha = MultiHeadAttention(12, 3, rng=make_rng(100))
    assert (mha.d_model, mha.num_heads, mha.d_k) == (12, 3, 4)
    for n in WEIGHT_NAMES:
        assert isinstance(getattr(mha, n), np.ndarray) and getattr(mha, n).shape == (12, 12)
    assert set(mha.get_params()) == set(WEIGHT_NAMES)
    assert [n for n, _ in mha.named_parameters()] == [n for n, _ in mha.named_gradients()]
    Q, K = randn(rng, 2, 4, 12), randn(rng, 2, 6, 12)
    mask = np.ones((2, 1, 1, 6), bool)
    mask[1, ..., 4:] = False
    out, w = mha.forward(Q, K, K, mask=mask)
    p = mha.get_params()
    ref_out, ref_w = explicit_mha(Q, K, K, p, 3, mask)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w, ref_w, rtol=1e-12, atol=1e-15)


def test_multi_head_class_is_seeded_by_rng():
    """The same rng seed gives the same initial weights, a different seed different ones."""
    a = MultiHeadAttention(8, 2, rng=np.random.default_rng(1)).get_params()
    b = MultiHeadAttention(8, 2, rng=np.random.default_rng(1)).get_params()
    c = MultiHeadAttention(8, 2, rng=np.random.default_rng(2)).get_params()
    for n in WEIGHT_NAMES:
        np.testing.assert_array_equal(a[n], b[n])
        assert not np.array_equal(a[n], c[n])
        assert np.all(np.isfinite(a[n])) and np.std(a[n]) > 0


def test_multi_head_class_gradients_accumulate_and_zero():
    """backward adds (+=) into mha.grads: two calls give twice the functional gradient; zero_grad resets."""
    rng = make_rng(11)
    mha = MultiHeadAttention(8, 2, rng=make_rng(110))
    x, G = randn(rng, 2, 3, 8), randn(rng, 2, 3, 8)
    _, cache = multi_head_attention_forward(x, x, x, *(getattr(mha, n) for n in WEIGHT_NAMES), 2)
    _, _, _, ref = multi_head_attention_backward(G, cache)
    mha.zero_grad()
    for _ in range(2):
        mha.forward(x, x, x)
        mha.backward(G)
    for n in WEIGHT_NAMES:
        np.testing.assert_allclose(mha.grads[n], 2 * ref[n], rtol=1e-12, atol=1e-14)
    grads = dict(mha.named_gradients())
    assert set(grads) == set(WEIGHT_NAMES)
    mha.zero_grad()
    assert all(np.all(g == 0) for g in mha.grads.values())
    assert all(np.all(g == 0) for _, g in mha.named_gradients())


# --------------------------------------------------------------------------------------------------------
# Layer norm and feed-forward
# --------------------------------------------------------------------------------------------------------
def explicit_layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased, like torch
    return gamma * (x - mean) / np.sqrt(var + eps) + beta


@pytest.mark.parametrize("eps", [1e-6, 1e-2, 0.5])
def test_layer_norm_formula(eps):
    """layer_norm = gamma * (x - mean) / sqrt(biased var + eps) + beta, for several eps."""
    rng = make_rng(12, int(eps * 1e6))
    x, gamma, beta = randn(rng, 2, 3, 7, scale=0.01), randn(rng, 7), randn(rng, 7)
    np.testing.assert_allclose(layer_norm(x, gamma, beta, eps=eps), explicit_layer_norm(x, gamma, beta, eps),
                               rtol=1e-12, atol=1e-12)


def test_layer_norm_default_eps_is_1e_minus_6():
    """With small-variance input the default eps visibly matters: it must be 1e-6, inside the square root."""
    rng = make_rng(13)
    x, gamma, beta = 1e-3 * randn(rng, 4, 6), np.ones(6), np.zeros(6)
    np.testing.assert_allclose(layer_norm(x, gamma, beta), explicit_layer_norm(x, gamma, beta, 1e-6), rtol=1e-12)
    assert not np.allclose(layer_norm(x, gamma, beta), explicit_layer_norm(x, gamma, beta, 0.0), rtol=1e-4)


def test_layer_norm_constant_row_gives_beta():
    """A constant row has zero deviation: the output is exactly beta (no division by zero)."""
    out = layer_norm(np.full((2, 5), 3.0), np.arange(5.0), np.arange(5.0) - 2)
    np.testing.assert_allclose(out, np.broadcast_to(np.arange(5.0) - 2, (2, 5)), atol=1e-12)


def test_layer_norm_backward_known_closed_form():
    """grad_beta = sum of G, grad_gamma = sum of G * x_hat over every leading axis."""
    rng = make_rng(14)
    x, gamma, G = randn(rng, 2, 3, 5), randn(rng, 5), randn(rng, 2, 3, 5)
    _, dgamma, dbeta = layer_norm_backward(G, x, gamma)
    x_hat = explicit_layer_norm(x, np.ones(5), np.zeros(5), 1e-6)
    np.testing.assert_allclose(dbeta, G.sum(axis=(0, 1)), rtol=1e-12)
    np.testing.assert_allclose(dgamma, (G * x_hat).sum(axis=(0, 1)), rtol=1e-12)


def test_feed_forward_formula():
    """feed_forward = relu(x W1 + b1) W2 + b2; negative pre-activations contribute nothing."""
    rng = make_rng(15)
    x, W1, b1, W2, b2 = randn(rng, 2, 3, 4), randn(rng, 4, 6), randn(rng, 6), randn(rng, 6, 4), randn(rng, 4)
    ref = np.maximum(x @ W1 + b1, 0.0) @ W2 + b2
    np.testing.assert_allclose(feed_forward(x, W1, b1, W2, b2), ref, rtol=1e-12, atol=1e-13)
    # All-negative pre-activations: the output is b2 exactly.
    np.testing.assert_array_equal(feed_forward(x, W1 * 0, -np.ones(6), W2, b2), np.broadcast_to(b2, x.shape))


def test_feed_forward_backward_closed_form():
    """grad_W2 = relu(h)^T G, grad_b2 = sum G, grad_b1 = sum of (G W2^T masked by h > 0), grad_x = that @ W1^T."""
    rng = make_rng(16)
    x, W1, b1, W2 = randn(rng, 2, 3, 4), randn(rng, 4, 6), randn(rng, 6), randn(rng, 6, 4)
    G = randn(rng, 2, 3, 4)
    dx, dp = feed_forward_backward(G, x, W1, b1, W2)
    pre = x @ W1 + b1
    dh = (G @ W2.T) * (pre > 0)
    np.testing.assert_allclose(dp["W2"], np.einsum("blf,bld->fd", np.maximum(pre, 0), G), rtol=1e-12)
    np.testing.assert_allclose(dp["b2"], G.sum(axis=(0, 1)), rtol=1e-12)
    np.testing.assert_allclose(dp["b1"], dh.sum(axis=(0, 1)), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dp["W1"], np.einsum("bld,blf->df", x, dh), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dx, dh @ W1.T, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------------------------------------
# Encoder block
# --------------------------------------------------------------------------------------------------------
BLOCK_OWN = ("W1", "b1", "W2", "b2", "gamma1", "beta1", "gamma2", "beta2")


def test_encoder_block_attributes():
    """Attributes and shapes: d_ff defaults to 4 * d_model, eps = 1e-6, LayerNorm starts at (1, 0)."""
    block = TransformerEncoderBlock(8, 2, rng=make_rng(17))
    assert (block.d_model, block.num_heads, block.d_ff, block.eps) == (8, 2, 32, 1e-6)
    assert isinstance(block.attention, MultiHeadAttention) and block.attention.num_heads == 2
    assert block.W1.shape == (8, 32) and block.b1.shape == (32,)
    assert block.W2.shape == (32, 8) and block.b2.shape == (8,)
    for n in ("gamma1", "gamma2"):
        np.testing.assert_array_equal(getattr(block, n), np.ones(8))
    for n in ("beta1", "beta2"):
        np.testing.assert_array_equal(getattr(block, n), np.zeros(8))
    assert TransformerEncoderBlock(8, 2, d_ff=5).W1.shape == (8, 5)


def test_encoder_block_forward_is_pre_norm_composition():
    """forward(x) = h + FFN(LN2(h)) with h = x + MHA(LN1(x)), built from the public functions."""
    rng = make_rng(18)
    block = TransformerEncoderBlock(8, 2, d_ff=12, rng=make_rng(180))
    for n in BLOCK_OWN:
        setattr(block, n, randn(rng, *getattr(block, n).shape) + (1.0 if n.startswith("gamma") else 0.0))
    x = randn(rng, 2, 5, 8)
    mask = create_causal_mask(5)
    a = layer_norm(x, block.gamma1, block.beta1, eps=1e-6)
    att, _ = multi_head_attention_forward(a, a, a, *(getattr(block.attention, n) for n in WEIGHT_NAMES), 2,
                                          mask=mask)
    h = x + att
    ref = h + feed_forward(layer_norm(h, block.gamma2, block.beta2, eps=1e-6), block.W1, block.b1, block.W2,
                           block.b2)
    np.testing.assert_allclose(block.forward(x, mask=mask), ref, rtol=1e-12, atol=1e-12)


def test_encoder_block_gradients_accumulate_names_match_and_zero():
    """named_gradients mirrors named_parameters (dotted names); backward accumulates; zero_grad resets all."""
    rng = make_rng(19)
    block = TransformerEncoderBlock(8, 2, d_ff=12, rng=make_rng(190))
    p_names = [n for n, _ in block.named_parameters()]
    g_names = [n for n, _ in block.named_gradients()]
    assert p_names == g_names
    sublayer_names = {TransformerEncoderBlock.STATE_DICT_RENAMES[n] for n in BLOCK_OWN}
    assert sublayer_names == {"ffn.W1", "ffn.b1", "ffn.W2", "ffn.b2", "norm1.gamma", "norm1.beta", "norm2.gamma",
                              "norm2.beta"}
    assert set(p_names) == sublayer_names | {f"attention.{n}" for n in WEIGHT_NAMES}
    shapes = {n: p.shape for n, p in block.named_parameters()}
    assert all(g.shape == shapes[n] for n, g in block.named_gradients())
    x, G = randn(rng, 2, 4, 8), randn(rng, 2, 4, 8)
    block.zero_grad()
    block.forward(x)
    dx1 = block.backward(G)
    once = {n: np.array(g) for n, g in block.named_gradients()}
    assert all(np.any(g != 0) for g in once.values())
    np.testing.assert_array_equal(block.ffn.grads["W1"], once["ffn.W1"])
    np.testing.assert_array_equal(block.attention.grads["W_Q"], once["attention.W_Q"])
    block.forward(x)
    dx2 = block.backward(G)
    np.testing.assert_allclose(dx2, dx1, rtol=1e-13)
    for n, g in block.named_gradients():
        np.testing.assert_allclose(g, 2 * once[n], rtol=1e-12, atol=1e-14)
    block.zero_grad()
    assert all(np.all(g == 0) for _, g in block.named_gradients())


def test_stack_encoder_blocks_is_sequential_forward():
    """stack_encoder_blocks applies the blocks in order with the same mask."""
    rng = make_rng(20)
    blocks = [TransformerEncoderBlock(8, 2, d_ff=10, rng=make_rng(200 + i)) for i in range(3)]
    x = randn(rng, 2, 5, 8)
    mask = np.ones((2, 1, 1, 5), bool)
    mask[0, ..., 3:] = False
    h = x
    for b in blocks:
        h = b.forward(h, mask=mask)
    out = stack_encoder_blocks(x, blocks, mask=mask)
    assert out.shape == x.shape
    np.testing.assert_allclose(out, h, rtol=1e-13, atol=1e-13)
    reversed_out = stack_encoder_blocks(x, blocks[::-1], mask=mask)
    assert not np.allclose(reversed_out, out)

"""Finite-difference checks (float64, central differences) of every backward pass in attnkit.

Every check uses the scalar loss ``sum(output * G)`` with a random upstream gradient ``G``, and perturbs
each entry of every input and every parameter; the normwise relative error must stay below 1e-6.
Shapes cover self- and cross-attention (Lq != Lk), several heads, lengths > 1 and every mask kind.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention_core import (
    additive_attention,
    additive_attention_backward,
    attention_weights,
    attention_weights_backward,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnkit.multi_head import MultiHeadAttention, multi_head_attention_backward, multi_head_attention_forward
from attnkit.positional import create_causal_mask
from attnkit.transformer_block import (
    TransformerEncoderBlock,
    feed_forward,
    feed_forward_backward,
    layer_norm,
    layer_norm_backward,
)

from helpers import assert_gradient, make_mask, make_rng, randn

SDPA_MASKS = ("none", "causal", "padding", "broadcast", "fully_masked")
# (leading dims, Lq, Lk): batch only, batch x heads, no batch; self and cross attention.
SDPA_SHAPES = [((2,), 3, 3), ((2, 3), 4, 4), ((2, 2), 3, 5), ((), 5, 2), ((3,), 1, 4), ((2,), 4, 1)]


# --------------------------------------------------------------------------------------------------------
# Softmax
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_attention_weights_backward_matches_finite_differences(axis):
    """attention_weights_backward is the exact gradient of the softmax along any axis."""
    rng = make_rng(1, axis + 5)
    scores = randn(rng, 3, 4, 5, scale=2.0)
    G = randn(rng, 3, 4, 5)
    w = attention_weights(scores, axis=axis)
    analytic = attention_weights_backward(G, w, axis=axis)
    assert_gradient(lambda: np.sum(attention_weights(scores, axis=axis) * G), scores, analytic, "scores")


# --------------------------------------------------------------------------------------------------------
# Scaled dot-product attention
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", SDPA_MASKS)
@pytest.mark.parametrize("lead,Lq,Lk", SDPA_SHAPES)
def test_sdpa_backward_matches_finite_differences(lead, Lq, Lk, kind):
    """grad_Q, grad_K and grad_V of scaled dot-product attention equal finite differences, any mask."""
    rng = make_rng(2, len(lead), Lq, Lk, SDPA_MASKS.index(kind))
    D, Dv = 3, 2
    Q, K, V = randn(rng, *lead, Lq, D), randn(rng, *lead, Lk, D), randn(rng, *lead, Lk, Dv)
    mask = make_mask(kind, rng, lead, Lq, Lk)
    G = randn(rng, *lead, Lq, Dv)

    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    dQ, dK, dV = scaled_dot_product_attention_backward(G, Q, K, V, w)

    def loss():
        return np.sum(scaled_dot_product_attention(Q, K, V, mask=mask)[0] * G)

    assert_gradient(loss, Q, dQ, "Q")
    assert_gradient(loss, K, dK, "K")
    assert_gradient(loss, V, dV, "V")


@pytest.mark.parametrize("kind", ["none", "causal", "fully_masked"])
def test_sdpa_self_attention_shared_input_gradient(kind):
    """With Q = K = V = x, grad_Q + grad_K + grad_V is the gradient of the shared input."""
    rng = make_rng(3, SDPA_MASKS.index(kind))
    x = randn(rng, 2, 5, 4)
    mask = make_mask(kind, rng, (2,), 5, 5)
    G = randn(rng, 2, 5, 4)
    _, w = scaled_dot_product_attention(x, x, x, mask=mask)
    dQ, dK, dV = scaled_dot_product_attention_backward(G, x, x, x, w)
    assert_gradient(lambda: np.sum(scaled_dot_product_attention(x, x, x, mask=mask)[0] * G), x,
                    dQ + dK + dV, "x")


# --------------------------------------------------------------------------------------------------------
# Additive attention
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", SDPA_MASKS)
@pytest.mark.parametrize("lead,Lq,Lk", [((2,), 3, 3), ((2,), 2, 4), ((2, 2), 3, 2), ((), 4, 3)])
def test_additive_attention_backward_matches_finite_differences(lead, Lq, Lk, kind):
    """Every input and parameter gradient of additive attention (Q, K, V, W_q, W_k, v) equals finite differences."""
    rng = make_rng(4, len(lead), Lq, Lk, SDPA_MASKS.index(kind))
    Dq, Dk, Dv, A = 3, 4, 2, 5
    Q, K, V = randn(rng, *lead, Lq, Dq), randn(rng, *lead, Lk, Dk), randn(rng, *lead, Lk, Dv)
    W_q, W_k, v = randn(rng, Dq, A), randn(rng, Dk, A), randn(rng, A)
    mask = make_mask(kind, rng, lead, Lq, Lk)
    G = randn(rng, *lead, Lq, Dv)

    out, w = additive_attention(Q, K, V, W_q, W_k, v, mask=mask)
    dQ, dK, dV, dp = additive_attention_backward(G, Q, K, V, W_q, W_k, v, w)
    assert set(dp) == {"W_q", "W_k", "v"}

    def loss():
        return np.sum(additive_attention(Q, K, V, W_q, W_k, v, mask=mask)[0] * G)

    for name, x, g in (("Q", Q, dQ), ("K", K, dK), ("V", V, dV), ("W_q", W_q, dp["W_q"]),
                       ("W_k", W_k, dp["W_k"]), ("v", v, dp["v"])):
        assert_gradient(loss, x, g, name)


# --------------------------------------------------------------------------------------------------------
# Multi-head attention (functional and class)
# --------------------------------------------------------------------------------------------------------
MHA_MASKS = ("none", "causal", "padding", "broadcast", "fully_masked")
MHA_SHAPES = [(2, 2, 4, 4), (2, 4, 3, 5), (1, 1, 5, 2), (3, 2, 1, 3)]  # (B, H, Lq, Lk)


@pytest.mark.parametrize("kind", MHA_MASKS)
@pytest.mark.parametrize("B,H,Lq,Lk", MHA_SHAPES)
def test_multi_head_functional_backward_matches_finite_differences(B, H, Lq, Lk, kind):
    """multi_head_attention_backward: grads of Q, K, V and W_Q, W_K, W_V, W_O equal finite differences."""
    rng = make_rng(5, B, H, Lq, Lk, MHA_MASKS.index(kind))
    D = 8
    Q, K, V = randn(rng, B, Lq, D), randn(rng, B, Lk, D), randn(rng, B, Lk, D)
    W = {n: randn(rng, D, D, scale=0.5) for n in ("W_Q", "W_K", "W_V", "W_O")}
    mask = make_mask(kind, rng, (B, H), Lq, Lk)
    G = randn(rng, B, Lq, D)

    out, cache = multi_head_attention_forward(Q, K, V, W["W_Q"], W["W_K"], W["W_V"], W["W_O"], H, mask=mask)
    dQ, dK, dV, dp = multi_head_attention_backward(G, cache)
    assert set(dp) == {"W_Q", "W_K", "W_V", "W_O"}

    def loss():
        o, _ = multi_head_attention_forward(Q, K, V, W["W_Q"], W["W_K"], W["W_V"], W["W_O"], H, mask=mask)
        return np.sum(o * G)

    assert_gradient(loss, Q, dQ, "Q")
    assert_gradient(loss, K, dK, "K")
    assert_gradient(loss, V, dV, "V")
    for name in W:
        assert_gradient(loss, W[name], dp[name], name)


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "fully_masked"])
@pytest.mark.parametrize("B,H,Lq,Lk", [(2, 2, 4, 4), (2, 4, 3, 5)])
def test_multi_head_class_backward_matches_finite_differences(B, H, Lq, Lk, kind):
    """MultiHeadAttention.backward returns exact input grads and stores exact parameter grads in mha.grads."""
    rng = make_rng(6, B, H, Lq, Lk, MHA_MASKS.index(kind))
    D = 8
    mha = MultiHeadAttention(D, H, rng=make_rng(60))
    params = {n: randn(rng, D, D, scale=0.5) for n in ("W_Q", "W_K", "W_V", "W_O")}
    mha.set_params(params)
    Q, K, V = randn(rng, B, Lq, D), randn(rng, B, Lk, D), randn(rng, B, Lk, D)
    mask = make_mask(kind, rng, (B, H), Lq, Lk)
    G = randn(rng, B, Lq, D)

    mha.zero_grad()
    mha.forward(Q, K, V, mask=mask)
    dQ, dK, dV = mha.backward(G)
    grads = {n: np.array(g, copy=True) for n, g in mha.named_gradients()}
    assert set(grads) == set(params) == set(mha.grads)

    def loss():
        mha.set_params(params)
        return np.sum(mha.forward(Q, K, V, mask=mask)[0] * G)

    assert_gradient(loss, Q, dQ, "Q")
    assert_gradient(loss, K, dK, "K")
    assert_gradient(loss, V, dV, "V")
    for name in params:
        assert_gradient(loss, params[name], grads[name], name)


# --------------------------------------------------------------------------------------------------------
# Layer norm and feed-forward
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5,), (2, 3, 6), (2, 2, 3, 4), (4, 1)])
def test_layer_norm_backward_matches_finite_differences(shape):
    """layer_norm_backward: grads of x, gamma and beta equal finite differences (d_model = 1 included)."""
    rng = make_rng(7, *shape)
    D = shape[-1]
    x, gamma, beta = randn(rng, *shape, scale=2.0), randn(rng, D), randn(rng, D)
    G = randn(rng, *shape)
    dx, dgamma, dbeta = layer_norm_backward(G, x, gamma, eps=1e-6)

    def loss():
        return np.sum(layer_norm(x, gamma, beta, eps=1e-6) * G)

    assert_gradient(loss, x, dx, "x")
    assert_gradient(loss, gamma, dgamma, "gamma")
    assert_gradient(loss, beta, dbeta, "beta")


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_layer_norm_backward_uses_eps(eps):
    """The backward honours a non-default eps (checked where eps matters: small variance)."""
    rng = make_rng(8, int(eps * 1e6))
    x = 1.0 + randn(rng, 3, 4, scale=0.05)
    gamma, beta, G = randn(rng, 4), randn(rng, 4), randn(rng, 3, 4)
    dx, dgamma, dbeta = layer_norm_backward(G, x, gamma, eps=eps)
    loss = lambda: np.sum(layer_norm(x, gamma, beta, eps=eps) * G)  # noqa: E731
    assert_gradient(loss, x, dx, "x")
    assert_gradient(loss, gamma, dgamma, "gamma")


@pytest.mark.parametrize("shape,F", [((2, 3, 4), 6), ((5, 3), 7), ((1, 1, 2), 1)])
def test_feed_forward_backward_matches_finite_differences(shape, F):
    """feed_forward_backward: grads of x, W1, b1, W2, b2 equal finite differences."""
    rng = make_rng(9, *shape, F)
    D = shape[-1]
    x, W1, b1, W2, b2 = randn(rng, *shape), randn(rng, D, F), randn(rng, F), randn(rng, F, D), randn(rng, D)
    G = randn(rng, *shape)
    dx, dp = feed_forward_backward(G, x, W1, b1, W2)
    assert set(dp) == {"W1", "b1", "W2", "b2"}

    def loss():
        return np.sum(feed_forward(x, W1, b1, W2, b2) * G)

    assert_gradient(loss, x, dx, "x")
    for name, arr in (("W1", W1), ("b1", b1), ("W2", W2), ("b2", b2)):
        assert_gradient(loss, arr, dp[name], name)


# --------------------------------------------------------------------------------------------------------
# Encoder block
# --------------------------------------------------------------------------------------------------------
def get_block_params(block) -> dict[str, np.ndarray]:
    """Copies of every block parameter under its dotted name ('ffn.W1', 'attention.W_Q', ...)."""
    return {name: np.array(p, copy=True) for name, p in block.named_parameters()}


def set_block_params(block, params: dict[str, np.ndarray]) -> None:
    """Copy dotted-name parameters into a block: the attention's via set_params, the others by name."""
    att = {n.split(".", 1)[1]: p for n, p in params.items() if n.startswith("attention.")}
    if att:
        block.attention.set_params(att)
    block.load_state_dict({n: p for n, p in params.items() if not n.startswith("attention.")}, strict=False)


def randomize_block(block, rng) -> dict[str, np.ndarray]:
    """Give every parameter (including gammas, betas and biases) random values; returns them."""
    params = {n: randn(rng, *p.shape, scale=0.5) for n, p in get_block_params(block).items()}
    for n in ("norm1.gamma", "norm2.gamma"):
        params[n] = params[n] + 1.0
    set_block_params(block, params)
    return params


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "fully_masked"])
@pytest.mark.parametrize("B,H,L", [(2, 2, 4), (1, 4, 3)])
def test_encoder_block_backward_matches_finite_differences(B, H, L, kind):
    """TransformerEncoderBlock.backward: grad_x and every parameter gradient equal finite differences."""
    rng = make_rng(10, B, H, L, MHA_MASKS.index(kind))
    D, F = 8, 12
    block = TransformerEncoderBlock(D, H, d_ff=F, rng=make_rng(100))
    params = randomize_block(block, rng)
    x = randn(rng, B, L, D)
    mask = make_mask(kind, rng, (B, H), L, L)
    G = randn(rng, B, L, D)

    block.zero_grad()
    block.forward(x, mask=mask)
    dx = block.backward(G)
    grads = {n: np.array(g, copy=True) for n, g in block.named_gradients()}
    assert set(grads) == set(params)
    assert {"ffn.W1", "ffn.b1", "ffn.W2", "ffn.b2", "norm1.gamma", "norm1.beta", "norm2.gamma", "norm2.beta",
            "attention.W_Q", "attention.W_K", "attention.W_V", "attention.W_O"} <= set(grads)

    def loss():
        set_block_params(block, params)
        return np.sum(block.forward(x, mask=mask) * G)

    assert_gradient(loss, x, dx, "x")
    for name in params:
        assert_gradient(loss, params[name], grads[name], name)


def test_encoder_block_causal_mask_from_positional_module():
    """The block's gradients stay exact with the mask built by create_causal_mask."""
    rng = make_rng(11)
    block = TransformerEncoderBlock(4, 2, d_ff=6, rng=make_rng(110))
    params = randomize_block(block, rng)
    x, G = randn(rng, 2, 5, 4), randn(rng, 2, 5, 4)
    mask = create_causal_mask(5)
    block.zero_grad()
    block.forward(x, mask=mask)
    dx = block.backward(G)
    grads = {n: np.array(g, copy=True) for n, g in block.named_gradients()}

    def loss():
        set_block_params(block, params)
        return np.sum(block.forward(x, mask=mask) * G)

    assert_gradient(loss, x, dx, "x")
    assert_gradient(loss, params["attention.W_K"], grads["attention.W_K"], "attention.W_K")
    assert_gradient(loss, params["norm1.gamma"], grads["norm1.gamma"], "norm1.gamma")

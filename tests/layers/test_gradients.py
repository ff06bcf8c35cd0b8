"""Finite-difference checks (float64, relative error < 1e-6) for every layer of attnkit.layers, every
parameter, the cross-entropy gradient and the TokenTagger model end to end; plus the layers' basic
contracts (dtype preserved, inputs not modified, gradients accumulate).

Each check runs forward, backpropagates a random upstream gradient ``G`` (the loss is ``sum(output * G)``),
then compares the returned input gradient and every entry of ``module.named_gradients()`` with central
differences taken through the module's own parameter arrays.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.layers import (
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    LearnedPositionalEmbedding,
    Projection,
    SinusoidalPositionalEncoding,
    TransformerEncoder,
    TransformerEncoderBlock,
)
from attnkit.losses import softmax_cross_entropy
from attnkit.models import TokenTagger, TokenTaggerConfig

from helpers import FD_TOL, numerical_gradient, randn, relative_error


def assert_gradient(f, x, analytic, name, tol=FD_TOL):
    """Relative FD check; a gradient that is zero in exact arithmetic (e.g. the key bias of softmax
    attention, which shifts every score of a query alike) is checked absolutely instead."""
    assert analytic.shape == x.shape and np.all(np.isfinite(analytic)), name
    numeric = numerical_gradient(f, x)
    if np.linalg.norm(analytic) < 1e-12:
        assert np.linalg.norm(numeric) < 1e-7, f"grad of {name}: analytic 0, numeric {np.linalg.norm(numeric):.2e}"
        return
    err = relative_error(analytic, numeric)
    assert err < tol, f"grad of {name}: relative error {err:.3e} >= {tol:.0e}"


def check_module(module, x, forward, rng, *, input_grad=True):
    """FD-check ``forward(x)`` (which calls ``module``) for the input ``x`` and every parameter of ``module``."""
    out = forward(x)
    G = randn(rng, *out.shape)
    module.zero_grad()
    grad_x = module.backward(G)
    loss = lambda: float(np.sum(forward(x) * G))  # noqa: E731
    if input_grad:
        assert_gradient(loss, x, grad_x, "x")
    names = []
    for name, p in module.named_parameters():
        assert_gradient(loss, p, dict(module.named_gradients())[name], name)
        names.append(name)
    return names


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5,), (2, 3, 5)])
def test_projection_gradients(rng, bias, shape):
    proj = Projection(5, 4, bias=bias, rng=1)
    names = check_module(proj, randn(rng, *shape), proj.forward, rng)
    assert names == (["W", "b"] if bias else ["W"])


@pytest.mark.parametrize("shape", [(6,), (2, 3, 6)])
def test_layer_norm_gradients(rng, shape):
    ln = LayerNorm(6)
    ln.gamma = randn(rng, 6)
    ln.beta = randn(rng, 6)
    assert check_module(ln, randn(rng, *shape), ln.forward, rng) == ["gamma", "beta"]


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
def test_feed_forward_gradients(rng, activation):
    ffn = FeedForward(4, 7, activation=activation, rng=2)
    ffn.b1 = randn(rng, 7, scale=0.1)
    ffn.b2 = randn(rng, 4)
    assert check_module(ffn, randn(rng, 2, 3, 4), ffn.forward, rng) == ["W1", "b1", "W2", "b2"]


def test_dropout_gradient_with_fixed_seed(rng):
    """A fresh layer with the same seed drops the same entries, so the loss is a fixed function of x."""
    x = randn(rng, 3, 4, 5)
    G = randn(rng, 3, 4, 5)
    layer = Dropout(0.3, seed=11)
    y = layer(x)
    assert 0 < np.count_nonzero(y == 0) < y.size
    grad_x = layer.backward(G)
    assert_gradient(lambda: float(np.sum(Dropout(0.3, seed=11)(x) * G)), x, grad_x, "x")


def test_embedding_gradient_with_repeats_and_padding(rng):
    emb = Embedding(6, 3, padding_idx=2, rng=0)
    ids = np.array([[0, 1, 1, 2], [5, 1, 2, 0]])
    G = randn(rng, 2, 4, 3)
    emb(ids)
    assert emb.backward(G) is None
    grad = emb.grads["weight"].copy()
    # Independent reference: one-hot matmul, padding row excluded.
    onehot = (ids[..., None] == np.arange(6)).reshape(-1, 6).astype(float)  # (N, V)
    expected = onehot.T @ G.reshape(-1, 3)
    expected[2] = 0.0
    np.testing.assert_allclose(grad, expected, rtol=1e-14, atol=1e-14)
    # FD through the table: the padding row is used by forward but, as in torch, gets no gradient.
    numeric = numerical_gradient(lambda: float(np.sum(emb(ids) * G)), emb.weight)
    rows = np.arange(6) != 2
    assert relative_error(grad[rows], numeric[rows]) < FD_TOL
    assert not grad[2].any() and np.abs(numeric[2]).max() > 0


def test_embedding_gradient_without_padding(rng):
    emb = Embedding(5, 4, rng=3)
    ids = rng.integers(0, 5, size=(3, 7))
    G = randn(rng, 3, 7, 4)
    emb(ids)
    emb.backward(G)
    assert_gradient(lambda: float(np.sum(emb(ids) * G)), emb.weight, emb.grads["weight"], "weight")


def test_positional_layers_gradients(rng):
    sin = SinusoidalPositionalEncoding(10, 6)
    check_module(sin, randn(rng, 2, 7, 6), sin.forward, rng)
    learned = LearnedPositionalEmbedding(10, 6, rng=0)
    names = check_module(learned, randn(rng, 2, 7, 6), learned.forward, rng)
    assert names == ["weight"]
    assert np.all(learned.grads["weight"][7:] == 0)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [True, False])
def test_transformer_encoder_gradients(rng, norm_first, activation):
    enc = TransformerEncoder(2, 8, 2, 12, norm_first=norm_first, activation=activation, attention_bias=True,
                             rng=4)
    for _, p in enc.named_parameters():  # move biases and norms away from their trivial initial values
        p += randn(rng, *p.shape, scale=0.1)
    kpm = np.array([[True] * 5, [True, True, True, False, False]])
    names = check_module(enc, randn(rng, 2, 5, 8), lambda x: enc(x, key_padding_mask=kpm), rng)
    assert len(names) == 2 * 16 + (2 if norm_first else 0)  # 8 block + 8 attention parameters (with biases)
    assert ("norm.gamma" in names) == norm_first


def test_transformer_encoder_causal_gradients(rng):
    enc = TransformerEncoder(2, 6, 3, 8, rng=5)
    check_module(enc, randn(rng, 1, 4, 6), lambda x: enc(x, is_causal=True), rng)


def test_softmax_cross_entropy_gradient(rng):
    logits = randn(rng, 3, 4, 5, scale=3.0)
    targets = rng.integers(0, 5, size=(3, 4))
    targets[0, 1] = targets[2, 3] = -1
    loss, grad = softmax_cross_entropy(logits, targets, ignore_index=-1)
    assert isinstance(loss, float)
    assert np.all(grad[0, 1] == 0) and np.all(grad[2, 3] == 0)
    assert_gradient(lambda: softmax_cross_entropy(logits, targets, ignore_index=-1)[0], logits, grad, "logits")


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [-1e4, -1e4, -1e4]])
    loss, grad = softmax_cross_entropy(logits, np.array([1, 2]))
    expected = (1e4 + np.log(3.0)) / 2
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert abs(loss - expected) < 1e-9 * expected


def test_softmax_cross_entropy_all_ignored_is_zero():
    loss, grad = softmax_cross_entropy(np.ones((2, 3)), np.array([-100, -100]), ignore_index=-100)
    assert loss == 0.0 and not grad.any()


def test_token_tagger_gradients_end_to_end(rng):
    model = TokenTagger(TokenTaggerConfig(vocab_size=5, num_classes=4, max_length=6, d_model=8, num_heads=2,
                                          num_layers=2, d_ff=8, positional="learned"), rng=6)
    ids = rng.integers(0, 5, size=(2, 4))
    targets = rng.integers(0, 4, size=(2, 4))
    kpm = np.array([[True] * 4, [True, True, True, False]])
    targets[1, 3] = -1
    loss, grad = softmax_cross_entropy(model(ids, key_padding_mask=kpm), targets, ignore_index=-1)
    model.zero_grad()
    model.backward(grad)
    grads = dict(model.named_gradients())
    f = lambda: softmax_cross_entropy(model(ids, key_padding_mask=kpm), targets, ignore_index=-1)[0]  # noqa: E731
    for name, p in model.named_parameters():
        assert_gradient(f, p, grads[name], name)
    assert len(grads) == 2 + 2 * 12 + 2 + 2  # embedding, positions, 2 blocks, final norm, head


# --------------------------------------------------------------------------------------------------------
# Contracts
# --------------------------------------------------------------------------------------------------------
def layer_cases():
    return [
        ("Projection", lambda: Projection(4, 3, rng=0), (2, 5, 4)),
        ("LayerNorm", lambda: LayerNorm(4), (2, 5, 4)),
        ("FeedForward", lambda: FeedForward(4, 6, activation="gelu", rng=0), (2, 5, 4)),
        ("Dropout", lambda: Dropout(0.5, seed=0), (2, 5, 4)),
        ("Sinusoidal", lambda: SinusoidalPositionalEncoding(8, 4), (2, 5, 4)),
        ("Learned", lambda: LearnedPositionalEmbedding(8, 4, rng=0), (2, 5, 4)),
        ("Block", lambda: TransformerEncoderBlock(4, 2, rng=0), (2, 5, 4)),
        ("Encoder", lambda: TransformerEncoder(2, 4, 2, rng=0), (2, 5, 4)),
    ]


@pytest.mark.parametrize("name,make,shape", layer_cases(), ids=[c[0] for c in layer_cases()])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layers_preserve_dtype_and_do_not_modify_inputs(rng, name, make, shape, dtype):
    layer = make()
    x = randn(rng, *shape, dtype=dtype)
    x_copy = x.copy()
    y = layer(x)
    G = randn(rng, *y.shape, dtype=dtype)
    G_copy = G.copy()
    grad_x = layer.backward(G)
    assert y.dtype == dtype and grad_x.dtype == dtype
    assert np.array_equal(x, x_copy) and np.array_equal(G, G_copy)
    for pname, g in layer.named_gradients():
        assert g.dtype == np.float64, pname  # gradients accumulate in the parameter dtype


def test_integer_input_computes_in_float64():
    assert Projection(2, 2, rng=0)(np.array([[1, 2]])).dtype == np.float64


def test_gradients_accumulate_until_zero_grad(rng):
    proj = Projection(3, 2, rng=0)
    x, G = randn(rng, 4, 3), randn(rng, 4, 2)
    proj(x)
    proj.backward(G)
    once = proj.grads["W"].copy()
    proj(x)
    proj.backward(G)
    np.testing.assert_allclose(proj.grads["W"], 2 * once, rtol=1e-15)
    proj.zero_grad()
    assert not proj.grads["W"].any()


def test_embedding_float32_table_gives_float32(rng):
    emb = Embedding(4, 3, rng=0).astype(np.float32)
    y = emb(np.array([[0, 3]]))
    assert y.dtype == np.float32
    emb.backward(np.ones((1, 2, 3), np.float32))
    assert emb.grads["weight"].dtype == np.float32


def test_encoder_need_weights_matches_plain_forward(rng):
    enc = TransformerEncoder(3, 8, 4, rng=0)
    x = randn(rng, 2, 6, 8)
    y_plain = enc(x)
    y, weights = enc(x, need_weights=True)
    # need_weights runs the reference kernel, the plain forward the tiled one: equal to float64 rounding.
    np.testing.assert_allclose(y, y_plain, rtol=1e-12, atol=1e-12)
    assert len(weights) == 3 and all(w.shape == (2, 4, 6, 6) for w in weights)
    np.testing.assert_allclose(np.sum(weights[2], axis=-1), 1.0, rtol=1e-12)
    # Block-level weights agree with the stack's
    block_out, block_w = enc.layers[0](x, need_weights=True)
    np.testing.assert_array_equal(block_w, weights[0])


def test_encoder_final_norm_defaults(rng):
    assert TransformerEncoder(1, 4, 2, rng=0).norm is not None
    assert TransformerEncoder(1, 4, 2, norm_first=False, rng=0).norm is None
    assert TransformerEncoder(1, 4, 2, final_norm=False, rng=0).norm is None
    post_norm_with_final = TransformerEncoder(1, 4, 2, norm_first=False, final_norm=True, rng=0)
    assert "norm.gamma" in dict(post_norm_with_final.named_parameters())


def test_model_need_weights_and_predict(rng):
    model = TokenTagger(TokenTaggerConfig(10, 10, 8, d_model=8, num_heads=2), rng=0)
    ids = rng.integers(0, 10, size=(3, 5))
    logits, weights = model(ids, need_weights=True)
    np.testing.assert_allclose(logits, model(ids), rtol=1e-12, atol=1e-12)  # reference vs tiled kernel
    assert [w.shape for w in weights] == [(3, 2, 5, 5)] * 2
    assert model.predict(ids).shape == (3, 5)

"""float16 in gives float16 out across the functional API and the attention modules (they compute in float32
and round once at the end), as the layers and models already did; float32 and mixed inputs are unchanged."""
import numpy as np
import pytest

from attnkit import attention_core as ac
from attnkit import multi_head as mh
from attnkit import transformer_block as tb
from attnkit.attention import AdditiveAttention, MultiHeadAttention, ScaledDotProductAttention
from attnkit.positional import add_positional_encoding, sinusoidal_encoding

rng = np.random.default_rng(0)
X = rng.normal(size=(2, 5, 8))
W = rng.normal(size=(8, 8)) * 0.3


def _calls(dtype):
    x, w = X.astype(dtype), W.astype(dtype)
    out, weights = ac.scaled_dot_product_attention(x, x, x)
    yield "scaled_dot_product_attention", (out, weights), ac.scaled_dot_product_attention(X, X, X)
    yield ("scaled_dot_product_attention_backward", ac.scaled_dot_product_attention_backward(out, x, x, x, weights),
           ac.scaled_dot_product_attention_backward(*ac.scaled_dot_product_attention(X, X, X)[:1], X, X, X,
                                                    ac.scaled_dot_product_attention(X, X, X)[1]))
    yield "compute_attention_scores", ac.compute_attention_scores(x, x), ac.compute_attention_scores(X, X)
    yield "attention_weights", ac.attention_weights(x), ac.attention_weights(X)
    yield "layer_norm", tb.layer_norm(x, np.ones(8, dtype), np.zeros(8, dtype)), tb.layer_norm(X, np.ones(8),
                                                                                             np.zeros(8))
    yield "feed_forward", tb.feed_forward(x, w, np.zeros(8, dtype), w, np.zeros(8, dtype)), \
        tb.feed_forward(X, W, np.zeros(8), W, np.zeros(8))
    pe = sinusoidal_encoding(5, 8)
    yield "add_positional_encoding", add_positional_encoding(x, pe.astype(dtype)), add_positional_encoding(X, pe)
    mha_out = mh.multi_head_attention_forward(x, x, x, w, w, w, w, num_heads=2)
    yield "multi_head_attention_forward", mha_out[0], mh.multi_head_attention_forward(X, X, X, W, W, W, W,
                                                                                        num_heads=2)[0]


@pytest.mark.parametrize("name", ["scaled_dot_product_attention", "scaled_dot_product_attention_backward",
                                  "compute_attention_scores", "attention_weights", "layer_norm", "feed_forward",
                                  "add_positional_encoding", "multi_head_attention_forward"])
def test_float16_in_gives_float16_out_close_to_float64(name):
    got, expected = next((g, e) for n, g, e in _calls(np.float16) if n == name)
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == np.float16, name
        np.testing.assert_allclose(g.astype(np.float64), e, rtol=2e-2, atol=2e-2 * np.abs(e).max())
    for _, g32, _ in _calls(np.float32):
        for g in (g32 if isinstance(g32, tuple) else (g32,)):
            assert g.dtype == np.float32


@pytest.mark.parametrize("module", [lambda: MultiHeadAttention(8, 2, rng=0), lambda: ScaledDotProductAttention(),
                                    lambda: AdditiveAttention(8, 8, 6, rng=0)])
def test_attention_modules_keep_float16(module):
    m = module().astype(np.float16)
    x = X.astype(np.float16)
    args = (x, x, x)
    out = m(*args)
    outputs = out if isinstance(out, tuple) else (out,)
    assert all(o.dtype == np.float16 for o in outputs if o is not None)
    grads = m.backward(np.ones_like(outputs[0]))
    grads = grads if isinstance(grads, tuple) else (grads,)
    assert all(g.dtype == np.float16 for g in grads if g is not None)


def test_mixed_precision_follows_the_widest_input():
    out, _ = ac.scaled_dot_product_attention(X.astype(np.float32), X.astype(np.float16), X.astype(np.float16))
    assert out.dtype == np.float32

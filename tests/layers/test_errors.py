"""Bad input to the layers, losses, models and tasks raises a clear TypeError/ValueError naming the argument
(or RuntimeError for backward before forward). State-dict errors are in core/test_state_dict.py, optimizer
argument errors in optim/test_optim.py, the non-BaseAttention head in attention/test_multi_head_attention.py
(and once more here)."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention import MultiHeadAttention
from attnkit.demos.tasks import make_batch, token_names
from attnkit.layers import (
    Dropout,
    Embedding,
    FeedForward,
    LayerNorm,
    LearnedPositionalEmbedding,
    Projection,
    SinusoidalPositionalEncoding,
    TransformerEncoder,
)
from attnkit.losses import softmax_cross_entropy
from attnkit.models import TokenTagger, TokenTaggerConfig

SMALL_TAGGER = TokenTaggerConfig(5, 3, 4, d_model=4, num_heads=2)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: Projection(3, 2, rng=0)(np.ones((4, 5))), ValueError, r"x has 5 features, expected in_features = 3"),
    (lambda: Projection(3, 2, rng=0)(np.float64(1.0)), ValueError, "x must be at least 1-D"),
    (lambda: LayerNorm(4)(np.ones((2, 3))), ValueError, "normalized_shape = 4"),
    (lambda: FeedForward(4, rng=0)(np.ones((2, 3))), ValueError, "d_model = 4"),
    (lambda: SinusoidalPositionalEncoding(4, 2)(np.ones((1, 5, 2))), ValueError, "exceeds max_length = 4"),
    (lambda: LearnedPositionalEmbedding(4, 2, rng=0)(np.ones((5, 2))), ValueError, "3-D"),
    (lambda: TransformerEncoder(1, 4, 2, rng=0)(np.ones((3, 4))), ValueError, "3-D"),
    (lambda: TransformerEncoder(1, 4, 2, rng=0)(np.ones((1, 3, 4)), key_padding_mask=np.ones((1, 4), bool)),
     ValueError, "key_padding_mask has shape"),
    (lambda: TransformerEncoder(1, 4, 2, rng=0)(np.ones((1, 3, 4)), mask=np.ones((1, 3, 3), bool)),
     ValueError, "ambiguous"),
    (lambda: TokenTagger(SMALL_TAGGER, rng=0)(np.zeros(4, int)), ValueError, "ids must be 2-D"),
    (lambda: TokenTagger(SMALL_TAGGER, rng=0)(np.zeros((1, 6), int)), ValueError,
     "exceeds max_length"),
])
def test_wrong_shapes(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call,exc,match", [
    (lambda: Projection(2, 2, rng=0)(np.array([["a", "b"]])), TypeError, "x must be a real numeric array"),
    (lambda: LayerNorm(2)(np.ones(2, complex)), TypeError, "x must be a real numeric array"),
    (lambda: Embedding(5, 2, rng=0)(np.array([0.0, 1.0])), TypeError, "ids must be an integer array"),
    (lambda: Embedding(5, 2, rng=0)(np.array([True, False])), TypeError, "ids must be an integer array"),
    (lambda: Embedding(5, 2, rng=0)(np.array([[0, 5]])), ValueError, r"ids must lie in \[0, num_embeddings=5\)"),
    (lambda: Embedding(5, 2, rng=0)(np.array([-1])), ValueError, "ids must lie in"),
    (lambda: TransformerEncoder(1, 4, 2, rng=0)(np.ones((1, 3, 4)), key_padding_mask=np.ones((1, 3), int)),
     TypeError, "key_padding_mask must be boolean"),
    (lambda: softmax_cross_entropy(np.ones((2, 3)), np.array([0.0, 1.0])), TypeError, "targets must be an integer"),
])
def test_wrong_dtypes(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_grad_output_of_the_wrong_shape():
    for layer, x in ((Projection(3, 2, rng=0), np.ones((4, 3))), (LayerNorm(3), np.ones((4, 3))),
                     (FeedForward(3, rng=0), np.ones((4, 3))), (Dropout(0.5, seed=0), np.ones((4, 3))),
                     (TransformerEncoder(1, 4, 2, rng=0), np.ones((1, 2, 4)))):
        y = layer(x)
        with pytest.raises(ValueError, match="grad_output has shape"):
            layer.backward(np.ones(y.shape + (1,)))
    emb = Embedding(5, 2, rng=0)
    emb(np.array([[1, 2]]))
    with pytest.raises(ValueError, match=r"grad_output has shape \(1, 2\), expected the output shape \(1, 2, 2\)"):
        emb.backward(np.ones((1, 2)))


@pytest.mark.parametrize("layer", [Projection(2, 2, rng=0), LayerNorm(2), FeedForward(2, rng=0), Dropout(0.1),
                                   Embedding(3, 2, rng=0), SinusoidalPositionalEncoding(3, 2),
                                   LearnedPositionalEmbedding(3, 2, rng=0)], ids=lambda m: type(m).__name__)
def test_backward_before_forward(layer):
    with pytest.raises(RuntimeError, match="before forward"):
        layer.backward(np.ones((1, 2)))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: Projection(0, 2), ValueError, "in_features must be positive"),
    (lambda: Projection(2.0, 2), TypeError, "in_features must be an integer"),
    (lambda: LayerNorm((2, 3)), ValueError, "normalized_shape"),
    (lambda: LayerNorm(2, eps=-1.0), ValueError, "eps"),
    (lambda: FeedForward(4, activation="tanh"), ValueError, "activation must be one of"),
    (lambda: Dropout(1.0), ValueError, r"p must be a probability in \[0, 1\)"),
    (lambda: Dropout(-0.1), ValueError, "p must be"),
    (lambda: Embedding(4, 2, padding_idx=4), ValueError, "padding_idx = 4 is out of range"),
    (lambda: TransformerEncoder(0, 4, 2), ValueError, "num_layers must be positive"),
    (lambda: TransformerEncoder(1, 6, 4), ValueError, "not divisible by num_heads"),
    (lambda: TokenTagger(TokenTaggerConfig(5, 3, 4, positional="rotary")), ValueError, "positional must be"),
    (lambda: MultiHeadAttention(4, 2, attention="sdpa"), TypeError, "attention must be a BaseAttention"),
])
def test_bad_constructor_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call,exc,match", [
    (lambda: softmax_cross_entropy(np.ones((2, 3)), np.array([0, 1, 2])), ValueError, r"targets has shape \(3,\)"),
    (lambda: softmax_cross_entropy(np.ones((2, 3)), np.array([0, 3])), ValueError, r"targets must lie in \[0, 3\)"),
    (lambda: softmax_cross_entropy(np.ones((2, 3)), np.array([0, -1])), ValueError, "targets must lie in"),
    (lambda: softmax_cross_entropy(np.float64(1.0), np.array(0)), ValueError, "logits must be at least 1-D"),
    (lambda: make_batch("rotate", 2, 3), ValueError, "task must be one of"),
    (lambda: make_batch("sort", 0, 3), ValueError, "batch_size must be positive"),
    (lambda: make_batch("copy_offset", 1, 3, offset=1.5), TypeError, "offset must be an integer"),
    (lambda: token_names(0), ValueError, "num_digits"),
])
def test_bad_loss_and_task_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()

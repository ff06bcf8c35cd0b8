"""A test per bad-input case: the exception type (ValueError or TypeError) and a message naming the argument.

Where the contract asks for it, the message must also carry the offending shape, so that the user sees
what was passed without a debugger.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from attnkit.attention_core import (
    additive_attention,
    apply_attention_mask,
    compute_attention_scores,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from attnkit.multi_head import MultiHeadAttention, merge_heads, multi_head_attention_forward, split_heads
from attnkit.positional import add_positional_encoding, create_padding_mask, sinusoidal_encoding
from attnkit.transformer_block import TransformerEncoderBlock, feed_forward, layer_norm

BAD = (ValueError, TypeError)


def word(name: str) -> str:
    """Regex matching ``name`` as a whole word (so 'K' does not match inside 'Keys' or 'mask')."""
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


def shape_text(shape) -> str:
    return re.escape(str(tuple(shape)))


def z(*shape):
    return np.zeros(shape)


# --------------------------------------------------------------------------------------------------------
# d_model not divisible by num_heads
# --------------------------------------------------------------------------------------------------------
def test_multi_head_attention_class_d_model_not_divisible_by_num_heads():
    """MultiHeadAttention(10, 3) is refused, naming num_heads."""
    with pytest.raises(ValueError, match=word("num_heads")):
        MultiHeadAttention(10, 3)


def test_split_heads_d_model_not_divisible_by_num_heads():
    """split_heads of a (2, 3, 10) array into 4 heads is refused, naming num_heads and the shape."""
    with pytest.raises(ValueError, match=word("num_heads")) as exc:
        split_heads(z(2, 3, 10), 4)
    assert "10" in str(exc.value)


def test_multi_head_functional_d_model_not_divisible_by_num_heads():
    """multi_head_attention_forward with d_model 6 and 4 heads is refused, naming num_heads."""
    x = z(1, 2, 6)
    with pytest.raises(ValueError, match=word("num_heads")):
        multi_head_attention_forward(x, x, x, z(6, 6), z(6, 6), z(6, 6), z(6, 6), 4)


def test_encoder_block_d_model_not_divisible_by_num_heads():
    """TransformerEncoderBlock(10, 4) is refused, naming num_heads."""
    with pytest.raises(ValueError, match=word("num_heads")):
        TransformerEncoderBlock(10, 4)


@pytest.mark.parametrize("num_heads", [0, -2, 2.0])
def test_num_heads_must_be_a_positive_integer(num_heads):
    """num_heads of 0, negative or a float is refused, naming num_heads."""
    with pytest.raises(BAD, match=word("num_heads")):
        split_heads(z(1, 2, 4), num_heads)
    with pytest.raises(BAD, match=word("num_heads")):
        MultiHeadAttention(4, num_heads)


# --------------------------------------------------------------------------------------------------------
# Q/K feature sizes, K/V lengths
# --------------------------------------------------------------------------------------------------------
def test_sdpa_query_key_feature_sizes_differ():
    """Q with 4 features and K with 5 are refused, naming K (or Q) and both shapes."""
    Q, K, V = z(2, 3, 4), z(2, 6, 5), z(2, 6, 2)
    with pytest.raises(ValueError, match=word("K")) as exc:
        scaled_dot_product_attention(Q, K, V)
    assert str(Q.shape) in str(exc.value) and str(K.shape) in str(exc.value)
    with pytest.raises(ValueError, match=word("K")):
        compute_attention_scores(Q, K)


def test_sdpa_backward_query_key_feature_sizes_differ():
    """The backward refuses mismatched Q/K features as well."""
    with pytest.raises(ValueError, match=word("K")):
        scaled_dot_product_attention_backward(z(2, 3, 2), z(2, 3, 4), z(2, 6, 5), z(2, 6, 2), z(2, 3, 6))


def test_sdpa_key_value_lengths_differ():
    """K of length 6 with V of length 5 is refused, naming V and both shapes."""
    K, V = z(2, 6, 4), z(2, 5, 3)
    with pytest.raises(ValueError, match=word("V")) as exc:
        scaled_dot_product_attention(z(2, 3, 4), K, V)
    assert str(K.shape) in str(exc.value) and str(V.shape) in str(exc.value)


def test_additive_key_value_lengths_differ():
    """additive_attention refuses K/V of different lengths, naming V."""
    with pytest.raises(ValueError, match=word("V")):
        additive_attention(z(2, 3, 4), z(2, 6, 4), z(2, 5, 3), z(4, 2), z(4, 2), z(2))


def test_additive_projection_shape_mismatch():
    """A W_q whose rows do not match Q's features is refused, naming W_q and its shape."""
    with pytest.raises(ValueError, match=word("W_q")) as exc:
        additive_attention(z(2, 3, 4), z(2, 6, 5), z(2, 6, 3), z(3, 2), z(5, 2), z(2))
    assert str((3, 2)) in str(exc.value)


def test_multi_head_key_value_lengths_differ():
    """multi_head_attention_forward refuses K and V of different lengths, naming V (or K)."""
    W = [z(4, 4)] * 4
    with pytest.raises(ValueError, match=rf"{word('V')}|{word('K')}") as exc:
        multi_head_attention_forward(z(1, 2, 4), z(1, 3, 4), z(1, 5, 4), *W, 2)
    assert str((1, 5, 4)) in str(exc.value)


def test_multi_head_key_feature_size_differs():
    """A key input whose feature size is not d_model is refused, naming K and its shape."""
    W = [z(4, 4)] * 4
    with pytest.raises(ValueError, match=word("K")) as exc:
        multi_head_attention_forward(z(1, 2, 4), z(1, 3, 6), z(1, 3, 4), *W, 2)
    assert str((1, 3, 6)) in str(exc.value)


def test_multi_head_weight_shape_wrong():
    """A projection matrix that is not (d_model, d_model) is refused, naming it and its shape."""
    x = z(1, 2, 4)
    with pytest.raises(ValueError, match=word("W_O")) as exc:
        multi_head_attention_forward(x, x, x, z(4, 4), z(4, 4), z(4, 4), z(4, 3), 2)
    assert str((4, 3)) in str(exc.value)


def test_multi_head_class_key_value_lengths_differ():
    """MultiHeadAttention.forward refuses key/value of different lengths, naming them."""
    mha = MultiHeadAttention(4, 2)
    with pytest.raises(ValueError, match=r"(?i)\bV\b|\bK\b|value|key"):
        mha.forward(z(1, 2, 4), z(1, 3, 4), z(1, 5, 4))


def test_set_params_wrong_shape():
    """set_params refuses a parameter of the wrong shape, naming it and the shapes."""
    mha = MultiHeadAttention(4, 2)
    before = mha.get_params()
    with pytest.raises(ValueError, match=word("W_Q")) as exc:
        mha.set_params({"W_Q": z(4, 5)})
    assert str((4, 5)) in str(exc.value) and str((4, 4)) in str(exc.value)
    np.testing.assert_array_equal(mha.W_Q, before["W_Q"])


# --------------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------------
def test_sdpa_mask_not_broadcastable():
    """A (3, 4) mask against (2, 3, 5) scores is refused, naming mask and its shape."""
    with pytest.raises(ValueError, match=word("mask")) as exc:
        scaled_dot_product_attention(z(2, 3, 4), z(2, 5, 4), z(2, 5, 2), mask=np.ones((3, 4), bool))
    assert str((3, 4)) in str(exc.value)


def test_mask_that_would_enlarge_the_output_is_refused():
    """A mask with more batch entries than the scores (4 vs 2) is refused rather than silently broadcast."""
    with pytest.raises(ValueError, match=word("mask")):
        scaled_dot_product_attention(z(2, 3, 4), z(2, 5, 4), z(2, 5, 2), mask=np.ones((4, 2, 3, 5), bool))


def test_apply_attention_mask_not_broadcastable():
    """apply_attention_mask refuses a mask that does not broadcast to the scores, naming mask."""
    with pytest.raises(ValueError, match=word("mask")) as exc:
        apply_attention_mask(z(2, 3), np.ones((4,), bool))
    assert str((4,)) in str(exc.value)


def test_multi_head_mask_not_broadcastable():
    """A (B, 1, 1, Lk) mask with the wrong Lk is refused by the functional and class forward."""
    x = z(2, 3, 4)
    W = [z(4, 4)] * 4
    bad = np.ones((2, 1, 1, 5), bool)
    with pytest.raises(ValueError, match=word("mask")) as exc:
        multi_head_attention_forward(x, x, x, *W, 2, mask=bad)
    assert str(bad.shape) in str(exc.value)
    with pytest.raises(ValueError, match=r"mask"):
        MultiHeadAttention(4, 2).forward(x, x, x, mask=bad)
    with pytest.raises(ValueError, match=r"mask"):
        TransformerEncoderBlock(4, 2).forward(x, mask=bad)


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.uint8])
def test_mask_not_boolean(dtype):
    """A 0/1 mask of a non-boolean dtype is refused (its polarity would be a guess), naming mask."""
    mask = np.ones((3, 5), dtype=dtype)
    with pytest.raises(BAD, match=word("mask")):
        scaled_dot_product_attention(z(2, 3, 4), z(2, 5, 4), z(2, 5, 2), mask=mask)
    with pytest.raises(BAD, match=word("mask")):
        apply_attention_mask(z(3, 5), mask)
    with pytest.raises(BAD, match=word("mask")):
        additive_attention(z(2, 3, 4), z(2, 5, 4), z(2, 5, 2), z(4, 2), z(4, 2), z(2), mask=mask)
    x = z(2, 3, 4)
    with pytest.raises(BAD, match=r"mask"):
        multi_head_attention_forward(x, x, x, *[z(4, 4)] * 4, 2, mask=np.ones((3, 3), dtype=dtype))
    with pytest.raises(BAD, match=r"mask"):
        MultiHeadAttention(4, 2).forward(x, x, x, mask=np.ones((3, 3), dtype=dtype))


# --------------------------------------------------------------------------------------------------------
# Positional table and padding lengths
# --------------------------------------------------------------------------------------------------------
def test_sequence_longer_than_positional_table():
    """add_positional_encoding of a length-10 sequence with a 5-row table names the sequence length."""
    x, pe = z(2, 10, 4), sinusoidal_encoding(5, 4)
    with pytest.raises(ValueError, match=r"(?i)seq|length") as exc:
        add_positional_encoding(x, pe)
    msg = str(exc.value)
    assert "10" in msg and "5" in msg


def test_positional_table_width_mismatch():
    """A table whose d_model differs from x's is refused, naming pe."""
    with pytest.raises(ValueError, match=word("pe")):
        add_positional_encoding(z(1, 3, 4), sinusoidal_encoding(5, 6))


@pytest.mark.parametrize("lengths", [[3, 5], [-1, 2]])
def test_padding_lengths_out_of_range(lengths):
    """create_padding_mask refuses a length above max_length or below zero, naming the lengths."""
    with pytest.raises(ValueError, match=r"(?i)length"):
        create_padding_mask(np.array(lengths), max_length=4)


# --------------------------------------------------------------------------------------------------------
# Wrong-rank inputs
# --------------------------------------------------------------------------------------------------------
def test_split_heads_wrong_rank():
    """split_heads of a 2-D array is refused, naming x and its shape."""
    with pytest.raises(ValueError, match=word("x")) as exc:
        split_heads(z(3, 8), 2)
    assert str((3, 8)) in str(exc.value)


def test_merge_heads_wrong_rank():
    """merge_heads of a 3-D array is refused, naming x and its shape."""
    with pytest.raises(ValueError, match=word("x")) as exc:
        merge_heads(z(2, 3, 8))
    assert str((2, 3, 8)) in str(exc.value)


def test_multi_head_class_forward_wrong_rank():
    """MultiHeadAttention.forward of 2-D inputs is refused, naming the query argument and its shape."""
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"(?<![A-Za-z])Q(?![A-Za-z])|query") as exc:
        mha.forward(z(3, 8), z(1, 3, 8), z(1, 3, 8))
    assert str((3, 8)) in str(exc.value)


def test_multi_head_functional_wrong_rank():
    """multi_head_attention_forward of a 4-D query is refused, naming Q."""
    W = [z(4, 4)] * 4
    with pytest.raises(ValueError, match=word("Q")):
        multi_head_attention_forward(z(1, 1, 2, 4), z(1, 2, 4), z(1, 2, 4), *W, 2)


def test_sdpa_one_dimensional_input():
    """scaled_dot_product_attention of a 1-D Q is refused, naming Q and its shape."""
    with pytest.raises(ValueError, match=word("Q")) as exc:
        scaled_dot_product_attention(z(4), z(3, 4), z(3, 2))
    assert str((4,)) in str(exc.value)
    with pytest.raises(ValueError, match=word("V")):
        scaled_dot_product_attention(z(2, 4), z(3, 4), z(3))


def test_encoder_block_wrong_rank_and_width():
    """The encoder block refuses 2-D input and input whose width is not d_model, naming x."""
    block = TransformerEncoderBlock(8, 2)
    with pytest.raises(ValueError, match=word("x")):
        block.forward(z(3, 8))
    with pytest.raises(ValueError, match=word("x")) as exc:
        block.forward(z(1, 3, 6))
    assert str((1, 3, 6)) in str(exc.value)


def test_layer_norm_gamma_shape_wrong():
    """layer_norm refuses a gamma whose length is not d_model, naming gamma."""
    with pytest.raises(ValueError, match=word("gamma")):
        layer_norm(z(2, 3, 4), np.ones(5), np.zeros(4))


def test_feed_forward_weight_shape_wrong():
    """feed_forward refuses a W1 whose rows are not d_model, naming W1 and its shape."""
    with pytest.raises(ValueError, match=word("W1")) as exc:
        feed_forward(z(2, 3, 4), z(5, 6), z(6), z(6, 4), z(4))
    assert str((5, 6)) in str(exc.value)


def test_non_numeric_input_is_a_type_error():
    """A string array as Q is refused with TypeError naming Q."""
    with pytest.raises(TypeError, match=word("Q")):
        scaled_dot_product_attention(np.array([["a", "b"]]), z(1, 2), z(1, 2))


def test_backward_weights_shape_wrong():
    """The sdpa backward refuses weights that do not have the (..., Lq, Lk) shape, naming weights."""
    with pytest.raises(ValueError, match=word("weights")):
        scaled_dot_product_attention_backward(z(2, 3, 2), z(2, 3, 4), z(2, 5, 4), z(2, 5, 2), z(2, 5, 3))

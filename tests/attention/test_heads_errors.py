"""Bad input to the attention heads raises a clear error naming the argument (a test each).

Dimension letters: B batch, H heads, Lq/Lk query/key length, D features.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention import (
    AdditiveAttention,
    Attention,
    CausalAttention,
    LearnedBiasAttention,
    MultiHeadAttention,
    PhysicsGuidedAttention,
)

Q, K, V = np.ones((2, 3, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 6))  # (B, Lq, D), (B, Lk, D), (B, Lk, Dv)
Q4, K4, V4 = Q[:, None], K[:, None], V[:, None]  # (B, 1, L, D): one head


# -- MultiHeadAttention and its heads ---------------------------------------------------------------------
def test_mha_refuses_a_head_that_is_not_base_attention():
    with pytest.raises(TypeError, match="attention must be a BaseAttention"):
        MultiHeadAttention(8, 2, attention=lambda q, k, v: q)


def test_learned_bias_heads_must_match_mha_heads():
    mha = MultiHeadAttention(8, 2, attention=LearnedBiasAttention(num_heads=4))
    x = np.ones((1, 3, 8))
    with pytest.raises(ValueError, match=r"num_heads = 4 but the inputs have 2 heads"):
        mha(x, x, x)


def test_learned_bias_needs_a_head_axis():
    with pytest.raises(ValueError, match=r"num_heads = 2 but the inputs have 5 heads"):
        LearnedBiasAttention(2, mode="alibi")(np.ones((5, 3, 4)), np.ones((5, 4, 4)), np.ones((5, 4, 2)))
    with pytest.raises(ValueError, match="no heads"):
        LearnedBiasAttention(2)(Q[0], K[0], V[0])


def test_physics_per_head_strengths_must_match_heads():
    mha = MultiHeadAttention(8, 4, attention=PhysicsGuidedAttention(num_heads=2))
    x = np.ones((1, 3, 8))
    with pytest.raises(ValueError, match=r"num_heads = 2 strengths but the inputs have 4 heads"):
        mha(x, x, x)


# -- Attention module masks: (B, Lk), (B, 1, Lk), (B, Lq, Lk), booleans or 0/1 ---------------------------------
@pytest.mark.parametrize("shape", [(3, 5), (2, 4), (5, 2)])
def test_attention_refuses_2d_masks_other_than_batch_by_seq_k(shape):
    with pytest.raises(ValueError, match=r"read as a \(batch, seq_k\) = \(2, 5\) key padding mask"):
        Attention()(Q, K, V, mask=np.ones(shape, bool))


@pytest.mark.parametrize("shape", [(5,), (2, 1, 1, 5)])
def test_attention_refuses_masks_of_other_ranks_for_3d_inputs(shape):
    with pytest.raises(ValueError, match=r"must be \(batch, seq_k\), \(batch, 1, seq_k\) or \(batch, seq_q, seq_k\)"):
        Attention()(Q, K, V, mask=np.ones(shape, bool))


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 4, 5), (3, 3, 5), (2, 5, 3)])
def test_attention_refuses_3d_masks_that_do_not_fit(shape):
    with pytest.raises(ValueError, match="does not broadcast to the"):
        Attention()(Q, K, V, mask=np.ones(shape, bool))


def test_attention_refuses_4d_masks_that_do_not_fit_4d_inputs():
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 2, 5\) does not broadcast"):
        Attention()(Q4, K4, V4, mask=np.ones((2, 1, 2, 5), bool))


def test_attention_refuses_float_masks():
    with pytest.raises(TypeError, match="mask must be boolean or a 0/1 integer array"):
        Attention()(Q, K, V, mask=np.ones((2, 5)))


def test_attention_refuses_integer_masks_other_than_0_1():
    with pytest.raises(ValueError, match="integers other than 0 and 1"):
        Attention()(Q, K, V, mask=np.full((2, 5), 2))


def test_other_heads_refuse_integer_masks():
    with pytest.raises(TypeError, match=r"mask must be boolean \(True = may attend\)"):
        AdditiveAttention(4, 4, 3)(Q, K, V, mask=np.ones((2, 3, 5), int))


# -- shapes and ranks ---------------------------------------------------------------------------------------------
def test_attention_refuses_different_query_and_key_sizes():
    with pytest.raises(ValueError, match=r"q has 4 features but k has 3 .* needs d_q == d_k"):
        Attention()(Q, np.ones((2, 5, 3)), V)


@pytest.mark.parametrize("head", [Attention(), AdditiveAttention(4, 4, 3), LearnedBiasAttention(1),
                                  PhysicsGuidedAttention()])
def test_heads_refuse_1d_inputs(head):
    with pytest.raises(ValueError, match=r"q must be at least 2-D"):
        head(np.ones(4), K[0], V[0])


@pytest.mark.parametrize("head", [Attention(), AdditiveAttention(4, 4, 3), PhysicsGuidedAttention()])
def test_heads_refuse_inputs_of_different_ranks(head):
    with pytest.raises(ValueError, match="same number of dimensions"):
        head(Q, K4, V)


@pytest.mark.parametrize("head", [Attention(), AdditiveAttention(4, 4, 3), PhysicsGuidedAttention()])
def test_heads_refuse_keys_and_values_of_different_lengths(head):
    with pytest.raises(ValueError, match="k has length 5 but v has length 4"):
        head(Q, K, V[:, :4])


def test_heads_refuse_leading_dims_that_do_not_broadcast():
    with pytest.raises(ValueError, match="leading .* dims of q, k and v do not broadcast"):
        Attention()(Q, np.ones((3, 5, 4)), np.ones((3, 5, 6)))


def test_heads_refuse_non_numeric_input():
    with pytest.raises(TypeError, match="q must be a real numeric array"):
        Attention()(np.array([["a"]]), K, V)


@pytest.mark.parametrize("which,shape,match", [("q", (2, 3, 5), "q has 5 features, expected d_q = 4"),
                                               ("k", (2, 5, 3), "k has 3 features, expected d_k = 4")])
def test_additive_refuses_wrong_feature_sizes(which, shape, match):
    args = {"q": Q, "k": K, "v": V}
    args[which] = np.ones(shape)
    with pytest.raises(ValueError, match=match):
        AdditiveAttention(4, 4, 3)(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("make", [Attention, lambda: AdditiveAttention(4, 4, 3), lambda: LearnedBiasAttention(1),
                                  PhysicsGuidedAttention])
def test_backward_checks_grad_output_and_order(make):
    head = make()
    with pytest.raises(RuntimeError, match="backward called before forward"):
        head.backward(np.ones((2, 1, 3, 6)))
    out, _ = head(Q4, K4, V4)
    with pytest.raises(ValueError,
                       match=r"grad_output has shape \(2, 3, 6\), expected the output shape \(2, 1, 3, 6\)"):
        head.backward(np.ones((2, 3, 6)))


# -- constructors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,match", [
    ({"d_q": 0, "d_k": 4, "d_attn": 3}, ValueError, "d_q must be positive"),
    ({"d_q": 4, "d_k": 4.0, "d_attn": 3}, TypeError, "d_k must be an integer"),
    ({"d_q": 4, "d_k": 4, "d_attn": -1}, ValueError, "d_attn must be positive"),
])
def test_additive_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdditiveAttention(**kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"num_heads": 0}, ValueError, "num_heads must be positive"),
    ({"num_heads": 2, "mode": "rope"}, ValueError, "mode must be 't5' or 'alibi'"),
    ({"num_heads": 2, "num_buckets": 3}, ValueError, "num_buckets = 3 is too small: need at least 4"),
    ({"num_heads": 2, "num_buckets": 1, "bidirectional": False}, ValueError, "need at least 2"),
    ({"num_heads": 2, "num_buckets": 32, "max_distance": 8}, ValueError, "max_distance = 8 must exceed"),
    ({"num_heads": 2, "dropout": 1.0}, ValueError, "dropout must be a probability"),
])
def test_learned_bias_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        LearnedBiasAttention(**kwargs)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"prior": "yukawa"}, ValueError, "prior must be one of"),
    ({"length_scale": 0.0}, ValueError, "length_scale must be a positive finite number"),
    ({"length_scale": "1"}, ValueError, "length_scale must be a positive finite number"),
    ({"strength_init": [1.0, 2.0]}, ValueError, r"strength_init must be a number or an array of shape \(1,\)"),
    ({"strength_init": [1.0, 2.0, 3.0], "num_heads": 2}, ValueError, r"array of shape \(2,\)"),
    ({"prior": np.subtract.outer, "learn_length_scale": True}, ValueError, "learn_length_scale needs a built-in"),
    ({"coordinates": np.ones((2, 3, 4))}, ValueError, r"coordinates must be arrays of shape \(N,\) or \(N, d\)"),
    ({"coordinates": (np.ones((3, 2)), np.ones((5, 3)))}, ValueError, "same point dimension"),
    ({"coordinates": np.array([0.0, np.nan])}, ValueError, "coordinates must be finite"),
])
def test_physics_constructor_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        PhysicsGuidedAttention(**kwargs)


def test_physics_coordinates_must_cover_the_sequences():
    with pytest.raises(ValueError, match="coordinates has 4 points .* seq_k = 5"):
        PhysicsGuidedAttention(coordinates=np.arange(4.0))(Q, K, V)
    with pytest.raises(ValueError, match=r"negative for seq_q = 5 > seq_k = 3; give a pair"):
        PhysicsGuidedAttention(coordinates=np.arange(6.0))(K, Q, Q)
    with pytest.raises(ValueError,
                       match="the pair has 3 query and 4 key points but the inputs have seq_q = 3, seq_k = 5"):
        PhysicsGuidedAttention(coordinates=(np.arange(3.0), np.arange(4.0)))(Q, K, V)


def test_physics_callable_prior_must_return_tq_by_tk():
    head = PhysicsGuidedAttention(lambda xq, xk: np.zeros((xk.shape[0], xq.shape[0])))
    with pytest.raises(ValueError,
                       match=r"prior\(q_pos, k_pos\) returned shape \(5, 3\), expected \(Tq, Tk\) = \(3, 5\)"):
        head(Q, K, V)


def test_causal_attention_stays_causal():
    """CausalAttention ignores is_causal=False: it is always causal."""
    _, w = CausalAttention()(Q, K, V, is_causal=False)
    assert np.all(w[:, 0, 3:] == 0)

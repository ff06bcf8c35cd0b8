"""Module-level reliability: returned arrays belong to the caller, half-precision LayerNorm, NaN isolation
at padded positions, and degenerate settings refused with a message naming the argument.

Dimension letters: B batch, H heads, L sequence length, D model dim.
"""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.attention import MultiHeadAttention, PhysicsGuidedAttention, ScaledDotProductAttention
from attnkit.layers import Dropout, LayerNorm, TransformerEncoder, TransformerEncoderBlock
from attnkit.models import TokenTagger, TokenTaggerConfig
from attnkit.multi_head import multi_head_attention_forward, split_heads
from attnkit.simple import multi_head_attention
from attnkit.transformer_block import layer_norm

from head_cases import DV as HDV
from head_cases import HEADS, LK, LQ
from head_cases import B as HB
from head_cases import D as HD
from head_cases import H as HH
from helpers import make_rng, randn


def _grads(module) -> dict[str, np.ndarray]:
    return {name: np.array(g, copy=True) for name, g in module.named_gradients()}


def _assert_same_grads(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{what}: gradient {name}")


def _vandalise(*arrays) -> None:
    """Overwrite every returned array in place, as a careless caller might."""
    for arr in arrays:
        if arr is not None:
            arr[...] = 1e3


# --------------------------------------------------------------------------------------------------------
# Returned arrays never alias what backward reads
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("name", sorted(HEADS))
def test_editing_a_heads_output_and_weights_leaves_its_gradients_unchanged(name, need_weights):
    """Each head: gradients after editing the returned output and weights in place equal those without."""
    factory, per_head = HEADS[name]
    rng = make_rng(31, sorted(HEADS).index(name))
    lead = (HB, HH) if per_head else (HB,)
    q, k, v = randn(rng, *lead, LQ, HD), randn(rng, *lead, LK, HD), randn(rng, *lead, LK, HDV)
    G = randn(rng, *lead, LQ, HDV)
    results = []
    for vandalise in (False, True):
        head = factory(7)
        out, weights = head(q, k, v, need_weights=need_weights)
        if vandalise:
            _vandalise(out, weights)
        dq, dk, dv = head.backward(G)
        results.append(({"q": dq.copy(), "k": dk.copy(), "v": dv.copy()}, _grads(head)))
    _assert_same_grads(results[0][0], results[1][0], name)
    _assert_same_grads(results[0][1], results[1][1], name)


@pytest.mark.parametrize("need_weights", [True, False])
def test_editing_multi_head_attention_results_leaves_gradients_unchanged(need_weights):
    rng = make_rng(32)
    x, G = randn(rng, 2, 5, 8), randn(rng, 2, 5, 8)
    results = []
    for vandalise in (False, True):
        mha = MultiHeadAttention(8, 2, bias=True, rng=0)
        out, weights = mha(x, x, x, need_weights=need_weights, is_causal=True)
        if vandalise:
            _vandalise(out, weights)
        grads_in = mha.backward(G)
        results.append(({f"in{i}": g.copy() for i, g in enumerate(grads_in)}, _grads(mha)))
    _assert_same_grads(results[0][0], results[1][0], "MultiHeadAttention")
    _assert_same_grads(results[0][1], results[1][1], "MultiHeadAttention")


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("stack", [False, True])
def test_editing_encoder_results_leaves_gradients_unchanged(stack, norm_first):
    """Block and stack: outputs and per-layer weights returned to the caller are not what backward reads."""
    rng = make_rng(33, stack, norm_first)
    x, G = randn(rng, 2, 5, 8), randn(rng, 2, 5, 8)
    kpm = np.arange(5) < np.array([[5], [3]])  # (B, L)
    results = []
    for vandalise in (False, True):
        if stack:
            module = TransformerEncoder(2, 8, 2, 16, norm_first=norm_first, final_norm=False, rng=0)
        else:
            module = TransformerEncoderBlock(8, 2, 16, norm_first=norm_first, rng=0)
        out, weights = module(x, key_padding_mask=kpm, need_weights=True)
        if vandalise:
            _vandalise(out, *(weights if stack else [weights]))
        grad_x = module.backward(G)
        results.append(({"x": grad_x.copy()}, _grads(module)))
    _assert_same_grads(results[0][0], results[1][0], "encoder")
    _assert_same_grads(results[0][1], results[1][1], "encoder")


def test_editing_token_tagger_results_leaves_gradients_unchanged():
    ids = make_rng(34).integers(0, 10, size=(3, 6))
    G = randn(make_rng(35), 3, 6, 10)
    results = []
    for vandalise in (False, True):
        model = TokenTagger(TokenTaggerConfig(10, 10, 8, d_model=8, num_heads=2), rng=0)
        logits, weights = model(ids, need_weights=True)
        if vandalise:
            _vandalise(logits, *weights)
        model.backward(G)
        results.append(_grads(model))
    _assert_same_grads(results[0], results[1], "TokenTagger")


# --------------------------------------------------------------------------------------------------------
# float16 LayerNorm: statistics in float32
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("centre", [0.0, 300.0, 3000.0])
def test_float16_layer_norm_computes_its_statistics_in_float32(centre):
    """Activations far above 256 overflowed the float16 variance; the result must match float64 to fp16 rounding."""
    rng = make_rng(36)
    x64 = centre + 40.0 * rng.standard_normal((4, 7, 64))
    x16 = x64.astype(np.float16)
    ln = LayerNorm(64)
    y16 = ln(x16)
    assert y16.dtype == np.float16
    exact = LayerNorm(64)(x16.astype(np.float64))
    assert np.max(np.abs(y16.astype(np.float64) - exact)) < 1e-2  # float16 keeps ~3 digits of values ~ 2
    g16 = randn(rng, 4, 7, 64).astype(np.float16)
    grad_x = ln.backward(g16)
    assert grad_x.dtype == np.float16 and np.all(np.isfinite(grad_x))
    ref = LayerNorm(64)
    ref(x16.astype(np.float64))
    exact_grad = ref.backward(g16.astype(np.float64))
    scale = np.max(np.abs(exact_grad))
    assert np.max(np.abs(grad_x.astype(np.float64) - exact_grad)) < 1e-2 * scale
    np.testing.assert_allclose(ln.grads["gamma"], ref.grads["gamma"], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(layer_norm(x16, np.ones(64, np.float16), np.zeros(64, np.float16)).astype(np.float64),
                               exact, atol=1e-2)


# --------------------------------------------------------------------------------------------------------
# NaN / inf at padded positions reach neither real outputs nor any gradient
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("stack", [False, True])
def test_nan_and_inf_at_padded_positions_stay_out_of_real_outputs_and_all_gradients(stack, norm_first):
    rng = make_rng(37, stack, norm_first)
    B, L, D = 3, 6, 8
    kpm = np.arange(L) < np.array([[L], [4], [2]])  # (B, L), True = real token
    real = kpm[..., None]  # (B, L, 1)
    finite = randn(rng, B, L, D)
    poisoned = finite.copy()
    poisoned[~kpm] = np.nan
    poisoned[2, 5, ::2] = np.inf
    poisoned[1, 4, 1] = -np.inf
    G = np.where(real, randn(rng, B, L, D), 0.0)  # the loss reads real positions only

    def run(x, grad):
        module = (TransformerEncoder(2, D, 2, 16, norm_first=norm_first, rng=0) if stack
                  else TransformerEncoderBlock(D, 2, 16, norm_first=norm_first, attention_bias=True, rng=0))
        out = module(x, key_padding_mask=kpm)
        return out, module.backward(grad), _grads(module)

    out_ref, gx_ref, grads_ref = run(finite, G)
    out, gx, grads = run(poisoned, G)
    np.testing.assert_allclose(out[kpm], out_ref[kpm], rtol=1e-12, atol=1e-12)
    assert np.all(np.isfinite(gx))
    np.testing.assert_allclose(gx[kpm], gx_ref[kpm], rtol=1e-10, atol=1e-12)
    assert np.all(gx[~kpm] == 0)  # padded inputs influence nothing the loss reads
    for name in grads:
        assert np.all(np.isfinite(grads[name])), name
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-9, atol=1e-12, err_msg=name)
    # A loss that also reads padded positions still gets finite gradients everywhere.
    _, gx_all, grads_all = run(poisoned, randn(rng, B, L, D))
    assert np.all(np.isfinite(gx_all)) and all(np.all(np.isfinite(g)) for g in grads_all.values())


# --------------------------------------------------------------------------------------------------------
# Degenerate settings: ValueError naming the argument
# --------------------------------------------------------------------------------------------------------
DEGENERATE = {
    "mha_d_model_below_heads": (lambda: MultiHeadAttention(2, 4), "num_heads"),
    "mha_not_divisible": (lambda: MultiHeadAttention(10, 4), "num_heads"),
    "block_d_model_below_heads": (lambda: TransformerEncoderBlock(3, 4), "num_heads"),
    "split_heads_zero_features": (lambda: split_heads(np.zeros((2, 3, 0)), 2), "num_heads"),
    "functional_mha_zero_features": (lambda: multi_head_attention_forward(
        *(np.zeros((1, 2, 0)),) * 3, *(np.zeros((0, 0)),) * 4, num_heads=2), "num_heads"),
    "simple_mha_zero_features": (lambda: multi_head_attention(np.zeros((2, 0)), np.zeros((2, 0)), np.zeros((2, 0)), 2),
                                 "num_heads"),
    "layer_norm_eps_zero": (lambda: LayerNorm(4, eps=0.0), "eps"),
    "layer_norm_eps_negative": (lambda: LayerNorm(4, eps=-1e-5), "eps"),
    "layer_norm_eps_nan": (lambda: LayerNorm(4, eps=float("nan")), "eps"),
    "layer_norm_eps_inf": (lambda: LayerNorm(4, eps=float("inf")), "eps"),
    "block_eps_zero": (lambda: TransformerEncoderBlock(4, 2, eps=0.0), "eps"),
    "functional_layer_norm_eps_nan": (lambda: layer_norm(np.ones((2, 4)), np.ones(4), np.zeros(4), eps=np.nan),
                                      "eps"),
    "physics_strength_nan": (lambda: PhysicsGuidedAttention(strength_init=float("nan")), "strength_init"),
    "physics_strength_inf_per_head": (lambda: PhysicsGuidedAttention(strength_init=[1.0, np.inf], num_heads=2),
                                      "strength_init"),
    "physics_length_scale_nan": (lambda: PhysicsGuidedAttention(length_scale=float("nan")), "length_scale"),
    "physics_length_scale_inf": (lambda: PhysicsGuidedAttention(length_scale=float("inf")), "length_scale"),
    "physics_length_scale_zero": (lambda: PhysicsGuidedAttention(length_scale=0.0), "length_scale"),
    "dropout_nan": (lambda: Dropout(float("nan")), "p"),
    "head_dropout_nan": (lambda: ScaledDotProductAttention(dropout=float("nan")), "dropout"),
    "head_scale_nan": (lambda: ScaledDotProductAttention(scale=float("nan")), "scale"),
}


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_degenerate_settings_raise_value_error_naming_the_argument(case):
    build, argument = DEGENERATE[case]
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        build()


def test_editing_bert_hidden_states_leaves_gradients_unchanged():
    """Every returned hidden state but the last is some block's cached input: the caller gets copies."""
    from attnkit.pretrained.bert import BertConfig, BertEncoder

    cfg = BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=16, max_position_embeddings=10)
    ids = np.array([[1, 5, 7, 2], [1, 9, 2, 0]])
    G = randn(make_rng(39), 2, 4, 8)
    results = []
    for vandalise in (False, True):
        model = BertEncoder(cfg, rng=0)
        states = model(ids, attention_mask=ids > 0, output_hidden_states=True)
        if vandalise:
            _vandalise(*states)
        model.backward(G)
        results.append(_grads(model))
    _assert_same_grads(results[0], results[1], "BertEncoder")

"""A NaN or inf at a key some queries may not see (causal or per-query mask) never reaches those queries.

Each case puts a non-finite value in k, v or both at one key and compares, bit for bit, the rows and query
gradients of the queries that cannot see that key with the same run holding a finite value there.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit.flex as F
from attnkit.kernels._masked_product import zero_safe_matmul
from attnkit.kernels.reference import attention_backward, attention_forward
from attnkit.kernels.tiled import flash_attention_backward, flash_attention_forward
from attnkit.models import CausalLM, DecoderConfig, MLPConfig

B, H, L, D = 2, 3, 11, 4
KEY = 7  # the poisoned key; under the causal mask queries 0..6 cannot see it

# rows that do see the poisoned key are NaN or inf, as they must be: that arithmetic may warn
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning",
                                        "ignore:overflow:RuntimeWarning")


def _inputs(dtype):
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((B, H, L, D)).astype(dtype) for _ in range(4))
    return q, k, v, g


def _poison(k, v, where, value):
    k, v = k.copy(), v.copy()
    if "k" in where:
        k[1, 2, KEY, 1] = value
    if "v" in where:
        v[0, 1, KEY, 3] = value
    return k, v


def _per_query_mask():
    """(L, L) bool: every query sees some keys; key KEY is seen by the odd queries only."""
    rng = np.random.default_rng(9)
    mask = rng.random((L, L)) < 0.6
    mask[:, 0] = True
    mask[:, KEY] = np.arange(L) % 2 == 1
    return mask


def _run(kernel, q, k, v, g, mask, causal):
    if kernel == "reference":
        out, _, ctx = attention_forward(q, k, v, mask=mask, causal=causal)
        grads = attention_backward(g, ctx)
    else:
        out, _, ctx = flash_attention_forward(q, k, v, mask=mask, causal=causal, block_q=4, block_k=4,
                                              num_threads=int(kernel[-1]))
        grads = flash_attention_backward(g, ctx)
    return out, grads[0]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["k", "v", "kv"])
@pytest.mark.parametrize("masking", ["causal", "per-query"])
@pytest.mark.parametrize("kernel", ["reference", "tiled1", "tiled2"])
def test_a_key_a_query_cannot_see_does_not_change_its_output_or_gradient(kernel, masking, where, value, dtype):
    q, k, v, g = _inputs(dtype)
    causal = masking == "causal"
    mask = None if causal else _per_query_mask()
    blind = np.arange(KEY) if causal else np.flatnonzero(~mask[:, KEY])  # queries that cannot see the key
    out, dq = _run(kernel, q, k, v, g, mask, causal)
    k_bad, v_bad = _poison(k, v, where, value)
    out_bad, dq_bad = _run(kernel, q, k_bad, v_bad, g, mask, causal)
    np.testing.assert_array_equal(out_bad[..., blind, :], out[..., blind, :])
    np.testing.assert_array_equal(dq_bad[..., blind, :], dq[..., blind, :])
    assert np.isfinite(out_bad[..., blind, :]).all()
    seeing = np.setdiff1d(np.arange(KEY, L) if causal else np.flatnonzero(mask[:, KEY]), [])
    if value != -np.inf or "v" in where:  # a -inf key score is a zero weight, as in the reference
        head = (1, 2) if where == "k" else (0, 1)
        assert not np.isfinite(out_bad[head][seeing]).all()  # the queries that see it are not finite


@pytest.mark.parametrize("kernel", ["reference", "tiled"])
@pytest.mark.parametrize("mod", [None, "softcap", "alibi", "relative"])
@pytest.mark.parametrize("where", ["k", "v", "kv"])
def test_flex_attention_keeps_masked_non_finite_keys_out(kernel, mod, where):
    q, k, v, g = _inputs(np.float64)
    mods = {None: None, "softcap": F.softcap(3.0), "alibi": F.alibi(F.alibi_slopes(H)),
            "relative": F.relative_position_bias(H, 8, 16, seed=1)}

    def run(k, v):
        score_mod = mods[mod]
        block_mask = F.create_block_mask(F.causal_mask, None, None, L, L, block_size=4)
        out, ctx = F.flex_attention(q, k, v, score_mod, block_mask, kernel=kernel)
        grads = F.flex_attention_backward(g, ctx)
        return out, grads[0]

    out, dq = run(k, v)
    out_bad, dq_bad = run(*_poison(k, v, where, np.nan))
    np.testing.assert_array_equal(out_bad[..., :KEY, :], out[..., :KEY, :])
    np.testing.assert_array_equal(dq_bad[..., :KEY, :], dq[..., :KEY, :])
    head = (1, 2) if where == "k" else (0, 1)
    assert np.isnan(out_bad[head][KEY:]).any()  # the rows that see the NaN are NaN, not zero


def test_zero_safe_matmul_keeps_zero_weights_at_zero_and_propagates_the_rest():
    a = np.array([[0.5, 0.0, 0.5], [0.25, 0.5, 0.25]])
    b = np.array([[1.0, 2.0], [np.nan, np.inf], [3.0, 4.0]])
    out = zero_safe_matmul(a, b)
    np.testing.assert_array_equal(out[0], a[0] @ np.nan_to_num(b))
    assert np.isnan(out[1, 0]) and out[1, 1] == np.inf


def test_a_cached_decode_equals_the_full_forward_with_nan_in_a_later_hidden_state():
    config = DecoderConfig(family="llama", vocab_size=23, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=4, mlp=MLPConfig(24), tie_word_embeddings=False)
    lm = CausalLM(config, rng=3).astype(np.float64)
    poisoned_token = 11
    ids = np.array([[3, 5, 1, 8, poisoned_token, 2, 9]])  # (1, 7)
    before = lm(ids)  # (1, 7, V)
    lm.embed.weight[poisoned_token] = np.nan  # every hidden state at position 4 is NaN, from the first layer on
    full = lm(ids)  # (1, 7, V)
    cache = lm.new_cache(1)
    steps = np.concatenate([lm(ids[:, t:t + 1], cache=cache) for t in range(4)], axis=1)  # (1, 4, V)
    np.testing.assert_array_equal(full[:, :4], before[:, :4])  # positions before the NaN: as if it were finite
    np.testing.assert_allclose(full[:, :4], steps, rtol=1e-12, atol=1e-12)
    assert np.isnan(full[:, 4:]).all()


@pytest.mark.parametrize("where", ["k", "v", "kv"])
@pytest.mark.parametrize("masking", ["causal", "per-query"])
def test_additive_attention_keeps_masked_non_finite_keys_out(masking, where):
    from attnkit.kernels.reference import additive_backward, additive_forward

    q, k, v, g = _inputs(np.float64)
    rng = np.random.default_rng(2)
    w_q, w_k, w_v = rng.standard_normal((D, 5)), rng.standard_normal((D, 5)), rng.standard_normal(5)
    mask = np.tril(np.ones((L, L), bool)) if masking == "causal" else _per_query_mask()
    blind = np.flatnonzero(~mask[:, KEY])

    def run(k, v):
        out, weights, hidden = additive_forward(q, k, v, w_q, w_k, w_v, mask)
        return out, additive_backward(g, q, k, v, w_q, w_k, w_v, weights, hidden)[0]

    out, dq = run(k, v)
    out_bad, dq_bad = run(*_poison(k, v, where, np.nan))
    np.testing.assert_array_equal(out_bad[..., blind, :], out[..., blind, :])
    np.testing.assert_array_equal(dq_bad[..., blind, :], dq[..., blind, :])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(2, 9), block=st.integers(1, 5),
       value=st.sampled_from([np.nan, np.inf, -np.inf]), where=st.sampled_from(["k", "v", "kv"]))
def test_any_masked_non_finite_key_is_invisible_on_both_kernels(seed, length, block, value, where):
    """Random per-query masks, key positions, lengths and tiles: the queries that cannot see the poisoned key
    get the same bits as with a finite value there, forward and query gradient, on both kernels."""
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal((2, length, 3)) for _ in range(4))
    mask = rng.random((length, length)) < 0.5
    key = int(rng.integers(length))
    blind = np.flatnonzero(~mask[:, key])
    k_bad, v_bad = k.copy(), v.copy()
    if "k" in where:
        k_bad[int(rng.integers(2)), key, int(rng.integers(3))] = value
    if "v" in where:
        v_bad[int(rng.integers(2)), key, int(rng.integers(3))] = value
    for run in (lambda k, v: _reference(q, k, v, g, mask), lambda k, v: _tiled(q, k, v, g, mask, block)):
        out, dq = run(k, v)
        out_bad, dq_bad = run(k_bad, v_bad)
        np.testing.assert_array_equal(out_bad[..., blind, :], out[..., blind, :])
        np.testing.assert_array_equal(dq_bad[..., blind, :], dq[..., blind, :])


def _reference(q, k, v, g, mask):
    out, _, ctx = attention_forward(q, k, v, mask=mask)
    return out, attention_backward(g, ctx)[0]


def _tiled(q, k, v, g, mask, block):
    out, _, ctx = flash_attention_forward(q, k, v, mask=mask, block_q=block, block_k=block, num_threads=1)
    return out, flash_attention_backward(g, ctx)[0]

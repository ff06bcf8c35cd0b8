"""``MultiHeadAttention`` and its heads run through :func:`attnkit.flex.flex_attention`, the one front door, and
give what the attention kernels give when called directly on the projected heads (the path before), forward
and backward, with and without weights, masks, causal alignment and dropout.

Reference: :func:`attnkit.kernels.attention_forward` on the same (B, H, L, Dh) heads, float64, tolerance 1e-12
(the same kernel runs; only the order of a few additions may differ).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

from attnkit import kernels
from attnkit.attention import LearnedBiasAttention, MultiHeadAttention
from attnkit.flex import FlexAttentionContext
from attnkit.kernels.heads import merge_heads, split_heads

from helpers import make_rng, randn

B, LQ, LK, E, H = 2, 5, 7, 8, 2


def _by_kernels(mha, query, key, value, mask, is_causal, need_weights, grad, dropout_seed=None):
    """The projections, then the attention kernel on (B, H, L, Dh) heads, then W_O; and the input gradients."""
    q, k, v = (split_heads(x @ w, H) for x, w in ((query, mha.W_Q), (key, mha.W_K), (value, mha.W_V)))
    p = mha.attention.dropout if dropout_seed is not None else 0.0
    heads, weights, ctx = kernels.attention_forward(q, k, v, mask=mask, causal=is_causal, need_weights=need_weights,
                                                    dropout_p=p, dropout_seed=dropout_seed)  # (B, H, Lq, Dh)
    out = merge_heads(heads) @ mha.W_O  # (B, Lq, E)
    d_heads = split_heads(grad @ mha.W_O.T, H)  # (B, H, Lq, Dh)
    dq, dk, dv, _ = kernels.attention_backward(d_heads, ctx)
    grads = tuple(merge_heads(d) @ w.T for d, w in ((dq, mha.W_Q), (dk, mha.W_K), (dv, mha.W_V)))
    return out, weights, grads


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masking", ["none", "attn_mask", "padding", "causal", "all"])
def test_multi_head_attention_through_flex_equals_the_kernels_called_directly(need_weights, masking):
    rng = make_rng(1, len(masking), need_weights)
    mha = MultiHeadAttention(E, H, rng=3)
    query, key, value = randn(rng, B, LQ, E), randn(rng, B, LK, E), randn(rng, B, LK, E)
    grad = randn(rng, B, LQ, E)
    attn_mask = rng.random((LQ, LK)) < 0.7 if masking in ("attn_mask", "all") else None
    kpm = np.ones((B, LK), bool) if masking in ("padding", "all") else None
    if kpm is not None:
        kpm[1, :2] = False
    is_causal = masking in ("causal", "all")
    out, weights = mha(query, key, value, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=need_weights,
                       is_causal=is_causal)
    ctx = mha.attention.saved_tensors[0]
    assert isinstance(ctx, FlexAttentionContext) and ctx.kernel == ("reference" if need_weights else "tiled")
    grads = mha.backward(grad)
    mask = attn_mask
    if kpm is not None:
        pad = kpm[:, None, None, :]  # (B, 1, 1, Lk)
        mask = pad if mask is None else mask & pad
    want_out, want_weights, want_grads = _by_kernels(mha, query, key, value, mask, is_causal, need_weights, grad)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    if need_weights:
        np.testing.assert_allclose(weights, want_weights, rtol=0, atol=1e-12)
    else:
        assert weights is None
    for got, want, name in zip(grads, want_grads, ("query", "key", "value")):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_through_flex_drops_what_the_kernels_drop_with_the_same_seed(need_weights):
    rng = make_rng(2)
    mha = MultiHeadAttention(E, H, dropout=0.3, rng=4)
    x, grad = randn(rng, B, LQ, E), randn(rng, B, LQ, E)
    seed = int(copy.deepcopy(mha.attention._rng).integers(2**63))  # the seed the head draws next
    out, _ = mha(x, x, x, need_weights=need_weights, is_causal=True)
    grads = mha.backward(grad)
    want_out, _, want_grads = _by_kernels(mha, x, x, x, None, True, need_weights, grad, dropout_seed=seed)
    np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    mha.eval()
    plain, _ = mha(x, x, x, need_weights=need_weights, is_causal=True)
    assert not np.allclose(plain, out)  # training dropped weights; eval mode does not


def test_one_decoding_step_runs_on_the_reference_kernel_by_the_one_rule():
    """``kernel="auto"``: one query row forms its scores (the reference kernel) even without the weights."""
    head = LearnedBiasAttention(H, mode="alibi", bidirectional=False)
    rng = make_rng(3)
    q, k, v = randn(rng, B, H, 1, 4), randn(rng, B, H, LK, 4), randn(rng, B, H, LK, 4)
    out, weights = head(q, k, v, is_causal=True, need_weights=False)
    assert weights is None and head.saved_tensors[0].kernel == "reference"
    head(randn(rng, B, H, 3, 4), k, v, is_causal=True, need_weights=False)
    assert head.saved_tensors[0].kernel == "tiled"


def test_a_head_s_modifier_shares_the_head_s_parameter_and_gradient_arrays():
    for mode, name, key in (("t5", "rel_bias", "table"), ("alibi", "slopes", "slopes")):
        head = LearnedBiasAttention(3, mode=mode, num_buckets=8, max_distance=12)
        mod = head.score_mod_for(4, 9)
        assert mod.params[key] is head._parameters[name] and mod.grads[key] is head.grads[name]
        assert mod.offset == 5
    assert LearnedBiasAttention(3, num_buckets=8, max_distance=12).rel_bias.shape == (8, 3)  # (NB, H)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_the_tiled_route_matches_torch_multihead_attention(dtype, tol):
    """Without the weights (the tiled kernel through flex): torch.nn.MultiheadAttention's output and input
    gradients, causal with padded keys, float64 to 1e-12 and float32 to 2e-5 (relative to the largest entry:
    float32 rounding of sums of ~E terms)."""
    import torch

    rng = make_rng(9)
    mha = MultiHeadAttention(E, H, rng=5)
    x, grad = randn(rng, B, LK, E, dtype=dtype), randn(rng, B, LK, E, dtype=dtype)
    kpm = np.ones((B, LK), bool)
    kpm[0, -2:] = False  # (B, Lk) padding at the end of row 0: no query loses every key
    out, weights = mha(x, x, x, key_padding_mask=kpm, is_causal=True, need_weights=False)
    assert weights is None and mha.attention.saved_tensors[0].kernel == "tiled"
    grad_x = sum(mha.backward(grad))
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    ref = torch.nn.MultiheadAttention(E, H, bias=False, batch_first=True, dtype=tdtype)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.from_numpy(np.concatenate([mha.W_Q.T, mha.W_K.T, mha.W_V.T])))
        ref.out_proj.weight.copy_(torch.from_numpy(mha.W_O.T.copy()))
    tx = torch.from_numpy(x).requires_grad_(True)
    causal = torch.from_numpy(~np.tril(np.ones((LK, LK), bool)))  # torch: True = not allowed
    t_out, _ = ref(tx, tx, tx, key_padding_mask=torch.from_numpy(~kpm), attn_mask=causal, need_weights=False)
    t_out.backward(torch.from_numpy(grad))
    for ours, theirs in ((out, t_out.detach().numpy()), (grad_x, tx.grad.numpy())):
        assert ours.dtype == dtype
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=tol * np.abs(theirs).max())

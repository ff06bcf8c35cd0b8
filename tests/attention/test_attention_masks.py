"""The ``Attention`` module (0/1 or boolean masks (B, Lk), (B, 1, Lk), (B, Lq, Lk), a future mask) against
``torch.nn.functional.scaled_dot_product_attention`` (float64, 1e-10).

Dimension letters: B batch, Lq/Lk query/key length, D query/key features, Dv value features.
Our masks: ``True``/1 = may attend, the same polarity as F.scaled_dot_product_attention's boolean mask. The
future mask is bottom-right aligned (query i sees keys ``j <= i + Lk - Lq``); torch's ``is_causal`` is
top-left aligned, so torch gets the future mask written out explicitly.
"""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.attention import Attention, MultiHeadAttention, ScaledDotProductAttention

from helpers import assert_close_rel, make_rng, randn, to_numpy, to_torch, torch_masked_attention, torch_sdpa

B, D, DV = 2, 4, 3
MASK_SHAPES = ["none", "(B, Lk)", "(B, 1, Lk)", "(B, Lq, Lk)"]


def _attention_module_mask(shape: str, rng, seq_q: int, seq_k: int):
    """A mask of a shape ``Attention`` reads for 3-D inputs, key 0 always allowed (no fully masked query)."""
    if shape == "none":
        return None
    if shape == "(B, Lq, Lk)":
        m = rng.random((B, seq_q, seq_k)) < 0.5  # (B, Lq, Lk)
        m[..., 0] = True
        return m
    m = np.arange(seq_k)[None, :] < rng.integers(1, seq_k + 1, size=B)[:, None]  # (B, Lk)
    return m if shape == "(B, Lk)" else m[:, None, :]  # (B, 1, Lk)


def _explicit_mask(mask, shape: str, future: bool, seq_q: int, seq_k: int):
    """The (B, Lq, Lk) mask torch gets: the mask as ``Attention`` reads it, plus a bottom-right future mask."""
    full = np.ones((B, seq_q, seq_k), bool)  # (B, Lq, Lk)
    if mask is not None:
        full &= (mask[:, None, :] if shape == "(B, Lk)" else mask).astype(bool)
    if future:
        full &= np.tril(np.ones((seq_q, seq_k), bool), k=seq_k - seq_q)
    return full


@pytest.mark.parametrize("seqs", [(3, 5), (4, 4), (1, 6)], ids=["Lq<Lk", "Lq=Lk", "Lq=1"])
@pytest.mark.parametrize("future", [False, True], ids=["", "future"])
@pytest.mark.parametrize("shape,as_int", [(s, False) for s in MASK_SHAPES] + [(s, True) for s in MASK_SHAPES[1:]])
def test_attention_matches_torch_sdpa(shape, as_int, future, seqs):
    """Output and gradients of q, k, v equal torch's for each mask shape ``Attention`` reads (bool or 0/1 integers),
    with and without the future mask."""
    seq_q, seq_k = seqs
    rng = make_rng(40, MASK_SHAPES.index(shape), future, as_int, seq_q)
    q, k, v = randn(rng, B, seq_q, D), randn(rng, B, seq_k, D), randn(rng, B, seq_k, DV)
    mask = _attention_module_mask(shape, rng, seq_q, seq_k)
    if as_int:
        mask = mask.astype(np.int64)
    G = randn(rng, B, seq_q, DV)

    attn = Attention(future_mask=future)
    out, w = attn(q, k, v, mask=mask)
    dq, dk, dv = attn.backward(G)
    t_out, t_dq, t_dk, t_dv = torch_sdpa(q, k, v, _explicit_mask(mask, shape, future, seq_q, seq_k), G)

    for what, ours, theirs in (("out", out, t_out), ("dq", dq, t_dq), ("dk", dk, t_dk), ("dv", dv, t_dv)):
        assert_close_rel(ours, theirs, np.float64, what)
    assert w.shape == (B, seq_q, seq_k)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=0, atol=1e-12)


def test_per_call_is_causal_equals_future_mask():
    """``Attention()(..., is_causal=True)`` is ``Attention(future_mask=True)``."""
    rng = make_rng(41)
    q, k, v = randn(rng, B, 3, D), randn(rng, B, 6, D), randn(rng, B, 6, DV)
    a, b = Attention(future_mask=True)(q, k, v), Attention()(q, k, v, is_causal=True)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_2d_mask_is_key_padding_even_when_batch_equals_seq_q():
    """With B == Lq a 2-D mask could pass as (Lq, Lk); it is always read as (B, Lk)."""
    rng = make_rng(42)
    batch, seq_q, seq_k = 3, 3, 4
    q, k, v = randn(rng, batch, seq_q, D), randn(rng, batch, seq_k, D), randn(rng, batch, seq_k, DV)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 1]], bool)  # (B, Lk)
    out, w = Attention()(q, k, v, mask=mask)
    out_pad, w_pad = Attention()(q, k, v, mask=mask[:, None, :])
    out_lq, _ = Attention()(q, k, v, mask=mask[None])  # the (Lq, Lk) reading
    np.testing.assert_array_equal(out, out_pad)
    np.testing.assert_array_equal(w, w_pad)
    assert not np.allclose(out, out_lq)


def test_fully_masked_queries_get_zeros_and_match_explicit_torch():
    """A query whose (B, Lq, Lk) mask allows nothing: zero weights, output and gradient, never NaN."""
    rng = make_rng(43)
    q, k, v = randn(rng, B, 4, D), randn(rng, B, 5, D), randn(rng, B, 5, DV)
    mask = rng.random((B, 4, 5)) < 0.6  # (B, Lq, Lk)
    mask[0, 1] = False
    mask[1, 3] = False
    mask[:, [0, 2], 0] = True
    G = randn(rng, B, 4, DV)
    attn = Attention(future_mask=True)
    out, w = attn(q, k, v, mask=mask)
    dq, dk, dv = attn.backward(G)
    assert np.all(w[0, 1] == 0) and np.all(out[0, 1] == 0) and np.all(dq[0, 1] == 0)

    tq, tk, tv = to_torch(q, True), to_torch(k, True), to_torch(v, True)
    t_out, t_w = torch_masked_attention(tq, tk, tv, _explicit_mask(mask, "(B, Lq, Lk)", True, 4, 5))
    t_out.backward(torch.from_numpy(G))
    for what, ours, theirs in (("out", out, t_out), ("weights", w, t_w), ("dq", dq, tq.grad),
                               ("dk", dk, tk.grad), ("dv", dv, tv.grad)):
        assert_close_rel(ours, to_numpy(theirs), np.float64, what)


def test_padding_garbage_never_leaks():
    """NaN / Inf in padded key and value rows change nothing, and the caller's arrays are not modified."""
    rng = make_rng(44)
    q, k, v = randn(rng, B, 3, D), randn(rng, B, 5, D), randn(rng, B, 5, DV)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # (B, Lk) 0/1
    out_clean, _ = Attention()(q, k, v, mask=mask)
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[0, 3:] = np.nan
    v_bad[0, 3:] = np.inf
    k_bad[1, 4] = -np.inf
    copies = [a.copy() for a in (q, k_bad, v_bad, mask)]
    attn = Attention()
    out, w = attn(q, k_bad, v_bad, mask=mask)
    dq, dk, dv = attn.backward(np.ones_like(out))
    np.testing.assert_array_equal(out, out_clean)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    for before, after in zip(copies, (q, k_bad, v_bad, mask), strict=False):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_preserves_dtype(dtype):
    """float32 in, float32 out (weights and gradients too); the same for float64."""
    rng = make_rng(45)
    q, k, v = (randn(rng, B, n, f, dtype=dtype) for n, f in ((3, D), (5, D), (5, DV)))
    attn = Attention(future_mask=True)
    out, w = attn(q, k, v, mask=np.ones((B, 5), np.int8))
    grads = attn.backward(np.ones_like(out))
    assert out.dtype == w.dtype == dtype and all(g.dtype == dtype for g in grads)


def test_integer_inputs_become_float64():
    out, w = Attention()(np.ones((1, 2, 3), int), np.ones((1, 4, 3), int), np.arange(8).reshape(1, 4, 2))
    assert out.dtype == w.dtype == np.float64


def test_attention_head_in_mha_equals_default_head():
    """As the head of MultiHeadAttention (4-D inputs, plain broadcast masks) it equals the default head."""
    rng = make_rng(46)
    x, mem = randn(rng, B, 3, 8), randn(rng, B, 5, 8)
    attn_mask = np.tril(np.ones((3, 5), bool), k=2)  # (Lq, Lk)
    kpm = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    ours = MultiHeadAttention(8, 2, attention=Attention(), rng=3)
    default = MultiHeadAttention(8, 2, attention=ScaledDotProductAttention(), rng=3)
    a = ours(x, mem, mem, attn_mask=attn_mask, key_padding_mask=kpm)
    b = default(x, mem, mem, attn_mask=attn_mask, key_padding_mask=kpm)
    np.testing.assert_array_equal(a[0], b[0])
    G = randn(rng, B, 3, 8)
    for ga, gb in zip(ours.backward(G), default.backward(G), strict=False):
        np.testing.assert_array_equal(ga, gb)

"""``MultiHeadAttention`` (the module) against ``torch.nn.MultiheadAttention(batch_first=True)``, forward and
backward including every parameter gradient: self- and cross-attention (Lq != Lk), kdim/vdim (torch then
keeps separate q/k/v_proj_weight), bias, attn_mask (2-D and 4-D), key_padding_mask, causal; the positional
signature ``MultiHeadAttention(d_model, num_heads).forward(Q, K, V, mask)``; padding garbage (NaN/Inf in
padded keys and values) never reaching an output or a gradient; bottom-right-aligned causal masking.

Mask polarity: ours ``True`` = may attend / real token; torch's boolean ``attn_mask`` and
``key_padding_mask`` mean ``True`` = not allowed / padding, so they are inverted when handed to torch.
Per-head weights come from torch with ``average_attn_weights=False``. Configurations avoid query rows with
no allowed key (torch gives NaN there; ours gives zeros, tested elsewhere).
"""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.attention import MultiHeadAttention, ScaledDotProductAttention
from attnkit.decoding.cache import CrossAttentionCache, KVCache
from attnkit.kernels.reference import causal_mask
from attnkit.layers import TransformerEncoder
from attnkit.models import TokenTagger, TokenTaggerConfig
from attnkit.multi_head import MultiHeadAttention as MultiHeadAttentionFromMultiHead

from helpers import TORCH_DTYPE, assert_close_rel, group_scale, make_rng, randn, to_numpy, to_torch

DTYPES = [np.float64, np.float32]


def set_(param: torch.Tensor, value: np.ndarray) -> None:
    with torch.no_grad():
        param.copy_(torch.from_numpy(np.ascontiguousarray(value)))


def torch_mha_from(mha: MultiHeadAttention, dtype) -> torch.nn.MultiheadAttention:
    """torch module holding ``mha``'s weights (ours x @ W, torch x @ W.T)."""
    E, H = mha.embed_dim, mha.num_heads
    kdim = None if mha.kdim == E and mha.vdim == E else mha.kdim
    vdim = None if kdim is None else mha.vdim
    ref = torch.nn.MultiheadAttention(E, H, bias=mha.bias, batch_first=True, kdim=kdim, vdim=vdim,
                                      dtype=TORCH_DTYPE[np.dtype(dtype).type])
    W = {n: getattr(mha, n).astype(dtype) for n in ("W_Q", "W_K", "W_V", "W_O")}
    if ref._qkv_same_embed_dim:
        set_(ref.in_proj_weight, np.concatenate([W["W_Q"].T, W["W_K"].T, W["W_V"].T]))
    else:
        set_(ref.q_proj_weight, W["W_Q"].T)
        set_(ref.k_proj_weight, W["W_K"].T)
        set_(ref.v_proj_weight, W["W_V"].T)
    set_(ref.out_proj.weight, W["W_O"].T)
    if mha.bias:
        set_(ref.in_proj_bias, np.concatenate([mha.b_Q, mha.b_K, mha.b_V]).astype(dtype))
        set_(ref.out_proj.bias, mha.b_O.astype(dtype))
    return ref


def torch_mha_grads(ref: torch.nn.MultiheadAttention) -> dict:
    E = ref.embed_dim
    if ref._qkv_same_embed_dim:
        g = to_numpy(ref.in_proj_weight.grad)
        out = {"W_Q": g[:E].T, "W_K": g[E:2 * E].T, "W_V": g[2 * E:].T}
    else:
        out = {"W_Q": to_numpy(ref.q_proj_weight.grad).T, "W_K": to_numpy(ref.k_proj_weight.grad).T,
               "W_V": to_numpy(ref.v_proj_weight.grad).T}
    out["W_O"] = to_numpy(ref.out_proj.weight.grad).T
    if ref.in_proj_bias is not None:
        gb = to_numpy(ref.in_proj_bias.grad)
        out.update(b_Q=gb[:E], b_K=gb[E:2 * E], b_V=gb[2 * E:], b_O=to_numpy(ref.out_proj.bias.grad))
    return out


def make_masks(kind: str, rng, B: int, H: int, Lq: int, Lk: int):
    """(attn_mask, key_padding_mask, is_causal) in our polarity, every query row left with an allowed key."""
    attn_mask = kpm = None
    causal = False
    if kind in ("attn_mask", "attn_mask_4d"):
        shape = (Lq, Lk) if kind == "attn_mask" else (B, H, Lq, Lk)
        attn_mask = rng.random(shape) < 0.6
        attn_mask[..., 0] = True
    if kind in ("padding", "causal+padding"):
        kpm = np.arange(Lk)[None, :] < rng.integers(max(Lk - Lq, 0) + 1, Lk + 1, size=(B, 1))  # (B, Lk)
        kpm[:, : max(Lk - Lq, 0) + 1] = True
    if kind in ("causal", "causal+padding"):
        causal = True
    return attn_mask, kpm, causal


def torch_mask_args(attn_mask, kpm, causal, B, H, Lq, Lk) -> dict:
    """The same masks for torch: explicit (bottom-right-aligned causal included), inverted polarity."""
    allowed = None if attn_mask is None else np.broadcast_to(attn_mask, attn_mask.shape)
    if causal:
        allowed = causal_mask(Lq, Lk) if allowed is None else (allowed & causal_mask(Lq, Lk))
    args = {}
    if allowed is not None:
        if allowed.ndim == 4:
            allowed = allowed.reshape(B * H, Lq, Lk)
        args["attn_mask"] = torch.from_numpy(~allowed)
    if kpm is not None:
        args["key_padding_mask"] = torch.from_numpy(~kpm)
    return args


def run_mha_parity(dtype, *, B=2, H=2, E=8, Lq=5, Lk=5, kdim=None, vdim=None, bias=False, kind="none",
                   self_attention=False, seed=0) -> dict:
    rng = make_rng(seed)
    mha = MultiHeadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, rng=seed)
    if bias:
        for n in ("b_Q", "b_K", "b_V", "b_O"):
            setattr(mha, n, randn(rng, E))
    ek, ev = kdim or E, vdim or E
    query = randn(rng, B, Lq, E, dtype=dtype)
    key = query if self_attention else randn(rng, B, Lk, ek, dtype=dtype)
    value = query if self_attention else randn(rng, B, Lk, ev, dtype=dtype)
    G = randn(rng, B, Lq, E, dtype=dtype)
    attn_mask, kpm, causal = make_masks(kind, rng, B, H, Lq, Lk)

    ref = torch_mha_from(mha, dtype)
    tq = to_torch(query, True)
    tk, tv = (tq, tq) if self_attention else (to_torch(key, True), to_torch(value, True))
    t_out, t_w = ref(tq, tk, tv, need_weights=True, average_attn_weights=False,
                     **torch_mask_args(attn_mask, kpm, causal, B, H, Lq, Lk))
    t_out.backward(to_torch(G))

    out, w = mha(query, key, value, attn_mask=attn_mask, key_padding_mask=kpm, is_causal=causal)
    dq, dk, dv = mha.backward(G)
    assert out.dtype == dtype and w.dtype == dtype and dq.dtype == dtype
    results = {"output": assert_close_rel(out, to_numpy(t_out), dtype, "output"),
               "weights": assert_close_rel(w, to_numpy(t_w), dtype, "weights")}
    if self_attention:
        results["grad_x"] = assert_close_rel(dq + dk + dv, to_numpy(tq.grad), dtype, "grad_x")
    else:
        for name, ours, t in (("grad_query", dq, tq), ("grad_key", dk, tk), ("grad_value", dv, tv)):
            results[name] = assert_close_rel(ours, to_numpy(t.grad), dtype, name)
    theirs = torch_mha_grads(ref)
    assert set(theirs) == set(mha.grads)
    bias_scale = group_scale(*(theirs[n] for n in ("b_Q", "b_V", "b_O"))) if bias else None
    for name, g in mha.grads.items():
        # b_K's gradient is zero in exact arithmetic (a shift of every score of a query): compare on the
        # scale of the other bias gradients.
        scale = bias_scale if name == "b_K" else None
        results[name] = assert_close_rel(g, theirs[name], dtype, name, scale=scale)
    return results


KINDS = ["none", "attn_mask", "attn_mask_4d", "padding", "causal", "causal+padding"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_self_attention_matches_torch(dtype, bias, kind):
    run_mha_parity(dtype, bias=bias, kind=kind, self_attention=True, Lq=6, Lk=6, seed=1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("Lq,Lk", [(3, 7), (7, 7), (1, 4)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cross_attention_matches_torch(dtype, Lq, Lk, kind):
    run_mha_parity(dtype, Lq=Lq, Lk=Lk, kind=kind, bias=True, seed=2)


@pytest.mark.parametrize("kind", ["none", "padding", "causal"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kdim_vdim_match_torch(dtype, bias, kind):
    run_mha_parity(dtype, E=12, H=3, Lq=4, Lk=6, kdim=5, vdim=7, bias=bias, kind=kind, seed=3)


def test_cross_attention_longer_queries_than_keys_matches_torch():
    """Lq > Lk without causal masking (causal would leave the first queries with no key)."""
    run_mha_parity(np.float64, Lq=9, Lk=4, kind="attn_mask", bias=True, seed=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_d_model_num_heads_signature_with_positional_mask_matches_torch(dtype):
    """``MultiHeadAttention(d_model, num_heads)`` and ``forward(Q, K, V, mask)`` (mask positional, True = attend)."""
    assert MultiHeadAttentionFromMultiHead is MultiHeadAttention
    rng = make_rng(5)
    mha = MultiHeadAttentionFromMultiHead(8, 4)
    assert mha.d_model == 8 and mha.d_k == 2 and sorted(mha.get_params()) == ["W_K", "W_O", "W_Q", "W_V"]
    Q, K, V = randn(rng, 2, 3, 8, dtype=dtype), randn(rng, 2, 5, 8, dtype=dtype), randn(rng, 2, 5, 8, dtype=dtype)
    mask = rng.random((3, 5)) < 0.5
    mask[:, 0] = True
    G = randn(rng, 2, 3, 8, dtype=dtype)
    out, w = mha.forward(Q, K, V, mask)
    out_kw, _ = mha.forward(Q, K, V, mask=mask)
    assert np.array_equal(out, out_kw)
    dQ, dK, dV = mha.backward(G)
    ref = torch_mha_from(mha, dtype)
    tQ, tK, tV = to_torch(Q, True), to_torch(K, True), to_torch(V, True)
    t_out, t_w = ref(tQ, tK, tV, attn_mask=torch.from_numpy(~mask), average_attn_weights=False)
    t_out.backward(to_torch(G))
    assert_close_rel(out, to_numpy(t_out), dtype, "output")
    assert_close_rel(w, to_numpy(t_w), dtype, "weights")
    for name, ours, t in (("dQ", dQ, tQ), ("dK", dK, tK), ("dV", dV, tV)):
        assert_close_rel(ours, to_numpy(t.grad), dtype, name)
    for name, g in torch_mha_grads(ref).items():
        assert_close_rel(mha.grads[name], g, dtype, name)


# --------------------------------------------------------------------------------------------------------
# Padding garbage and causal alignment
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("garbage", [np.nan, np.inf, -np.inf, 1e308])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_padded_keys_never_influence_outputs_or_gradients(garbage, bias):
    rng = make_rng(6)
    B, Lq, Lk, E = 3, 4, 6, 8
    mha = MultiHeadAttention(E, 2, bias=bias, kdim=5, vdim=3, rng=0)
    query, G = randn(rng, B, Lq, E), randn(rng, B, Lq, E)
    key, value = randn(rng, B, Lk, 5), randn(rng, B, Lk, 3)
    kpm = np.arange(Lk)[None, :] < np.array([[6], [3], [1]])  # (B, Lk), True = real token
    clean_out, clean_w = mha(query, key, value, key_padding_mask=kpm, is_causal=False)
    clean_grads = mha.backward(G)
    clean_params = {n: g.copy() for n, g in mha.grads.items()}
    dirty_key, dirty_value = key.copy(), value.copy()
    dirty_key[~kpm] = garbage
    dirty_value[~kpm] = garbage
    mha.zero_grad()
    out, w = mha(query, dirty_key, dirty_value, key_padding_mask=kpm)
    grads = mha.backward(G)
    assert np.array_equal(out, clean_out) and np.array_equal(w, clean_w)
    assert np.all(w[np.broadcast_to(~kpm[:, None, None, :], w.shape)] == 0)
    for ours, clean in zip(grads, clean_grads, strict=False):
        assert np.all(np.isfinite(ours)) and np.array_equal(ours, clean)
    assert np.all(grads[1][~kpm] == 0) and np.all(grads[2][~kpm] == 0)
    for name, g in mha.grads.items():
        assert np.all(np.isfinite(g)) and np.array_equal(g, clean_params[name]), name
    # The caller's arrays are untouched.
    assert np.isnan(dirty_key[~kpm]).all() if np.isnan(garbage) else np.all(dirty_key[~kpm] == garbage)


def test_padded_tokens_never_influence_real_positions_of_a_model():
    """Whatever ids sit in padded positions, real positions' logits and every gradient are the same."""
    rng = make_rng(7)
    model = TokenTagger(TokenTaggerConfig(10, 10, 8, d_model=8, num_heads=2), rng=0)
    ids = rng.integers(0, 10, size=(3, 8))
    kpm = np.arange(8)[None, :] < np.array([[8], [5], [2]])
    G = randn(rng, 3, 8, 10) * kpm[..., None]  # the loss ignores padded positions
    results = []
    for fill in (0, 9):
        model.zero_grad()
        logits = model(np.where(kpm, ids, fill), key_padding_mask=kpm)
        model.backward(G)
        results.append((logits[kpm], {n: g.copy() for n, g in model.named_gradients()}))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for name, g in results[0][1].items():
        np.testing.assert_array_equal(g, results[1][1][name], err_msg=name)


def test_encoder_real_positions_ignore_nan_in_padded_positions():
    rng = make_rng(8)
    enc = TransformerEncoder(2, 8, 2, rng=0)
    x = randn(rng, 2, 5, 8)
    kpm = np.array([[True] * 5, [True, True, False, False, False]])
    clean = enc(x, key_padding_mask=kpm)
    dirty_x = x.copy()
    dirty_x[~kpm] = np.nan
    dirty = enc(dirty_x, key_padding_mask=kpm)
    assert np.isfinite(dirty[kpm]).all()
    # The encoder runs the tiled kernel, whose per-tile rescaling choices see every row of a tile, so a
    # NaN query row may change the rounding (not the value) of its neighbours: equal to float64 rounding.
    np.testing.assert_allclose(dirty[kpm], clean[kpm], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("Lq,Lk", [(3, 7), (1, 5), (4, 4), (6, 6)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_causal_is_bottom_right_aligned_and_equals_the_explicit_mask(dtype, Lq, Lk):
    rng = make_rng(9)
    mha = MultiHeadAttention(8, 2, bias=True, rng=1)
    q, k, v = randn(rng, 2, Lq, 8, dtype=dtype), randn(rng, 2, Lk, 8, dtype=dtype), randn(rng, 2, Lk, 8, dtype=dtype)
    G = randn(rng, 2, Lq, 8, dtype=dtype)
    explicit = np.tril(np.ones((Lq, Lk), bool), k=Lk - Lq)  # query i sees keys j <= i + Lk - Lq
    out_c, w_c = mha(q, k, v, is_causal=True)
    grads_c = mha.backward(G)
    out_m, w_m = mha(q, k, v, attn_mask=explicit)
    grads_m = mha.backward(G)
    np.testing.assert_array_equal(out_c, out_m)
    np.testing.assert_array_equal(w_c, w_m)
    for a, b in zip(grads_c, grads_m, strict=False):
        np.testing.assert_array_equal(a, b)
    assert np.all(w_c[..., ~explicit] == 0) and np.all(w_c[..., -1, :] > 0)  # the last query sees every key
    # and torch, given the same explicit mask, agrees
    ref = torch_mha_from(mha, dtype)
    t_out, _ = ref(to_torch(q), to_torch(k), to_torch(v), attn_mask=torch.from_numpy(~explicit))
    assert_close_rel(out_c, to_numpy(t_out), dtype, "output")


def test_head_must_be_a_base_attention():
    with pytest.raises(TypeError, match="BaseAttention"):
        MultiHeadAttention(8, 2, attention=lambda q, k, v: (q, None))
    with pytest.raises(TypeError, match="BaseAttention"):
        MultiHeadAttention(8, 2, attention=torch.nn.MultiheadAttention(8, 2))
    MultiHeadAttention(8, 2, attention=ScaledDotProductAttention())  # accepted


def test_cross_attention_through_a_cache_equals_the_forward():
    """The memory is projected on the first call and read from the cache after: the same output and weights."""
    rng = np.random.default_rng(7)
    mha = MultiHeadAttention(8, 2, kdim=6, vdim=5, bias=True, rng=0, layer_index=1)
    for _, p in mha.named_parameters():
        p[...] = rng.normal(size=p.shape)
    query, key, value = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 7, 6)), rng.normal(size=(2, 7, 5))
    mask = rng.random((2, 1, 3, 7)) < 0.7
    expected, expected_weights = mha(query, key, value, mask=mask)
    cache = CrossAttentionCache(num_layers=2)
    for _ in range(2):  # the first call projects the memory, the second reads it
        out, weights = mha(query, key, value, mask=mask, cache=cache)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(weights, expected_weights, rtol=1e-12, atol=1e-12)
    assert cache.stored(0) is None and cache.stored(1).keys.shape == (2, 2, 7, 4)
    with pytest.raises(RuntimeError, match="before forward"):
        mha.backward(np.ones_like(out))  # the cached path keeps nothing for a backward
    with pytest.raises(ValueError, match="key has 5 features, expected 6"):
        mha(query, value, value, cache=CrossAttentionCache(num_layers=2))


def test_self_attention_through_a_cache_equals_the_causal_forward():
    """New positions appended to a KVCache step by step give the rows of one causal forward, padding included."""
    rng = np.random.default_rng(8)
    mha = MultiHeadAttention(8, 2, bias=True, rng=0)
    x = rng.normal(size=(2, 5, 8))
    padding = np.array([[True] * 5, [False, True, True, True, True]])  # row 1 starts with a pad slot
    expected, expected_weights = mha(x, x, x, key_padding_mask=padding, is_causal=True)
    cache = KVCache(1, 2, 2, 4, np.float64)
    pieces = [mha(x[:, :2], x[:, :2], x[:, :2], key_padding_mask=padding[:, :2], is_causal=True, cache=cache)]
    pieces += [mha(x[:, t:t + 1], x[:, t:t + 1], x[:, t:t + 1], key_padding_mask=padding[:, :t + 1], is_causal=True,
                   cache=cache) for t in (2, 3, 4)]
    np.testing.assert_allclose(np.concatenate([out for out, _ in pieces], axis=1), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(pieces[-1][1], expected_weights[:, :, -1:], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x[:, :1], x[:, :1], x[:, :1], key_padding_mask=padding[:, :1], cache=cache)  # 6 cached keys now

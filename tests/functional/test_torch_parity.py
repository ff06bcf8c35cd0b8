"""PyTorch (CPU) as the independent reference, forward and backward.

- scaled_dot_product_attention vs torch.nn.functional.scaled_dot_product_attention (bool mask, True = attend);
- multi_head_attention_forward/backward and MultiHeadAttention vs torch.nn.MultiheadAttention(bias=False,
  batch_first=True) with the weights copied across (ours are applied as x @ W, torch's as x @ W.T), per-head
  weights included; torch's bool attn_mask means True = NOT allowed, so ours is inverted;
- layer_norm / layer_norm_backward vs torch.nn.LayerNorm(eps=1e-6);
- TransformerEncoderBlock vs torch.nn.TransformerEncoderLayer(norm_first=True, dropout=0, relu, eps=1e-6)
  with the attention biases zeroed: output, grad_x and every parameter gradient.

Agreement: 1e-10 in float64 and 1e-5 in float32, relative to the largest reference magnitude. Torch gives
NaN on rows whose mask allows no key: those rows are compared only where torch defines them, ours are
asserted to be exactly zero there, and gradients (which torch's NaN rows contaminate) are compared against
an explicit torch autograd composition with zero-weight rows instead.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

import torch
from attnkit.attention_core import scaled_dot_product_attention, scaled_dot_product_attention_backward
from attnkit.multi_head import MultiHeadAttention, multi_head_attention_backward, multi_head_attention_forward
from attnkit.transformer_block import TransformerEncoderBlock, layer_norm, layer_norm_backward

from helpers import (
    MASK_KINDS,
    TORCH_DTYPE,
    assert_close_rel,
    dead_rows,
    group_scale,
    make_mask,
    make_rng,
    randn,
    to_numpy,
    to_torch,
    torch_bool_mask_for_mha,
    torch_masked_attention,
    torch_sdpa,
)

DTYPES = [np.float64, np.float32]
BATCHES = [1, 2]
LENGTHS = [1, 7, 64]
HEADS = [1, 2, 4]
D_MODEL = 16
WEIGHT_NAMES = ("W_Q", "W_K", "W_V", "W_O")


def dtype_id(dt) -> str:
    return np.dtype(dt).name


def grid_seed(*parts) -> tuple[int, ...]:
    """Integers for make_rng from a mix of ints, strings and dtypes."""
    out = []
    for p in parts:
        if isinstance(p, (int, np.integer)):
            out.append(int(p))
        else:
            out.append(sum(ord(c) for c in str(np.dtype(p).name if isinstance(p, type) else p)))
    return tuple(out)


def assert_rows_match(ours, ref, dead, dtype, what, scale=None):
    """Compare query rows torch defines; rows with no allowed key must be exactly zero in ours."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    live = ~dead
    assert np.all(np.isfinite(ref[live])), f"{what}: torch undefined on a row that may attend"
    assert np.all(np.isfinite(ours)), f"{what}: ours has NaN/Inf"
    assert np.all(ours[dead] == 0), f"{what}: fully masked rows are not zero"
    return assert_close_rel(ours[live], ref[live], dtype, what, scale) if live.any() else 0.0


# --------------------------------------------------------------------------------------------------------
# Scaled dot-product attention
# --------------------------------------------------------------------------------------------------------
def check_sdpa_against_torch(dtype, lead, Lq, Lk, kind, Dk=8, Dv=5, seed=()):
    rng = make_rng(*seed)
    Q, K, V = (randn(rng, *lead, Lq, Dk, dtype=dtype), randn(rng, *lead, Lk, Dk, dtype=dtype),
               randn(rng, *lead, Lk, Dv, dtype=dtype))
    mask = make_mask(kind, rng, lead, Lq, Lk)
    G = randn(rng, *lead, Lq, Dv, dtype=dtype)

    out, w = scaled_dot_product_attention(Q, K, V, mask=mask)
    dQ, dK, dV = scaled_dot_product_attention_backward(G, Q, K, V, w)
    t_out, t_dQ, t_dK, t_dV = torch_sdpa(Q, K, V, mask, G)
    dead = dead_rows(mask, lead + (Lq, Lk))

    assert out.dtype == dtype and w.dtype == dtype and dQ.dtype == dtype
    assert_rows_match(out, t_out, dead, dtype, "output")
    gs = group_scale(t_dQ[~dead], t_dK, t_dV)  # the scale of the whole gradient
    assert_rows_match(dQ, t_dQ, dead, dtype, "grad_Q", gs)
    assert_close_rel(dK, t_dK, dtype, "grad_K", gs)
    assert_close_rel(dV, t_dV, dtype, "grad_V", gs)
    # The weights against an explicit torch softmax over the masked scores.
    _, t_w = torch_masked_attention(to_torch(Q), to_torch(K), to_torch(V), mask)
    assert_close_rel(w, to_numpy(t_w), dtype, "weights")
    assert np.all(w[dead] == 0)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sdpa_self_attention_matches_torch(dtype, B, L, H, kind):
    """Self-attention shapes (Lq = Lk) on (B, H, L, Dh): output and grads of Q, K, V match F.sdpa."""
    check_sdpa_against_torch(dtype, (B, H), L, L, kind, seed=grid_seed(1, dtype, B, L, H, kind))


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("Lq,Lk", [(1, 7), (7, 64), (64, 7), (7, 1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_sdpa_cross_attention_matches_torch(dtype, Lq, Lk, kind):
    """Cross-attention (Lq != Lk), 3-D (B, L, D) inputs: output and every gradient match F.sdpa."""
    check_sdpa_against_torch(dtype, (2,), Lq, Lk, kind, Dk=16, Dv=3, seed=grid_seed(2, dtype, Lq, Lk, kind))


# --------------------------------------------------------------------------------------------------------
# Multi-head attention
# --------------------------------------------------------------------------------------------------------
def torch_mha_module(W: dict, H: int, dtype) -> torch.nn.MultiheadAttention:
    """nn.MultiheadAttention without biases holding our weights (torch stores the transposes)."""
    D = W["W_Q"].shape[0]
    m = torch.nn.MultiheadAttention(D, H, bias=False, batch_first=True, dtype=TORCH_DTYPE[np.dtype(dtype).type])
    with torch.no_grad():
        m.in_proj_weight.copy_(to_torch(np.concatenate([W["W_Q"].T, W["W_K"].T, W["W_V"].T], axis=0)))
        m.out_proj.weight.copy_(to_torch(W["W_O"].T))
    return m


def torch_mha_grads(m: torch.nn.MultiheadAttention) -> dict[str, np.ndarray]:
    """Parameter gradients of nn.MultiheadAttention under our names and layout."""
    D = m.embed_dim
    g = to_numpy(m.in_proj_weight.grad)
    return {"W_Q": g[:D].T, "W_K": g[D:2 * D].T, "W_V": g[2 * D:].T, "W_O": to_numpy(m.out_proj.weight.grad).T}


def torch_manual_mha(Q, K, V, W, H, mask, G):
    """Explicit torch autograd MHA (x @ W, zero weights on fully masked rows): output and all grads."""
    t = {n: to_torch(a, True) for n, a in (("Q", Q), ("K", K), ("V", V), *W.items())}
    B, Lq, D = Q.shape
    Lk = K.shape[1]

    def heads(x, L):
        return x.reshape(B, L, H, D // H).transpose(1, 2)  # (B, H, L, Dh)

    q, k, v = heads(t["Q"] @ t["W_Q"], Lq), heads(t["K"] @ t["W_K"], Lk), heads(t["V"] @ t["W_V"], Lk)
    o, w = torch_masked_attention(q, k, v, mask)  # (B, H, Lq, Dh)
    out = o.transpose(1, 2).reshape(B, Lq, D) @ t["W_O"]  # (B, Lq, D)
    out.backward(to_torch(G))
    return to_numpy(out), to_numpy(w), {n: to_numpy(x.grad) for n, x in t.items()}


def mha_case(dtype, B, Lq, Lk, H, kind, seed):
    rng = make_rng(*seed)
    D = D_MODEL
    Q, K, V = randn(rng, B, Lq, D, dtype=dtype), randn(rng, B, Lk, D, dtype=dtype), randn(rng, B, Lk, D, dtype=dtype)
    W = {n: randn(rng, D, D, dtype=dtype, scale=D ** -0.5) for n in WEIGHT_NAMES}
    mask = make_mask(kind, rng, (B, H), Lq, Lk)
    G = randn(rng, B, Lq, D, dtype=dtype)
    return Q, K, V, W, mask, G


def torch_mha_reference(Q, K, V, W, H, mask, G, dtype):
    """nn.MultiheadAttention output, per-head weights and (when defined) every gradient."""
    B, Lq, _ = Q.shape
    Lk = K.shape[1]
    m = torch_mha_module(W, H, dtype)
    q, k, v = to_torch(Q, True), to_torch(K, True), to_torch(V, True)
    out, w = m(q, k, v, attn_mask=torch_bool_mask_for_mha(mask, B, H, Lq, Lk), need_weights=True,
               average_attn_weights=False)
    out.backward(to_torch(G))
    grads = {"Q": to_numpy(q.grad), "K": to_numpy(k.grad), "V": to_numpy(v.grad), **torch_mha_grads(m)}
    return to_numpy(out), to_numpy(w), grads


def check_mha_against_torch(ours_out, ours_w, ours_grads, Q, K, V, W, H, mask, G, dtype):
    B, Lq, D = Q.shape
    Lk = K.shape[1]
    t_out, t_w, t_grads = torch_mha_reference(Q, K, V, W, H, mask, G, dtype)
    dead = dead_rows(mask, (B, H, Lq, Lk))  # (B, H, Lq)
    dead_any_head = dead.any(axis=1)  # (B, Lq): torch's output row is NaN if any head is undefined
    assert ours_out.dtype == dtype or ours_out.dtype == np.float64
    assert_rows_match(ours_w, t_w, dead, dtype, "per-head weights")
    live = ~dead_any_head
    if live.any():
        assert_close_rel(ours_out[live], t_out[live], dtype, "output")
    if not dead.any():
        gs = group_scale(*t_grads.values())
        for name, g in t_grads.items():
            assert_close_rel(ours_grads[name], g, dtype, f"grad {name}", gs)
    else:
        # torch's NaN rows poison its gradients; use the explicit composition with zero-weight rows.
        m_out, m_w, m_grads = torch_manual_mha(Q, K, V, W, H, mask, G)
        assert_close_rel(ours_out, m_out, dtype, "output (explicit torch)")
        assert_close_rel(ours_w, m_w, dtype, "weights (explicit torch)")
        gs = group_scale(*m_grads.values())
        for name, g in m_grads.items():
            assert_close_rel(ours_grads[name], g, dtype, f"grad {name} (explicit torch)", gs)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_multi_head_functional_matches_torch(dtype, B, L, H, kind):
    """multi_head_attention_forward/backward equal nn.MultiheadAttention: output, per-head weights, all grads."""
    Q, K, V, W, mask, G = mha_case(dtype, B, L, L, H, kind, grid_seed(3, dtype, B, L, H, kind))
    out, cache = multi_head_attention_forward(Q, K, V, W["W_Q"], W["W_K"], W["W_V"], W["W_O"], H, mask=mask)
    dQ, dK, dV, dp = multi_head_attention_backward(G, cache)
    check_mha_against_torch(out, cache["weights"], {"Q": dQ, "K": dK, "V": dV, **dp}, Q, K, V, W, H, mask, G, dtype)
    dtypes = {n: g.dtype for n, g in (("output", out), ("Q", dQ), ("K", dK), ("V", dV), *dp.items())}
    assert all(d == dtype for d in dtypes.values()), f"dtypes with {np.dtype(dtype)} input: {dtypes}"


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("Lq,Lk", [(1, 7), (7, 64), (64, 7)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_multi_head_functional_cross_attention_matches_torch(dtype, Lq, Lk, kind):
    """Cross-attention (Lq != Lk) through multi_head_attention_forward/backward equals torch."""
    H = 4
    Q, K, V, W, mask, G = mha_case(dtype, 2, Lq, Lk, H, kind, grid_seed(4, dtype, Lq, Lk, kind))
    out, cache = multi_head_attention_forward(Q, K, V, W["W_Q"], W["W_K"], W["W_V"], W["W_O"], H, mask=mask)
    dQ, dK, dV, dp = multi_head_attention_backward(G, cache)
    check_mha_against_torch(out, cache["weights"], {"Q": dQ, "K": dK, "V": dV, **dp}, Q, K, V, W, H, mask, G, dtype)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (7, 7), (64, 64), (7, 64)])
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_multi_head_class_matches_torch(dtype, H, Lq, Lk, kind):
    """MultiHeadAttention (weights loaded with set_params) equals nn.MultiheadAttention; grads land in mha.grads."""
    Q, K, V, W, mask, G = mha_case(dtype, 2, Lq, Lk, H, kind, grid_seed(5, dtype, H, Lq, Lk, kind))
    mha = MultiHeadAttention(D_MODEL, H, rng=make_rng(50))
    mha.set_params(W)
    mha.zero_grad()
    out, w = mha.forward(Q, K, V, mask=mask)
    assert w.shape == (2, H, Lq, Lk)
    dQ, dK, dV = mha.backward(G)
    grads = dict(mha.named_gradients())
    check_mha_against_torch(out, w, {"Q": dQ, "K": dK, "V": dV, **{n: grads[n] for n in WEIGHT_NAMES}},
                            Q, K, V, W, H, mask, G, dtype)


# --------------------------------------------------------------------------------------------------------
# Layer norm
# --------------------------------------------------------------------------------------------------------
# d_model 1 and 2 make the backward ill-conditioned (the exact grad_x is ~0 and both libraries return
# rounding noise of ~1e-5 in float32), so those sizes are compared in float64 only.
LN_CASES = [(np.float64, D) for D in (1, 2, 16, 64)] + [(np.float32, D) for D in (16, 64)]


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("dtype,D", LN_CASES, ids=[f"{dtype_id(t)}-D{d}" for t, d in LN_CASES])
def test_layer_norm_matches_torch(dtype, D, B, L):
    """layer_norm and layer_norm_backward equal nn.LayerNorm(eps=1e-6): output and grads of x, gamma, beta."""
    rng = make_rng(*grid_seed(6, dtype, B, L, D))
    x = (3.0 + 2.0 * rng.standard_normal((B, L, D))).astype(dtype)
    gamma, beta = randn(rng, D, dtype=dtype), randn(rng, D, dtype=dtype)
    G = randn(rng, B, L, D, dtype=dtype)

    y = layer_norm(x, gamma, beta, eps=1e-6)
    dx, dgamma, dbeta = layer_norm_backward(G, x, gamma, eps=1e-6)

    ln = torch.nn.LayerNorm(D, eps=1e-6, dtype=TORCH_DTYPE[np.dtype(dtype).type])
    with torch.no_grad():
        ln.weight.copy_(to_torch(gamma))
        ln.bias.copy_(to_torch(beta))
    tx = to_torch(x, True)
    ty = ln(tx)
    ty.backward(to_torch(G))

    assert y.dtype == dtype and dx.dtype == dtype
    assert_close_rel(y, to_numpy(ty), dtype, "layer_norm output")
    refs = to_numpy(tx.grad), to_numpy(ln.weight.grad), to_numpy(ln.bias.grad)
    gs = group_scale(*refs)
    for name, ours, ref in zip(("grad_x", "grad_gamma", "grad_beta"), (dx, dgamma, dbeta), refs, strict=False):
        assert_close_rel(ours, ref, dtype, name, gs)


# --------------------------------------------------------------------------------------------------------
# Encoder block
# --------------------------------------------------------------------------------------------------------
def torch_encoder_layer(block, dtype) -> torch.nn.TransformerEncoderLayer:
    """nn.TransformerEncoderLayer (pre-norm, no dropout, relu) holding the block's parameters, attention biases 0."""
    D, H, Fd = block.d_model, block.num_heads, block.d_ff
    layer = torch.nn.TransformerEncoderLayer(D, H, dim_feedforward=Fd, dropout=0.0, activation="relu",
                                             layer_norm_eps=1e-6, batch_first=True, norm_first=True,
                                             dtype=TORCH_DTYPE[np.dtype(dtype).type])
    p = {n: np.asarray(a, dtype=dtype) for n, a in block.named_parameters()}
    with torch.no_grad():
        att = layer.self_attn
        att.in_proj_weight.copy_(to_torch(np.concatenate(
            [p["attention.W_Q"].T, p["attention.W_K"].T, p["attention.W_V"].T], axis=0)))
        att.in_proj_bias.zero_()
        att.out_proj.weight.copy_(to_torch(p["attention.W_O"].T))
        att.out_proj.bias.zero_()
        layer.linear1.weight.copy_(to_torch(p["ffn.W1"].T))
        layer.linear1.bias.copy_(to_torch(p["ffn.b1"]))
        layer.linear2.weight.copy_(to_torch(p["ffn.W2"].T))
        layer.linear2.bias.copy_(to_torch(p["ffn.b2"]))
        for i in ("1", "2"):
            getattr(layer, "norm" + i).weight.copy_(to_torch(p["norm" + i + ".gamma"]))
            getattr(layer, "norm" + i).bias.copy_(to_torch(p["norm" + i + ".beta"]))
    layer.train()
    return layer


def torch_layer_grads(layer) -> dict[str, np.ndarray]:
    """Parameter gradients of the torch layer under the block's dotted names and layout."""
    D = layer.self_attn.embed_dim
    g = to_numpy(layer.self_attn.in_proj_weight.grad)
    return {
        "attention.W_Q": g[:D].T, "attention.W_K": g[D:2 * D].T, "attention.W_V": g[2 * D:].T,
        "attention.W_O": to_numpy(layer.self_attn.out_proj.weight.grad).T,
        "ffn.W1": to_numpy(layer.linear1.weight.grad).T, "ffn.b1": to_numpy(layer.linear1.bias.grad),
        "ffn.W2": to_numpy(layer.linear2.weight.grad).T, "ffn.b2": to_numpy(layer.linear2.bias.grad),
        "norm1.gamma": to_numpy(layer.norm1.weight.grad), "norm1.beta": to_numpy(layer.norm1.bias.grad),
        "norm2.gamma": to_numpy(layer.norm2.weight.grad), "norm2.beta": to_numpy(layer.norm2.bias.grad),
    }


def torch_manual_layer(layer, x, mask, H):
    """The same pre-norm layer as explicit torch ops, with zero weights on fully masked rows."""
    eps = 1e-6
    D = layer.self_attn.embed_dim
    W_in = layer.self_attn.in_proj_weight
    B, L, _ = x.shape
    a = F.layer_norm(x, (D,), layer.norm1.weight, layer.norm1.bias, eps)

    def heads(t):
        return t.reshape(B, L, H, D // H).transpose(1, 2)  # (B, H, L, Dh)

    q, k, v = heads(a @ W_in[:D].T), heads(a @ W_in[D:2 * D].T), heads(a @ W_in[2 * D:].T)
    o, _ = torch_masked_attention(q, k, v, mask)
    h = x + o.transpose(1, 2).reshape(B, L, D) @ layer.self_attn.out_proj.weight.T
    f = F.layer_norm(h, (D,), layer.norm2.weight, layer.norm2.bias, eps)
    return h + layer.linear2(torch.relu(layer.linear1(f)))


def randomize_block(block, rng):
    """Random values for every block parameter (gammas around 1), set through the public API."""
    params = {n: rng.standard_normal(np.shape(p)) * (0.3 if n.startswith("attention.") else 0.5)
              for n, p in block.named_parameters()}
    params["norm1.gamma"] += 1.0
    params["norm2.gamma"] += 1.0
    block.attention.set_params({n.split(".", 1)[1]: v for n, v in params.items() if n.startswith("attention.")})
    block.load_state_dict({n: v for n, v in params.items() if not n.startswith("attention.")}, strict=False)


def check_block_against_torch(dtype, B, L, H, kind, seed, d_ff=32):
    rng = make_rng(*seed)
    D = D_MODEL
    block = TransformerEncoderBlock(D, H, d_ff=d_ff, rng=make_rng(70))
    randomize_block(block, rng)
    x = randn(rng, B, L, D, dtype=dtype)
    mask = make_mask(kind, rng, (B, H), L, L)
    G = randn(rng, B, L, D, dtype=dtype)

    block.zero_grad()
    out = block.forward(x, mask=mask)
    dx = block.backward(G)
    grads = {n: np.array(g) for n, g in block.named_gradients()}

    layer = torch_encoder_layer(block, dtype)
    tx = to_torch(x, True)
    t_out = layer(tx, src_mask=torch_bool_mask_for_mha(mask, B, H, L, L))
    t_out.backward(to_torch(G))

    dead = dead_rows(mask, (B, H, L, L)).any(axis=1)  # (B, L)
    live = ~dead
    if live.any():
        assert_close_rel(out[live], to_numpy(t_out)[live], dtype, "block output")
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(dx))
    if not dead.any():
        t_dx = to_numpy(tx.grad)
        t_grads = torch_layer_grads(layer)
    else:
        layer.zero_grad()
        tx = to_torch(x, True)
        m_out = torch_manual_layer(layer, tx, mask, H)
        m_out.backward(to_torch(G))
        assert_close_rel(out, to_numpy(m_out), dtype, "block output (explicit torch)")
        t_dx = to_numpy(tx.grad)
        t_grads = torch_layer_grads(layer)
    assert set(t_grads) == set(grads), f"block parameters {sorted(grads)}"
    gs = group_scale(t_dx, *t_grads.values())
    assert_close_rel(dx, t_dx, dtype, "grad_x", gs)
    for name, g in t_grads.items():
        assert_close_rel(grads[name], g, dtype, f"grad {name}", gs)


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_encoder_block_matches_torch(dtype, B, L, H, kind):
    """TransformerEncoderBlock: output, grad_x and all 12 parameter gradients equal nn.TransformerEncoderLayer."""
    check_block_against_torch(dtype, B, L, H, kind, grid_seed(7, dtype, B, L, H, kind))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_encoder_block_default_d_ff_matches_torch(dtype):
    """The default d_ff = 4 * d_model block equals torch's layer with dim_feedforward = 64."""
    block = TransformerEncoderBlock(D_MODEL, 2, rng=make_rng(71))
    assert block.d_ff == 4 * D_MODEL
    check_block_against_torch(dtype, 2, 7, 2, "causal", grid_seed(8, dtype), d_ff=None)

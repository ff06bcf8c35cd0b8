"""PyTorch parity (forward and backward, weights copied across) for every attnkit layer torch also has:
Projection ~ nn.Linear, LayerNorm ~ nn.LayerNorm, Embedding ~ nn.Embedding (with padding_idx),
FeedForward ~ Linear-ReLU/GELU-Linear, TransformerEncoder ~ nn.TransformerEncoder of
nn.TransformerEncoderLayer (pre- and post-norm, relu and gelu, biases, key padding, causal mask, final norm),
and softmax_cross_entropy ~ F.cross_entropy (with ignore_index).

Layout: our weights are applied as ``x @ W`` (torch stores ``W.T``). Masks: ours ``True`` = may attend / real
token, torch's boolean masks ``True`` = not allowed / padding, so they are inverted. Agreement: 1e-10 (float64)
and 1e-5 (float32) relative to the largest reference magnitude (helpers.assert_close_rel).

Each ``run_*`` helper returns ``{quantity: max relative discrepancy}`` so the figures can be reported.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F

import torch
from attnkit.layers import Embedding, FeedForward, LayerNorm, Projection, TransformerEncoder
from attnkit.losses import softmax_cross_entropy

from helpers import TORCH_DTYPE, assert_close_rel, group_scale, make_rng, randn, to_numpy, to_torch

DTYPES = [np.float64, np.float32]


def tdt(dtype):
    return TORCH_DTYPE[np.dtype(dtype).type]


def set_(param: torch.Tensor, value: np.ndarray) -> None:
    with torch.no_grad():
        param.copy_(torch.from_numpy(np.ascontiguousarray(value)))


def compare(results: dict, ours: dict, theirs: dict, dtype) -> dict:
    """Compare every entry; the key-projection bias, whose gradient is zero in exact arithmetic (it shifts
    all scores of a query alike), is compared relative to the scale of the other attention-bias gradients."""
    for name, value in ours.items():
        scale = None
        if name.endswith("attention.b_K"):
            scale = group_scale(*(theirs[name[:-3] + b] for b in ("b_Q", "b_V", "b_O")))
        results[name] = assert_close_rel(value, theirs[name], dtype, name, scale=scale)
    return results


# --------------------------------------------------------------------------------------------------------
def run_linear_parity(dtype, seed=0) -> dict:
    rng = make_rng(seed)
    proj = Projection(6, 4, rng=seed)
    proj.b = randn(rng, 4)
    x, G = randn(rng, 2, 5, 6, dtype=dtype), randn(rng, 2, 5, 4, dtype=dtype)
    ref = torch.nn.Linear(6, 4, dtype=tdt(dtype))
    set_(ref.weight, proj.W.T.astype(dtype))
    set_(ref.bias, proj.b.astype(dtype))
    tx = to_torch(x, True)
    ty = ref(tx)
    ty.backward(to_torch(G))
    y = proj(x)
    gx = proj.backward(G)
    return compare({}, {"output": y, "grad_x": gx, "W": proj.grads["W"], "b": proj.grads["b"]},
                   {"output": to_numpy(ty), "grad_x": to_numpy(tx.grad), "W": to_numpy(ref.weight.grad).T,
                    "b": to_numpy(ref.bias.grad)}, dtype)


def run_layer_norm_parity(dtype, seed=0) -> dict:
    rng = make_rng(seed)
    ln = LayerNorm(7)
    ln.gamma, ln.beta = randn(rng, 7), randn(rng, 7)
    x, G = randn(rng, 3, 4, 7, dtype=dtype, scale=3.0), randn(rng, 3, 4, 7, dtype=dtype)
    ref = torch.nn.LayerNorm(7, eps=1e-6, dtype=tdt(dtype))
    set_(ref.weight, ln.gamma.astype(dtype))
    set_(ref.bias, ln.beta.astype(dtype))
    tx = to_torch(x, True)
    ty = ref(tx)
    ty.backward(to_torch(G))
    y = ln(x)
    gx = ln.backward(G)
    return compare({}, {"output": y, "grad_x": gx, "gamma": ln.grads["gamma"], "beta": ln.grads["beta"]},
                   {"output": to_numpy(ty), "grad_x": to_numpy(tx.grad), "gamma": to_numpy(ref.weight.grad),
                    "beta": to_numpy(ref.bias.grad)}, dtype)


def run_embedding_parity(dtype, seed=0) -> dict:
    rng = make_rng(seed)
    emb = Embedding(9, 5, padding_idx=0, rng=seed).astype(dtype)
    ids = rng.integers(0, 9, size=(4, 6))
    ids[0, :2] = 0
    G = randn(rng, 4, 6, 5, dtype=dtype)
    ref = torch.nn.Embedding(9, 5, padding_idx=0, dtype=tdt(dtype))
    set_(ref.weight, emb.weight)
    ty = ref(torch.from_numpy(ids))
    ty.backward(to_torch(G))
    y = emb(ids)
    emb.backward(G)
    return compare({}, {"output": y, "weight": emb.grads["weight"]},
                   {"output": to_numpy(ty), "weight": to_numpy(ref.weight.grad)}, dtype)


def run_ffn_parity(dtype, activation, seed=0) -> dict:
    rng = make_rng(seed)
    ffn = FeedForward(6, 10, activation=activation, rng=seed)
    ffn.b1, ffn.b2 = randn(rng, 10), randn(rng, 6)
    x, G = randn(rng, 2, 5, 6, dtype=dtype), randn(rng, 2, 5, 6, dtype=dtype)
    act = {"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU(approximate="tanh")}
    ref = torch.nn.Sequential(torch.nn.Linear(6, 10, dtype=tdt(dtype)), act[activation],
                              torch.nn.Linear(10, 6, dtype=tdt(dtype)))
    for i, (w, b) in zip((0, 2), (("W1", "b1"), ("W2", "b2")), strict=False):
        set_(ref[i].weight, getattr(ffn, w).T.astype(dtype))
        set_(ref[i].bias, getattr(ffn, b).astype(dtype))
    tx = to_torch(x, True)
    ty = ref(tx)
    ty.backward(to_torch(G))
    y = ffn(x)
    gx = ffn.backward(G)
    ours = {"output": y, "grad_x": gx, **{n: ffn.grads[n] for n in ("W1", "b1", "W2", "b2")}}
    theirs = {"output": to_numpy(ty), "grad_x": to_numpy(tx.grad), "W1": to_numpy(ref[0].weight.grad).T,
              "b1": to_numpy(ref[0].bias.grad), "W2": to_numpy(ref[2].weight.grad).T, "b2": to_numpy(ref[2].bias.grad)}
    return compare({}, ours, theirs, dtype)


# --------------------------------------------------------------------------------------------------------
def torch_encoder_from(enc: TransformerEncoder, dtype, d_ff: int, activation: str) -> torch.nn.TransformerEncoder:
    """nn.TransformerEncoder holding ``enc``'s weights (dropout 0, eps 1e-6, batch_first)."""
    D, H = enc.d_model, enc.num_heads
    layer = torch.nn.TransformerEncoderLayer(D, H, d_ff, dropout=0.0, activation=activation, layer_norm_eps=1e-6,
                                             batch_first=True, norm_first=enc.norm_first, dtype=tdt(dtype))
    norm = torch.nn.LayerNorm(D, eps=1e-6, dtype=tdt(dtype)) if enc.norm is not None else None
    ref = torch.nn.TransformerEncoder(layer, enc.num_layers, norm=norm, enable_nested_tensor=False)
    for ours, theirs in zip(enc.layers, ref.layers, strict=False):
        a = ours.attention
        set_(theirs.self_attn.in_proj_weight, np.concatenate([a.W_Q.T, a.W_K.T, a.W_V.T]).astype(dtype))
        set_(theirs.self_attn.in_proj_bias, np.concatenate([a.b_Q, a.b_K, a.b_V]).astype(dtype))
        set_(theirs.self_attn.out_proj.weight, a.W_O.T.astype(dtype))
        set_(theirs.self_attn.out_proj.bias, a.b_O.astype(dtype))
        set_(theirs.linear1.weight, ours.W1.T.astype(dtype))
        set_(theirs.linear1.bias, ours.b1.astype(dtype))
        set_(theirs.linear2.weight, ours.W2.T.astype(dtype))
        set_(theirs.linear2.bias, ours.b2.astype(dtype))
        for i in ("1", "2"):
            set_(getattr(theirs, "norm" + i).weight, getattr(ours, "gamma" + i).astype(dtype))
            set_(getattr(theirs, "norm" + i).bias, getattr(ours, "beta" + i).astype(dtype))
    if norm is not None:
        set_(norm.weight, enc.norm.gamma.astype(dtype))
        set_(norm.bias, enc.norm.beta.astype(dtype))
    return ref


def torch_encoder_grads(ref: torch.nn.TransformerEncoder, D: int) -> dict:
    """Parameter gradients of the torch stack under our dotted names and layout."""
    out = {}
    for i, layer in enumerate(ref.layers):
        p = f"layers.{i}."
        gw, gb = to_numpy(layer.self_attn.in_proj_weight.grad), to_numpy(layer.self_attn.in_proj_bias.grad)
        for j, n in enumerate("QKV"):
            out[p + "attention.W_" + n] = gw[j * D:(j + 1) * D].T
            out[p + "attention.b_" + n] = gb[j * D:(j + 1) * D]
        out[p + "attention.W_O"] = to_numpy(layer.self_attn.out_proj.weight.grad).T
        out[p + "attention.b_O"] = to_numpy(layer.self_attn.out_proj.bias.grad)
        out[p + "ffn.W1"] = to_numpy(layer.linear1.weight.grad).T
        out[p + "ffn.b1"] = to_numpy(layer.linear1.bias.grad)
        out[p + "ffn.W2"] = to_numpy(layer.linear2.weight.grad).T
        out[p + "ffn.b2"] = to_numpy(layer.linear2.bias.grad)
        for k in ("1", "2"):
            out[p + "norm" + k + ".gamma"] = to_numpy(getattr(layer, "norm" + k).weight.grad)
            out[p + "norm" + k + ".beta"] = to_numpy(getattr(layer, "norm" + k).bias.grad)
    if ref.norm is not None:
        out["norm.gamma"], out["norm.beta"] = to_numpy(ref.norm.weight.grad), to_numpy(ref.norm.bias.grad)
    return out


def run_encoder_parity(dtype, norm_first, activation, masking, seed=0) -> dict:
    rng = make_rng(seed)
    B, L, D, H, Fd = 3, 6, 12, 3, 20
    enc = TransformerEncoder(2, D, H, Fd, norm_first=norm_first, activation=activation, attention_bias=True, rng=seed)
    for _, p in enc.named_parameters():
        p += randn(rng, *p.shape, scale=0.2)
    ref = torch_encoder_from(enc, dtype, Fd, activation)
    x, G = randn(rng, B, L, D, dtype=dtype), randn(rng, B, L, D, dtype=dtype)
    kpm = causal = None
    t_kwargs = {}
    if masking == "padding":
        kpm = np.arange(L)[None, :] < np.array([[L], [4], [1]])  # (B, L), True = real token
        t_kwargs["src_key_padding_mask"] = torch.from_numpy(~kpm)
    elif masking == "causal":
        causal = True
        t_kwargs["mask"] = torch.from_numpy(~np.tril(np.ones((L, L), bool)))
    tx = to_torch(x, True)
    ty = ref(tx, **t_kwargs)
    ty.backward(to_torch(G))
    y = enc(x, key_padding_mask=kpm, is_causal=bool(causal))
    enc.zero_grad()
    gx = enc.backward(G)
    theirs = {"output": to_numpy(ty), "grad_x": to_numpy(tx.grad), **torch_encoder_grads(ref, D)}
    ours = {"output": y, "grad_x": gx, **dict(enc.named_gradients())}
    assert set(ours) == set(theirs)
    return compare({}, ours, theirs, dtype)


def run_cross_entropy_parity(dtype, seed=0) -> dict:
    rng = make_rng(seed)
    logits = randn(rng, 4, 5, 7, dtype=dtype, scale=4.0)
    targets = rng.integers(0, 7, size=(4, 5))
    targets[1, :3] = -100
    loss, grad = softmax_cross_entropy(logits, targets, ignore_index=-100)
    tl = to_torch(logits, True)
    t_loss = F.cross_entropy(tl.reshape(-1, 7), torch.from_numpy(targets.reshape(-1)), ignore_index=-100)
    t_loss.backward()
    assert grad.dtype == dtype
    return compare({}, {"loss": np.array(loss), "grad_logits": grad},
                   {"loss": to_numpy(t_loss), "grad_logits": to_numpy(tl.grad)}, dtype)


# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_projection_matches_torch_linear(dtype):
    run_linear_parity(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_layer_norm_matches_torch(dtype):
    run_layer_norm_parity(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_embedding_matches_torch_with_padding_idx(dtype):
    run_embedding_parity(dtype)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_feed_forward_matches_torch(dtype, activation):
    run_ffn_parity(dtype, activation)


@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_norm", "post_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_transformer_encoder_matches_torch(dtype, norm_first, activation, masking):
    run_encoder_parity(dtype, norm_first, activation, masking)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cross_entropy_matches_torch(dtype):
    run_cross_entropy_parity(dtype)

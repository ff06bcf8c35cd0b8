"""GatedAttention: Qwen3-Next's gated full attention equals transformers' Qwen3NextAttention forward and backward
(every parameter's gradient, through torch autograd), passes float64 finite differences, is half of
GroupedQueryAttention when the gate's pre-activation is zero, and decodes with a cache as it runs whole."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.attention.gated import GatedAttention
from attnkit.attention.grouped_query import GroupedQueryAttention
from attnkit.decoding.cache import KVCache
from attnkit.layers.rotary import RotaryEmbedding
from decoder_cases import tiny_config

from helpers import assert_close_rel, assert_gradient, make_rng, randn

CASES = {
    "gqa_partial": dict(rotary=dict(partial_factor=0.5), attention=dict(qk_norm="head"), norm=dict(offset=1.0),
                        layer_types=("gated_attention",) * 2),
    "mqa_bias": dict(num_kv_heads=1, attention=dict(bias=True, output_bias=True), layer_types=("gated_attention",) * 2),
}


def _rotary(cfg):
    return RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)


def _layer(case, rng, dtype=np.float64):
    cfg = tiny_config(**CASES[case])
    attn = GatedAttention(cfg, 0, rng=rng).astype(dtype)
    for name, p in attn.named_parameters():
        setattr(attn, name, randn(rng, *p.shape, scale=0.4))
    return cfg, attn


def _padded(b, length, pads):
    mask = np.ones((b, length), dtype=bool)
    for row, n in enumerate(pads):
        mask[row, :n] = False
    return mask, np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_by_finite_differences(case):
    rng = make_rng(len(case), 3)
    cfg, attn = _layer(case, rng)
    mask, pos = _padded(2, 5, [0, 2])
    rotary = _rotary(cfg)(pos, dtype=np.float64)
    x, g = randn(rng, 2, 5, cfg.hidden_size), randn(rng, 2, 5, cfg.hidden_size)

    def loss():
        return np.sum(attn(x, rotary=rotary, attention_mask=mask) * g)

    loss()
    grad_x = attn.backward(g)
    assert_gradient(loss, x, grad_x, "x")
    for name, p in attn.named_parameters():
        assert_gradient(loss, p, attn.grads[name], name)


def _hf_attention(cfg, dtype):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

    hf_cfg = Qwen3NextConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                             num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, num_hidden_layers=1,
                             attention_bias=cfg.attention.bias, rms_norm_eps=cfg.norm.eps, vocab_size=8,
                             layer_types=["full_attention"], attention_dropout=0.0)
    hf_cfg._attn_implementation = "sdpa"  # the eager path takes its softmax in float32 even for float64
    return Qwen3NextAttention(hf_cfg, 0).to(dtype)


def _copy_into(ours, theirs, dtype):
    """attnkit's W_Q and W_G as Hugging Face's q_proj (Hq, 2, Dh, D): each head's query rows, then its gate rows."""
    p = {n: np.asarray(a) for n, a in ours.named_parameters()}
    hq, dh, d = ours.num_heads, ours.head_dim, ours.hidden_size
    q_proj = np.stack([p["W_Q"].T.reshape(hq, dh, d), p["W_G"].T.reshape(hq, dh, d)], axis=1).reshape(-1, d)
    with torch.no_grad():
        theirs.q_proj.weight.copy_(torch.from_numpy(q_proj))
        for name, proj in (("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
            getattr(theirs, proj).weight.copy_(torch.from_numpy(p[f"W_{name}"].T.copy()))
        if "b_Q" in p:
            theirs.q_proj.bias.copy_(torch.from_numpy(np.stack([p["b_Q"].reshape(hq, dh),
                                                                p["b_G"].reshape(hq, dh)], 1).ravel()))
            for name, proj in (("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
                getattr(theirs, proj).bias.copy_(torch.from_numpy(p[f"b_{name}"]))
        for norm in ("q_norm", "k_norm"):
            getattr(theirs, norm).weight.copy_(torch.from_numpy(p.get(norm, np.zeros(dh))))
    theirs.to(dtype)


def _theirs_as_ours(theirs, hq, dh, d):
    """Hugging Face's gradients under attnkit's names (q_proj's split back into W_Q and W_G)."""
    q = theirs.q_proj.weight.grad.double().numpy().reshape(hq, 2, dh, d)
    out = {"W_Q": q[:, 0].reshape(-1, d).T, "W_G": q[:, 1].reshape(-1, d).T}
    for name, proj in (("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
        out[f"W_{name}"] = getattr(theirs, proj).weight.grad.double().numpy().T
    if theirs.q_proj.bias is not None:
        qb = theirs.q_proj.bias.grad.double().numpy().reshape(hq, 2, dh)
        out.update(b_Q=qb[:, 0].ravel(), b_G=qb[:, 1].ravel())
        for name, proj in (("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
            out[f"b_{name}"] = getattr(theirs, proj).bias.grad.double().numpy()
    for norm in ("q_norm", "k_norm"):
        out[norm] = getattr(theirs, norm).weight.grad.double().numpy()
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_qwen3_next_attention_forward_and_backward(case, dtype):
    """Qwen3NextAttention always has (1 + w) q/k norms; the case without qk_norm gives it zero weights."""
    rng = make_rng(len(case), 8)
    case_config = CASES[case]
    cfg = tiny_config(**{**case_config, "attention": {**case_config["attention"], "qk_norm": "head"},
                         "norm": {"offset": 1.0}})
    ours = GatedAttention(cfg, 0, rng=rng).astype(dtype)
    for name, p in ours.named_parameters():
        setattr(ours, name, randn(rng, *p.shape, scale=0.4))
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    theirs = _hf_attention(cfg, tdtype)
    _copy_into(ours, theirs, tdtype)
    mask, pos = _padded(3, 6, [0, 2, 5])
    cos, sin = _rotary(cfg)(pos, dtype=dtype)
    x, g = randn(rng, 3, 6, cfg.hidden_size, dtype=dtype), randn(rng, 3, 6, cfg.hidden_size, dtype=dtype)
    g[~mask] = 0  # a padded query: HF spreads it uniformly, attnkit gives zeros; neither reaches a real token
    y = ours(x, rotary=(cos, sin), attention_mask=mask)
    grad_x = ours.backward(g)

    allowed = np.tril(np.ones((6, 6), bool)) & mask[:, None, :]  # (B, Lq, Lk)
    additive = torch.from_numpy(np.where(allowed, 0.0, torch.finfo(tdtype).min)[:, None]).to(tdtype)  # (B, 1, L, L)
    tx = torch.tensor(x, requires_grad=True)
    ty, _ = theirs(tx, position_embeddings=(torch.from_numpy(cos), torch.from_numpy(sin)), attention_mask=additive)
    ty.backward(torch.from_numpy(g))
    real = mask[..., None]
    # Qwen3NextRMSNorm normalises in float32 whatever the model's dtype, so the q/k norms bound a float64 model's
    # agreement by float32 rounding; the float64 backward is checked alone by finite differences above.
    tol = np.float32
    assert_close_rel(np.where(real, y, 0), np.where(real, ty.detach().numpy(), 0), tol, f"{case} y")
    assert_close_rel(np.where(real, grad_x, 0), np.where(real, tx.grad.numpy(), 0), tol, f"{case} grad_x")
    expected = _theirs_as_ours(theirs, cfg.num_heads, cfg.head_dim, cfg.hidden_size)
    assert set(expected) == set(ours.grads)
    for name, grad in expected.items():
        assert_close_rel(ours.grads[name], grad, tol, name)


def test_a_zero_gate_pre_activation_halves_the_plain_attention():
    """sigmoid(0) = 1/2: with W_G = 0 the gated layer is exactly half of GroupedQueryAttention's heads' output."""
    rng = make_rng(5)
    cfg, gated = _layer("gqa_partial", rng)
    gated.W_G = np.zeros_like(gated.W_G)
    plain = GroupedQueryAttention(cfg, 0, rng=0).astype(np.float64)
    plain.load_state_dict({n: a for n, a in gated.named_parameters() if n != "W_G"})
    plain.W_O = gated.W_O / 2
    x = randn(rng, 2, 4, cfg.hidden_size)
    rotary = _rotary(cfg)(np.tile(np.arange(4), (2, 1)), dtype=np.float64)
    np.testing.assert_allclose(gated(x, rotary=rotary), plain(x, rotary=rotary), rtol=1e-13, atol=1e-15)


def test_cached_decoding_equals_the_whole_sequence():
    rng = make_rng(6)
    cfg, attn = _layer("mqa_bias", rng)
    x = randn(rng, 2, 5, cfg.hidden_size)
    rotary = _rotary(cfg)
    pos = np.tile(np.arange(5), (2, 1))
    whole = attn(x, rotary=rotary(pos, dtype=np.float64))
    cache = KVCache(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, np.float64)
    steps = [attn(x[:, :3], rotary=rotary(pos[:, :3], dtype=np.float64), cache=cache)]
    steps += [attn(x[:, t:t + 1], rotary=rotary(pos[:, t:t + 1], dtype=np.float64), cache=cache) for t in (3, 4)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), whole, rtol=1e-12, atol=1e-14)


def test_hook_z_is_what_the_output_projection_reads_so_head_attributions_sum_to_the_logit():
    """hook_z holds the heads' outputs after the gate: a head's share is hook_z times its rows of W_O, and the
    direct logit attribution of a gated model adds up to its logit exactly."""
    from attnkit.explain.direct_logit import direct_logit_attribution
    from attnkit.models import CausalLM

    cfg = tiny_config(**CASES["gqa_partial"])
    lm = CausalLM(cfg, rng=0).astype(np.float64)
    rng = make_rng(7)
    for _, p in lm.named_parameters():
        p[...] = 0.3 * rng.standard_normal(p.shape)
    parts = direct_logit_attribution(lm, [1, 5, 3, 7], target=4)
    total = parts["embed"] + parts["pos_embed"] + parts["heads"].sum() + parts["mlp"].sum() + parts["bias"]
    assert abs(total - parts["logit"]) < 1e-12 * max(1.0, abs(parts["logit"]))

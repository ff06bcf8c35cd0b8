"""DeepSeek Sparse Attention: the lightning indexer's scores and top-k selection, latent attention over only the
chosen keys (exact gradients given the choice, equal to dense MLA when top-k covers the sequence, equal to a
float64 dense-with-mask reference and to transformers' DeepseekV32Attention), the indexer's KL loss and its
gradient, and cached decoding that selects over the cached index keys."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.attention.latent import LatentAttentionConfig, MultiHeadLatentAttention
from attnkit.attention.lightning_indexer import LightningIndexer, half_split_rotary, indexer_kl_loss
from attnkit.decoding.cache import LatentCache
from attnkit.kernels import indexer as kernel
from attnkit.kernels.rotary import rotary_cos_sin, rotary_frequencies

from helpers import assert_close_rel, assert_gradient, make_rng, max_rel_diff, randn

BASE = dict(hidden_size=16, num_heads=4, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4,
            v_head_dim=3)
# eight heads: a key whose every ReLU is zero scores exactly 0, and two such keys tie (torch and numpy break a tie
# differently); with eight heads that needs eight negative dot products
INDEX = dict(index_n_heads=8, index_head_dim=6)
HF_NAMES = {"W_QA": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "W_QB": "q_b_proj.weight",
            "W_KVA": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
            "W_KVB": "kv_b_proj.weight", "W_O": "o_proj.weight", "indexer.W_QB": "indexer.wq_b.weight",
            "indexer.W_K": "indexer.wk.weight", "indexer.k_norm": "indexer.k_norm.weight",
            "indexer.k_norm_bias": "indexer.k_norm.bias", "indexer.W_weights": "indexer.weights_proj.weight"}


def _config(top_k, **extra):
    return LatentAttentionConfig(**BASE, index_topk=top_k, **INDEX, **extra)


def _layer(cfg, rng, dtype=np.float64, scale=0.4):
    attn = MultiHeadLatentAttention(cfg, rng=rng).astype(dtype)
    for name, p in attn.named_parameters():
        setattr_path(attn, name, randn(rng, *p.shape, scale=scale, dtype=dtype)
                     + (1.0 if name.endswith("norm") else 0.0))
    return attn


def setattr_path(module, name, value):
    *parents, leaf = name.split(".")
    for part in parents:
        module = getattr(module, part)
    setattr(module, leaf, value)


def _left_padded_mask(b, length, pads):
    mask = np.ones((b, length), dtype=bool)
    for row, n in enumerate(pads):
        mask[row, :n] = False
    return mask


def _positions(mask):
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def _rotary(cfg, positions, dtype=np.float64, interleaved=True):
    inv_freq, factor = rotary_frequencies(cfg.qk_rope_head_dim, 10000.0, None, max_position_embeddings=128)
    return rotary_cos_sin(positions, inv_freq, factor, interleaved=interleaved, dtype=dtype)


def _inputs(rng, cfg, b=2, length=9, pads=(0, 3), dtype=np.float64):
    mask = _left_padded_mask(b, length, pads)
    return randn(rng, b, length, cfg.hidden_size, dtype=dtype), mask, _rotary(cfg, _positions(mask), dtype)


# ----------------------------------------------------------------------------------------------------------
# kernels
def test_index_scores_and_their_gradient_by_finite_differences():
    rng = make_rng(1)
    q, k, w, g = randn(rng, 2, 5, 3, 4), randn(rng, 2, 7, 4), randn(rng, 2, 5, 3), randn(rng, 2, 5, 7)
    scores = kernel.index_scores(q, k, w, 0.5)
    reference = np.einsum("blh,blhs->bls", w, np.maximum(0.5 * np.einsum("blhd,bsd->blhs", q, k), 0))
    assert max_rel_diff(scores, reference) < 1e-14
    dq, dk, dw = kernel.index_scores_backward(g, q, k, w, 0.5)
    for name, arr, grad in (("q", q, dq), ("k", k, dk), ("w", w, dw)):
        assert_gradient(lambda: float(np.sum(kernel.index_scores(q, k, w, 0.5) * g)), arr, grad, name)


def test_top_k_keeps_the_best_allowed_keys_and_all_when_fewer():
    scores = np.array([[[5.0, 1.0, 4.0, 3.0, 2.0], [9.0, 8.0, 7.0, 6.0, 0.0]]])
    allowed = np.array([[[True, True, True, True, True], [False, True, False, True, True]]])
    chosen = kernel.top_k_selection(scores, allowed, 2)
    assert chosen.tolist() == [[[True, False, True, False, False], [False, True, False, True, False]]]
    few = np.zeros_like(allowed)
    few[0, 0, :1] = True  # one allowed key: kept; a row with none keeps none
    assert kernel.top_k_selection(scores, few, 2).sum(axis=-1).tolist() == [[1, 0]]
    assert (kernel.top_k_selection(scores, allowed, 5) == allowed).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_gathered_attention_equals_attention_masked_to_the_chosen_keys(dtype):
    """The inference kernel scores only each query's K gathered keys; a query with no valid key gets zeros."""
    rng = make_rng(11)
    b, h, length, s, width, dv = 2, 3, 5, 9, 6, 4
    q, kv = randn(rng, b, h, length, width), randn(rng, b, s, width)
    scores = randn(rng, b, length, s)
    allowed = rng.random((b, length, s)) < 0.6
    allowed[1, 2] = False  # nothing to attend to
    indices, valid = kernel.top_k_indices(scores, allowed, 3)
    chosen = kernel.top_k_selection(scores, allowed, 3)
    logits = np.einsum("bhld,bsd->bhls", q, kv) * 0.3
    logits = np.where(chosen[:, None], logits, -np.inf)
    alive = chosen.any(-1)[:, None, :, None]
    p = np.exp(logits - np.where(alive, logits.max(-1, keepdims=True), 0))
    p = np.where(alive, p / np.where(alive, p.sum(-1, keepdims=True), 1), 0)
    reference = p @ kv[:, None, :, :dv]
    out = kernel.gathered_attention(q.astype(dtype), kv.astype(dtype), indices, valid, 0.3, dv, block=2)
    assert out.dtype == dtype and out.shape == (b, h, length, dv)
    assert max_rel_diff(out, reference) < (1e-15 if dtype == np.float64 else 2e-3)
    assert not out[1, :, 2].any()


# ----------------------------------------------------------------------------------------------------------
# sparse latent attention
def _dense_reference(attn, x, mask, rotary):
    """float64 MLA and indexer written out in full: scores of every key, then the top-k chosen keys as a mask."""
    cfg, p = attn.config, {n: v for n, v in attn.named_parameters()}
    cos, sin = rotary
    b, length, _ = x.shape
    h, dn, r, c_w = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank

    def rms(t, gain):
        return gain * t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + cfg.norm_eps)

    def rope(t, c, s, interleaved):  # t (B, L, ..., R), c/s (B, L, R)
        c, s = c.reshape(c.shape[:2] + (1,) * (t.ndim - 3) + c.shape[2:]), s.reshape(s.shape[:2] + (1,) * (t.ndim - 3)
                                                                                      + s.shape[2:])
        if interleaved:
            turned = np.stack([-t[..., 1::2], t[..., 0::2]], axis=-1).reshape(t.shape)
        else:
            turned = np.concatenate([-t[..., r // 2:], t[..., :r // 2]], axis=-1)
        return t * c + turned * s

    a = rms(x @ p["W_QA"], p["q_a_norm"])
    q = (a @ p["W_QB"]).reshape(b, length, h, dn + r)
    q = np.concatenate([q[..., :dn], rope(q[..., dn:], cos, sin, True)], axis=-1)
    kv_a = x @ p["W_KVA"]
    c = rms(kv_a[..., :c_w], p["kv_a_norm"])
    k_r = rope(kv_a[..., c_w:], cos, sin, True)
    kv = (c @ p["W_KVB"]).reshape(b, length, h, -1)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(k_r[:, :, None], (b, length, h, r))], axis=-1)
    v = kv[..., dn:]
    # the indexer, rotary half-split on the first R features
    hc, hs = half_split_rotary(cos, sin, True)
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    iq = (a @ p["indexer.W_QB"]).reshape(b, length, hi, di)
    iq = np.concatenate([rope(iq[..., :r], hc, hs, False), iq[..., r:]], axis=-1)
    ik = x @ p["indexer.W_K"]
    ik = (ik - ik.mean(-1, keepdims=True)) / np.sqrt(ik.var(-1, keepdims=True) + 1e-6) * p["indexer.k_norm"] \
        + p["indexer.k_norm_bias"]
    ik = np.concatenate([rope(ik[..., :r], hc, hs, False), ik[..., r:]], axis=-1)
    w = x @ p["indexer.W_weights"] * hi ** -0.5
    index = np.einsum("bth,bths->bts", w, np.maximum(np.einsum("bthd,bsd->bths", iq, ik) * di ** -0.5, 0))
    allowed = np.tril(np.ones((length, length), bool))[None] & mask[:, None, :]
    ranked = np.where(allowed, index, -np.inf)
    kth = -np.sort(-ranked, axis=-1)[..., min(cfg.index_topk, length) - 1:min(cfg.index_topk, length)]
    chosen = allowed & (ranked >= kth)
    assert (chosen.sum(-1) <= cfg.index_topk).all(), "a tie at the top-k boundary: pick other test data"
    scores = np.einsum("bthd,bshd->bhts", q, k) * cfg.scale
    scores = np.where(chosen[:, None], scores, -np.inf)
    alive = chosen.any(-1)[:, None, :, None]
    weights = np.exp(scores - np.where(alive, scores.max(-1, keepdims=True), 0))
    weights = np.where(alive, weights / np.where(alive, weights.sum(-1, keepdims=True), 1), 0)
    out = np.einsum("bhts,bshd->bthd", weights, v).reshape(b, length, -1)
    return out @ p["W_O"], chosen


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_matches_a_float64_dense_reference_with_the_chosen_keys_as_a_mask(top_k):
    rng = make_rng(2, top_k)
    cfg = _config(top_k)
    attn = _layer(cfg, rng)
    x, mask, rotary = _inputs(rng, cfg)
    y, weights = attn(x, rotary=rotary, attention_mask=mask, output_attentions=True)
    reference, chosen = _dense_reference(attn, x, mask, rotary)
    real = mask[..., None]
    assert max_rel_diff(np.where(real, y, 0), np.where(real, reference, 0)) < 1e-13
    assert ((weights > 0) == chosen[:, None]).all()  # attention lands on the chosen keys only
    assert (chosen.sum(-1)[mask] == np.minimum(top_k, np.cumsum(mask, axis=1)[mask])).all()


@pytest.mark.parametrize("top_k", [9, 20])
def test_top_k_at_least_the_length_equals_dense_latent_attention(top_k):
    rng = make_rng(3, top_k)
    cfg = _config(top_k)
    sparse = _layer(cfg, rng)
    dense = MultiHeadLatentAttention(LatentAttentionConfig(**BASE), rng=0)
    for name in dense._parameters:
        dense._parameters[name] = sparse._parameters[name].copy()
    x, mask, rotary = _inputs(rng, cfg)
    g = randn(rng, *x.shape)
    ys, yd = sparse(x, rotary=rotary, attention_mask=mask), dense(x, rotary=rotary, attention_mask=mask)
    assert max_rel_diff(ys, yd) < 1e-15
    assert max_rel_diff(sparse.backward(g), dense.backward(g)) < 1e-15
    for name in dense.grads:
        assert max_rel_diff(sparse.grads[name], dense.grads[name]) < 1e-15, name


def test_gradients_given_the_selection_by_finite_differences():
    """The choice of keys is discrete (no gradient, as transformers' indexer runs under no_grad): every other
    parameter's gradient is exact, and the indexer's parameters get none from the attention."""
    rng = make_rng(4)
    cfg = _config(3)
    attn = _layer(cfg, rng)
    x, mask, rotary = _inputs(rng, cfg, length=7)
    g = randn(rng, *x.shape)
    g[~mask] = 0

    def loss():
        return np.sum(attn(x, rotary=rotary, attention_mask=mask) * g)

    first = attn(x, rotary=rotary, attention_mask=mask, output_attentions=True)[1] > 0
    loss()
    grad_x = attn.backward(g)
    assert_gradient(loss, x, grad_x, "x")
    grads = dict(attn.named_gradients())
    for name, p in attn.named_parameters():
        if name.startswith("indexer."):
            assert not grads[name].any(), name
        else:
            assert_gradient(loss, p, grads[name], name)
    again = attn(x, rotary=rotary, attention_mask=mask, output_attentions=True)[1] > 0
    assert (first == again).all() and not first[:, :, -1].all()  # the same keys, and fewer than all of them


def test_matches_transformers_deepseek_v32_attention():
    """Against DeepseekV32Attention (SDPA path, float64: its indexer folds the top-k into the additive mask)."""
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

    cfg = _config(4)
    rng = make_rng(5)
    ours = _layer(cfg, rng)
    hf_cfg = DeepseekV32Config(
        vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_group=1, topk_group=1,
        num_experts_per_tok=2, q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3,
        index_topk=4, max_position_embeddings=128, **INDEX)
    hf_cfg._attn_implementation = "sdpa"  # the eager path takes its softmax in float32 even for float64
    theirs = DeepseekV32Attention(hf_cfg, 0).to(torch.float64)
    for norm in (theirs.q_a_layernorm, theirs.kv_a_layernorm):  # transformers' RMSNorm rounds to float32
        norm.forward = (lambda n: lambda h: n.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                                                        + n.variance_epsilon)))(norm)
    state = {HF_NAMES[n]: torch.tensor(p.T if n.split(".")[-1].startswith("W_") else p)
             for n, p in ours.named_parameters()}
    missing, unexpected = theirs.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    x, mask, rotary = _inputs(rng, cfg, b=3, length=10, pads=(0, 2, 6))
    hf_cos, hf_sin = _rotary(cfg, _positions(mask), interleaved=False)
    y = ours(x, rotary=rotary, attention_mask=mask)
    allowed = np.tril(np.ones((10, 10), bool)) & mask[:, None, :]
    additive = torch.from_numpy(np.where(allowed, 0.0, torch.finfo(torch.float64).min)[:, None])
    ty, _ = theirs(torch.tensor(x), position_embeddings=(torch.from_numpy(hf_cos), torch.from_numpy(hf_sin)),
                   attention_mask=additive)
    real = mask[..., None]
    error = assert_close_rel(np.where(real, y, 0), np.where(real, ty.detach().numpy(), 0), np.float64, "y")
    assert error < 1e-12


# ----------------------------------------------------------------------------------------------------------
# decoding
@pytest.mark.parametrize("form", ["absorbed", "explicit"])
def test_cached_decoding_selects_over_the_cached_index_keys(form):
    rng = make_rng(6)
    cfg = _config(3)
    attn = _layer(cfg, rng)
    x, mask, (cos, sin) = _inputs(rng, cfg, length=10, pads=(0, 4))
    full = attn(x, rotary=(cos, sin), attention_mask=mask)
    cache = LatentCache(1, 2, cfg.cache_dim, np.float64, max_length=10)
    prompt = 4
    pieces = [attn(x[:, :prompt], rotary=(cos[:, :prompt], sin[:, :prompt]), attention_mask=mask[:, :prompt],
                   cache=cache, form=form)]
    cache.mark()
    for i in range(prompt, 10):
        pieces.append(attn(x[:, i:i + 1], rotary=(cos[:, i:i + 1], sin[:, i:i + 1]), attention_mask=mask[:, :i + 1],
                           cache=cache, form=form))
    stepped = np.concatenate(pieces, axis=1)
    assert max_rel_diff(stepped, full) < 1e-13
    assert cache.nbytes == 2 * 10 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim) * 8
    cache.crop(prompt)  # roll back to the prompt: the index keys go with the latents
    again = attn(x[:, prompt:], rotary=(cos[:, prompt:], sin[:, prompt:]), attention_mask=mask, cache=cache,
                 form=form)
    assert max_rel_diff(again, full[:, prompt:]) < 1e-13


# ----------------------------------------------------------------------------------------------------------
# the indexer's loss
@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_indexer_kl_loss_gradient_by_finite_differences(stage):
    """The KL divergence from the attention's distribution (summed over heads) to the indexer's softmax, through
    every indexer parameter and both inputs; the dense warm-up's support is every visible key, the sparse
    stage's the chosen ones (held fixed, as the attention's weights are: the target carries no gradient)."""
    rng = make_rng(7, len(stage))
    cfg = _config(3)
    attn = _layer(cfg, rng)
    x, mask, (cos, sin) = _inputs(rng, cfg, length=6, pads=(0, 2))
    _, weights = attn(x, rotary=(cos, sin), attention_mask=mask, output_attentions=True)
    a = randn(rng, 2, 6, cfg.q_lora_rank)
    indexer, rotary = attn.indexer, half_split_rotary(cos, sin, True)
    allowed = np.tril(np.ones((6, 6), bool))[None] & mask[:, None, :]
    scores = indexer(x, a, rotary=rotary)
    support = allowed if stage == "dense" else indexer.select(scores, allowed)
    if stage == "dense":
        weights = np.where(allowed[:, None], rng.random(weights.shape), 0)  # a dense pattern's support

    def loss():
        return indexer_kl_loss(indexer(x, a, rotary=rotary), weights, support)[0]

    value, grad_scores = indexer_kl_loss(indexer(x, a, rotary=rotary), weights, support)
    assert value > 0
    grad_x, grad_a = indexer.backward(grad_scores)
    assert_gradient(loss, x, grad_x, "x")
    assert_gradient(loss, a, grad_a, "a")
    for name, p in indexer.named_parameters():
        assert_gradient(loss, p, indexer.grads[name], name)


def test_indexer_kl_loss_is_zero_when_the_indexer_agrees_and_checks_its_inputs():
    support = np.ones((1, 1, 3), bool)
    target = np.array([[[[0.2, 0.3, 0.5]]]])
    loss, grad = indexer_kl_loss(np.log(target[:, 0]), target, support)
    assert abs(loss) < 1e-15 and np.abs(grad).max() < 1e-15
    loss, _ = indexer_kl_loss(np.zeros((1, 1, 3)), target, support)
    assert loss == pytest.approx(float(np.sum(target * np.log(target * 3))), rel=1e-14)
    with pytest.raises(ValueError, match="support must be a boolean"):
        indexer_kl_loss(np.zeros((1, 1, 3)), target, np.ones((1, 1, 3)))
    with pytest.raises(ValueError, match="attention_weights"):
        indexer_kl_loss(np.zeros((1, 1, 3)), target[0], support)


def test_config_errors_name_the_indexer_keys():
    with pytest.raises(ValueError, match="go together"):
        LatentAttentionConfig(**BASE, index_topk=4)
    with pytest.raises(ValueError, match="q_lora_rank"):
        LatentAttentionConfig(**{**BASE, "q_lora_rank": None}, index_topk=4, **INDEX)
    with pytest.raises(ValueError, match="index_head_dim"):
        LatentAttentionConfig(**BASE, index_topk=4, index_n_heads=2, index_head_dim=2)
    with pytest.raises(ValueError, match="head_dim"):
        LightningIndexer(8, 4, 2, 2, 4, 3)


# ----------------------------------------------------------------------------------------------------------
# layers without positions (NoPE): no rotation is a rotation by zero angles
def _zero_angles(cfg, b, length, dtype=np.float64):
    shape = (b, length, cfg.qk_rope_head_dim)
    return np.ones(shape, dtype), np.zeros(shape, dtype)


def test_a_sparse_layer_without_positions_is_the_layer_turned_by_zero_angles():
    """A NoPE sparse latent layer (``rotary=None``): forward, gradients and cached steps equal the same layer
    given rotary tables of zero angles, whose turn is the identity."""
    rng = make_rng(41)
    cfg = _config(3)
    attn = _layer(cfg, rng)
    x, mask, _ = _inputs(rng, cfg)
    zero = _zero_angles(cfg, *x.shape[:2])
    y0 = attn(x, rotary=zero, attention_mask=mask)
    gx0 = attn.backward(np.ones_like(y0))
    grads0 = {name: attn.grads[name].copy() for name in attn.grads}
    attn.zero_grad()
    y = attn(x, rotary=None, attention_mask=mask)
    gx = attn.backward(np.ones_like(y))
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(gx, gx0)
    for name, grad in grads0.items():
        np.testing.assert_array_equal(attn.grads[name], grad, err_msg=name)
    cache = LatentCache(1, x.shape[0], cfg.cache_dim, np.float64)
    steps = [attn(x[:, :4], rotary=None, attention_mask=mask[:, :4], cache=cache)]
    for t in range(4, x.shape[1]):
        steps.append(attn.step(x[:, t], rotary=None, attention_mask=mask[:, :t + 1], cache=cache)[:, None])
    assert max_rel_diff(np.concatenate(steps, axis=1)[mask], y[mask]) < 1e-12


def test_the_indexer_without_positions_is_the_indexer_turned_by_zero_angles():
    rng = make_rng(42)
    idx = LightningIndexer(8, 6, num_heads=3, head_dim=4, rope_dim=2, top_k=3, rng=0).astype(np.float64)
    x, a = randn(rng, 2, 5, 8), randn(rng, 2, 5, 6)
    zero = (np.ones((2, 5, 2)), np.zeros((2, 5, 2)))
    g = randn(rng, 2, 5, 5)
    s0 = idx(x, a, rotary=zero)
    back0 = idx.backward(g)
    grads0 = {name: idx.grads[name].copy() for name in idx.grads}
    idx.zero_grad()
    s = idx(x, a, rotary=None)
    back = idx.backward(g)
    np.testing.assert_array_equal(s, s0)
    for got, want in zip(back, back0):
        np.testing.assert_array_equal(got, want)
    for name, grad in grads0.items():
        np.testing.assert_array_equal(idx.grads[name], grad, err_msg=name)
    np.testing.assert_array_equal(idx.keys(x, None), idx.keys(x, zero))

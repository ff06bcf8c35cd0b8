"""MultiHeadLatentAttention: exact gradients, parity with transformers' DeepseekV3Attention, the absorbed decoding
path equal to the explicit forward, left padding, and the latent cache's size."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.attention.latent import LatentAttentionConfig, MultiHeadLatentAttention, yarn_softmax_scale
from attnkit.decoding.cache import KVCache, LatentCache
from attnkit.kernels.rotary import rotary_cos_sin, rotary_frequencies

from helpers import assert_close_rel, assert_gradient, make_rng, max_rel_diff, randn

BASE = dict(hidden_size=16, num_heads=4, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=3)
CASES = {
    "q_lora": {"q_lora_rank": 8},
    "q_proj_half_split": {"rope_interleaved": False},
    "bias": {"q_lora_rank": 8, "attention_bias": True},
    "q_proj_bias": {"attention_bias": True},  # q_proj has no bias: only kv_a_proj_with_mqa and o_proj
    "window": {"q_lora_rank": 8, "sliding_window": 3},
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
# Each weight is the transpose of the transformers nn.Linear's; norms and biases are copied.
HF_NAMES = {"W_QA": "q_a_proj.weight", "b_QA": "q_a_proj.bias", "q_a_norm": "q_a_layernorm.weight",
            "W_QB": "q_b_proj.weight", "W_Q": "q_proj.weight", "W_KVA": "kv_a_proj_with_mqa.weight",
            "b_KVA": "kv_a_proj_with_mqa.bias", "kv_a_norm": "kv_a_layernorm.weight", "W_KVB": "kv_b_proj.weight",
            "W_O": "o_proj.weight", "b_O": "o_proj.bias"}


def _config(case, **extra):
    return LatentAttentionConfig(**{**BASE, **CASES[case], **extra})


def _layer(cfg, rng, dtype=np.float64, scale=0.4):
    attn = MultiHeadLatentAttention(cfg, rng=rng).astype(dtype)
    for name, p in attn.named_parameters():
        setattr(attn, name, randn(rng, *p.shape, scale=scale) + (1.0 if name.endswith("norm") else 0.0))
    return attn


def _left_padded_mask(b, length, pads):
    mask = np.ones((b, length), dtype=bool)
    for row, n in enumerate(pads):
        mask[row, :n] = False
    return mask


def _positions(mask):
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def _rotary(cfg, positions, dtype=np.float64, scaling=None, interleaved=None):
    inv_freq, factor = rotary_frequencies(cfg.qk_rope_head_dim, 10000.0, scaling, max_position_embeddings=128)
    interleaved = cfg.rope_interleaved if interleaved is None else interleaved
    return rotary_cos_sin(positions, inv_freq, factor, interleaved=interleaved, dtype=dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_by_finite_differences(case):
    rng = make_rng(len(case), 3)
    cfg = _config(case)
    attn = _layer(cfg, rng)
    b, length = 2, 5
    mask = _left_padded_mask(b, length, [0, 2])
    rotary = _rotary(cfg, _positions(mask))
    x, g = randn(rng, b, length, cfg.hidden_size), randn(rng, b, length, cfg.hidden_size)

    def loss():
        return np.sum(attn(x, rotary=rotary, attention_mask=mask) * g)

    loss()
    grad_x = attn.backward(g)
    assert_gradient(loss, x, grad_x, "x")
    for name, p in attn.named_parameters():
        assert_gradient(loss, p, attn.grads[name], name)


# ----------------------------------------------------------------------------------------------------------
# transformers' DeepseekV3Attention (torch autograd)
# ----------------------------------------------------------------------------------------------------------
def _hf_attention(cfg, rope_parameters, tdtype):
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf_cfg = DeepseekV3Config(
        vocab_size=32, hidden_size=cfg.hidden_size, intermediate_size=16, moe_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleaved, attention_bias=cfg.attention_bias,
        rope_parameters=rope_parameters, max_position_embeddings=128)
    hf_cfg._attn_implementation = "sdpa"  # the eager path takes its softmax in float32 even for float64
    attn = DeepseekV3Attention(hf_cfg, 0).to(tdtype)
    if tdtype == torch.float64:
        for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):
            if norm is not None:
                _normalise_in_input_dtype(norm)
    return attn


def _normalise_in_input_dtype(norm):
    """transformers' RMSNorm rounds its input to float32 whatever its dtype (1e-7 relative in float64); the same
    formula in the input's dtype lets the float64 comparison check the rest of the layer to round-off."""
    def forward(h):
        return norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    norm.forward = forward


def _copy_to_hf(ours, theirs, tdtype):
    state = {}
    for name, p in ours.named_parameters():
        state[HF_NAMES[name]] = torch.tensor(p.T if name.startswith("W_") else p, dtype=tdtype)
    missing, unexpected = theirs.load_state_dict(state, strict=True)
    assert not missing and not unexpected


HF_CASES = {
    "q_lora_interleaved": ("q_lora", None),
    "q_proj_half_split": ("q_proj_half_split", None),
    "bias": ("bias", None),
    "q_proj_bias": ("q_proj_bias", None),
    "yarn_mscale": ("q_lora", YARN),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("hf_case", sorted(HF_CASES))
def test_matches_deepseek_v3_forward_and_backward(hf_case, dtype):
    case, scaling = HF_CASES[hf_case]
    rope_parameters = scaling or {"rope_type": "default", "rope_theta": 10000.0}
    cfg = _config(case, attention_scale=yarn_softmax_scale(BASE["qk_nope_head_dim"] + BASE["qk_rope_head_dim"],
                                                          scaling))
    rng = make_rng(len(hf_case), 5)
    ours = _layer(cfg, rng, dtype)
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    theirs = _hf_attention(cfg, rope_parameters, tdtype)
    assert theirs.scaling == pytest.approx(cfg.scale, rel=1e-15)
    _copy_to_hf(ours, theirs, tdtype)
    b, length = 3, 6
    mask = _left_padded_mask(b, length, [0, 2, 5])
    pos = _positions(mask)
    rotary = _rotary(cfg, pos, dtype, scaling)
    hf_cos, hf_sin = _rotary(cfg, pos, dtype, scaling, interleaved=False)  # transformers' layout: cat(f, f)
    x, g = randn(rng, b, length, cfg.hidden_size, dtype=dtype), randn(rng, b, length, cfg.hidden_size, dtype=dtype)
    g[~mask] = 0  # padded queries: transformers spreads them uniformly, we give zeros; neither reaches a real token
    y = ours(x, rotary=rotary, attention_mask=mask)
    grad_x = ours.backward(g)

    allowed = np.tril(np.ones((length, length), bool)) & mask[:, None, :]  # (B, Lq, Lk)
    additive = torch.from_numpy(np.where(allowed, 0.0, torch.finfo(tdtype).min)[:, None]).to(tdtype)  # (B, 1, L, L)
    tx = torch.tensor(x, requires_grad=True)
    ty, _ = theirs(tx, position_embeddings=(torch.from_numpy(hf_cos), torch.from_numpy(hf_sin)),
                   attention_mask=additive)
    ty.backward(torch.from_numpy(g))
    real = mask[..., None]
    errors = {"y": assert_close_rel(np.where(real, y, 0), np.where(real, ty.detach().numpy(), 0), dtype, "y"),
              "x": assert_close_rel(grad_x, tx.grad.numpy(), dtype, "grad_x")}
    hf_params = dict(theirs.named_parameters())
    for name in ours.grads:
        ref = hf_params[HF_NAMES[name]].grad.numpy()
        errors[name] = assert_close_rel(ours.grads[name], ref.T if name.startswith("W_") else ref, dtype, name)
    assert set(ours.grads) == {k for k, v in HF_NAMES.items() if v in hf_params}  # every parameter compared
    print(hf_case, np.dtype(dtype).name, {k: f"{v:.1e}" for k, v in errors.items()})


def test_rotary_tables_match_deepseek_v3_yarn():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = _config("q_lora")
    hf_rotary = DeepseekV3RotaryEmbedding(_hf_attention(cfg, YARN, torch.float32).config)
    pos = np.arange(40)[None]
    cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), torch.from_numpy(pos))
    ours = _rotary(cfg, pos, np.float32, YARN, interleaved=False)
    np.testing.assert_allclose(ours[0], cos.numpy(), atol=2e-6)
    np.testing.assert_allclose(ours[1], sin.numpy(), atol=2e-6)


# ----------------------------------------------------------------------------------------------------------
# the absorbed form and the latent cache
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["q_lora", "q_proj_half_split", "window"])
@pytest.mark.parametrize("chunks", [(7,), (3, 1, 1, 1, 1), (1,) * 7, (2, 5)])
def test_absorbed_decoding_equals_the_explicit_forward(case, chunks):
    rng = make_rng(len(case), len(chunks))
    cfg = _config(case)
    attn = _layer(cfg, rng)
    b, length = 2, sum(chunks)
    mask = _left_padded_mask(b, length, [0, 3])
    cos, sin = _rotary(cfg, _positions(mask))
    x = randn(rng, b, length, cfg.hidden_size)
    full = attn(x, rotary=(cos, sin), attention_mask=mask)
    for form in ("absorbed", "explicit"):
        cache = LatentCache(1, b, cfg.latent_dim, np.float64, max_length=length)
        start, pieces = 0, []
        for n in chunks:
            end = start + n
            pieces.append(attn(x[:, start:end], rotary=(cos[:, start:end], sin[:, start:end]),
                               attention_mask=mask[:, :end], cache=cache, form=form))
            start = end
        stepped = np.concatenate(pieces, axis=1)
        assert max_rel_diff(stepped, full) < 1e-13, (form, max_rel_diff(stepped, full))
        assert cache.nbytes == b * length * cfg.latent_dim * 8  # the latent only, no keys or values
    uncached = attn(x, rotary=(cos, sin), attention_mask=mask, form="absorbed")
    assert max_rel_diff(uncached, full) < 1e-13
    with pytest.raises(RuntimeError, match="without a cache"):
        attn.backward(np.ones_like(full))


def test_float32_absorbed_decoding_stays_close_to_the_explicit_forward():
    rng = make_rng(4)
    cfg = _config("q_lora")
    attn = _layer(cfg, rng, np.float32)
    length = 6
    cos, sin = _rotary(cfg, np.arange(length)[None], np.float32)
    x = randn(rng, 1, length, cfg.hidden_size, dtype=np.float32)
    full = attn(x, rotary=(cos, sin))
    cache = LatentCache(1, 1, cfg.latent_dim, np.float32)
    steps = [attn(x[:, i:i + 1], rotary=(cos[:, i:i + 1], sin[:, i:i + 1]), cache=cache) for i in range(length)]
    stepped = np.concatenate(steps, axis=1)
    assert stepped.dtype == np.float32 and max_rel_diff(stepped, full) < 2e-6


@pytest.mark.parametrize("form", ["uncached", "explicit", "absorbed"])
def test_left_padded_rows_equal_each_row_alone(form):
    rng = make_rng(8)
    cfg = _config("q_lora")
    attn = _layer(cfg, rng)
    pads, length = [0, 2, 4], 6
    mask = _left_padded_mask(len(pads), length, pads)
    cos, sin = _rotary(cfg, _positions(mask))
    x = randn(rng, len(pads), length, cfg.hidden_size)
    if form == "uncached":  # the training forward over the whole padded batch
        batched = attn(x, rotary=(cos, sin), attention_mask=mask)
    else:  # the prompt in one call, then one token per call (decoding)
        prompt = 3
        cache = LatentCache(1, len(pads), cfg.latent_dim, np.float64)
        batched = np.concatenate(
            [attn(x[:, :prompt], rotary=(cos[:, :prompt], sin[:, :prompt]), attention_mask=mask[:, :prompt],
                  cache=cache, form=form)]
            + [attn(x[:, i:i + 1], rotary=(cos[:, i:i + 1], sin[:, i:i + 1]), attention_mask=mask[:, :i + 1],
                    cache=cache, form=form) for i in range(prompt, length)], axis=1)
    for row, pad in enumerate(pads):
        alone_rotary = _rotary(cfg, np.arange(length - pad)[None])
        alone = attn(x[row:row + 1, pad:], rotary=alone_rotary)  # (1, L - pad, D): explicit, no mask
        assert max_rel_diff(batched[row, pad:], alone[0]) < 1e-13, row


def test_latent_cache_holds_the_latent_only():
    # DeepSeek-V3's attention in float16: C + R = 512 + 64 numbers per token and layer ...
    v3 = LatentAttentionConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    latent = LatentCache(1, 1, v3.latent_dim, np.float16, max_length=1)
    latent.update(0, np.zeros((1, 1, v3.latent_dim)))
    # ... against Llama-style GQA at the same width (8 key/value heads of 128) ...
    gqa = KVCache(1, 1, num_kv_heads=8, head_dim=128, dtype=np.float16, max_length=1)
    gqa.update(0, np.zeros((1, 8, 1, 128)), np.zeros((1, 8, 1, 128)))
    # ... and the per-head keys and values of MLA's own explicit form
    explicit = v3.num_heads * (v3.qk_head_dim + v3.v_head_dim) * 2
    assert (latent.nbytes, gqa.nbytes, explicit) == (1152, 4096, 81920)
    # The tiny layer after 5 decoded tokens of 2 rows: 2 * 5 * (C + R) float64 numbers, nothing else.
    cfg = _config("q_lora")
    attn = _layer(cfg, make_rng(2))
    cache = LatentCache(1, 2, cfg.latent_dim, np.float64, max_length=5)
    cos, sin = _rotary(cfg, np.tile(np.arange(5), (2, 1)))
    x = randn(make_rng(3), 2, 5, cfg.hidden_size)
    for i in range(5):
        attn(x[:, i:i + 1], rotary=(cos[:, i:i + 1], sin[:, i:i + 1]), cache=cache)
    assert cache.length == 5 and cache.nbytes == 2 * 5 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 8
    cache.reorder(np.array([1, 1, 0]))
    assert cache.batch_size == 3 and cache.nbytes == 3 * 5 * cfg.latent_dim * 8
    with pytest.raises(ValueError, match="max_length=5"):
        cache.update(0, np.zeros((3, 1, cfg.latent_dim)))


def test_float32_stays_float32_and_errors_name_arguments():
    rng = make_rng(9)
    cfg = _config("q_lora")
    attn = _layer(cfg, rng, np.float32)
    rotary = _rotary(cfg, np.arange(3)[None], np.float32)
    x = randn(rng, 1, 3, 16, dtype=np.float32)
    x_before = x.copy()
    y = attn(x, rotary=rotary)
    grad_x = attn.backward(np.ones_like(y))
    assert y.dtype == np.float32 and grad_x.dtype == np.float32 and np.array_equal(x, x_before)
    assert all(g.dtype == np.float32 for g in attn.grads.values())
    with pytest.raises(ValueError, match="attention_mask"):
        attn(x, rotary=rotary, attention_mask=np.ones((1, 4), bool))
    with pytest.raises(ValueError, match="rotary"):
        attn(x, rotary=rotary[:1])
    with pytest.raises(ValueError, match=r"\(B, L, R\)"):
        attn(x, rotary=_rotary(cfg, np.arange(4)[None], np.float32))
    with pytest.raises(ValueError, match="form"):
        attn(x, rotary=rotary, form="fast")
    with pytest.raises(ValueError, match="hidden_size"):
        attn(np.zeros((1, 3, 8)), rotary=rotary)
    with pytest.raises(ValueError, match="even"):
        LatentAttentionConfig(**{**BASE, "qk_rope_head_dim": 3})
    with pytest.raises(ValueError, match="latent_new"):
        LatentCache(1, 1, cfg.latent_dim).update(0, np.zeros((1, 1, cfg.latent_dim + 1)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_rotary_tables_is_no_rotation(case):
    """``rotary=None`` (Kimi Linear's NoPE latent attention) is the rotation by angle zero (cos 1, sin 0), forward,
    backward and through a cache."""
    rng = make_rng(len(case), 11)
    cfg = _config(case)
    attn = _layer(cfg, rng)
    x, g = randn(rng, 2, 5, 16), randn(rng, 2, 5, 16)
    still = (np.ones((2, 5, cfg.qk_rope_head_dim)), np.zeros((2, 5, cfg.qk_rope_head_dim)))
    y = attn(x, rotary=None)
    grad_x = attn.backward(g)
    grads = {n: v.copy() for n, v in attn.grads.items()}
    attn.zero_grad()
    np.testing.assert_allclose(y, attn(x, rotary=still), rtol=0, atol=1e-14)
    np.testing.assert_allclose(grad_x, attn.backward(g), rtol=0, atol=1e-13)
    for name, grad in attn.grads.items():
        np.testing.assert_allclose(grad, grads[name], rtol=0, atol=1e-13)
    cache = LatentCache(1, 2, cfg.latent_dim, np.float64)
    steps = np.concatenate([attn(x[:, t:t + 1], rotary=None, cache=cache) for t in range(5)], axis=1)
    np.testing.assert_allclose(steps, y, rtol=0, atol=1e-13)


def test_a_latent_cache_keeps_the_states_of_the_layers_beside_it():
    """Kimi Linear's cache: latents for the attention layer, a state for the other; a mark and a crop bring the
    state back, a reorder moves its rows, and arrays / load_arrays round-trip both."""
    from attnkit.layers import KimiDeltaAttention

    rng = make_rng(12)
    layer = KimiDeltaAttention(16, 2, 4, rng=0)
    cache = LatentCache(2, 2, 6, np.float64, states={0: layer.new_cache(2, dtype=np.float64)})
    x = randn(rng, 2, 4, 16)
    with pytest.raises(ValueError, match="keeps a state, not latents"):
        cache.update(0, np.zeros((2, 1, 6)))
    with pytest.raises(ValueError, match="keeps latents, not a state"):
        cache.state(1)
    layer(x[:, :2], cache=cache.state(0))
    cache.update(1, randn(rng, 2, 2, 6))
    cache.record(np.zeros((2, 2), np.int64))
    assert cache.length == 2 and cache.needs_marks and cache.mark() == 2
    kept = cache.state(0).recurrent_state.copy()
    layer(x[:, 2:], cache=cache.state(0))
    cache.update(1, randn(rng, 2, 2, 6))
    cache.record(np.zeros((2, 2), np.int64))
    assert not cache.can_crop(3) and cache.can_crop(2) and cache.can_crop(0)
    with pytest.raises(ValueError, match="marked lengths: \\[2\\]"):
        cache.crop(3)
    cache.crop(2)
    assert cache.length == 2 and np.array_equal(cache.state(0).recurrent_state, kept)
    cache.reorder(np.array([1, 1, 0]))
    assert np.array_equal(cache.state(0).recurrent_state, kept[[1, 1, 0]]) and cache.batch_size == 3
    arrays = cache.arrays()
    assert set(arrays) == {"token_ids", "layers.1.latent", "layers.0.state.conv_state",
                           "layers.0.state.recurrent_state"}
    fresh = LatentCache(2, 3, 6, np.float64, states={0: layer.new_cache(3, dtype=np.float64)})
    fresh.load_arrays(arrays)
    assert fresh.length == 2 and np.array_equal(fresh.state(0).recurrent_state, kept[[1, 1, 0]])
    cache.crop(0)
    assert cache.length == 0 and not cache.state(0).recurrent_state.any()

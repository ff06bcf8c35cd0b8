"""GroupedQueryAttention: exact gradients, parity with HF Llama/Mistral/Qwen2 attention, cached = uncached."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit.attention.grouped_query import GroupedQueryAttention
from attnkit.decoding.cache import KVCache
from attnkit.layers.rotary import RotaryEmbedding
from decoder_cases import copy_attention, hf_config, tiny_config

from helpers import assert_close_rel, assert_gradient, make_rng, randn

CASES = {
    "gqa": {},
    "mqa": {"num_kv_heads": 1},
    "mha": {"num_kv_heads": 4},
    "bias": {"attention": {"bias": True, "output_bias": True}},
    "window": {"family": "mistral", "attention": {"sliding_window": 3},
               "layer_types": ("sliding_attention", "full_attention")},
    "partial_interleaved": {"rotary": {"partial_factor": 0.5, "interleaved": True}, "head_dim": 4},
}


def _layer(case, rng, dtype=np.float64, scale=0.4):
    cfg = tiny_config(**CASES[case])
    attn = GroupedQueryAttention(cfg, 0, rng=rng).astype(dtype)
    for name, p in attn.named_parameters():
        setattr(attn, name, randn(rng, *p.shape, scale=scale))
    return cfg, attn


def _left_padded_mask(b, length, pads):
    mask = np.ones((b, length), dtype=bool)
    for row, n in enumerate(pads):
        mask[row, :n] = False
    return mask


def _positions(mask):
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def band_mask(seq_q, seq_k, window):
    """Independent window band, bottom-right aligned: query i sees key j iff i + Lk - Lq - W < j."""
    return np.array([[j > i + seq_k - seq_q - window for j in range(seq_k)] for i in range(seq_q)])


def test_window_counts_the_query_itself():
    rng = make_rng(11)
    cfg, attn = _layer("window", rng)  # W = 3
    x = randn(rng, 1, 6, cfg.hidden_size)
    y = attn(x)
    g = np.zeros_like(y)
    g[0, 5] = 1.0
    grad_x = attn.backward(g)
    # Query 5 sees keys 3, 4, 5 only: inputs 0..2 get no gradient, 3..5 do.
    assert np.all(grad_x[0, :3] == 0) and np.all(np.abs(grad_x[0, 3:]).sum(axis=-1) > 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_by_finite_differences(case):
    rng = make_rng(len(case))
    cfg, attn = _layer(case, rng)
    b, length = 2, 5
    mask = _left_padded_mask(b, length, [0, 2])
    rotary = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)(_positions(mask), dtype=np.float64)
    x, g = randn(rng, b, length, cfg.hidden_size), randn(rng, b, length, cfg.hidden_size)

    def loss():
        return np.sum(attn(x, rotary=rotary, attention_mask=mask) * g)

    loss()
    grad_x = attn.backward(g)
    assert_gradient(loss, x, grad_x, "x")
    for name, p in attn.named_parameters():
        assert_gradient(loss, p, attn.grads[name], name)


def _hf_attention(cfg, layer_idx=0):
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    hf_cfg = hf_config(cfg)
    hf_cfg._attn_implementation = "sdpa"  # HF's eager path takes its softmax in float32 even for float64
    cls = {"llama": LlamaAttention, "mistral": MistralAttention, "qwen2": Qwen2Attention}[cfg.family]
    return cls(hf_cfg, layer_idx)


HF_CASES = {
    "llama_gqa": {},
    "llama_mqa": {"num_kv_heads": 1},
    "llama_bias": {"attention": {"bias": True, "output_bias": True}},
    "mistral_window": {"family": "mistral", "attention": {"sliding_window": 3},
                       "layer_types": ("sliding_attention",) * 2},
    "qwen2_bias": {"family": "qwen2", "attention": {"bias": True}},
    "qwen2_window": {"family": "qwen2", "attention": {"bias": True, "sliding_window": 2},
                     "layer_types": ("sliding_attention", "full_attention")},
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_matches_hugging_face_forward_and_backward(case, dtype):
    rng = make_rng(len(case), 7)
    cfg = tiny_config(**HF_CASES[case])
    ours = GroupedQueryAttention(cfg, 0, rng=rng).astype(dtype)
    for name, p in ours.named_parameters():
        setattr(ours, name, randn(rng, *p.shape, scale=0.4))
    tdtype = torch.float64 if dtype == np.float64 else torch.float32
    theirs = _hf_attention(cfg).to(tdtype)
    copy_attention(ours, theirs, tdtype)
    b, length = 3, 6
    mask = _left_padded_mask(b, length, [0, 2, 5])
    pos = _positions(mask)
    cos, sin = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)(pos, dtype=dtype)
    x, g = randn(rng, b, length, cfg.hidden_size, dtype=dtype), randn(rng, b, length, cfg.hidden_size, dtype=dtype)
    g[~mask] = 0  # padded queries: HF spreads them uniformly, we give zeros; neither reaches a real token
    y = ours(x, rotary=(cos, sin), attention_mask=mask)
    grad_x = ours.backward(g)

    allowed = np.tril(np.ones((length, length), bool)) & mask[:, None, :]  # (B, Lq, Lk)
    window = cfg.layers[0].window
    if window is not None:
        allowed &= band_mask(length, length, window)
    additive = torch.from_numpy(np.where(allowed, 0.0, torch.finfo(tdtype).min)[:, None]).to(tdtype)  # (B, 1, L, L)
    tx = torch.tensor(x, requires_grad=True)
    ty, _ = theirs(tx, position_embeddings=(torch.from_numpy(cos), torch.from_numpy(sin)), attention_mask=additive)
    ty.backward(torch.from_numpy(g))
    real = mask[..., None]
    assert_close_rel(np.where(real, y, 0), np.where(real, ty.detach().numpy(), 0), dtype, f"{case} y")
    assert np.all(y[~mask] == ours._parameters.get("b_O", 0.0))  # a query with no key: zero attention output
    assert_close_rel(grad_x, tx.grad.numpy(), dtype, f"{case} grad_x")
    for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
        assert_close_rel(ours.grads[f"W_{name}"], getattr(theirs, proj).weight.grad.numpy().T, dtype, name)
        if f"b_{name}" in ours.grads:
            assert_close_rel(ours.grads[f"b_{name}"], getattr(theirs, proj).bias.grad.numpy(), dtype, name)


@pytest.mark.parametrize("case", ["gqa", "window", "partial_interleaved"])
@pytest.mark.parametrize("chunks", [(7,), (3, 1, 1, 1, 1), (1,) * 7, (2, 5)])
def test_cached_steps_equal_the_uncached_forward(case, chunks):
    rng = make_rng(len(case), len(chunks))
    cfg, attn = _layer(case, rng)
    b, length = 2, sum(chunks)
    mask = _left_padded_mask(b, length, [0, 3])
    rotary = RotaryEmbedding(cfg.rotary, cfg.head_dim, cfg.max_position_embeddings)
    cos, sin = rotary(_positions(mask), dtype=np.float64)
    x = randn(rng, b, length, cfg.hidden_size)
    full = attn(x, rotary=(cos, sin), attention_mask=mask)
    cache = KVCache(cfg.num_layers, b, cfg.num_kv_heads, cfg.head_dim, np.float64,
                    windows=[s.window for s in cfg.layers])
    start, pieces = 0, []
    for n in chunks:
        end = start + n
        pieces.append(attn(x[:, start:end], rotary=(cos[:, start:end], sin[:, start:end]),
                           attention_mask=mask[:, :end], cache=cache))
        start = end
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-12, atol=1e-14)
    with pytest.raises(RuntimeError, match="without a cache"):
        attn.backward(np.ones_like(pieces[-1]))


def test_float32_stays_float32_and_errors_name_arguments():
    rng = make_rng(9)
    cfg, attn = _layer("gqa", rng, dtype=np.float32)
    y = attn(randn(rng, 1, 3, 16, dtype=np.float32))
    assert y.dtype == np.float32 and attn.backward(np.ones_like(y)).dtype == np.float32
    with pytest.raises(ValueError, match="attention_mask"):
        attn(np.zeros((1, 3, 16)), attention_mask=np.ones((1, 4), bool))
    with pytest.raises(ValueError, match="layer_index"):
        GroupedQueryAttention(cfg, 5)
    with pytest.raises(ValueError, match="hidden_size"):
        attn(np.zeros((1, 3, 8)))

"""Llama 4's attention parts on GroupedQueryAttention: the ``chunked_attention`` layer (a query sees its own chunk of
positions, counted from its row's first real token), the query temperature of the layers without rotary and the
q/k RMS norm without weights after the rotation. Exact gradients by finite differences (float64), parity with
transformers' Llama4TextAttention forward and backward, cached (chunks of new tokens and one-token steps) = uncached
across chunk boundaries, and the chunked flex mask against its definition."""
from __future__ import annotations

import numpy as np
import pytest

import torch
from attnkit import flex as F
from attnkit.attention.grouped_query import GroupedQueryAttention, QueryTemperature, slot_positions
from attnkit.decoding.cache import KVCache
from attnkit.layers.rotary import RotaryEmbedding
from decoder_cases import copy_attention, tiny_config

from helpers import assert_close_rel, assert_gradient, make_rng, randn

CHUNK = 3


def _config(qk_norm="unit_after_rotary", temperature=(2.0, 0.5)):
    """Layer 0: chunked, interleaved rotary, the unit q/k norm; layer 1: no rotary, full, the temperature."""
    return tiny_config("llama4_text", attention=dict(chunk_size=CHUNK, qk_norm=qk_norm, query_temperature=temperature),
                       rotary=dict(interleaved=True, skip_layers=(1,)),
                       layer_types=("chunked_attention", "full_attention"))


def _layer(layer, rng, dtype=np.float64, **settings):
    cfg = _config(**settings)
    attn = GroupedQueryAttention(cfg, layer, rng=rng).astype(dtype)
    for name, p in attn.named_parameters():
        setattr(attn, name, randn(rng, *p.shape, scale=0.4).astype(dtype))
    return cfg, attn


def _left_padded_mask(b, length, pads):
    mask = np.ones((b, length), dtype=bool)
    for row, n in enumerate(pads):
        mask[row, :n] = False
    return mask


def _positions(mask):
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def _rotary(cfg, layer, positions, dtype=np.float64):
    rotary = cfg.layers[layer].rotary
    return None if rotary is None else RotaryEmbedding(rotary, cfg.head_dim, cfg.max_position_embeddings)(
        positions, dtype=dtype)


def test_the_config_places_each_part_on_its_layers():
    cfg = _config()
    first, second = cfg.layers
    assert (first.chunk, second.chunk) == (CHUNK, None)
    assert (first.keys_kept, second.keys_kept) == (CHUNK, None)
    assert (first.qk_norm, second.qk_norm) == ("unit_after_rotary", None)  # rotary layers only
    assert (first.query_temperature, second.query_temperature) == (None, (2.0, 0.5))  # NoPE layers only
    assert GroupedQueryAttention(cfg, 0, rng=0).state_dict().keys() == {"W_Q", "W_K", "W_V", "W_O"}  # no norm weights
    with pytest.raises(ValueError, match="chunked_attention layers but attention.chunk_size is None"):
        tiny_config("llama4_text", layer_types=("chunked_attention", "full_attention"))
    with pytest.raises(ValueError, match="query_temperature must be"):
        tiny_config("llama4_text", attention=dict(query_temperature=(2.0,)))


@pytest.mark.parametrize("layer", [0, 1])
def test_gradients_by_finite_differences(layer):
    rng = make_rng(61, layer)
    cfg, attn = _layer(layer, rng)
    b, length = 2, 8
    mask = _left_padded_mask(b, length, [0, 2])
    rotary = _rotary(cfg, layer, _positions(mask))
    x, g = randn(rng, b, length, cfg.hidden_size), randn(rng, b, length, cfg.hidden_size)

    def loss():
        return np.sum(attn(x, rotary=rotary, attention_mask=mask) * g)

    loss()
    grad_x = attn.backward(g)
    assert_gradient(loss, x, grad_x, "x")
    for name, p in attn.named_parameters():
        assert_gradient(loss, p, attn.grads[name], name)


def test_a_query_sees_only_its_chunk_counted_from_the_first_real_token():
    rng = make_rng(62)
    cfg, attn = _layer(0, rng)
    mask = _left_padded_mask(2, 8, [0, 2])  # row 1's positions 0..5 sit in slots 2..7
    x = randn(rng, 2, 8, cfg.hidden_size)
    for row, slot, chunk_slots in ((0, 7, [6, 7]), (0, 5, [3, 4, 5]), (1, 7, [5, 6, 7]), (1, 4, [2, 3, 4])):
        y = attn(x, rotary=_rotary(cfg, 0, _positions(mask)), attention_mask=mask)
        g = np.zeros_like(y)
        g[row, slot] = 1.0
        grad_x = attn.backward(g)
        reached = np.flatnonzero(np.abs(grad_x[row]).sum(axis=-1) > 0)
        assert reached.tolist() == chunk_slots, (row, slot)


def test_matches_transformers_llama4_attention_forward_and_backward():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding

    cfg = _config(temperature=(2.0, 0.5))
    hf_cfg = Llama4TextConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                              num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, num_hidden_layers=2,
                              rms_norm_eps=cfg.norm.eps, no_rope_layers=[1, 0], attention_chunk_size=CHUNK,
                              floor_scale=2, attn_scale=0.5, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": cfg.rotary.theta})
    hf_cfg._attn_implementation = "eager"
    b, length = 2, 8
    positions = np.tile(np.arange(length), (b, 1))  # unpadded: transformers' temperature counts slots
    freqs = Llama4TextRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float64), torch.from_numpy(positions))
    for layer in (0, 1):
        rng = make_rng(63, layer)
        _, ours = _layer(layer, rng)
        theirs = Llama4TextAttention(hf_cfg, layer).double()
        copy_attention(ours, theirs)
        x, g = randn(rng, b, length, cfg.hidden_size), randn(rng, b, length, cfg.hidden_size)
        y = ours(x, rotary=_rotary(cfg, layer, positions))
        grad_x = ours.backward(g)
        allowed = np.tril(np.ones((length, length), bool))
        if layer == 0:
            allowed &= positions[0][:, None] // CHUNK == positions[0][None, :] // CHUNK
        additive = torch.from_numpy(np.where(allowed, 0.0, -1e300)[None, None])  # (1, 1, L, L)
        tx = torch.tensor(x, requires_grad=True)
        ty, _ = theirs(tx, position_embeddings=freqs, attention_mask=additive)
        ty.backward(torch.from_numpy(g))
        # transformers rotates, normalises and takes the temperature in float32 whatever the module's dtype, so
        # its float64 module agrees to float32's rounding (float64 exactness is the finite differences' test)
        assert_close_rel(y, ty.detach().numpy(), np.float32, f"layer {layer} y")
        assert_close_rel(grad_x, tx.grad.numpy(), np.float32, f"layer {layer} grad_x")
        for name, proj in (("Q", "q_proj"), ("K", "k_proj"), ("V", "v_proj"), ("O", "o_proj")):
            assert_close_rel(ours.grads[f"W_{name}"], getattr(theirs, proj).weight.grad.numpy().T, np.float32, name)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("pieces", [(9,), (4, 1, 1, 1, 1, 1), (1,) * 9, (2, 5, 2)])
def test_cached_pieces_and_steps_equal_the_uncached_forward(layer, pieces):
    """Every chunk boundary (positions 3 and 6) is crossed by a cached piece or a one-token step, on a row that is
    left-padded and one that is not; the cache keeps only the chunk's slots (a ring of C)."""
    rng = make_rng(64, layer, len(pieces))
    cfg, attn = _layer(layer, rng)
    b, length = 2, sum(pieces)
    mask = _left_padded_mask(b, length, [0, 2])
    rotary = _rotary(cfg, layer, _positions(mask))
    x = randn(rng, b, length, cfg.hidden_size)
    full = attn(x, rotary=rotary, attention_mask=mask)
    cache = KVCache(cfg.num_layers, b, cfg.num_kv_heads, cfg.head_dim, np.float64,
                    windows=[s.keys_kept for s in cfg.layers])
    start, outs = 0, []
    for n in pieces:
        end = start + n
        part = None if rotary is None else (rotary[0][:, start:end], rotary[1][:, start:end])
        if n == 1 and start:  # a decoding step through the layer's step
            outs.append(attn.step(x[:, start], rotary=part, attention_mask=mask[:, :end], cache=cache)[:, None])
        else:
            outs.append(attn(x[:, start:end], rotary=part, attention_mask=mask[:, :end], cache=cache))
        start = end
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-12, atol=1e-13)


def test_steps_without_a_mask_equal_the_forward():
    """With every token real the step has no key mask: the chunk alone must still hide the earlier chunks."""
    rng = make_rng(65)
    cfg, attn = _layer(0, rng)
    length = 8
    positions = np.arange(length)[None]
    rotary = _rotary(cfg, 0, positions)
    x = randn(rng, 1, length, cfg.hidden_size)
    full = attn(x, rotary=rotary)
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, np.float64, windows=[CHUNK, None])
    outs = [attn(x[:, :2], rotary=(rotary[0][:, :2], rotary[1][:, :2]), cache=cache)]
    for t in range(2, length):
        outs.append(attn.step(x[:, t], rotary=(rotary[0][:, t:t + 1], rotary[1][:, t:t + 1]), cache=cache)[:, None])
    np.testing.assert_allclose(np.concatenate(outs, axis=1), full, rtol=1e-12, atol=1e-13)


def test_query_temperature_is_llama4s_formula():
    temperature = QueryTemperature(4.0, 0.1)
    positions = np.array([[0, 2, 3, 7, 8190, 8191]])
    expected = 1 + 0.1 * np.log(np.floor((positions + 1.0) / 4.0) + 1.0)
    np.testing.assert_allclose(temperature.scales(positions, np.float64), expected, rtol=1e-15)
    q = np.ones((1, 2, 6, 3), np.float32)
    scaled, scales = temperature.forward(q, positions)
    assert scaled.dtype == np.float32 and scales.shape == (1, 1, 6, 1)
    np.testing.assert_array_equal(QueryTemperature.backward(q, scales), scaled)
    assert slot_positions(np.array([[False, True, True], [True, True, True]]), np.array([1, 2])).tolist() == \
        [[0, 1], [1, 2]]


@pytest.mark.parametrize("offset", [0, 3])
def test_chunked_mask_with_positions_is_its_definition_on_every_kernel(offset):
    rng = make_rng(66, offset)
    b, h, lk, d = 2, 2, 9, 4
    lq = lk - offset
    keep = _left_padded_mask(b, lk, [0, 4])
    positions = _positions(keep)
    q, k, v = randn(rng, b, h, lq, d), randn(rng, b, h, lk, d), randn(rng, b, h, lk, d)
    mask = F.and_masks(F.chunked_mask(CHUNK, offset=offset, positions=positions), F.padding_mask(keep))
    qi, ki = np.arange(lq)[:, None] + offset, np.arange(lk)[None]
    allowed = (ki <= qi) & (positions[:, qi] // CHUNK == positions[:, ki] // CHUNK) & keep[:, None, :]  # (B, Lq, Lk)
    block = F.create_block_mask(mask, b, None, lq, lk)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d)  # (B, H, Lq, Lk)
    scores = np.where(allowed[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True, initial=-1e300, where=allowed[:, None]))
    weights = np.where(allowed[:, None], weights, 0)
    total = weights.sum(-1, keepdims=True)
    expected = np.einsum("bhqk,bhkd->bhqd", weights / np.where(total == 0, 1, total), v)  # (B, H, Lq, D)
    for kernel in ("reference", "tiled"):
        out, _ = F.flex_attention(q, k, v, None, block, kernel=kernel)
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-13, err_msg=kernel)


def test_gemma4s_layerwise_layers_refuse_chunks_and_the_temperature():
    """Gemma 4's shared-key/value attention builds its own layers, without chunks, temperature or the unit norm: a
    config asking for them is refused when made rather than run with a full mask."""
    from attnkit.models.layerwise import LayerwiseConfig

    part = LayerwiseConfig(global_head_dim=8, global_kv_heads=1)
    for attention, types in ((dict(chunk_size=2), ("chunked_attention", "full_attention")),
                             (dict(query_temperature=(2.0, 0.5)), ("full_attention",) * 2),
                             (dict(qk_norm="unit_after_rotary"), ("full_attention",) * 2)):
        with pytest.raises(ValueError, match="layerwise layers are full_attention and sliding_attention layers"):
            tiny_config("gemma4_text", layerwise=part, norm=dict(placement="sandwich"), attention=attention,
                        layer_types=types)

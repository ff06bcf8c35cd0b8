"""The decoder switches of the newer families (OLMo 2, SmolLM3, GPT-NeoX, Gemma): exact float64 gradients by
finite differences of every parameter and of the input, a cached decode equal to the full forward, a padded
row equal to the row alone. Their parity with transformers is in tests/pretrained/test_families.py."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, ExpertsConfig, NormConfig, RotaryConfig

from helpers import assert_gradient, make_rng, randn

VARIANTS = {
    # OLMo 2: q/k RMSNorm over the whole projection, post-norms only
    "olmo2": dict(family="olmo2", norm=NormConfig(placement="post"),
                  attention=AttentionConfig(bias=True, output_bias=True, qk_norm="projection")),
    # SmolLM3: a NoPE layer beside a rotary one, the NoPE layer sliding
    "smollm3": dict(family="smollm3", layer_types=("full_attention", "sliding_attention"), mlp_bias=True,
                    rotary=RotaryConfig(skip_layers=(1,)), attention=AttentionConfig(sliding_window=2)),
    # GPT-NeoX: LayerNorm, plain MLP, partial rotary, parallel residual
    "gpt_neox": dict(family="gpt_neox", mlp="plain", activation="gelu", mlp_bias=True, residual="parallel",
                     norm=NormConfig(kind="layernorm"), rotary=RotaryConfig(partial_factor=0.5),
                     attention=AttentionConfig(bias=True, output_bias=True)),
    # Gemma 2: soft-capped scores and logits, (1 + w) norms before and after each branch, scaled embeddings
    "gemma2": dict(family="gemma2", embedding_scale=2.5, final_logit_softcap=2.0, activation="gelu_tanh",
                   layer_types=("sliding_attention", "full_attention"),
                   norm=NormConfig(offset=1.0, placement="sandwich"),
                   attention=AttentionConfig(scale=0.3, logit_softcap=1.5, sliding_window=2)),
    # Gemma 3: (1 + w) per-head q/k norms and a rotary base of its own on the sliding layers
    "gemma3_text": dict(family="gemma3_text", embedding_scale=1.5, layer_types=("sliding_attention", "full_attention"),
                        norm=NormConfig(offset=1.0, placement="sandwich"), rotary=RotaryConfig(sliding_theta=7.0),
                        attention=AttentionConfig(sliding_window=2, qk_norm="head")),
    # gpt-oss: learned sinks, biases, a top-2-of-3 mixture of clamped-SwiGLU experts (limit low enough to clamp)
    "gpt_oss": dict(family="gpt_oss", mlp="experts", layer_types=("sliding_attention", "full_attention"),
                    attention=AttentionConfig(sinks=True, bias=True, output_bias=True, sliding_window=2),
                    experts=ExpertsConfig(num_experts=3, per_token=2, swiglu_limit=0.6)),
}


def _model(name, rng, **extra):
    base = dict(vocab_size=7, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                intermediate_size=6, max_position_embeddings=32, rotary=RotaryConfig(theta=100.0))
    lm = CausalLM(DecoderConfig(**{**base, **VARIANTS[name], **extra}), rng=rng).astype(np.float64)
    for pname, p in lm.named_parameters():  # larger weights than the init so that every path matters
        if pname.endswith(("gamma", "q_norm", "k_norm")):
            p[...] = 1.0 - lm.config.norm.offset + 0.3 * rng.standard_normal(p.shape)
        else:
            p[...] = 0.4 * rng.standard_normal(p.shape)
    return lm


def _left_padded(rng, vocab, lengths, total):
    ids = rng.integers(0, vocab, size=(len(lengths), total))
    mask = np.zeros((len(lengths), total), dtype=bool)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = True
    return ids, mask


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_gradient_by_finite_differences(name):
    rng = make_rng(len(name), 1)
    lm = _model(name, rng)
    ids, mask = _left_padded(rng, 7, [5, 3], 5)
    g = randn(rng, 2, 5, 7)
    g[~mask] = 0

    def loss():
        return np.sum(lm(ids, mask) * g)

    lm.zero_grad()
    loss()
    grad_embedded = lm.backward(g)
    grads = dict(lm.named_gradients())
    for pname, p in lm.named_parameters():
        assert_gradient(loss, p, grads[pname], pname)
    # the returned input gradient is the embedding rows' gradient, gathered per token
    table = np.zeros_like(lm.embed.weight)
    np.add.at(table, ids, grad_embedded)
    if not lm.config.tie_word_embeddings:
        np.testing.assert_allclose(table, grads["embed.weight"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_steps_equal_the_full_forward(name):
    rng = make_rng(len(name), 2)
    lm = _model(name, rng)
    ids, mask = _left_padded(rng, 7, [9, 6], 9)
    full = lm(ids, mask)
    cache = lm.new_cache(2)
    pieces = [lm(ids[:, :3], mask[:, :3], cache=cache)]
    for t in range(3, 9):
        pieces.append(lm(ids[:, t:t + 1], mask[:, :t + 1], cache=cache))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-11, atol=1e-12)
    alone = lm(ids[1:, 3:])
    np.testing.assert_allclose(full[1, 3:], alone[0], rtol=1e-11, atol=1e-12)


def test_switches_are_checked():
    base = dict(family="llama", vocab_size=7, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                intermediate_size=6)
    with pytest.raises(ValueError, match="attention.qk_norm"):
        DecoderConfig(**base, attention=AttentionConfig(qk_norm="row"))
    with pytest.raises(ValueError, match="rotary.skip_layers"):
        DecoderConfig(**base, rotary=RotaryConfig(skip_layers=(2,)))
    with pytest.raises(ValueError, match="attention.logit_softcap"):
        DecoderConfig(**base, attention=AttentionConfig(logit_softcap=0.0))
    with pytest.raises(ValueError, match="rotary.sliding_theta"):
        DecoderConfig(**base, rotary=RotaryConfig(sliding_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="norm.placement"):
        DecoderConfig(**base, norm=NormConfig(placement="none"))
    with pytest.raises(TypeError, match="rotary must be a RotaryConfig or None"):
        DecoderConfig(**base, rotary={"theta": 1e4})
    with pytest.raises(ValueError, match="experts .* goes with mlp='experts'"):
        DecoderConfig(**base, experts=ExpertsConfig(num_experts=2, per_token=1))
    names = dict(CausalLM(DecoderConfig(**base, norm=NormConfig(placement="post")), rng=0).named_parameters())
    assert "layers.0.attn_post_norm.gamma" in names and "layers.0.mlp_post_norm.gamma" in names
    assert "layers.0.attn_norm.gamma" not in names

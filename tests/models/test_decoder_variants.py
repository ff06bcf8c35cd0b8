"""The decoder switches of the newer families (OLMo 2, SmolLM3, GPT-NeoX, Gemma 2-4, gpt-oss): exact float64
gradients by finite differences of every parameter and of the input, a cached decode equal to the full forward, a padded
row equal to the row alone. Their parity with transformers is in tests/pretrained/test_families.py."""
from __future__ import annotations

import numpy as np
import pytest

from attnkit.models import (
    AttentionConfig,
    CausalLM,
    DecoderConfig,
    ExpertsConfig,
    LayerwiseConfig,
    MLPConfig,
    NormConfig,
    RotaryConfig,
    ScalesConfig,
)
from decoder_cases import DECODER_VARIANTS, with_mlp

from helpers import assert_gradient, make_rng, numerical_gradient, randn

VARIANTS = {
    **DECODER_VARIANTS,
    # Gemma 4: wider global layers (proportional rotary) whose keys are the values, the last two layers reusing
    # keys and values with double-wide MLPs, per-layer inputs, layer scalars
    "gemma4_text": dict(family="gemma4_text", num_layers=4, scales=ScalesConfig(embedding=1.5, final_logit_softcap=2.0),
                        mlp=dict(activation="gelu_tanh"),
                        layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
                        norm=NormConfig(placement="sandwich"),
                        rotary=RotaryConfig(scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5},
                                            sliding_theta=7.0),
                        attention=AttentionConfig(scale=1.0, sliding_window=2, qk_norm="head"),
                        layerwise=LayerwiseConfig(global_head_dim=6, global_kv_heads=2, keys_are_values=True,
                                                  shared_kv_layers=2, wide_shared_mlp=True, per_layer_input_size=3,
                                                  per_layer_vocab_size=7)),
}


def _model(name, rng, **extra):
    base = dict(vocab_size=7, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                max_position_embeddings=32, rotary=RotaryConfig(theta=100.0))
    lm = CausalLM(DecoderConfig(**with_mlp({**base, **VARIANTS[name], **extra}, 6)), rng=rng).astype(np.float64)
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
    last_scalar = f"layers.{lm.config.num_layers - 1}.layer_scalar"
    for pname, p in lm.named_parameters():
        if pname == last_scalar:
            # The final RMSNorm undoes a scale of the last layer's output but for its eps: the gradient is near
            # zero (2e-6 here), so it is checked against the other layer scalars' gradients.
            scale = max(np.max(np.abs(v)) for k, v in grads.items() if k.endswith("layer_scalar"))
            assert np.max(np.abs(numerical_gradient(loss, p) - grads[pname])) <= 1e-9 * scale
            continue
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
                mlp=MLPConfig(6))
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
    with pytest.raises(ValueError, match=r"experts.layers must be layer indices below num_layers \(2\)"):
        DecoderConfig(**base, experts=ExpertsConfig(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4,
                                                    layers=(2,)))
    names = dict(CausalLM(DecoderConfig(**base, norm=NormConfig(placement="post")), rng=0).named_parameters())
    assert "layers.0.attn_post_norm.gamma" in names and "layers.0.mlp_post_norm.gamma" in names
    assert "layers.0.attn_norm.gamma" not in names


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_backward_for_the_inputs_alone_gives_the_same_gradient_and_leaves_no_parameter_gradient(name):
    lm = _model(name, make_rng(7))
    ids = np.array([[3, 1, 4, 1, 5, 6], [2, 6, 5, 3, 5, 0]])
    logits = lm(ids)
    grad_logits = make_rng(8).standard_normal(logits.shape)  # (B, L, V)
    full = lm.backward(grad_logits)  # (B, L, D)
    lm.zero_grad(set_to_none=True)
    lm(ids)
    with lm.input_gradients_only():
        alone = lm.backward(grad_logits)  # (B, L, D)
        assert not lm.embed.grads.allocated()  # the embedding's scatter-add is skipped
    np.testing.assert_allclose(alone, full, rtol=1e-12, atol=1e-14)
    assert all(not module.grads.allocated() and module.grads.wanted for _, module in lm.named_modules())


def test_the_inputs_block_frees_the_buffers_and_gives_the_gradients_back_after_an_error():
    lm = _model("olmo2", make_rng(9))
    ids = np.array([[1, 2, 3]])
    logits = lm(ids)
    lm.backward(np.ones_like(logits))
    with pytest.raises(KeyError, match="an error in the caller's code"):
        with lm.input_gradients_only():
            lm.backward(np.ones_like(logits))
            raise KeyError("an error in the caller's code")
    assert all(not module.grads.allocated() and module.grads.wanted for _, module in lm.named_modules())
    logits = lm(ids)
    lm.backward(np.ones_like(logits))  # the next backward forms every gradient again
    assert np.abs(lm.layers[0].mlp.grads["W_down"]).sum() > 0 and np.abs(lm.embed.grads["weight"]).sum() > 0

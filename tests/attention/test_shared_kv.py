"""Keys and values shared across layers (Gemma 4): the layer plan, the cache that stores only the owners', the
proportional rotary of the global layers against transformers' own function, and the refusals. The model's
gradients (the readers' share reaching the owner) are checked by finite differences in
tests/models/test_decoder_variants.py and against transformers in tests/pretrained/test_families.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from attnkit.decoding.cache import KVCache
from attnkit.kernels.rotary import rotary_frequencies
from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, LayerwiseConfig, MLPConfig, NormConfig

TYPES = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention")


def _config(placement="sandwich", **part):
    layerwise = LayerwiseConfig(**{**dict(global_head_dim=8, global_kv_heads=1, keys_are_values=True,
                                          shared_kv_layers=2), **part})
    return DecoderConfig(family="gemma4_text", vocab_size=11, hidden_size=8, num_layers=5, num_heads=2,
                         num_kv_heads=2, head_dim=4, mlp=MLPConfig(6), layer_types=TYPES,
                         attention=AttentionConfig(sliding_window=2), norm=NormConfig(placement=placement),
                         layerwise=layerwise)


def test_the_last_layers_reuse_the_last_earlier_layer_of_their_type():
    cfg = _config()
    assert cfg.layerwise.kv_owners(TYPES) == (None, None, None, 2, 1)
    assert [(s.num_kv_heads, s.head_dim) if s.cache == "keys_values" else None for s in cfg.layers] == \
        [(2, 4), (1, 8), (2, 4), None, None]
    assert [s.mixer for s in cfg.layers] == ["kv_owner_attention"] * 3 + ["kv_reader_attention"] * 2
    assert [s.kv_owner for s in cfg.layers] == [None, None, None, 2, 1]
    lm = CausalLM(cfg, rng=0)
    names = {name for name, _ in lm.named_parameters()}
    assert "layers.1.attention.W_K" in names and "layers.1.attention.W_V" not in names  # keys are the values
    assert "layers.0.attention.W_V" in names
    assert not any(name.startswith(("layers.3.attention.W_K", "layers.4.attention.k_norm")) for name in names)
    assert lm.layers[3].attention.shared is lm.layers[2].attention.shared
    assert lm.layers[4].attention.shared is lm.layers[1].attention.shared


def test_the_cache_stores_only_the_owners_and_counts_their_length():
    cfg = _config()
    lm = CausalLM(cfg, rng=0)
    cache = lm.new_cache(1)
    lm(np.array([[1, 2, 3]]), cache=cache)
    assert cache.length == 3
    k = np.zeros((1, 2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="layer 3 stores no keys and values"):
        cache.update(3, k, k)
    with pytest.raises(ValueError, match=r"k_new must have shape \(1, 1, 'Lnew', 8\)"):
        cache.update(1, k, k)
    with pytest.raises(ValueError, match="layer_shapes has 2 entries"):
        KVCache(3, 1, 2, 4, layer_shapes=[(2, 4), None])


def test_a_cache_whose_layers_hold_nothing_counts_the_ids_it_recorded():
    """An early exit of Nemotron-H that keeps only layers of the MLP alone stores nothing: its length is the ids
    the model's forward recorded, and cropping or reordering them moves it."""
    cache = KVCache(2, 2, 2, 4, layer_shapes=[None, None])
    assert cache.length == 0 and cache.nbytes == 0
    cache.record(np.array([[1, 2, 3], [4, 5, 6]]))
    assert cache.length == 3
    cache.crop(1)
    assert cache.length == 1
    cache.reorder(np.array([1, 1]))
    np.testing.assert_array_equal(cache.token_ids, [[4], [4]])


def test_a_reader_before_its_owner_ran_is_refused():
    lm = CausalLM(_config(), rng=0)
    with pytest.raises(RuntimeError, match="has not run in this pass"):
        lm.layers[3].attention(np.ones((1, 2, 8)))


@pytest.mark.parametrize("part, message", [
    (dict(shared_kv_layers=5), "must be smaller than num_layers"),
    (dict(global_kv_heads=3), "global_kv_heads"),
    (dict(per_layer_input_size=4), "both be positive or both 0"),
    (dict(global_head_dim=7), "global_head_dim must be even"),
    (dict(placement="pre"), "norms before and after both branches"),
])
def test_layer_plans_that_cannot_be_built_are_refused(part, message):
    with pytest.raises(ValueError, match=message):
        _config(**part)


def test_a_shared_layer_type_without_an_owner_is_refused():
    with pytest.raises(ValueError, match="no layer before them is a full_attention layer"):
        DecoderConfig(family="gemma4_text", vocab_size=11, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=2,
                      head_dim=4, mlp=MLPConfig(6), attention=AttentionConfig(sliding_window=2),
                      norm=NormConfig(placement="sandwich"),
                      layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                      layerwise=LayerwiseConfig(global_head_dim=8, global_kv_heads=2, shared_kv_layers=1))


@pytest.mark.parametrize("head_dim, share, theta, factor", [(16, 0.25, 1e6, 1.0), (12, 0.5, 100.0, 2.0),
                                                            (8, 1.0, 50.0, 1.0)])
def test_proportional_frequencies_equal_transformers(head_dim, share, theta, factor):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    full = {"rope_type": "proportional", "partial_rotary_factor": share, "rope_theta": theta, "factor": factor}
    cfg = transformers.Gemma4TextConfig(hidden_size=16, num_attention_heads=2, head_dim=4, global_head_dim=head_dim,
                                        num_hidden_layers=2, rope_parameters={
                                            "full_attention": full,
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, layer_type="full_attention")
    ours, attention_factor = rotary_frequencies(head_dim, theta, {"rope_type": "proportional",
                                                                  "partial_rotary_factor": share, "factor": factor})
    assert attention_factor == 1.0 and ours.shape == (head_dim // 2,)
    np.testing.assert_allclose(ours, theirs.to(torch.float64).numpy(), rtol=1e-6)
    assert np.count_nonzero(ours) == int(share * head_dim // 2)


@pytest.mark.parametrize("changes, message", [
    (dict(enable_moe_block=True), "enable_moe_block"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(per_layer_config={"0": {"head_dim": 16}}), "changes a sliding layer's heads"),
    (dict(per_layer_config={"1": {"head_dim": 16}, "4": {"head_dim": 32}}), "different heads"),
    (dict(per_layer_config={"1": {"sliding_window": 2}}), "may set only head_dim"),
    (dict(per_layer_config={"5": {"head_dim": 8}}), "keys must be layer indices below 5"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
])
def test_config_keys_attnkit_does_not_implement_are_refused(changes, message):
    from attnkit.pretrained.families import family

    config = json.loads(json.dumps(dict(
        model_type="gemma4_text", vocab_size=11, hidden_size=8, intermediate_size=6, num_hidden_layers=5,
        num_attention_heads=2, num_key_value_heads=2, head_dim=4, sliding_window=2, layer_types=list(TYPES),
        hidden_size_per_layer_input=0, per_layer_config={"1": {"head_dim": 8}, "4": {"head_dim": 8}})))
    assert family("gemma4_text").config_from_hf(config).layerwise.global_head_dim == 8
    # transformers pads the indices of deeper models ("01", ..., "29")
    padded = {**config, "per_layer_config": {"01": {"head_dim": 8}, "04": {"head_dim": 8}}}
    assert family("gemma4_text").config_from_hf(padded).layerwise.global_head_dim == 8
    # "vision": only image tokens attend both ways, so a text model is causal (transformers keeps is_causal)
    assert family("gemma4_text").config_from_hf({**config, "use_bidirectional_attention": "vision"}) == \
        family("gemma4_text").config_from_hf(config)
    with pytest.raises(ValueError, match=message):
        family("gemma4_text").config_from_hf({**config, **changes})


def test_a_readers_replaced_pattern_sends_its_value_gradient_to_the_owner():
    """With the pattern of reading layer 3 replaced by constant weights, the input gradient (through the owner's
    values, which layer 3 still averages) equals finite differences in float64."""
    from attnkit.explain import hooks

    rng = np.random.default_rng(0)
    lm = CausalLM(_config(per_layer_input_size=2, per_layer_vocab_size=11), rng=0).astype(np.float64)
    for _, p in lm.named_parameters():
        p[...] = p + 0.3 * rng.standard_normal(p.shape)
    ids = np.array([[1, 5, 2, 9, 3]])
    fixed = rng.random((1, 2, 5, 5)) * np.tri(5)
    fixed /= fixed.sum(-1, keepdims=True)
    weights = rng.normal(size=(1, 5, 11))
    names = {"blocks.3.attn.hook_pattern": lambda p, n: fixed}
    with hooks(lm, names):
        lm(ids)
        grad = lm.backward(weights)
    embeds = lm.embed.weight[ids[0]].copy()
    numeric = np.zeros_like(embeds)
    for index in np.ndindex(*embeds.shape):
        for sign in (1, -1):
            shifted = embeds.copy()
            shifted[index] += sign * 1e-6
            with hooks(lm, {**names, "hook_embed": lambda x, n, s=shifted: s[None]}):
                numeric[index] += sign * (lm(ids) * weights).sum() / 2e-6
    np.testing.assert_allclose(grad[0], numeric, atol=1e-7)

"""``DecoderConfig.layers`` is the one answer to "what is layer i": every family's blocks, mixers, MLP widths,
rotary tables and cache entries are what each layer's spec says, and the family rules it resolves (latent
attention, reused keys and values, NoPE layers, one-branch layers, dense first layers) come out right."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from attnkit.layers.lm_block import BLOCKS
from attnkit.models import (
    AttentionConfig,
    CausalLM,
    DecoderConfig,
    ExpertsConfig,
    LayerwiseConfig,
    MLPConfig,
    NormConfig,
    RotaryConfig,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "attnkit"

# The module each mixer kind names, written out here rather than read from MIXERS.
MIXER_CLASSES = {"full_attention": "GroupedQueryAttention", "sliding_attention": "GroupedQueryAttention",
                 "chunked_attention": "GroupedQueryAttention", "gated_attention": "GatedAttention",
                 "latent_attention": "MultiHeadLatentAttention", "kv_owner_attention": "KVOwnerAttention",
                 "kv_reader_attention": "KVReaderAttention", "linear_attention": "GatedDeltaNetMixer",
                 "kimi_delta_attention": "KimiDeltaAttentionMixer", "short_conv": "ShortConvMixer",
                 "mamba2": "Mamba2Mixer", "attention_mamba2": "AttentionMamba2Mixer", None: "Identity"}
# The part that shapes each mixer kind (none: the config's attention part, or no mixer)
PART_CLASSES = {"latent_attention": "LatentAttentionConfig", "linear_attention": "GatedDeltaNetConfig",
                "kimi_delta_attention": "KimiDeltaAttentionConfig", "short_conv": "ShortConvConfig",
                "mamba2": "Mamba2Config", "attention_mamba2": "AttentionMamba2Config"}


def _mlp_width(mlp) -> int | None:
    """F of a dense MLP from its weights (None for a mixture of experts or an absent MLP)."""
    params = dict(mlp.named_parameters())
    for name in ("W_down", "W2"):
        if name in params and params[name].ndim == 2:
            return params[name].shape[0]
    return None


def check_model_against_its_specs(lm: CausalLM) -> None:
    ids = np.array([[3, 5, 7]])
    cache = lm.new_cache(1)
    lm(ids, cache=cache)
    arrays = cache.arrays()
    for spec, block in zip(lm.config.layers, lm.layers, strict=True):
        i = spec.index
        assert type(block) is BLOCKS[spec.block], i
        assert type(block.attention).__name__ == MIXER_CLASSES[spec.mixer], (i, spec.mixer)
        assert type(spec.part).__name__ == PART_CLASSES.get(spec.mixer, "NoneType"), (i, spec.mixer)
        if spec.mlp is None:
            assert type(block.mlp).__name__ == "Identity", i
        elif spec.mlp == "experts":
            assert type(block.mlp).__name__ == "MixtureOfExperts", i
        else:
            assert _mlp_width(block.mlp) == spec.intermediate_size, i
        if hasattr(block.attention, "num_kv_heads") and spec.mixer not in ("latent_attention", None):
            assert (block.attention.head_dim, block.attention.num_kv_heads) == (spec.head_dim, spec.num_kv_heads)
            assert block.attention.window == spec.window
        assert (lm.layer_rotary[i] is None) == (spec.rotary is None), i
        # the model's cache is the list its layers' mixers make
        assert cache.kinds[i] == ("none" if spec.cache == "shared" else spec.cache), (i, cache.kinds[i])
        made = None if spec.mixer is None else block.attention.new_cache(1)
        assert type(cache.entries[i]) is type(made), (i, type(cache.entries[i]).__name__)
        held = {name.split(".", 2)[2] for name in arrays if name.startswith(f"layers.{i}.")}
        keys = {"keys", "values"} <= held
        states = any(name.startswith("state.") for name in held)
        expected = {"keys_values": (True, False), "paired": (True, True), "state": (False, True),
                    "shared": (False, False), "none": (False, False)}
        if spec.cache == "latent":
            assert held and not states, (i, held)
        else:
            assert (keys, states) == expected[spec.cache], (i, spec.cache, held)
        if spec.cache in ("keys_values", "paired"):
            kept = min(3, spec.keys_kept or 3)
            assert arrays[f"layers.{i}.keys"].shape == (1, spec.num_kv_heads, kept, spec.head_dim), i


def test_every_family_is_built_from_its_layers_specs(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from attnkit.pretrained import load_causal_lm
    from hf_models import FAMILY_MODELS, saved_model

    kinds = set()
    for name in FAMILY_MODELS:
        lm = load_causal_lm(saved_model(name, tmp_path)[0])
        check_model_against_its_specs(lm)
        kinds |= {(s.mixer, s.mlp, s.block, s.cache) for s in lm.config.layers}
    mixers = {k[0] for k in kinds}
    assert mixers == set(MIXER_CLASSES), sorted(map(str, set(MIXER_CLASSES) - mixers))  # every kind was seen
    assert {k[3] for k in kinds} == {"keys_values", "latent", "state", "paired", "shared", "none"}


def _config(**overrides) -> DecoderConfig:
    base = dict(family="llama", vocab_size=11, hidden_size=8, num_layers=4, num_heads=2, num_kv_heads=1,
                head_dim=4, mlp=MLPConfig(6))
    base.update(overrides)
    return DecoderConfig(**base)


def test_reused_keys_and_values_resolve_to_their_owner_with_wide_mlps_and_global_heads():
    cfg = _config(family="gemma4_text", norm=NormConfig(placement="sandwich"),
                  attention=AttentionConfig(sliding_window=2),
                  layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
                  layerwise=LayerwiseConfig(global_head_dim=8, global_kv_heads=1, shared_kv_layers=2,
                                            wide_shared_mlp=True))
    specs = cfg.layers
    assert [s.kv_owner for s in specs] == [None, None, 0, 1]
    assert [s.head_dim for s in specs] == [4, 8, 4, 8]
    assert [s.intermediate_size for s in specs] == [6, 6, 12, 12]
    assert [s.cache for s in specs] == ["keys_values", "keys_values", "shared", "shared"]
    assert [s.rotary.theta == cfg.rotary.sliding().theta for s in specs] == [True, True, True, True]
    check_model_against_its_specs(CausalLM(cfg, rng=0))


def test_nope_and_chunked_layers_take_the_temperature_and_drop_the_unit_norm():
    cfg = _config(family="llama4_text", rotary=RotaryConfig(skip_layers=(1, 3)),
                  attention=AttentionConfig(chunk_size=2, qk_norm="unit_after_rotary", query_temperature=(4.0, 0.1)),
                  layer_types=("chunked_attention", "full_attention") * 2)
    specs = cfg.layers
    assert [s.rotary is None for s in specs] == [False, True, False, True]
    assert [s.qk_norm for s in specs] == ["unit_after_rotary", None] * 2
    assert [s.query_temperature for s in specs] == [None, (4.0, 0.1)] * 2
    assert [s.keys_kept for s in specs] == [2, None, 2, None]
    check_model_against_its_specs(CausalLM(cfg, rng=0))


def test_dense_first_layers_and_one_branch_layers_resolve_their_mlps():
    experts = ExpertsConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3, layers=(2, 3))
    specs = _config(experts=experts).layers
    assert [s.mlp for s in specs] == ["gated", "gated", "experts", "experts"]
    single = _config(family="nemotron_h", residual="single", mlp=MLPConfig(6, kind="ungated", activation="relu2"),
                     layer_types=("full_attention", "mlp", "full_attention", "mlp")).layers
    assert [(s.mixer, s.mlp, s.block, s.cache) for s in single] == [
        ("full_attention", None, "mixer_only", "keys_values"), (None, "ungated", "mlp_only", "none")] * 2


def test_no_layer_is_built_from_a_rebuilt_or_impersonated_config():
    """Layers take their own sizes: no ``replace(config, ...)`` and no ``SimpleNamespace`` standing in for a
    config where blocks, layers and attention are built."""
    offenders = []
    for folder in ("layers", "attention", "models"):
        for path in sorted((SRC / folder).glob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    first = node.args[0] if node.args else None
                    if node.func.id == "SimpleNamespace" or (
                            node.func.id == "replace" and isinstance(first, ast.Name) and first.id == "config"
                            and any(k.arg in ("intermediate_size", "mlp_bias", "head_dim", "num_kv_heads")
                                    for k in node.keywords)):
                        offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == []

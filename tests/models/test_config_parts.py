"""``DecoderConfig``'s parts: the mixers' shapes in one ``mixer_parts`` field, each layer's in its spec; configs
saved with the older flat fields still load; every part's bad value is refused naming the part."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from attnkit.attention.latent import LatentAttentionConfig
from attnkit.layers import (
    AttentionMamba2Config,
    GatedDeltaNetConfig,
    KimiDeltaAttentionConfig,
    Mamba2Config,
    ShortConvConfig,
)
from attnkit.models import DecoderConfig, MLPConfig, RotaryConfig, ScalesConfig, SpecialTokens

SIZES = dict(vocab_size=11, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
OLD_SIZES = {**SIZES, "intermediate_size": 6}  # as configs were saved with the MLP's width a flat field
MAMBA = Mamba2Config(num_heads=2, head_dim=4, state_size=3, chunk_size=2)
LATENT = LatentAttentionConfig(hidden_size=8, num_heads=2, kv_lora_rank=5, qk_nope_head_dim=3, qk_rope_head_dim=4,
                               v_head_dim=3, rope_interleaved=False)


def _config(**overrides) -> DecoderConfig:
    return DecoderConfig(**{"family": "llama", **SIZES, "mlp": MLPConfig(6), **overrides})


def _kimi() -> DecoderConfig:
    return _config(family="kimi_linear", layer_types=("kimi_delta_attention", "full_attention"),
                   mixer_parts=(LATENT, KimiDeltaAttentionConfig(num_heads=2, head_dim=3, conv_kernel_size=3)),
                   rotary=RotaryConfig(skip_layers=(0, 1)))


def _falcon_and_bamba() -> DecoderConfig:
    """Both Mamba-2 layer types in one model, each with its own shape."""
    return _config(family="falcon_h1", layer_types=("attention_mamba2", "mamba2"),
                   mixer_parts=(MAMBA, AttentionMamba2Config(dataclasses.replace(MAMBA, head_dim=2), mamba_out=1.5)))


def test_the_field_list():
    names = [f.name for f in dataclasses.fields(DecoderConfig)]
    assert names == ["family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "mlp", "max_position_embeddings", "residual", "norm", "rotary", "attention", "experts", "scales",
                     "tie_word_embeddings", "layer_types", "tokens", "layerwise", "mixer_parts", "mtp_layers"]
    assert len(names) <= 25


def test_each_layer_s_part_is_its_mixer_s_shape():
    kimi = _kimi()
    assert [(s.mixer, type(s.part).__name__) for s in kimi.layers] == [
        ("kimi_delta_attention", "KimiDeltaAttentionConfig"), ("latent_attention", "LatentAttentionConfig")]
    assert kimi.mixer_parts[-1] is LATENT  # kept in MIXER_PARTS' order, whatever order they were given in
    both = _falcon_and_bamba()
    assert [s.part for s in both.layers] == [both.mixer_part(AttentionMamba2Config), MAMBA]
    assert both.layers[0].part.mamba2.head_dim == 2 and both.layers[1].part.head_dim == 4
    plain = _config(layer_types=("full_attention", "mlp"), residual="single")
    assert [s.part for s in plain.layers] == [None, None]


def test_the_order_parts_are_given_in_does_not_matter():
    shortconv, gdn = ShortConvConfig(3), GatedDeltaNetConfig(1, 2, 4, 3)
    types = ("short_conv", "linear_attention")
    assert _config(layer_types=types, mixer_parts=(shortconv, gdn)) == \
        _config(layer_types=types, mixer_parts=[gdn, shortconv])
    assert hash(_config(layer_types=types, mixer_parts=(shortconv, gdn))) is not None


@pytest.mark.parametrize("parts, types, error, match", [
    ((GatedDeltaNetConfig(1, 2, 4, 3),), ("full_attention",) * 2, ValueError,
     r"mixer_parts has a GatedDeltaNetConfig, the shape of the linear_attention layers, but layer_types has none"),
    ((), ("mamba2", "full_attention"), ValueError,
     r"layer_types has mamba2 layers, so mixer_parts needs a Mamba2Config \(their shape\); it has \[\]"),
    ((MAMBA,), ("attention_mamba2",) * 2, ValueError,
     r"layer_types has attention_mamba2 layers, so mixer_parts needs an AttentionMamba2Config .*"
     r"it has \['Mamba2Config'\]"),
    ((MAMBA, AttentionMamba2Config(MAMBA)), ("attention_mamba2",) * 2, ValueError,
     r"mixer_parts has a Mamba2Config, the shape of the mamba2 layers, but layer_types has none"),
    ((ShortConvConfig(3), ShortConvConfig(4)), ("short_conv",) * 2, ValueError,
     "mixer_parts must hold at most one part of each class, got 2 parts with more than one ShortConvConfig"),
    ((RotaryConfig(),), ("full_attention",) * 2, TypeError,
     "mixer_parts must hold parts of the classes GatedDeltaNetConfig, .*LatentAttentionConfig, got RotaryConfig"),
    (ShortConvConfig(3), ("short_conv",) * 2, TypeError, "mixer_parts must be a tuple of parts, got ShortConvConfig"),
])
def test_a_bad_mixer_part_is_refused_naming_it(parts, types, error, match):
    with pytest.raises(error, match=match):
        _config(layer_types=types, mixer_parts=parts)


def test_a_latent_part_must_fit_the_model():
    with pytest.raises(ValueError, match="the LatentAttentionConfig in mixer_parts describes hidden_size 8 and 2 "
                                         "heads, the model 8 and 4"):
        _config(family="kimi_linear", num_heads=4, mixer_parts=(LATENT,), rotary=RotaryConfig(skip_layers=(0, 1)))
    with pytest.raises(ValueError, match="kind must be one of the classes .*, got <class 'int'>"):
        _kimi().mixer_part(int)


@pytest.mark.parametrize("make", [_kimi, _falcon_and_bamba])
def test_the_parts_survive_a_json_round_trip(make):
    cfg = make()
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert sorted(saved["mixer_parts"]) == sorted(type(p).__name__ for p in cfg.mixer_parts)
    assert DecoderConfig.from_dict(saved) == cfg


def test_a_config_saved_with_the_flat_part_fields_loads():
    """Falcon-H1 wrote one ``mamba2`` for the Mamba-2 half and ``attention_mamba2`` for the factors; Kimi Linear
    wrote ``latent`` and ``kimi_delta``."""
    old = {"family": "falcon_h1", **OLD_SIZES, "layer_types": ["attention_mamba2"] * 2, "linear_attention": None,
           "latent": None, "short_conv": None, "kimi_delta": None,
           "mamba2": dataclasses.asdict(MAMBA), "attention_mamba2": {"attention_in": 0.5, "attention_out": 1.0,
                                                                     "mamba_in": 1.0, "mamba_out": 2.0}}
    cfg = DecoderConfig.from_dict(json.loads(json.dumps(old)))
    assert cfg.mixer_parts == (AttentionMamba2Config(MAMBA, attention_in=0.5, mamba_out=2.0),)
    both = {**old, "layer_types": ["attention_mamba2", "mamba2"]}  # the one shape served both layer types
    assert [type(s.part).__name__ for s in DecoderConfig.from_dict(both).layers] == ["AttentionMamba2Config",
                                                                                   "Mamba2Config"]
    kimi = _kimi().to_dict()
    parts = kimi.pop("mixer_parts")
    kimi.update(latent=parts["LatentAttentionConfig"], kimi_delta=parts["KimiDeltaAttentionConfig"])
    assert DecoderConfig.from_dict(kimi) == _kimi()


def test_a_saved_part_of_an_unknown_class_is_refused():
    saved = _kimi().to_dict()
    saved["mixer_parts"]["SlidingConfig"] = {}
    with pytest.raises(TypeError, match="mixer_parts has no part class 'SlidingConfig' \\(classes: GatedDeltaNet"):
        DecoderConfig.from_dict(saved)


@pytest.mark.parametrize("name, value, match", [
    ("embedding", 0.0, r"scales.embedding must be .*got 0.0"),
    ("residual", float("inf"), "scales.residual must be"),
    ("logit", 1e6, "scales.logit must be"),
    ("final_logit_softcap", -3.0, "scales.final_logit_softcap must be"),
    ("mlp_gate", 1e-9, "scales.mlp_gate must be"),
    ("mlp_output", "2", "scales.mlp_output must be a number, got '2'"),
])
def test_a_bad_scale_is_refused_naming_it(name, value, match):
    with pytest.raises(ValueError, match=match):
        ScalesConfig(**{name: value})


def test_the_mlp_factors_need_the_scaled_gated_mlp_and_the_scales_must_be_a_part():
    with pytest.raises(ValueError, match=r"scales.mlp_gate and scales.mlp_output \(1.0, 2.0\) scale the "
                                         r"'scaled_gated' MLP only; mlp.kind is 'gated'"):
        _config(scales=ScalesConfig(mlp_output=2.0))
    assert _config(mlp=MLPConfig(6, kind="scaled_gated"), scales=ScalesConfig(mlp_output=2.0)).scales.mlp_output == 2.0
    with pytest.raises(TypeError, match="scales must be a ScalesConfig, got dict"):
        _config(scales={"embedding": 2.0})


def test_a_config_saved_with_the_flat_scales_loads():
    old = {"family": "falcon_h1", **OLD_SIZES, "mlp": "scaled_gated", "embedding_scale": 2.0, "residual_scale": 1.0,
           "logit_scale": 0.5, "final_logit_softcap": None, "mlp_multipliers": [0.8, 1.25]}
    cfg = DecoderConfig.from_dict(old)
    assert cfg.scales == ScalesConfig(embedding=2.0, logit=0.5, mlp_gate=0.8, mlp_output=1.25)
    assert DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match=r"mlp_multipliers must be 2 values \(mlp_gate, mlp_output\), got \[0.8\]"):
        DecoderConfig.from_dict({**old, "mlp_multipliers": [0.8]})


@pytest.mark.parametrize("name, value, match", [
    ("bos", -1, r"tokens.bos must be a non-negative token id or a non-empty sequence of them or None, got -1"),
    ("eos", [], r"tokens.eos must be a non-negative token id or a non-empty sequence of them or None, got \[\]"),
    ("eos", (2, "3"), r"tokens.eos must be .*, got \(2, '3'\)"),
    ("pad", (0,), r"tokens.pad must be a non-negative token id or None, got \(0,\)"),
    ("pad", True, r"tokens.pad must be a non-negative token id or None, got True"),
])
def test_a_bad_special_token_is_refused_naming_it(name, value, match):
    with pytest.raises(ValueError, match=match):
        SpecialTokens(**{name: value})


def test_the_special_tokens_keep_their_ids_and_a_config_saved_with_the_flat_ids_loads():
    tokens = SpecialTokens(bos=np.int64(1), eos=[2, 7], pad=0)
    assert (tokens.bos, tokens.eos, tokens.pad) == (1, (2, 7), 0) and type(tokens.bos) is int
    cfg = _config(tokens=tokens)
    assert DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg and hash(cfg)
    old = {"family": "llama", **OLD_SIZES, "bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": 0}
    assert DecoderConfig.from_dict(old) == cfg
    with pytest.raises(TypeError, match="tokens must be a SpecialTokens, got int"):
        _config(tokens=3)


def test_every_old_flat_field_is_read():
    """One dict with each field that moved into a part, as configs were saved before: all of them land."""
    old = {"family": "falcon_h1", **OLD_SIZES, "mlp": "scaled_gated", "layer_types": ["attention_mamba2", "mamba2"],
           "mamba2": dataclasses.asdict(MAMBA), "attention_mamba2": {"mamba_out": 2.0}, "linear_attention": None,
           "latent": None, "short_conv": None, "kimi_delta": None, "embedding_scale": 2.0, "residual_scale": 0.5,
           "logit_scale": 0.25, "final_logit_softcap": 30.0, "mlp_multipliers": [0.8, 1.25], "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": None}
    cfg = DecoderConfig.from_dict(json.loads(json.dumps(old)))
    assert cfg.mlp == MLPConfig(6, kind="scaled_gated")
    assert cfg.mixer_parts == (MAMBA, AttentionMamba2Config(MAMBA, mamba_out=2.0))
    assert cfg.scales == ScalesConfig(embedding=2.0, residual=0.5, logit=0.25, final_logit_softcap=30.0,
                                      mlp_gate=0.8, mlp_output=1.25)
    assert cfg.tokens == SpecialTokens(bos=1, eos=2)


@pytest.mark.parametrize("fields, error, match", [
    (dict(intermediate_size=0), ValueError, "mlp.intermediate_size must be positive, got 0"),
    (dict(intermediate_size=6.0), TypeError, "mlp.intermediate_size must be"),
    (dict(intermediate_size=6, kind="swiglu"), ValueError, "mlp.kind must be one of 'gated', 'plain'"),
    (dict(intermediate_size=6, activation="swish"), ValueError, "mlp.activation must be one of"),
    (dict(intermediate_size=6, bias=1), TypeError, "mlp.bias must be True or False, got 1"),
])
def test_a_bad_mlp_is_refused_naming_it(fields, error, match):
    with pytest.raises(error, match=match):
        MLPConfig(**fields)
    with pytest.raises(TypeError, match="mlp must be a MLPConfig, got int"):
        _config(mlp=6)
    with pytest.raises(TypeError, match=r"mlp must be a MLPConfig, got str \(the MLP's kind is mlp.kind: "
                                        r"mlp=MLPConfig\(intermediate_size, kind='plain'\)\)"):
        _config(mlp="plain")


def test_a_config_saved_with_the_flat_mlp_fields_loads():
    old = {"family": "gpt2", **OLD_SIZES, "activation": "gelu_tanh", "mlp": "plain", "mlp_bias": True}
    cfg = DecoderConfig.from_dict(json.loads(json.dumps(old)))
    assert cfg.mlp == MLPConfig(6, kind="plain", activation="gelu_tanh", bias=True)
    assert DecoderConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.to_dict()["mlp"] == {"intermediate_size": 6, "kind": "plain", "activation": "gelu_tanh", "bias": True}
    assert [s.intermediate_size for s in cfg.layers] == [6, 6]

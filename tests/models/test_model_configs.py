"""Every model is built as ``Model(config, rng=...)`` from a frozen, validated config dataclass."""
import dataclasses

import numpy as np
import pytest

from attnkit.layers import GatedDeltaNetConfig, ShortConvConfig
from attnkit.models import (
    CausalLM,
    DecoderConfig,
    MLPConfig,
    Seq2SeqConfig,
    Seq2SeqTransformer,
    TokenTagger,
    TokenTaggerConfig,
)

TAGGER = TokenTaggerConfig(vocab_size=7, num_classes=3, max_length=6, d_model=8, num_heads=2, num_layers=1)
SEQ2SEQ = Seq2SeqConfig(9, 7, d_model=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=2, d_ff=12,
                        max_length=10)
DECODER = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=4, mlp=MLPConfig(12))


@pytest.mark.parametrize("model_class, config", [(TokenTagger, TAGGER), (Seq2SeqTransformer, SEQ2SEQ),
                                                 (CausalLM, DECODER)])
def test_models_take_one_config_and_keep_it(model_class, config):
    model = model_class(config, rng=0)
    assert model.config is config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_heads = 1  # a model's config cannot drift from the model it built
    with pytest.raises(TypeError, match=f"config must be a {type(config).__name__}, got int"):
        model_class(7, rng=0)
    twin = model_class(config, rng=0)
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)  # the config and the seed decide every weight


def test_the_config_sizes_decide_the_shapes():
    model = Seq2SeqTransformer(SEQ2SEQ, rng=0)
    assert model.transformer.decoder.num_layers == 2 and len(model.transformer.encoder.layers) == 1
    assert model.src_embedding.weight.shape == (9, 8) and model.head.W.shape == (8, 7)
    assert model.transformer.decoder.layers[0].ffn.d_ff == 12
    tagger = TokenTagger(dataclasses.replace(TAGGER, positional="learned", norm_first=False), rng=0)
    assert tagger.positional.weight.shape == (6, 8) and not tagger.encoder.layers[0].norm_first
    assert tagger(np.zeros((2, 5), int)).shape == (2, 5, 3)


def test_the_configs_accept_every_activation_the_layers_have():
    """The configs name the layers' own choices: SiLU feed-forward blocks build, as they did before the configs."""
    tagger = TokenTagger(dataclasses.replace(TAGGER, activation="silu"), rng=0)
    assert tagger.encoder.layers[0].ffn.activation == "silu"
    model = Seq2SeqTransformer(dataclasses.replace(SEQ2SEQ, activation="silu", cross_attention="additive"), rng=0)
    assert model.transformer.decoder.layers[0].activation == "silu"


@pytest.mark.parametrize("make, error, match", [
    (lambda: dataclasses.replace(TAGGER, vocab_size=0), ValueError, "vocab_size must be positive, got 0"),
    (lambda: dataclasses.replace(TAGGER, d_model=8.0), TypeError, "d_model must be an integer, got float"),
    (lambda: dataclasses.replace(TAGGER, d_ff=-3), ValueError, "d_ff must be positive, got -3"),
    (lambda: dataclasses.replace(TAGGER, norm_first="yes"), TypeError, "norm_first must be True or False"),
    (lambda: dataclasses.replace(TAGGER, activation="swish"), ValueError, "activation must be one of"),
    (lambda: dataclasses.replace(TAGGER, positional="rotary"), ValueError, "positional must be one of"),
    (lambda: dataclasses.replace(SEQ2SEQ, num_decoder_layers=True), TypeError, "num_decoder_layers must be an integer"),
    (lambda: dataclasses.replace(SEQ2SEQ, cross_attention="luong"), ValueError, "cross_attention must be one of"),
    (lambda: dataclasses.replace(SEQ2SEQ, dropout=1.0), ValueError, r"dropout must be a number in \[0, 1\)"),
    (lambda: dataclasses.replace(SEQ2SEQ, max_length=2**40), ValueError, "max_length must be at most"),
])
def test_configs_are_checked_when_made(make, error, match):
    with pytest.raises(error, match=match):
        make()


LLAMA = dict(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
             mlp=MLPConfig(8))


@pytest.mark.parametrize("changes, match", [
    ("norm", "norm.placement must be one of 'pre', 'post', 'sandwich', got 'none'"),
    ("qk_norm", "attention.qk_norm must be one of 'head', 'projection'"),
    ("offset", r"norm.offset \(1.0\) is an RMSNorm gain's offset; norm.kind is 'layernorm'"),
    ("experts", r"experts.layers must list distinct non-negative layer indices \(at least one\)"),
    ("family", "family must be a model_type such as 'llama'"),
    ("linear_layers", r"layer_types has linear_attention layers, so mixer_parts needs a GatedDeltaNetConfig \(their "
                      r"shape\); it has \[\]"),
    ("linear_shape", r"mixer_parts has a GatedDeltaNetConfig, the shape of the linear_attention layers, but "
                     r"layer_types has none"),
    ("twice", "mixer_parts must hold at most one part of each class, got 2 parts with more than one "
              "ShortConvConfig"),
    ("moe_layers", r"experts.layers must be layer indices below num_layers \(1\)"),
    ("moe_mlp", "the other layers' mlp.kind 'gated'"),
])
def test_a_decoder_no_architecture_has_is_refused(changes, match):
    from attnkit.models import AttentionConfig, DecoderConfig, ExpertsConfig, NormConfig

    make = {"norm": lambda: dict(norm=NormConfig(placement="none")),
            "qk_norm": lambda: dict(attention=AttentionConfig(qk_norm="both")),
            "offset": lambda: dict(norm=NormConfig(kind="layernorm", offset=1.0)),
            "experts": lambda: dict(experts=ExpertsConfig(2, 1, 4, layers=())),
            "family": lambda: dict(family="not a model type"),
            "linear_layers": lambda: dict(layer_types=("linear_attention",)),
            "linear_shape": lambda: dict(mixer_parts=(GatedDeltaNetConfig(1, 2, 4, 4),)),
            "twice": lambda: dict(layer_types=("short_conv",), mixer_parts=(ShortConvConfig(3), ShortConvConfig(4))),
            "moe_layers": lambda: dict(experts=ExpertsConfig(2, 1, 4, layers=(1,))),
            "moe_mlp": lambda: dict(experts=ExpertsConfig(2, 1, 4, layers=(0,)),
                                    mlp=MLPConfig(8, kind="plain"))}[changes]
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**{**LLAMA, **make()})
    DecoderConfig(**LLAMA)  # the same config without the change is fine

"""config.json -> DecoderConfig for gpt2, llama, mistral, qwen2: HF's own saved configs, both rope styles, the
sliding-window rules of each family, defaults, and errors that name the offending key."""
from __future__ import annotations

import json

import pytest

from attnkit.pretrained.hf_config import decoder_config_from_hf

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4)
QWEN2 = {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2}


def saved(config) -> dict:
    """The dict ``save_pretrained`` writes (only the keys that differ from the class defaults)."""
    return json.loads(config.to_json_string())


def test_gpt2_keys_and_defaults():
    # GPT-2's vocabulary, so the class's default special ids (50256, which save_pretrained writes) are tokens of it
    cfg = decoder_config_from_hf(saved(transformers.GPT2Config(vocab_size=50257, n_embd=32, n_layer=3, n_head=4,
                                                               n_positions=40, layer_norm_epsilon=1e-4)))
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads) == ("gpt2", 50257, 32, 3, 4)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.mlp.intermediate_size, cfg.max_position_embeddings) == (4, 8, 128, 40)
    assert (cfg.norm.kind, cfg.norm.eps, cfg.mlp.activation, cfg.mlp.kind, cfg.rotary) == (
        "layernorm", 1e-4, "gelu_tanh", "plain", None)
    assert cfg.attention.bias and cfg.attention.output_bias and cfg.mlp.bias and cfg.tie_word_embeddings
    assert (cfg.tokens.bos, cfg.tokens.eos, cfg.tokens.pad) == (50256, 50256, None)


def test_gpt2_inner_size_activation_and_untied_head():
    cfg = decoder_config_from_hf({"model_type": "gpt2", "vocab_size": 10, "n_embd": 8, "n_layer": 1, "n_head": 2,
                                  "n_inner": 20, "activation_function": "relu", "tie_word_embeddings": False})
    assert (cfg.mlp.intermediate_size, cfg.mlp.activation, cfg.tie_word_embeddings) == (20, "relu", False)


@pytest.mark.parametrize("style", ["rope_scaling_type", "rope_scaling_rope_type", "rope_parameters"])
def test_both_rope_styles_give_one_normalised_form(style):
    scaling = {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    raw = {"model_type": "llama", **SMALL}
    if style == "rope_parameters":
        raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, **scaling}
    else:
        raw["rope_theta"] = 5e5
        raw["rope_scaling"] = {("type" if style == "rope_scaling_type" else "rope_type"): "llama3", **scaling}
    cfg = decoder_config_from_hf(raw)
    assert cfg.rotary.theta == 5e5
    assert cfg.rotary.scaling == {"rope_type": "llama3", **scaling}


@pytest.mark.parametrize("kind, extra", [("linear", {"factor": 2.0}), ("dynamic", {"factor": 3.0}),
                                         ("yarn", {"factor": 4.0, "beta_fast": 16.0})])
def test_rope_types_round_trip_through_hf_config(kind, extra):
    hf = transformers.LlamaConfig(**SMALL, max_position_embeddings=128, rope_parameters={"rope_type": kind, **extra})
    cfg = decoder_config_from_hf(saved(hf))
    assert cfg.rotary.kind == kind
    assert cfg.rotary.scaling["factor"] == extra["factor"]
    if kind == "yarn":  # HF fills the pre-scaling length from max_position_embeddings
        assert cfg.rotary.scaling["original_max_position_embeddings"] == 128
        assert cfg.rotary.scaling["beta_fast"] == 16.0


def test_default_rope_has_no_scaling_and_theta_default():
    cfg = decoder_config_from_hf({"model_type": "llama", **SMALL})
    assert (cfg.rotary.theta, cfg.rotary.scaling, cfg.rotary.kind) == (10000.0, None, "default")
    cfg = decoder_config_from_hf({"model_type": "llama", **SMALL, "rope_scaling": None, "rope_theta": 123.0})
    assert cfg.rotary.theta == 123.0


def test_llama_head_dim_kv_heads_biases_and_tokens():
    cfg = decoder_config_from_hf({"model_type": "llama", **SMALL, "head_dim": 16, "num_key_value_heads": 1,
                                  "attention_bias": True, "mlp_bias": True, "eos_token_id": [2, 7],
                                  "pad_token_id": 0, "hidden_act": "gelu_pytorch_tanh"})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.num_groups) == (16, 1, 4)
    assert cfg.attention.bias and cfg.attention.output_bias and cfg.mlp.bias
    assert (cfg.tokens.bos, cfg.tokens.eos, cfg.tokens.pad, cfg.mlp.activation) == (1, (2, 7), 0, "gelu_tanh")
    plain = decoder_config_from_hf({"model_type": "llama", **SMALL})
    assert (plain.head_dim, plain.num_kv_heads, plain.tie_word_embeddings) == (8, 4, False)


def test_mistral_defaults_eight_kv_heads_and_slides_every_layer():
    raw = {"model_type": "mistral", **SMALL, "num_attention_heads": 8}
    cfg = decoder_config_from_hf(raw)
    assert (cfg.num_kv_heads, cfg.attention.sliding_window, cfg.max_position_embeddings) == (8, 4096, 131072)
    assert cfg.layer_types == ("sliding_attention",) * 4
    cfg = decoder_config_from_hf({**raw, "sliding_window": None})
    assert cfg.attention.sliding_window is None and cfg.layer_types == ("full_attention",) * 4
    hf = saved(transformers.MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=6))
    assert decoder_config_from_hf(hf).layers[3].window == 6


@pytest.mark.parametrize("use, max_window_layers, expected", [
    (False, 2, ("full_attention",) * 4),
    (True, 2, ("full_attention", "full_attention", "sliding_attention", "sliding_attention")),
    (True, 0, ("sliding_attention",) * 4),
    (True, 4, ("full_attention",) * 4),
])
def test_qwen2_sliding_layers_follow_hf_rule(use, max_window_layers, expected):
    hf = transformers.Qwen2Config(**SMALL, num_key_value_heads=2, use_sliding_window=use, sliding_window=5,
                                  max_window_layers=max_window_layers)
    assert tuple(hf.layer_types) == expected  # the rule as HF applies it
    cfg = decoder_config_from_hf(saved(hf))
    assert cfg.layer_types == expected
    assert cfg.attention.sliding_window == (5 if "sliding_attention" in expected else None)
    assert cfg.attention.bias and not cfg.attention.output_bias and not cfg.tie_word_embeddings


def test_qwen2_explicit_layer_types_win_over_max_window_layers():
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    cfg = decoder_config_from_hf({"model_type": "qwen2", **SMALL, "num_key_value_heads": 2, "use_sliding_window": True,
                                  "sliding_window": 3,
                                  "max_window_layers": 1, "layer_types": types})
    assert cfg.layer_types == tuple(types) and cfg.layers[0].window == 3 and cfg.layers[1].window is None


@pytest.mark.parametrize("raw, words", [
    ({"model_type": "bert", **SMALL}, ["bert", "gpt2, gpt_neox, gpt_oss, granite, granitemoehybrid, hunyuan_v1_dense"]),
    (dict(SMALL), ["model_type"]),
    ({"model_type": "llama", **{k: v for k, v in SMALL.items() if k != "hidden_size"}}, ["'hidden_size'", "missing"]),
    ({"model_type": "llama", **SMALL, "num_hidden_layers": "4"}, ["'num_hidden_layers'", "'4'"]),
    ({"model_type": "llama", **SMALL, "num_attention_heads": True}, ["'num_attention_heads'"]),
    ({"model_type": "llama", **SMALL, "num_key_value_heads": 3}, ["num_key_value_heads (3)", "divide"]),
    ({"model_type": "llama", **SMALL, "rms_norm_eps": -1}, ["'rms_norm_eps'"]),
    ({"model_type": "llama", **SMALL, "hidden_act": "mish"}, ["'hidden_act'", "mish"]),
    ({"model_type": "llama", **SMALL, "tie_word_embeddings": "yes"}, ["'tie_word_embeddings'"]),
    ({"model_type": "llama", **SMALL, "eos_token_id": [2, "x"]}, ["'eos_token_id'"]),
    ({"model_type": "llama", **SMALL, "rope_scaling": {"type": "mrope", "factor": 2.0}}, ["mrope"]),
    ({"model_type": "llama", **SMALL, "rope_scaling": {"rope_type": "linear"}}, ["'factor'", "missing"]),
    ({"model_type": "llama", **SMALL, "rope_scaling": {"rope_type": "linear", "factor": "2"}}, ["'factor'"]),
    ({"model_type": "llama", **SMALL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["low_freq_factor"]),
    ({"model_type": "llama", **SMALL, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "mystery": 1}},
     ["mystery"]),
    ({"model_type": "llama", **SMALL, "rope_scaling": [1, 2]}, ["'rope_scaling'"]),
    ({"model_type": "llama", **SMALL, "rope_parameters": {"full_attention": {"rope_type": "default"}}},
     ["per-layer-type"]),
    ({"model_type": "llama", **SMALL, "hidden_size": 30}, ["hidden_size (30)", "num_attention_heads"]),
    ({"model_type": "mistral", **SMALL, "num_key_value_heads": 2, "sliding_window": 0}, ["'sliding_window'"]),
    ({**QWEN2, "use_sliding_window": True, "max_window_layers": -1}, ["'max_window_layers'"]),
    ({**QWEN2, "layer_types": ["sliding_attention"] * 4}, ["no window", "use_sliding_window"]),
    ({**QWEN2, "layer_types": ["full_attention"] * 3}, ["3 entries", "4"]),
    ({**QWEN2, "use_sliding_window": True, "layer_types": ["chunked"] * 4}, ["chunked"]),
    ({"model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 3}, ["n_embd (8)", "n_head (3)"]),
    ({"model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
      "scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
    ({"model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2, "add_cross_attention": True},
     ["add_cross_attention"]),
])
def test_errors_name_the_key(raw, words):
    with pytest.raises(ValueError) as info:
        decoder_config_from_hf(raw)
    for word in words:
        assert word in str(info.value)


def test_not_a_dict_is_a_type_error():
    with pytest.raises(TypeError, match="config must be a dict"):
        decoder_config_from_hf('{"model_type": "llama"}')

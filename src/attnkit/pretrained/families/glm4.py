"""GLM-4: Llama, except norms both before and after the attention and the MLP (``input_layernorm`` and
``post_attention_layernorm`` are the branches' input norms, ``post_self_attn_layernorm`` and
``post_mlp_layernorm`` their output norms), interleaved rotary pairs ``(x0, x1), (x2, x3), ...`` on the first half
of each head (``partial_rotary_factor`` 0.5), biases on q, k and v but not on the output (``attention_bias``,
default true), a fused ``gate_up_proj`` as Phi-3's, and ``head_dim`` 128 by default."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, RotaryConfig
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, common_config, rotated_features
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader, read_rope
from .llama import (
    BENCHMARK_SHAPE,
    GGUF_ATTENTION_BIAS,
    fused_gated_mlp_tensors,
    rotary_config,
    rotary_tensors,
    with_norm_names,
)

__all__ = ["FAMILY", "half_rotary"]

DEFAULTS = {"max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": [151329, 151336, 151338], "pad_token_id": 151329, "num_key_value_heads": 2,
            "head_dim": 128, "rms_norm_eps": 1.5625e-07}

# Llama's names of a sandwich's norms (Gemma's) -> GLM-4's
_NORM_NAMES = {"post_attention_layernorm": "post_self_attn_layernorm",
               "pre_feedforward_layernorm": "post_attention_layernorm",
               "post_feedforward_layernorm": "post_mlp_layernorm"}


def half_rotary(read: Reader, max_positions: int, *, interleaved: bool = True) -> RotaryConfig:
    """Llama's rotary settings, half of each head by default (``partial_rotary_factor`` 0.5), its pairs
    interleaved (GLM-4) or the two halves of the rotated part (GLM-4.5, ``interleaved=False``)."""
    config = dict(read.config)
    config.setdefault("partial_rotary_factor", 0.5)  # transformers' default, beneath rope_parameters' own
    theta, scaling, partial = read_rope(Reader(config, read.family), max_positions)
    return RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial, interleaved=interleaved)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    return dict(attention=AttentionConfig(bias=read.bool("attention_bias", True)))


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """Llama's sandwich-norm checkpoint with GLM-4's norm names and the fused gate and up projection."""
    maps, prefix = rotary_tensors(cfg, fused_gated_mlp_tensors)
    return with_norm_names(maps, _NORM_NAMES), prefix


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """The common keys, the rotated fraction always stated: without it GLM-4 rotates half of each head, while
    llama.cpp rotates ``rope.dimension_count`` features (default all). llama.cpp keeps the interleaved pairs and
    the fused ``ffn_up`` (gate and up) as they are."""
    config = common_config(file, meta)
    config["partial_rotary_factor"] = rotated_features(meta, config["head_dim"]) / config["head_dim"]
    return config


FAMILY = Family(
    model_type="glm4", keys=frozenset(COMMON_KEYS + ("attention_bias",)),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields, norm_placement="sandwich", rotary=half_rotary),
    tensors=_tensors, architecture="Glm4ForCausalLM", hf_config_class="Glm4Config",
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64),
    gguf=GGUFArchitecture("glm4", _gguf_config, bias_flags=GGUF_ATTENTION_BIAS))

"""Seed-OSS: Llama, except separate switches for the biases of q, k and v (``attention_bias``, default true) and of
the output projection (``attention_out_bias``, default false), ``head_dim`` 128 and 8 key/value heads by default,
and a training-only ``residual_dropout``. Llama's checkpoint names."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 524288, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "pad_token_id": 1, "num_key_value_heads": 8, "head_dim": 128}


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    return dict(attention=AttentionConfig(bias=read.bool("attention_bias", True),
                                          output_bias=read.bool("attention_out_bias", False)),
                mlp_bias=read.bool("mlp_bias", False))


FAMILY = Family(
    model_type="seed_oss",
    # residual_dropout is a training setting, as attention_dropout: no forward pass reads it
    keys=frozenset(COMMON_KEYS + ("attention_bias", "attention_out_bias", "mlp_bias", "residual_dropout")),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="SeedOssForCausalLM", hf_config_class="SeedOssConfig",
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64))

"""Granite: Llama, except four scalars: the token embeddings times ``embedding_multiplier``, the attention scores
times ``attention_multiplier`` (in place of ``head_dim ** -0.5``; 1 by default), each branch's output times
``residual_multiplier`` before it joins the residual stream, and the logits divided by ``logits_scaling``.
Llama's checkpoint names."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, ScalesConfig
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "num_key_value_heads": None}


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, scale=read.factor("attention_multiplier", 1.0)),
                mlp_bias=read.bool("mlp_bias", False),
                scales=ScalesConfig(embedding=read.factor("embedding_multiplier", 1.0),
                                    residual=read.factor("residual_multiplier", 1.0),
                                    logit=1.0 / read.factor("logits_scaling", 1.0)))


FAMILY = Family(
    model_type="granite",
    keys=frozenset(COMMON_KEYS + ("attention_bias", "mlp_bias", "attention_multiplier", "embedding_multiplier",
                                  "residual_multiplier", "logits_scaling")),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="GraniteForCausalLM", hf_config_class="GraniteConfig",
    benchmark=dict(BENCHMARK_SHAPE, attention_multiplier=0.125, embedding_multiplier=12.0,
                   residual_multiplier=0.22, logits_scaling=8.0))

"""Mistral: Llama, except a sliding window on every layer (4096 tokens unless ``sliding_window`` says otherwise or
is null) and 8 key/value heads by default. No biases. Llama's checkpoint names."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 4096 * 32, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096}


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    window = read.int("sliding_window", DEFAULTS["sliding_window"], optional=True)
    return dict(attention=AttentionConfig(sliding_window=window),
                layer_types=("sliding_attention",) * layers if window is not None else ())


FAMILY = Family(
    model_type="mistral", keys=frozenset(COMMON_KEYS + ("sliding_window",)),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="MistralForCausalLM", hf_config_class="MistralConfig",
    benchmark=dict(BENCHMARK_SHAPE, sliding_window=512))

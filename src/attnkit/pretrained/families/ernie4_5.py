"""ERNIE 4.5 (dense): Llama, except interleaved rotary pairs ``(x0, x1), (x2, x3), ...`` over the whole head, one
switch ``use_bias`` for the biases of every projection (q, k, v, o and the MLP's), a rotary base of 500000, a tied
head, ``head_dim`` 128 and 2 key/value heads by default. Llama's checkpoint names."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, RotaryConfig
from . import Family
from ._reader import COMMON_KEYS, Reader, read_rope
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 131072, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1e-5}


def _rotary(read: Reader, max_positions: int) -> RotaryConfig:
    """Llama's rotary settings with a base of 500000, its pairs interleaved."""
    theta, scaling, partial = read_rope(Reader({**read.config, "rope_theta": read.raw("rope_theta", 500000.0)},
                                               read.family), max_positions)
    return RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial, interleaved=True)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("use_bias", False)
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias), mlp_bias=bias)


FAMILY = Family(
    model_type="ernie4_5", keys=frozenset(COMMON_KEYS + ("use_bias",)),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields, rotary=_rotary), tensors=plain_tensors,
    architecture="Ernie4_5ForCausalLM", hf_config_class="Ernie4_5Config", benchmark=dict(BENCHMARK_SHAPE, head_dim=64))

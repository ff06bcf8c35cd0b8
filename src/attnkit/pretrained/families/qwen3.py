"""Qwen3: Qwen2, except a per-head RMSNorm of queries and keys before the rotation (``self_attn.q_norm`` /
``k_norm``), an explicit ``head_dim`` (default 128), and no biases unless ``attention_bias`` (then on q, k, v
and o)."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from ..gguf_metadata import GGUFArchitecture
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, GGUF_ATTENTION_BIAS, LLAMA3_ROPE_TENSORS, plain_tensors, rotary_config
from .qwen2 import DEFAULTS as QWEN2_DEFAULTS
from .qwen2 import WINDOW_KEYS, qwen_windows

__all__ = ["FAMILY"]

DEFAULTS = dict(QWEN2_DEFAULTS, head_dim=128)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)  # the switch covers the output projection too
    window, types = qwen_windows(read, layers)
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="head", sliding_window=window),
                layer_types=types)


FAMILY = Family(
    model_type="qwen3",
    keys=frozenset(COMMON_KEYS + WINDOW_KEYS + ("attention_bias",)),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="Qwen3ForCausalLM", hf_config_class="Qwen3Config", benchmark=dict(BENCHMARK_SHAPE, head_dim=64),
    gguf=GGUFArchitecture("qwen3", rope_tensors=LLAMA3_ROPE_TENSORS, bias_flags=GGUF_ATTENTION_BIAS))

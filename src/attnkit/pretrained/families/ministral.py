"""Ministral: Mistral, except that ``layer_types`` says which layers slide (by default every layer, when
``sliding_window`` is set), as in Ministral 8B's interleaved sliding and full layers. Llama's checkpoint names."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from . import Family
from ._reader import COMMON_KEYS, Reader, read_layer_types
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config
from .mistral import DEFAULTS

__all__ = ["FAMILY"]


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    window = read.int("sliding_window", DEFAULTS["sliding_window"], optional=True)
    types = read_layer_types(read, layers, window)
    if types is None:
        types = ("sliding_attention" if window is not None else "full_attention",) * layers
    return dict(attention=AttentionConfig(sliding_window=window if "sliding_attention" in types else None),
                layer_types=types)


FAMILY = Family(
    model_type="ministral", keys=frozenset(COMMON_KEYS + ("sliding_window", "layer_types")),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="MinistralForCausalLM", hf_config_class="MinistralConfig",
    # transformers' MinistralConfig leaves head_dim None (its attention then fails to build): say it
    benchmark=dict(BENCHMARK_SHAPE, sliding_window=512, head_dim=64))

"""Qwen2: Llama, except biases on the q, k and v projections (not on o), and sliding-window layers only when
``use_sliding_window``: those ``layer_types`` marks, else the layers from ``max_window_layers`` on (as
transformers' ``Qwen2Config``). Llama's checkpoint names."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from ..gguf_metadata import GGUFArchitecture
from . import Family
from ._reader import COMMON_KEYS, Reader, read_layer_types
from .llama import BENCHMARK_SHAPE, LLAMA3_ROPE_TENSORS, plain_tensors, rotary_config

__all__ = ["FAMILY", "WINDOW_KEYS", "qwen_windows"]

DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "num_key_value_heads": 32}
WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


def qwen_windows(read: Reader, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """The window (None without sliding layers) and the per-layer types, by the rule of transformers'
    ``Qwen2Config``: a window (default 4096)
    only when ``use_sliding_window``; ``layer_types`` (if given) says which layers use it, else layers
    ``i >= max_window_layers`` (default 28) do."""
    use = read.bool("use_sliding_window", False)
    window = read.int("sliding_window", 4096, optional=True) if use else None
    given = read_layer_types(read, layers, window)
    if given is not None:
        return (window if "sliding_attention" in given else None), given
    if window is None:
        return None, ()
    first = read.count("max_window_layers", 28)
    types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    return (window if "sliding_attention" in types else None), types


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    window, types = qwen_windows(read, layers)
    return dict(attention=AttentionConfig(bias=True, sliding_window=window), layer_types=types)


FAMILY = Family(
    model_type="qwen2", keys=frozenset(COMMON_KEYS + WINDOW_KEYS),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="Qwen2ForCausalLM", hf_config_class="Qwen2Config", benchmark=dict(BENCHMARK_SHAPE),
    gguf=GGUFArchitecture("qwen2", rope_tensors=LLAMA3_ROPE_TENSORS))

"""EXAONE 4: OLMo 2's norms after the attention and the MLP, except per-head RMSNorms of queries and keys (Qwen3's
``q_norm``, ``k_norm``), a sliding window (4096) on three layers of four (every ``sliding_window_pattern``-th
layer full, or the layers ``layer_types`` marks), and no rotary on the full layers while there is a window (the
hybrid's global NoPE); without ``sliding_window`` every layer is full and rotary."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from . import Family
from ._reader import COMMON_KEYS, Reader, read_layer_types
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
            "num_key_value_heads": 32, "rms_norm_eps": 1e-5}


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    window = read.int("sliding_window", 4096, optional=True)
    types = read_layer_types(read, layers, window)
    if types is None:
        if window is None:
            types = ("full_attention",) * layers
        else:
            every = read.raw("sliding_window_pattern", 4)
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"exaone4 config: 'sliding_window_pattern' must be a positive integer (every n-th "
                                 f"layer full) when 'layer_types' is not given, got {every!r}")
            types = tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers))
    # with a window, the full layers attend without positions (transformers' Exaone4Attention)
    nope = () if window is None else tuple(i for i, t in enumerate(types) if t == "full_attention")
    return dict(attention=AttentionConfig(qk_norm="head",
                                          sliding_window=window if "sliding_attention" in types else None),
                layer_types=types, skip_rotary=nope)


FAMILY = Family(
    model_type="exaone4",
    keys=frozenset(COMMON_KEYS + ("sliding_window", "sliding_window_pattern", "layer_types")),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields, norm_placement="post"), tensors=plain_tensors,
    architecture="Exaone4ForCausalLM", hf_config_class="Exaone4Config",
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64, sliding_window=512))

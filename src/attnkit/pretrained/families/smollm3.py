"""SmolLM3: Llama, except that some layers have no rotary at all (NoPE): ``no_rope_layers[i] == 0``, or by
default every ``no_rope_layer_interval``-th layer (the 4th, 8th, ...); with ``use_sliding_window``, a window on
the layers ``layer_types`` marks (else on the NoPE layers). Tied head by default. Llama's checkpoint names."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig
from . import Family
from ._reader import COMMON_KEYS, Reader, read_layer_types
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": True, "bos_token_id": 128000,
            "eos_token_id": 128001, "num_key_value_heads": 4}


def _nope_layers(read: Reader, layers: int) -> tuple[int, ...]:
    """The layers without rotary, as in transformers' ``SmolLM3Config``."""
    flags = read.raw("no_rope_layers", None)
    if flags is None:
        interval = read.int("no_rope_layer_interval", 4)
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) != layers or not all(f in (0, 1) and not isinstance(f, float)
                                                                      for f in flags):
        raise ValueError(f"smollm3 config: 'no_rope_layers' must be a list of {layers} entries 0 or 1 (1 = the "
                         f"layer uses rotary), got {flags!r}")
    return tuple(i for i, f in enumerate(flags) if not f)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    nope = _nope_layers(read, layers)
    use = read.bool("use_sliding_window", False)
    window = read.int("sliding_window", None, optional=True) if use else None
    types = read_layer_types(read, layers, window if use else 0)
    if types is None:
        types = tuple("sliding_attention" if window is not None and i in nope else "full_attention"
                      for i in range(layers))
    if window is None:  # transformers slides no layer without the switch, whatever layer_types says
        types = ("full_attention",) * layers
    attention = AttentionConfig(bias=bias, output_bias=bias,
                                sliding_window=window if "sliding_attention" in types else None)
    return dict(attention=attention, mlp_bias=read.bool("mlp_bias", False), skip_rotary=nope, layer_types=types)


FAMILY = Family(
    model_type="smollm3",
    keys=frozenset(COMMON_KEYS + ("attention_bias", "mlp_bias", "use_sliding_window", "sliding_window",
                                  "layer_types", "no_rope_layers", "no_rope_layer_interval")),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="SmolLM3ForCausalLM", hf_config_class="SmolLM3Config", benchmark=dict(BENCHMARK_SHAPE))

"""OLMo 3: OLMo 2, except a sliding window (4096) on three layers of four (every fourth layer full, or the layers
``layer_types`` marks), a rotary base of 500000, and the rotary settings per layer type (``rope_parameters``
keyed by ``full_attention`` and ``sliding_attention``): a scaling applies to the full layers only. OLMo 2's
checkpoint names.

llama.cpp writes OLMo 3 as OLMo 2 (``olmo2``), with the window and one flag per layer: OLMo 2's GGUF entry reads
such a file with :func:`olmo_gguf_config`."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...models.config import AttentionConfig, RotaryConfig
from ..gguf_metadata import GGUFMetadata, common_config
from . import Family
from ._reader import COMMON_KEYS, Reader, per_layer_type, read_layer_types, read_rope, read_rope_by_layer_type
from .llama import BENCHMARK_SHAPE, plain_tensors, rotary_config

__all__ = ["FAMILY", "olmo_gguf_config"]

DEFAULTS = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": 50279, "pad_token_id": 1, "num_key_value_heads": None, "rms_norm_eps": 1e-5}
THETA = 500000.0


def _rotary(read: Reader, max_positions: int) -> RotaryConfig:
    """The full layers' rotary, and the sliding layers' where it differs. transformers' ``Olmo3Config`` reads
    the older ``rope_theta`` and ``rope_scaling`` into the full layers only: the sliding ones keep the default
    rotary of base 500000."""
    if per_layer_type(read):
        per_type = read_rope_by_layer_type(read, max_positions, {"full_attention": THETA,
                                                                 "sliding_attention": THETA})
        (theta, scaling, partial), (sliding_theta, sliding_scaling, sliding_partial) = (
            per_type["full_attention"], per_type["sliding_attention"])
    else:
        if read.raw("rope_parameters", None):
            raise ValueError("olmo3 config: 'rope_parameters' must be keyed by layer type (full_attention, "
                             "sliding_attention), as OLMo 3 writes it")
        theta, scaling, partial = read_rope(Reader({**read.config, "rope_theta": read.raw("rope_theta", THETA)},
                                                   read.family), max_positions)
        sliding_theta, sliding_scaling, sliding_partial = THETA, None, partial
    if sliding_partial != partial:
        raise ValueError(f"olmo3 config: the full and sliding layers rotate different fractions of each head "
                         f"({partial} and {sliding_partial}), which attnkit does not support")
    if (sliding_theta, sliding_scaling) == (theta, scaling):
        sliding_theta = sliding_scaling = None
    return RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial, sliding_theta=sliding_theta,
                        sliding_scaling=sliding_scaling)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    window = read.int("sliding_window", 4096, optional=True)
    types = read_layer_types(read, layers, window)
    if types is None:
        types = tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers))
        if window is None:
            raise ValueError("olmo3 config: 'sliding_window' is null, so 'layer_types' must say which layers "
                             "slide (none)")
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="projection",
                                          sliding_window=window if "sliding_attention" in types else None),
                layer_types=types)


def olmo_gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """The config of llama.cpp's ``olmo2`` files: OLMo 2's, or OLMo 3's where the metadata has a window.
    llama.cpp rotates OLMo 3's sliding layers with the file's base and no scaling (its full layers with both),
    and slides on the layers the per-layer flags mark (every layer but each fourth without them, the
    converter's default)."""
    config = common_config(file, meta)
    if meta.get("attention.sliding_window") is None:
        return config
    layers = config["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern")
    if pattern is None:
        flags = [(i + 1) % 4 != 0 for i in range(layers)]
    elif isinstance(pattern, np.ndarray) and len(pattern) == layers:
        flags = pattern.tolist()
    else:
        raise file.fail(f"metadata {meta.arch}.attention.sliding_window_pattern must be {layers} bools (one per "
                        f"layer, {meta.arch}.block_count = {layers}), got {pattern!r}")
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    full.update(config.pop("rope_scaling", None) or {})
    return dict(config, model_type=FAMILY.model_type, sliding_window=meta.int("attention.sliding_window"),
                layer_types=["sliding_attention" if flag else "full_attention" for flag in flags],
                rope_parameters={"full_attention": full,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": full["rope_theta"]}})


FAMILY = Family(
    model_type="olmo3", keys=frozenset(COMMON_KEYS + ("attention_bias", "sliding_window", "layer_types")),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields, norm_placement="post", rotary=_rotary),
    tensors=plain_tensors, architecture="Olmo3ForCausalLM", hf_config_class="Olmo3Config",
    benchmark=dict(BENCHMARK_SHAPE, sliding_window=512))

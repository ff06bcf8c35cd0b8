"""HunYuan (dense): Llama, except per-head RMSNorms of queries and keys after the rotation, not before
(``self_attn.query_layernorm`` / ``key_layernorm``), and the rotary scaling its checkpoints name ``"dynamic"``
with an ``alpha``: a fixed stretch of the base to ``rope_theta * alpha ** (Dh / (Dh - 2))``, not a function of
the sequence length (transformers' ``ntk_alpha``)."""
from __future__ import annotations

import dataclasses
from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, RotaryConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader, read_rope
from .llama import BENCHMARK_SHAPE, rotary_config, rotary_tensors

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "num_key_value_heads": None, "rms_norm_eps": 1e-5}
_QK_NORM_NAMES = {"q_norm": "query_layernorm", "k_norm": "key_layernorm"}


def _rotary(read: Reader, max_positions: int) -> RotaryConfig:
    """Llama's rotary settings; a ``"dynamic"`` scaling with ``alpha`` is the default rotary of a larger base."""
    key = "rope_scaling" if read.raw("rope_scaling", None) else "rope_parameters"
    params = read.raw(key, None)
    if isinstance(params, dict) and params.get("alpha") is not None and \
            (params.get("rope_type") or params.get("type")) == "dynamic":
        alpha = Reader(params, f"{read.family} config: {key}").float("alpha")
        head_dim = read.int("head_dim", None, optional=True) or read.int("hidden_size") // read.int(
            "num_attention_heads")
        if head_dim <= 2:
            raise ValueError(f"{read.family} config: {key}['alpha'] stretches the base by alpha ** (Dh / (Dh - 2)), "
                             f"which needs head_dim > 2, got {head_dim}")
        theta, _, partial = read_rope(Reader({**read.config, key: None, "rope_parameters": {
            k: v for k, v in params.items() if k not in ("alpha", "factor", "type", "rope_type")}}, read.family),
            max_positions)
        theta = Reader({"rope_theta": theta * alpha ** (head_dim / (head_dim - 2))},
                       f"{read.family} config: {key} (rope_theta * alpha ** (Dh / (Dh - 2)))").float("rope_theta")
        return RotaryConfig(theta=theta, partial_factor=partial)
    theta, scaling, partial = read_rope(read, max_positions)
    return RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="head_after_rotary"))


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """Llama's checkpoint with the q/k norms under HunYuan's names."""
    maps, prefix = rotary_tensors(cfg)
    renamed = []
    for m in maps:
        layer, dot, name = m.source.rpartition(".weight")[0].rpartition(".")
        if name in _QK_NORM_NAMES:
            m = dataclasses.replace(m, source=f"{layer}{dot}{_QK_NORM_NAMES[name]}.weight")
        renamed.append(m)
    return renamed, prefix


FAMILY = Family(
    model_type="hunyuan_v1_dense",
    keys=frozenset(COMMON_KEYS + ("attention_bias",)),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields, rotary=_rotary), tensors=_tensors,
    architecture="HunYuanDenseV1ForCausalLM", hf_config_class="HunYuanDenseV1Config",
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64))

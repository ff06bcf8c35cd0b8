"""Phi-3: Llama, except fused projections (``self_attn.qkv_proj`` holds q, k and v; ``mlp.gate_up_proj`` gate
and up, both split on load), ``longrope`` scaling (short factors up to ``original_max_position_embeddings``,
long ones past it; "su" and "yarn" are its older names), partial rotary, and a window on every layer when
``sliding_window`` is set."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, common_config, rope_factors
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, fused_gated_mlp_tensors, rotary_config, rotary_tensors

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 32000, "num_key_value_heads": None, "rms_norm_eps": 1e-5}
_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}  # as Phi3Config reads them


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    window = read.int("sliding_window", None, optional=True)
    return dict(attention=AttentionConfig(sliding_window=window),
                layer_types=("sliding_attention",) * layers if window is not None else ())


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """Llama's tensors with each layer's q_proj, k_proj and v_proj replaced by one qkv_proj, in q_proj's place."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    maps, prefix = rotary_tensors(cfg, fused_gated_mlp_tensors)
    fused = []
    for m in maps:
        layer, _, rest = m.source.partition(".self_attn.")
        if rest == "q_proj.weight":
            attn = m.targets[0][:-len("W_Q")]
            fused.append(TensorMap(layer + ".self_attn.qkv_proj.weight", (q + 2 * kv, cfg.hidden_size),
                                   (attn + "W_Q", attn + "W_K", attn + "W_V"), "row_split_transpose",
                                   sizes=(q, kv, kv)))
        elif rest not in ("k_proj.weight", "v_proj.weight"):
            fused.append(m)
    return fused, prefix


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """Phi-3: partial rotary from ``rope.dimension_count``, a window, longrope's divisors as tensors."""
    config = common_config(file, meta)
    if meta.get("attention.sliding_window") is not None:
        config["sliding_window"] = meta.int("attention.sliding_window")
    present = [name for name in meta.architecture.rope_tensors if name in file.tensors]
    if len(present) == 1:
        raise file.fail(f"tensor {present[0]!r} comes without its pair: longrope needs both "
                        f"{' and '.join(meta.architecture.rope_tensors)}")
    if present:
        config["rope_scaling"] = {
            "rope_type": "longrope", "short_factor": rope_factors(file, "rope_factors_short.weight"),
            "long_factor": rope_factors(file, "rope_factors_long.weight"),
            "original_max_position_embeddings": meta.int("rope.scaling.original_context_length")}
        if meta.get("rope.scaling.attn_factor") is not None:
            config["rope_scaling"]["attention_factor"] = meta.float("rope.scaling.attn_factor")
    return config


FAMILY = Family(
    model_type="phi3", keys=frozenset(COMMON_KEYS + ("sliding_window",)),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields, rope_aliases=_ROPE_ALIASES), tensors=_tensors,
    architecture="Phi3ForCausalLM", hf_config_class="Phi3Config", benchmark=dict(BENCHMARK_SHAPE),
    gguf=GGUFArchitecture("phi3", _gguf_config, rope_tensors=("rope_factors_short.weight", "rope_factors_long.weight"),
                          tokenizer_style="phi3"))

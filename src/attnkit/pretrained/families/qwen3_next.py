"""Qwen3-Next: Qwen3.5 (text), except that the MLP of the sparse layers is Qwen3-MoE's mixture (``num_experts``
SwiGLU experts of width ``moe_intermediate_size``, the top ``num_experts_per_tok`` of a softmax over all router
logits, renormalised with ``norm_topk_prob``, on by default) plus a shared expert of width
``shared_expert_intermediate_size`` scaled by ``sigmoid(x W)``; the Gated DeltaNet's projections are fused
(``in_proj_qkvz``, ``in_proj_ba``) and grouped per key head.

Checkpoint (under ``model.``): Qwen3.5's, except ``linear_attn.in_proj_qkvz`` (Hk, 2 Dk + 2 (Hv / Hk) Dv, D):
each key head's q, k, v and z rows, and ``linear_attn.in_proj_ba`` (Hk, 2 Hv / Hk, D): its b then a rows; a
sparse layer's MLP is Qwen3-MoE's (``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``) with
``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate``.
"""
from __future__ import annotations

from typing import Any

from ...layers.gated_deltanet import GatedDeltaNetConfig
from ...models.config import DecoderConfig, ExpertsConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import Reader
from .qwen3_5_text import FAMILY as QWEN3_5
from .qwen3_5_text import HYBRID_KEYS, hybrid_config, hybrid_tensors, linear_attention_tensors
from .qwen3_moe import EXPERT_KEYS, mlp_tensors, num_experts, sparse_layers

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "num_key_value_heads": 2, "head_dim": 256}


def _experts(read: Reader, layers: int) -> dict[str, Any]:
    experts, sparse = num_experts(read, 512, ("num_experts",)), sparse_layers(read, layers)
    if not experts or not sparse:  # a dense model: every layer keeps the gated MLP
        return {}
    return dict(experts=ExpertsConfig(
        num_experts=experts, num_experts_per_tok=read.int("num_experts_per_tok", 10),
        moe_intermediate_size=read.int("moe_intermediate_size", 512), layers=sparse,
        norm_topk_prob=read.bool("norm_topk_prob", True),
        shared_expert_intermediate_size=read.int("shared_expert_intermediate_size", 512), shared_expert_gate=True))


def _fused_linear_attention(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """Qwen3.5's Gated DeltaNet tensors with the four input maps fused and grouped per key head."""
    shape, d = cfg.mixer_part(GatedDeltaNetConfig), cfg.hidden_size
    hk, r = shape.num_key_heads, shape.num_value_heads // shape.num_key_heads
    dk, rdv = shape.key_head_dim, r * shape.value_head_dim
    at = ak + "attention."
    fused = [TensorMap(hf + "linear_attn.in_proj_qkvz.weight", (hk * (2 * dk + 2 * rdv), d),
                       (at + "W_qkv",) * 3 + (at + "W_z",), "head_row_split_transpose", heads=hk,
                       sizes=(dk, dk, rdv, rdv)),
             TensorMap(hf + "linear_attn.in_proj_ba.weight", (hk * 2 * r, d), (at + "W_b", at + "W_a"),
                       "head_row_split_transpose", heads=hk, sizes=(r, r))]
    return fused + [m for m in linear_attention_tensors(cfg, hf, ak) if ".in_proj_" not in m.source]


FAMILY = Family(
    model_type="qwen3_next",
    keys=frozenset(HYBRID_KEYS + EXPERT_KEYS + ("shared_expert_intermediate_size",)),
    read_config=lambda read: hybrid_config(read, DEFAULTS, _experts),
    tensors=lambda cfg, mxfp4=False: hybrid_tensors(cfg, _fused_linear_attention, mlp_tensors),
    architecture="Qwen3NextForCausalLM", hf_config_class="Qwen3NextConfig",
    # Qwen3.5's benchmark shape with eight experts of width 768, two per token, and a shared expert of 768
    benchmark=dict(QWEN3_5.benchmark, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
                   shared_expert_intermediate_size=768))

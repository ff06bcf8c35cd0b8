"""Qwen3.5-MoE and Qwen3.6-MoE (text): Qwen3.5 (text), except that every layer's MLP is the mixture of Qwen3-Next
(``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, the top ``num_experts_per_tok`` of a softmax
over all router logits, always renormalised, plus a shared expert of width ``shared_expert_intermediate_size``
scaled by ``sigmoid(x W)``), with no dense MLP at all; two key/value heads and a context of 32768 by default.

Checkpoint (under ``model.``): Qwen3.5's, with each layer's MLP Qwen3-Next's (``mlp.gate``,
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.{gate,up,down}_proj``, ``mlp.shared_expert_gate``).
"""
from __future__ import annotations

from typing import Any

from ...models.config import DecoderConfig, ExpertsConfig
from . import Family
from ._reader import Reader
from .qwen3_5_text import FAMILY as QWEN3_5
from .qwen3_5_text import HYBRID_KEYS, hybrid_config, hybrid_tensors, linear_attention_tensors
from .qwen3_moe import mlp_tensors, num_experts

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "num_key_value_heads": 2, "head_dim": 256}
KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "router_aux_loss_coef", "output_router_logits")


def _experts(read: Reader, layers: int) -> dict[str, Any]:
    size = read.int("moe_intermediate_size", 512)
    return dict(experts=ExpertsConfig(
        num_experts=num_experts(read, 256, ("num_experts",)), num_experts_per_tok=read.int("num_experts_per_tok", 8),
        moe_intermediate_size=size, layers=tuple(range(layers)), norm_topk_prob=True,
        shared_expert_intermediate_size=read.int("shared_expert_intermediate_size", 512), shared_expert_gate=True))


def _read(read: Reader) -> DecoderConfig:
    """No layer has a dense MLP: the model's MLP width is the experts' (an ``intermediate_size`` in the config, which
    transformers keeps and never reads, is not read either)."""
    return hybrid_config(Reader({**read.config, "intermediate_size": read.int("moe_intermediate_size", 512)},
                                read.family), DEFAULTS, _experts)


FAMILY = Family(
    model_type="qwen3_5_moe_text",
    keys=frozenset(HYBRID_KEYS + KEYS),
    read_config=_read,
    tensors=lambda cfg, mxfp4=False: hybrid_tensors(cfg, linear_attention_tensors, mlp_tensors),
    architecture="Qwen3_5MoeForCausalLM", hf_config_class="Qwen3_5MoeTextConfig",
    # Qwen3.5's benchmark shape with eight experts of width 768, two per token, and a shared expert of 768
    benchmark={**{k: v for k, v in QWEN3_5.benchmark.items() if k != "intermediate_size"}, "num_experts": 8,
               "num_experts_per_tok": 2, "moe_intermediate_size": 768, "shared_expert_intermediate_size": 768})

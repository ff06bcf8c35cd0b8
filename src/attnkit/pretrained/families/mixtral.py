"""Mixtral: Mistral, except that every layer's MLP is a mixture of ``num_local_experts`` SwiGLU experts of width
``intermediate_size`` (the top ``num_experts_per_tok`` of a softmax over all router logits, divided by their sum),
no sliding window unless ``sliding_window`` gives one (then on every layer), and a rotary base of 1000000 by
default.

Checkpoint (under ``model.``): Llama's, except each layer's ``block_sparse_moe.gate`` (the router) and
``block_sparse_moe.experts.{j}.{w1,w3,w2}`` (expert j's gate, up and down matrices) in place of ``mlp.``: Qwen3-MoE's
one tensor per expert, with Mixtral's names.
"""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, ExpertsConfig
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, rotary_config, rotary_tensors
from .qwen3_moe import mlp_tensors, num_experts

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 4096 * 32, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-5}


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    window = read.int("sliding_window", None, optional=True)
    experts = ExpertsConfig(num_experts=num_experts(read, 8, ("num_local_experts", "num_experts")),
                            num_experts_per_tok=read.int("num_experts_per_tok", 2),
                            moe_intermediate_size=read.int("intermediate_size"), layers=tuple(range(layers)))
    return dict(attention=AttentionConfig(sliding_window=window),
                layer_types=("sliding_attention",) * layers if window is not None else (), experts=experts)


def _read_config(read: Reader) -> DecoderConfig:
    return rotary_config(Reader({"rope_theta": 1e6, **read.config}, read.family), DEFAULTS, _fields)


FAMILY = Family(
    model_type="mixtral",
    keys=frozenset(COMMON_KEYS + ("sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok",
                                  "router_aux_loss_coef", "router_jitter_noise", "output_router_logits")),
    read_config=_read_config,
    tensors=lambda cfg, mxfp4=False: rotary_tensors(
        cfg, lambda cfg, hf, ak: mlp_tensors(cfg, hf, ak, moe="block_sparse_moe.", projections=("w1", "w3", "w2"))),
    architecture="MixtralForCausalLM", hf_config_class="MixtralConfig",
    # eight experts of width 768, two per token: the same active MLP width as the other families
    benchmark=dict(BENCHMARK_SHAPE, intermediate_size=768, num_local_experts=8, num_experts_per_tok=2, head_dim=64))

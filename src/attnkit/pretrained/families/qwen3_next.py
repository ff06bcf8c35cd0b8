"""Qwen3-Next: Qwen3.5 (text), except that the MLP of the sparse layers (every ``decoder_sparse_step``-th layer
not in ``mlp_only_layers``, all of them by default) is a mixture of ``num_experts`` SwiGLU experts of width
``moe_intermediate_size`` (the top ``num_experts_per_tok`` of a softmax over all router logits, renormalised
with ``norm_topk_prob``) plus a shared expert of width ``shared_expert_intermediate_size`` scaled by
``sigmoid(x W)``; the Gated DeltaNet's projections are fused (``in_proj_qkvz``, ``in_proj_ba``) and grouped per
key head.

Checkpoint (under ``model.``): Qwen3.5's, except ``linear_attn.in_proj_qkvz`` (Hk, 2 Dk + 2 (Hv / Hk) Dv, D):
each key head's q, k, v and z rows, and ``linear_attn.in_proj_ba`` (Hk, 2 Hv / Hk, D): its b then a rows; a
sparse layer's ``mlp.gate`` (the router), ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert.
{gate,up,down}_proj`` and ``mlp.shared_expert_gate``.
"""
from __future__ import annotations

from typing import Any

from ...layers.experts import SharedExpertMixtureConfig
from ...models.config import DecoderConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import Reader
from .llama import gated_mlp_tensors
from .qwen3_5_text import FAMILY as QWEN3_5
from .qwen3_5_text import HYBRID_KEYS, hybrid_config, hybrid_tensors, linear_attention_tensors

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "num_key_value_heads": 2, "head_dim": 256}
_EXPERT_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
                "output_router_logits")


def _experts(read: Reader, layers: int) -> dict[str, Any]:
    experts = read.raw("num_experts", 512)
    if experts == 0:  # a dense model: every layer keeps the gated MLP
        return {}
    step = read.int("decoder_sparse_step", 1)
    dense = read.raw("mlp_only_layers", None) or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"{read.family} config: 'mlp_only_layers' must be a list of layer indices, got {dense!r}")
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return dict(shared_experts=SharedExpertMixtureConfig(
        read.int("num_experts", 512), read.int("num_experts_per_tok", 10), read.int("moe_intermediate_size", 512),
        read.int("shared_expert_intermediate_size", 512), read.bool("norm_topk_prob", True), sparse))


def _fused_linear_attention(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """Qwen3.5's Gated DeltaNet tensors with the four input maps fused and grouped per key head."""
    shape, d = cfg.linear_attention, cfg.hidden_size
    hk, r = shape.num_key_heads, shape.num_value_heads // shape.num_key_heads
    dk, rdv = shape.key_head_dim, r * shape.value_head_dim
    at = ak + "attention."
    fused = [TensorMap(hf + "linear_attn.in_proj_qkvz.weight", (hk * (2 * dk + 2 * rdv), d),
                       (at + "W_qkv",) * 3 + (at + "W_z",), "head_row_split_transpose", heads=hk,
                       sizes=(dk, dk, rdv, rdv)),
             TensorMap(hf + "linear_attn.in_proj_ba.weight", (hk * 2 * r, d), (at + "W_b", at + "W_a"),
                       "head_row_split_transpose", heads=hk, sizes=(r, r))]
    return fused + [m for m in linear_attention_tensors(cfg, hf, ak) if ".in_proj_" not in m.source]


def _mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """A dense layer's gated MLP, or a sparse layer's router, experts (one tensor per expert and matrix), shared
    expert and its gate."""
    moe = cfg.shared_experts
    layer = int(hf.split(".")[1])
    if moe is None or layer not in moe.layers:
        return gated_mlp_tensors(cfg, hf, ak)
    d, f, e = cfg.hidden_size, moe.expert_intermediate_size, moe.num_experts
    hf, ak = hf + "mlp.", ak + "mlp."
    maps = [TensorMap(hf + "gate.weight", (e, d), (ak + "W_router",), "transpose")]
    for expert in range(e):
        for proj, shape, name in (("gate_proj", (f, d), "W_gate"), ("up_proj", (f, d), "W_up"),
                                  ("down_proj", (d, f), "W_down")):
            maps.append(TensorMap(f"{hf}experts.{expert}.{proj}.weight", shape, (ak + name,), "transpose",
                                  stack_index=expert, stack_size=e))
    fs = moe.shared_intermediate_size
    for proj, shape, name in (("gate_proj", (fs, d), "W_gate"), ("up_proj", (fs, d), "W_up"),
                              ("down_proj", (d, fs), "W_down")):
        maps.append(TensorMap(f"{hf}shared_expert.{proj}.weight", shape, (f"{ak}shared_expert.{name}",), "transpose"))
    maps.append(TensorMap(hf + "shared_expert_gate.weight", (1, d), (ak + "W_shared_gate",), "transpose"))
    return maps


FAMILY = Family(
    model_type="qwen3_next",
    keys=frozenset(HYBRID_KEYS + _EXPERT_KEYS),
    read_config=lambda read: hybrid_config(read, DEFAULTS, _experts),
    tensors=lambda cfg, mxfp4=False: hybrid_tensors(cfg, _fused_linear_attention, _mlp_tensors),
    architecture="Qwen3NextForCausalLM", hf_config_class="Qwen3NextConfig",
    # Qwen3.5's benchmark shape with eight experts of width 768, two per token, and a shared expert of 768
    benchmark=dict(QWEN3_5.benchmark, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
                   shared_expert_intermediate_size=768))

"""GLM-4.5 (``glm4_moe``, also GLM-4.6): Llama, except biases on q, k and v but not on the output
(``attention_bias``), RMS-normalised queries and keys per head before the rotary embedding with ``use_qk_norm``
(Qwen3's), the rotary embedding on the first half of each head (``partial_rotary_factor`` 0.5) in Llama's
two-halves layout, and after ``first_k_dense_replace`` dense layers DeepSeek-V3's mixture of experts: sigmoid
scores, ``num_experts_per_tok`` experts chosen by score plus a correction bias within the ``topk_group`` best of
``n_group`` groups, weighed by their uncorrected scores (normalised when ``norm_topk_prob``) times
``routed_scaling_factor``, beside ``n_shared_experts`` shared experts.

Checkpoint (under ``model.``): Llama's (Qwen3's ``self_attn.{q,k}_norm`` with ``use_qk_norm``) with DeepSeek-V3's
expert layers: ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, ``mlp.experts.{j}.{gate,up,down}_proj``
and ``mlp.shared_experts.{gate,up,down}_proj``. The multi-token-prediction layer published after the last one
(``layers.{num_hidden_layers}``) is skipped when the model loads, as transformers skips it, and read on request as a
speculative draft (:func:`~attnkit.pretrained.load_multi_token_predictor`).

llama.cpp's GGUF files (``glm4moe``) keep that layer as the last ``nextn_predict_layers`` blocks (not read either),
state the mixture as ``expert_*`` keys (``leading_dense_block_count`` the dense layers) and stack each matrix's
experts in one tensor.
"""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, common_config, rotated_features
from ..tensor_map import TensorMap
from . import Family
from ._multi_token import MTP_KEYS, mtp_layer_count, multi_token_tensors
from ._reader import COMMON_KEYS, Reader
from .deepseek_v3 import group_routed_experts
from .glm4 import half_rotary
from .llama import BENCHMARK_SHAPE, rotary_config, rotary_tensors
from .qwen3_moe import mlp_tensors

__all__ = ["FAMILY"]

# transformers' Glm4MoeConfig defaults for the keys a config.json may leave out
DEFAULTS = {"max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "pad_token_id": None, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
            "moe_intermediate_size": 1408, "n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 1,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0}

_MOE_KEYS = ("moe_intermediate_size", "n_routed_experts", "num_local_experts", "num_experts_per_tok",
             "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
             "routed_scaling_factor")
# the router's training loss: it changes no forward
_INERT = ("output_router_logits",)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    attention = AttentionConfig(bias=read.bool("attention_bias", False),
                                qk_norm="head" if read.bool("use_qk_norm", False) else None)
    experts = group_routed_experts(read, layers, DEFAULTS)
    return dict(attention=attention, mtp_layers=mtp_layer_count(read),
                **({} if experts is None else dict(experts=experts)))


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """Llama's checkpoint with DeepSeek-V3's expert layers (shared experts under ``shared_experts``)."""
    return rotary_tensors(cfg, lambda c, hf, ak: mlp_tensors(c, hf, ak, shared="shared_experts"))


_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _gguf_count(file: Any, meta: GGUFMetadata, key: str, default: int, below: int | None = None) -> int:
    """A count that may be 0 (``meta.int`` wants a positive one), below ``below`` if given."""
    value = meta.get(key, default)
    if value < 0 or (below is not None and value >= below):
        bound = "" if below is None else f" and below {below}"
        raise file.fail(f"metadata {meta.arch}.{key} = {value} must be 0 or more{bound}")
    return int(value)


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """transformers' config of a ``glm4moe`` file: the blocks less the multi-token-prediction ones, the rotated
    fraction always stated (the reader's default is half), the mixture from llama.cpp's ``expert_*`` keys (a
    sigmoid router; without ``expert_weights_norm`` llama.cpp leaves the weights unnormalised)."""
    config = common_config(file, meta)
    config["partial_rotary_factor"] = rotated_features(meta, config["head_dim"]) / config["head_dim"]
    blocks = config["num_hidden_layers"]
    extra = _gguf_count(file, meta, "nextn_predict_layers", 0, below=blocks)
    gating = meta.get("expert_gating_func", _SIGMOID)
    if gating != _SIGMOID:
        raise file.fail(f"metadata {meta.arch}.expert_gating_func = {gating} is not the sigmoid router ({_SIGMOID}) "
                        f"GLM-4.5 has")
    return dict(config, num_hidden_layers=blocks - extra, num_nextn_predict_layers=extra,
                n_routed_experts=meta.int("expert_count"), num_experts_per_tok=meta.int("expert_used_count"),
                moe_intermediate_size=meta.int("expert_feed_forward_length"),
                n_shared_experts=meta.int("expert_shared_count"),
                first_k_dense_replace=_gguf_count(file, meta, "leading_dense_block_count", 0),
                n_group=meta.int("expert_group_count", 1), topk_group=meta.int("expert_group_used_count", 1),
                routed_scaling_factor=meta.float("expert_weights_scale", 1.0),
                norm_topk_prob=bool(meta.get("expert_weights_norm", False)))


FAMILY = Family(
    model_type="glm4_moe",
    keys=frozenset(COMMON_KEYS + ("attention_bias", "use_qk_norm") + _MOE_KEYS + _INERT + MTP_KEYS),
    read_config=lambda read: rotary_config(
        read, DEFAULTS, _fields, rotary=lambda r, positions: half_rotary(r, positions, interleaved=False)),
    tensors=_tensors, mtp_tensors=lambda cfg: multi_token_tensors(cfg, _tensors),
    gguf=GGUFArchitecture("glm4moe", _gguf_config, bias_flags=(("attention_bias", "blk.0.attn_q.bias"),
                                                               ("use_qk_norm", "blk.0.attn_q_norm.weight")),
                          renamed=(("e_score_correction_bias", "e_score_correction.bias"),), nextn_blocks=True),
    architecture="Glm4MoeForCausalLM", hf_config_class="Glm4MoeConfig",
    # the shared shape with q/k norms and biases, and after one dense layer eight experts of width 512, two per
    # token plus one shared: the active MLP width of the other families (1536)
    benchmark=dict(BENCHMARK_SHAPE, attention_bias=True, use_qk_norm=True, moe_intermediate_size=512,
                   n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                   first_k_dense_replace=1))

"""gpt-oss: Llama, except learned attention sinks per head, biases on every projection, sliding (128) and full
layers alternating (sliding first) unless ``layer_types`` says otherwise, YaRN scaling by default (base 150000,
x32 from 4096 positions), and a mixture of experts instead of the MLP: a router with a bias picks the top-k of
``num_local_experts``, a softmax over the chosen k weighs them, and each expert is a clamped SwiGLU
(``swiglu_alpha``, ``swiglu_limit``) whose ``gate_up_proj`` alternates gate and up columns. The experts'
matrices may be MXFP4 blocks and scales, as gpt-oss is published (``quantization_config`` mxfp4)."""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, ExpertsConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader, read_layer_types
from .llama import BENCHMARK_SHAPE, rotary_config, rotary_tensors

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
            "rms_norm_eps": 1e-5}
_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", True)
    window = read.int("sliding_window", DEFAULTS["sliding_window"], optional=True)
    types = read_layer_types(read, layers, window)
    if types is None:
        types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
    experts = read.int("num_local_experts", 128)
    top_k = read.int("num_experts_per_tok", 4)
    legacy = read.raw("experts_per_token", None)  # the name of OpenAI's own format, kept in its folders
    if legacy is not None and legacy != top_k:
        raise ValueError(f"gpt_oss config: 'experts_per_token' ({legacy!r}) disagrees with 'num_experts_per_tok' "
                         f"({top_k})")
    if top_k > experts:
        raise ValueError(f"gpt_oss config: 'num_experts_per_tok' ({top_k}) exceeds 'num_local_experts' ({experts})")
    attention = AttentionConfig(bias=bias, output_bias=bias, sinks=True,
                                sliding_window=window if "sliding_attention" in types else None)
    return dict(attention=attention, layer_types=types,
                experts=ExpertsConfig(num_experts=experts, num_experts_per_tok=top_k,
                                      moe_intermediate_size=read.int("intermediate_size"), layers=tuple(range(layers)),
                                      router="topk_softmax", router_bias=True, expert_bias=True,
                                      swiglu_limit=read.factor("swiglu_limit", 7.0),
                                      swiglu_alpha=read.factor("swiglu_alpha", 1.702)))


def _read_config(read: Reader) -> DecoderConfig:
    config = {"rope_theta": 150000.0, **read.config}
    if not config.get("rope_scaling") and config.get("rope_parameters") is None:
        config["rope_parameters"] = dict(_ROPE)
    return rotary_config(Reader(config, read.family), DEFAULTS, _fields)


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """Llama's tensors with the router and experts in each MLP's place."""

    def experts(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
        d, f, e = cfg.hidden_size, cfg.experts.moe_intermediate_size, cfg.experts.num_experts
        hf, ak = hf + "mlp.", ak + "mlp."

        def matrix(name: str, shape: tuple[int, ...], targets: tuple[str, ...], layout: str) -> TensorMap:
            if mxfp4:
                return TensorMap(f"{hf}experts.{name}_blocks", shape, targets, layout,
                                 scales=f"{hf}experts.{name}_scales")
            return TensorMap(f"{hf}experts.{name}", shape, targets, layout)

        return [TensorMap(hf + "router.weight", (e, d), (ak + "router.W_router",), "transpose"),
                TensorMap(hf + "router.bias", (e,), (ak + "router.b_router",), "copy"),
                matrix("gate_up_proj", (e, d, 2 * f), (ak + "W_gate", ak + "W_up"), "interleaved_split"),
                TensorMap(hf + "experts.gate_up_proj_bias", (e, 2 * f), (ak + "b_gate", ak + "b_up"),
                          "interleaved_split"),
                matrix("down_proj", (e, f, d), (ak + "W_down",), "copy"),
                TensorMap(hf + "experts.down_proj_bias", (e, d), (ak + "b_down",), "copy")]

    return rotary_tensors(cfg, experts)


FAMILY = Family(
    model_type="gpt_oss",
    keys=frozenset(COMMON_KEYS + ("attention_bias", "sliding_window", "layer_types", "num_local_experts",
                                  "num_experts_per_tok", "experts_per_token", "swiglu_alpha", "swiglu_limit",
                                  "router_aux_loss_coef", "output_router_logits", "initial_context_length")),
    read_config=_read_config, tensors=_tensors, architecture="GptOssForCausalLM", hf_config_class="GptOssConfig",
    # eight experts of width 768, two per token: the same active MLP width as the other families
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64, intermediate_size=768, num_local_experts=8, num_experts_per_tok=2,
                   sliding_window=128),
    quantizations=("mxfp4",))

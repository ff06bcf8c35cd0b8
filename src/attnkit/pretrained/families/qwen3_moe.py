"""Qwen3-MoE: Qwen3, except that the MLP of the sparse layers (every ``decoder_sparse_step``-th layer not in
``mlp_only_layers``, all of them by default) is a mixture of ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``: the top ``num_experts_per_tok`` of a softmax over all router logits, weighted by their
probabilities (divided by their sum when ``norm_topk_prob``, off by default); and a sliding window, with
``use_sliding_window``, on every layer (there is no ``max_window_layers``).

Checkpoint (under ``model.``): Qwen3's, except a sparse layer's ``mlp.gate`` (the router) and
``mlp.experts.{j}.{gate,up,down}_proj`` for each expert j: one tensor per expert on disk (transformers stacks
them in memory), each an entry of attnkit's stacked ``W_gate``, ``W_up``, ``W_down``. Qwen3-Next, DeepSeek-V3
and Mixtral store their experts alike (:func:`mlp_tensors`).
"""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, ExpertsConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import gated_mlp_tensors, rotary_config, rotary_tensors
from .qwen3 import FAMILY as QWEN3

__all__ = ["FAMILY", "EXPERT_KEYS", "mlp_tensors", "num_experts", "sparse_layers"]

DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "num_key_value_heads": 4}
EXPERT_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers", "router_aux_loss_coef", "output_router_logits")
_NUM_EXPERTS = ("num_experts", "num_local_experts")  # transformers reads either and writes the second


def num_experts(read: Reader, default: int, keys: tuple[str, ...] = _NUM_EXPERTS) -> int:
    """E from the first of ``keys`` the config has (all of them must agree); 0 is a dense model."""
    given = {key: read.config[key] for key in keys if key in read.config}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"{read.family} config: " + " and ".join(f"{k!r} ({v!r})" for k, v in given.items())
                         + " disagree")
    key, value = next(iter(given.items()), ("num_experts", default))
    if value == 0 and not isinstance(value, bool):
        return 0
    return Reader({key: value}, read.family).int(key)


def sparse_layers(read: Reader, layers: int) -> tuple[int, ...]:
    """The layers whose MLP is the mixture, by transformers' rule: not in ``mlp_only_layers``, and ``i + 1`` a
    multiple of ``decoder_sparse_step``."""
    step = read.int("decoder_sparse_step", 1)
    dense = read.raw("mlp_only_layers", None) or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"{read.family} config: 'mlp_only_layers' must be a list of layer indices, got {dense!r}")
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _experts(read: Reader, layers: int) -> dict[str, Any]:
    experts, sparse = num_experts(read, 128), sparse_layers(read, layers)
    if not experts or not sparse:  # a dense model: every layer keeps the gated MLP
        return {}
    return dict(experts=ExpertsConfig(
        num_experts=experts, num_experts_per_tok=read.int("num_experts_per_tok", 8),
        moe_intermediate_size=read.int("moe_intermediate_size", 768), layers=sparse,
        norm_topk_prob=read.bool("norm_topk_prob", False)))


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)  # the switch covers the output projection too
    window = read.int("sliding_window", 4096, optional=True) if read.bool("use_sliding_window", False) else None
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="head", sliding_window=window),
                layer_types=("sliding_attention",) * layers if window is not None else (), **_experts(read, layers))


def mlp_tensors(cfg: DecoderConfig, hf: str, ak: str, *, moe: str = "mlp.",
                projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                shared: str = "shared_expert") -> list[TensorMap]:
    """Layer ``hf``'s MLP: Llama's gated MLP on a dense layer; on a layer the experts part lists, the router
    ``{moe}gate`` (with its ``e_score_correction_bias`` for the sigmoid router), each expert's gate, up and down
    matrices one tensor apiece (``{moe}experts.{j}.{projections}``) and the shared expert ``{moe}{shared}.`` with
    its ``shared_expert_gate``, if any."""
    part = cfg.experts
    if part is None or int(hf.split(".")[1]) not in part.layers:
        return gated_mlp_tensors(cfg, hf, ak)
    d, f, e = cfg.hidden_size, part.moe_intermediate_size, part.num_experts
    hf, ak = hf + moe, ak + "mlp."
    maps = [TensorMap(hf + "gate.weight", (e, d), (ak + "router.W_router",), "transpose")]
    if part.router == "sigmoid_group_topk":
        maps.append(TensorMap(hf + "gate.e_score_correction_bias", (e,), (ak + "router.e_score_correction_bias",),
                              "copy"))
    for j in range(e):  # one tensor per expert on disk, one (E, ...) stack per matrix in attnkit
        maps += [TensorMap(f"{hf}experts.{j}.{proj}.weight", shape, (f"{ak}W_{name}",), "transpose", stack_index=j,
                           stack_size=e)
                 for proj, shape, name in zip(projections, ((f, d), (f, d), (d, f)), ("gate", "up", "down"))]
    fs = part.shared_expert_intermediate_size
    if fs:
        maps += [TensorMap(f"{hf}{shared}.{proj}.weight", shape, (f"{ak}shared_expert.W_{name}",), "transpose")
                 for proj, shape, name in (("gate_proj", (fs, d), "gate"), ("up_proj", (fs, d), "up"),
                                           ("down_proj", (d, fs), "down"))]
    if part.shared_expert_gate:
        maps.append(TensorMap(hf + "shared_expert_gate.weight", (1, d), (ak + "shared_expert.W_shared_gate",),
                              "transpose"))
    return maps


FAMILY = Family(
    model_type="qwen3_moe",
    keys=frozenset(COMMON_KEYS + ("attention_bias", "use_sliding_window", "sliding_window") + EXPERT_KEYS
                   + _NUM_EXPERTS),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields),
    tensors=lambda cfg, mxfp4=False: rotary_tensors(cfg, mlp_tensors),
    architecture="Qwen3MoeForCausalLM", hf_config_class="Qwen3MoeConfig",
    # Qwen3's benchmark shape with eight experts of width 768, two per token: the other families' active MLP width
    benchmark=dict(QWEN3.benchmark, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768))

"""Granite 4 hybrid (IBM's GraniteMoeHybrid): Bamba (Mamba-2 mixers, here on the layers ``layer_types`` marks
``mamba``, attention on the others), except for Granite's four scalars (``embedding_multiplier``,
``attention_multiplier`` as the scores' scale, ``residual_multiplier`` on each branch, logits divided by
``logits_scaling``), rotary positions only with ``position_embedding_type`` "rope" (none by default: NoPE), and as
every layer's MLP a mixture of ``num_local_experts`` SwiGLU experts of width ``intermediate_size`` (a softmax over
the top ``num_experts_per_tok`` router logits) plus an ungated shared MLP of width ``shared_intermediate_size``;
with no experts (``num_local_experts`` 0), the shared MLP alone.

Checkpoint (under ``model.``): Bamba's mixers (``mamba.``, ``self_attn.``) with Llama's norm names; each layer's
``shared_mlp.input_linear`` (2 Fs, D, gate rows first) and ``shared_mlp.output_linear``, and with experts
``block_sparse_moe.router.layer`` and the experts stacked in two tensors, ``block_sparse_moe.input_linear``
(E, 2F, D) and ``block_sparse_moe.output_linear`` (E, D, F).

GGUF: llama.cpp's ``granitehybrid``, which its converter writes for Bamba too; a Bamba file reads as the
equivalent Granite 4 hybrid (no multipliers or experts, its MLP the shared MLP, rotary). The converter stores each
``input_linear`` as its gate and up tensors (:data:`GGUF`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, ExpertsConfig, ScalesConfig
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, common_config, layer_counts
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .bamba import (
    MAMBA2_GGUF_RENAMED,
    MAMBA2_GGUF_RESTORED,
    MAMBA_KEYS,
    attention_tensors,
    mamba2_config,
    mamba2_gguf_restore,
    mamba2_tensors,
)
from .llama import BENCHMARK_SHAPE, pre_norm_tensors, rotary_config
from .qwen3_moe import num_experts

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "num_key_value_heads": None}
MULTIPLIER_KEYS = ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling")
EXPERT_KEYS = ("num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "router_aux_loss_coef",
               "output_router_logits")
# transformers' names of a layer's kind, old and new ("layers_block_type" is its other name of "layer_types")
_LAYER_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "full_attention",
                "full_attention": "full_attention"}
_POSITIONS = (None, "nope", "rope")


def _layer_types(read: Reader, layers: int) -> tuple[str, ...]:
    given = {key: read.config[key] for key in ("layer_types", "layers_block_type") if key in read.config}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"{read.family} config: 'layer_types' and 'layers_block_type' disagree")
    key, kinds = next(iter(given.items()), ("layer_types", None))
    if kinds is None:  # transformers' default: every layer a Mamba-2 mixer
        return ("mamba2",) * layers
    if not isinstance(kinds, list) or len(kinds) != layers or not all(k in _LAYER_KINDS for k in kinds):
        raise ValueError(f"{read.family} config: {key!r} must list one of {', '.join(_LAYER_KINDS)} for each of the "
                         f"{layers} layers, got {kinds!r}")
    return tuple(_LAYER_KINDS[k] for k in kinds)


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    # IBM's config.json files name the norm, which transformers never reads: RMSNorm, the one it builds
    if read.raw("normalization_function", "rmsnorm") != "rmsnorm":
        raise ValueError(f"{read.family} config: 'normalization_function' must be 'rmsnorm' (the norm transformers "
                         f"builds), got {read.raw('normalization_function')!r}")
    position = read.raw("position_embedding_type", None)
    if position not in _POSITIONS:
        raise ValueError(f"{read.family} config: 'position_embedding_type' must be 'rope', 'nope' or null, got "
                         f"{position!r}")
    types = _layer_types(read, layers)
    bias = read.bool("attention_bias", False)
    shared = read.int("shared_intermediate_size", 1024)
    experts = num_experts(read, 8, ("num_local_experts",))
    mixture = {} if not experts else dict(experts=ExpertsConfig(
        num_experts=experts, num_experts_per_tok=read.int("num_experts_per_tok", 2),
        moe_intermediate_size=read.int("intermediate_size"), layers=tuple(range(layers)), router="topk_softmax",
        shared_expert_intermediate_size=shared))
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias, scale=read.factor("attention_multiplier", 1.0)),
                scales=ScalesConfig(embedding=read.factor("embedding_multiplier", 1.0),
                                    residual=read.factor("residual_multiplier", 1.0),
                                    logit=1.0 / read.factor("logits_scaling", 1.0)), layer_types=types,
                mixer_parts=(mamba2_config(read),) if "mamba2" in types else (),
                skip_rotary=() if position == "rope" else tuple(range(layers)), **mixture)


def _read(read: Reader) -> DecoderConfig:
    """Without experts the shared MLP is every layer's MLP, so the model's MLP width is
    ``shared_intermediate_size`` (``intermediate_size``, the experts' width, is then read by no layer)."""
    if num_experts(read, 8, ("num_local_experts",)) == 0:
        read = Reader({**read.config, "intermediate_size": read.int("shared_intermediate_size", 1024)}, read.family)
    return rotary_config(read, DEFAULTS, _fields)


def _mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """The shared MLP (attnkit's shared expert, or with no experts the layer's MLP), then the router and the
    stacked experts."""
    d, part = cfg.hidden_size, cfg.experts
    shared = ak + ("mlp.shared_expert." if part is not None else "mlp.")
    fs = part.shared_expert_intermediate_size if part is not None else cfg.mlp.intermediate_size
    maps = [TensorMap(hf + "shared_mlp.input_linear.weight", (2 * fs, d), (shared + "W_gate", shared + "W_up"),
                      "row_split_transpose", sizes=(fs, fs)),
            TensorMap(hf + "shared_mlp.output_linear.weight", (d, fs), (shared + "W_down",), "transpose")]
    if part is None:
        return maps
    e, f, hf, ak = part.num_experts, part.moe_intermediate_size, hf + "block_sparse_moe.", ak + "mlp."
    return maps + [TensorMap(hf + "router.layer.weight", (e, d), (ak + "router.W_router",), "transpose"),
                   TensorMap(hf + "input_linear.weight", (e, 2 * f, d), (ak + "W_gate", ak + "W_up"),
                             "row_split_transpose", sizes=(f, f)),
                   TensorMap(hf + "output_linear.weight", (e, d, f), (ak + "W_down",), "transpose")]


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    return pre_norm_tensors(cfg, attention_tensors, _mlp_tensors, {"mamba2": mamba2_tensors})


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """llama.cpp's ``granitehybrid`` metadata as Granite 4 hybrid's ``config.json``.

    llama.cpp's converter writes Bamba and Granite 4 hybrid alike: a layer is a Mamba-2 layer where
    ``attention.head_count_kv`` is 0; the ``ssm.*`` keys give its shape (``time_step_rank`` heads sharing
    ``inner_size`` features, ``group_count`` groups of ``state_size``); ``rope.scaling.finetuned`` says whether the
    attention rotates (Bamba) or is position-free (Granite 4); Granite's four scalars are written when set, and
    llama.cpp's defaults (scores scaled by ``1 / sqrt(head_dim)``, the other three 1) stand for the absent ones;
    ``expert_shared_feed_forward_length`` is the shared MLP's width (Bamba's MLP: ``feed_forward_length``).
    """
    layers = meta.int("block_count")
    counts = layer_counts(meta, "attention.head_count_kv", layers, "a Mamba-2 layer")
    kv = max(counts) or meta.int("attention.head_count")
    flat = replace(file, metadata={**file.metadata, f"{meta.arch}.attention.head_count_kv": kv})
    config = common_config(flat, GGUFMetadata(flat, meta.architecture))
    experts = file.metadata.get(f"{meta.arch}.expert_count", 0)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        raise file.fail(f"metadata '{meta.arch}.expert_count' must be a non-negative integer, got {experts!r}")
    attention = [i for i, n in enumerate(counts) if n]
    mamba = [i for i, n in enumerate(counts) if not n]
    config.update(
        layer_types=["attention" if n else "mamba" for n in counts],
        position_embedding_type="rope" if meta.get("rope.scaling.finetuned", False) else "nope",
        attention_bias=bool(attention) and f"blk.{attention[0]}.attn_q.bias" in file.tensors,
        attention_multiplier=meta.float("attention.scale", config["head_dim"] ** -0.5),
        embedding_multiplier=meta.float("embedding_scale", 1.0),
        residual_multiplier=meta.float("residual_scale", 1.0), logits_scaling=meta.float("logit_scale", 1.0),
        num_local_experts=experts,
        shared_intermediate_size=meta.int("expert_shared_feed_forward_length", config["intermediate_size"]))
    if experts:
        config["num_experts_per_tok"] = meta.int("expert_used_count")
    if mamba:
        hidden, inner, heads = config["hidden_size"], meta.int("ssm.inner_size"), meta.int("ssm.time_step_rank")
        if inner % hidden or inner % heads:
            raise file.fail(f"metadata '{meta.arch}.ssm.inner_size' = {inner} must be a multiple of "
                            f"'{meta.arch}.embedding_length' = {hidden} and of '{meta.arch}.ssm.time_step_rank' = "
                            f"{heads} (the Mamba-2 heads)")
        config.update(mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_expand=inner // hidden,
                      mamba_d_state=meta.int("ssm.state_size"), mamba_n_groups=meta.int("ssm.group_count"),
                      mamba_d_conv=meta.int("ssm.conv_kernel"),
                      mamba_conv_bias=f"blk.{mamba[0]}.ssm_conv1d.bias" in file.tensors,
                      mamba_proj_bias=f"blk.{mamba[0]}.ssm_in.bias" in file.tensors)
    return config


def _gguf_tensors(cfg: DecoderConfig, maps: list[TensorMap]) -> list[TensorMap]:
    """The checkpoint maps as llama.cpp's converter writes them: each fused ``input_linear`` as its gate and up
    parts (``ffn_gate_exps`` / ``ffn_up_exps``; the shared MLP's ``ffn_gate_shexp`` / ``ffn_up_shexp``, or with no
    experts ``ffn_gate`` / ``ffn_up``, its ``output_linear`` then ``ffn_down``)."""
    shared = "mlp.shared_expert." if cfg.experts is not None else "mlp."
    fused = {"shared_mlp.input_linear.weight": shared, "block_sparse_moe.input_linear.weight": "mlp.experts."}
    read = []
    for m in maps:
        ending = next((e for e in fused if m.source.endswith(e)), None)
        if ending is not None:
            part = m.source[:-len(ending)] + fused[ending]  # "layers.{i}.mlp.experts." ...
            read += m.parts_apart((part + "gate_proj.weight", part + "up_proj.weight"))
        elif m.source.endswith("shared_mlp.output_linear.weight"):
            read.append(replace(m, source=m.source.replace("shared_mlp.output_linear", shared + "down_proj")))
        else:
            read.append(m)
    return read


GGUF = GGUFArchitecture(
    "granitehybrid", _gguf_config, permuted_qk=True, renamed=MAMBA2_GGUF_RENAMED, restored=MAMBA2_GGUF_RESTORED,
    restore=mamba2_gguf_restore, tensors=_gguf_tensors)


FAMILY = Family(
    model_type="granitemoehybrid",
    keys=frozenset(COMMON_KEYS + MAMBA_KEYS + MULTIPLIER_KEYS + EXPERT_KEYS
                   + ("attention_bias", "position_embedding_type", "layer_types", "layers_block_type",
                      "normalization_function")),
    read_config=_read, tensors=_tensors, architecture="GraniteMoeHybridForCausalLM",
    hf_config_class="GraniteMoeHybridConfig", gguf=GGUF,
    # the benchmark's shape with one attention layer in six, Mamba-2 heads of 64, eight experts of width 384, two
    # per token, and a shared MLP of 768: the same active MLP width as the other families
    benchmark=dict(BENCHMARK_SHAPE, intermediate_size=384, layer_types=(["mamba"] * 5 + ["attention"]) * 5,
                   mamba_n_heads=18, mamba_d_state=64, mamba_chunk_size=64,
                   num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=768,
                   position_embedding_type="nope", attention_multiplier=0.125, embedding_multiplier=12.0,
                   residual_multiplier=0.22, logits_scaling=8.0))

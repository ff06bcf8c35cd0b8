"""Nemotron-H (NVIDIA): Llama's norms and grouped-query attention, except that every layer is ONE branch, a norm and
its one part beside the residual, the part by ``layers_block_type`` (or ``hybrid_override_pattern``, a letter per
layer): a Mamba-2 mixer ("linear_attention", ``M``; its ``n_groups`` groups, dt held at or above
``time_step_min``), attention without any position embedding ("full_attention", ``*``), or an ungated MLP of
squared ReLU ("mlp", ``-``); the mixture-of-experts layers ("moe", ``E``: ungated experts) and the multi-token
prediction layers are refused by name.

transformers holds dt up in its chunked scan (a prompt) but not in its one-token step; attnkit holds it up in both,
so that cached decoding equals the uncached forward.

Checkpoint (under ``backbone.``): ``embeddings``; per layer ``norm`` and ``mixer.`` holding Bamba's Mamba-2 tensors
(:mod:`attnkit.layers.mamba2` maps them), ``{q,k,v,o}_proj`` or ``{up,down}_proj``; ``norm_f``; ``lm_head`` (never
tied: transformers ties nothing here).

GGUF: llama.cpp's ``nemotron_h`` (a dense model; its ``nemotron_h_moe`` is not read), each layer's kind from the
per-layer counts, the step sizes without a floor as llama.cpp computes them (:data:`GGUF`).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ...layers.mamba2 import Mamba2Config
from ...models.config import AttentionConfig, DecoderConfig, MLPConfig, NormConfig, RotaryConfig, SpecialTokens
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, layer_counts, special_ids, vocab_size
from ..tensor_map import TensorMap
from . import Family
from ._reader import Reader
from .bamba import MAMBA2_GGUF_RENAMED, MAMBA2_GGUF_RESTORED, mamba2_gguf_restore, mamba2_tensors
from .llama import BENCHMARK_SHAPE

__all__ = ["FAMILY"]

_KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "full_attention",
          "attention": "full_attention", "mlp": "mlp"}
_LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# transformers' older names of some keys (it reads the older one where both are given)
_ALIASES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "expand": "mamba_expand",
            "time_step_min": "mamba_dt_min", "time_step_max": "mamba_dt_max", "time_step_limit": "mamba_dt_limit",
            "time_step_floor": "mamba_dt_init_floor", "use_conv_bias": "mamba_conv_bias",
            "chunk_size": "mamba_chunk_size"}
_READ = ("vocab_size", "hidden_size", "layers_block_type", "hybrid_override_pattern", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "intermediate_size",
         "mlp_hidden_act", "mlp_bias", "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "mamba_hidden_act",
         "n_groups", "conv_kernel", "time_step_min", "use_conv_bias", "chunk_size", "use_bias", "layer_norm_epsilon",
         "num_nextn_predict_layers", "attention_head_dim")
# keys that change no forward pass of transformers' NemotronH: its attention has no biases and no window whatever
# they say, its Mamba-2 clamps dt to [time_step_min, inf) whatever time_step_limit says, its head is never tied,
# the rest are initialisation, cache dtype, generation settings and remote code's classes (auto_map); and the
# mixture's keys, read by no layer
# once "moe" layers are refused
_IGNORED = ("attention_bias", "sliding_window", "time_step_limit", "time_step_max", "time_step_floor", "expand",
            "mamba_proj_bias", "mamba_ssm_cache_dtype", "residual_in_fp32", "rescale_prenorm_residual",
            "use_mamba_kernels", "num_logits_to_keep", "n_routed_experts", "num_local_experts", "output_router_logits",
            "n_shared_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "moe_latent_size",
            "moe_shared_expert_overlap", "num_experts_per_tok", "routed_scaling_factor", "n_group", "topk_group",
            "norm_topk_prob", "mtp_layers_block_type", "mtp_hybrid_override_pattern", "auto_map")


def _unaliased(config: dict) -> dict:
    """The config with transformers' older key names read into the newer ones, as its config class does."""
    out = {k: v for k, v in config.items() if k not in _ALIASES.values()}
    out.update({key: config[alias] for key, alias in _ALIASES.items() if alias in config})
    return out


def _layer_kinds(read: Reader) -> list[str]:
    kinds = read.raw("layers_block_type", None)
    pattern = read.raw("hybrid_override_pattern", None)
    if kinds is None and pattern is not None:
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_LETTERS):
            raise ValueError(f"{read.family} config: 'hybrid_override_pattern' must be a string of the letters "
                             f"{', '.join(_LETTERS)} (one per layer), got {pattern!r}")
        kinds = [_LETTERS[c] for c in pattern]
    if kinds is None:  # transformers' default
        kinds = ["linear_attention", "moe", "full_attention", "mlp"]
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"{read.family} config: 'layers_block_type' must be a non-empty list of layer kinds, got "
                         f"{kinds!r}")
    if "moe" in kinds:
        raise ValueError(f"{read.family} config: 'moe' layers (layer {kinds.index('moe')}: a mixture of ungated "
                         f"experts) are not supported; attnkit reads Nemotron-H's mamba, attention and mlp layers")
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown:
        raise ValueError(f"{read.family} config: 'layers_block_type' holds kinds attnkit does not know: {unknown} "
                         f"(expected {', '.join(_KINDS)})")
    return [_KINDS[k] for k in kinds]


def _read(read: Reader) -> DecoderConfig:
    read = Reader(_unaliased(read.config), read.family)
    types = _layer_kinds(read)
    if read.int("num_nextn_predict_layers", 0, minimum=0):
        raise ValueError(f"{read.family} config: 'num_nextn_predict_layers' > 0 (multi-token prediction layers) is "
                         f"not supported")
    if read.raw("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"{read.family} config: 'mamba_hidden_act' must be 'silu' (the convolution's activation "
                         f"attnkit's Mamba-2 applies), got {read.raw('mamba_hidden_act')!r}")
    hidden, heads = read.int("hidden_size", 4096), read.int("num_attention_heads", 32)
    kv_heads = read.int("num_key_value_heads", 8, optional=True) or heads
    if heads % kv_heads:
        raise ValueError(f"{read.family} config: num_key_value_heads ({kv_heads}) must divide num_attention_heads "
                         f"({heads})")
    head_dim = read.int("head_dim", 128)
    # NVIDIA's config.json files name the heads' width attention_head_dim, which transformers does not read (its
    # head_dim, 128 by default, decides): the two must agree
    if read.int("attention_head_dim", head_dim) != head_dim:
        raise ValueError(f"{read.family} config: 'attention_head_dim' ({read.raw('attention_head_dim')}) must equal "
                         f"head_dim ({head_dim}), the width transformers uses")
    eps = read.eps("layer_norm_epsilon", 1e-5)
    fields: dict[str, Any] = {}
    if "mamba2" in types:
        floor = read.raw("time_step_min", 0.001)
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor < float("inf"):
            raise ValueError(f"{read.family} config: 'time_step_min' must be a finite number >= 0, got {floor!r}")
        fields["mixer_parts"] = (Mamba2Config(
            read.int("mamba_num_heads", 128), read.int("mamba_head_dim", 64), read.int("ssm_state_size", 128),
            read.int("n_groups", 8), read.int("conv_kernel", 4), read.bool("use_conv_bias", True),
            read.bool("use_bias", False), read.int("chunk_size", 128), float(floor)),)
    layers = len(types)
    return DecoderConfig(
        family=read.family, vocab_size=read.int("vocab_size", 131072), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        mlp=MLPConfig(read.int("intermediate_size", 21504), kind="ungated",
                      activation=read.activation("mlp_hidden_act", "relu2"), bias=read.bool("mlp_bias", False)),
        max_position_embeddings=read.int("max_position_embeddings", 4096),
        residual="single", norm=NormConfig(eps=eps), rotary=RotaryConfig(skip_layers=tuple(range(layers))),
        attention=AttentionConfig(), tie_word_embeddings=False, layer_types=tuple(types),
        tokens=SpecialTokens(bos=read.token_ids("bos_token_id", 1, many=False),
                             eos=read.token_ids("eos_token_id", 2, many=True),
                             pad=read.token_ids("pad_token_id", 0, many=False)), **fields)


def _mixer_tensors(cfg: DecoderConfig, i: int) -> list[TensorMap]:
    d, kind = cfg.hidden_size, cfg.layer_types[i]
    hf, ak = f"layers.{i}.", f"layers.{i}."
    if kind == "mamba2":
        return [replace(m, source=m.source.replace(".mamba.", ".mixer.")) for m in mamba2_tensors(cfg, hf, ak)]
    if kind == "mlp":
        f, mlp = cfg.mlp.intermediate_size, ak + "mlp."
        maps = [TensorMap(hf + "mixer.up_proj.weight", (f, d), (mlp + "W_up",), "transpose"),
                TensorMap(hf + "mixer.down_proj.weight", (d, f), (mlp + "W_down",), "transpose")]
        if cfg.mlp.bias:
            maps += [TensorMap(hf + "mixer.up_proj.bias", (f,), (mlp + "b_up",), "copy"),
                     TensorMap(hf + "mixer.down_proj.bias", (d,), (mlp + "b_down",), "copy")]
        return maps
    q, kv, attn = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, ak + "attention."
    return [TensorMap(f"{hf}mixer.{proj}.weight", shape, (attn + "W_" + name,), "transpose")
            for proj, shape, name in (("q_proj", (q, d), "Q"), ("k_proj", (kv, d), "K"), ("v_proj", (kv, d), "V"),
                                      ("o_proj", (d, q), "O"))]


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    d, v = cfg.hidden_size, cfg.vocab_size
    maps = [TensorMap("embeddings.weight", (v, d), ("embed.weight",), "copy")]
    for i, kind in enumerate(cfg.layer_types):
        norm = "mlp_norm" if kind == "mlp" else "attn_norm"
        maps += [TensorMap(f"layers.{i}.norm.weight", (d,), (f"layers.{i}.{norm}.gamma",), "copy"),
                 *_mixer_tensors(cfg, i)]
    maps += [TensorMap("norm_f.weight", (d,), ("norm.gamma",), "copy"),
             TensorMap("lm_head.weight", (v, d), ("head.weight",), "copy")]
    return maps, "backbone."


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """llama.cpp's ``nemotron_h`` metadata as Nemotron-H's ``config.json``.

    A layer's kind is where its per-layer counts are not 0: ``attention.head_count_kv`` (attention),
    ``feed_forward_length`` (the MLP), neither (Mamba-2, its shape from the ``ssm.*`` keys). Biases are read from
    the tensors. llama.cpp holds dt at no floor, so neither does the model read here (``time_step_min`` 0;
    transformers' default is 0.001).
    """
    layers, hidden = meta.int("block_count"), meta.int("embedding_length")
    kv = layer_counts(meta, "attention.head_count_kv", layers, "a layer without attention")
    widths = layer_counts(meta, "feed_forward_length", layers, "a layer without an MLP")
    both = [i for i in range(layers) if kv[i] and widths[i]]
    if both:
        raise file.fail(f"layer {both[0]} has both attention ('{meta.arch}.attention.head_count_kv') and an MLP "
                        f"('{meta.arch}.feed_forward_length'); a Nemotron-H layer has one branch")
    kinds = ["full_attention" if k else "mlp" if f else "linear_attention" for k, f in zip(kv, widths)]
    heads = meta.int("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden // heads)
    scale = meta.get("attention.scale")
    if scale is not None and not math.isclose(meta.float("attention.scale"), head_dim ** -0.5, rel_tol=1e-6):
        raise file.fail(f"metadata '{meta.arch}.attention.scale' = {scale} is not 1 / sqrt(head_dim) = "
                        f"{head_dim ** -0.5:.6g}; Nemotron-H's attention scales its scores by that alone")
    eps_key = ("attention.layer_norm_rms_epsilon" if meta.get("attention.layer_norm_rms_epsilon") is not None
               else "attention.layer_norm_epsilon")
    config = {"model_type": file.model_type, "vocab_size": vocab_size(file, meta), "hidden_size": hidden,
              "layers_block_type": kinds, "num_attention_heads": heads, "num_key_value_heads": max(kv) or heads,
              "head_dim": head_dim,
              "max_position_embeddings": meta.int("context_length"), "layer_norm_epsilon": meta.float(eps_key),
              **special_ids(file)}
    if "mlp" in kinds:
        config.update(intermediate_size=max(widths),
                      mlp_bias=f"blk.{kinds.index('mlp')}.ffn_up.bias" in file.tensors)
    if "linear_attention" in kinds:
        first, inner, ssm_heads = kinds.index("linear_attention"), meta.int("ssm.inner_size"), \
            meta.int("ssm.time_step_rank")
        if inner % ssm_heads:
            raise file.fail(f"metadata '{meta.arch}.ssm.inner_size' = {inner} must be a multiple of "
                            f"'{meta.arch}.ssm.time_step_rank' = {ssm_heads} (the Mamba-2 heads)")
        config.update(mamba_num_heads=ssm_heads, mamba_head_dim=inner // ssm_heads,
                      ssm_state_size=meta.int("ssm.state_size"), n_groups=meta.int("ssm.group_count"),
                      conv_kernel=meta.int("ssm.conv_kernel"), time_step_min=0.0,
                      use_conv_bias=f"blk.{first}.ssm_conv1d.bias" in file.tensors,
                      use_bias=f"blk.{first}.ssm_in.bias" in file.tensors)
    return config


GGUF = GGUFArchitecture("nemotron_h", _gguf_config, permuted_qk=True, renamed=MAMBA2_GGUF_RENAMED,
                        restored=MAMBA2_GGUF_RESTORED, restore=mamba2_gguf_restore)


FAMILY = Family(
    model_type="nemotron_h",
    keys=frozenset(_READ + _IGNORED + tuple(_ALIASES.values())),
    read_config=_read, tensors=_tensors, architecture="NemotronHForCausalLM", hf_config_class="NemotronHConfig",
    gguf=GGUF,
    # the benchmark's shape (30 layers: mamba, mlp, mamba, mlp, attention, mlp, five times) with Mamba-2 heads of 64
    benchmark=dict({k: v for k, v in BENCHMARK_SHAPE.items() if k not in ("num_hidden_layers", "rms_norm_eps",
                                                                          "tie_word_embeddings")},
                   head_dim=64, layers_block_type=["linear_attention", "mlp", "linear_attention", "mlp",
                                                   "full_attention", "mlp"] * 5,
                   mamba_num_heads=18, mamba_head_dim=64, ssm_state_size=64, n_groups=1, chunk_size=64))

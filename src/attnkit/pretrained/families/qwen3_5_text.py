"""Qwen3.5 and Qwen3.6 (text): Qwen3, except that three layers in four are Gated DeltaNet layers (linear
attention with a delta-rule state, ``layer_types`` "linear_attention", or every ``full_attention_interval``-th
layer full), the full layers gate their heads' outputs with a sigmoid (``q_proj`` makes each head's queries and
its gate), every RMSNorm but the Gated DeltaNet's output norm multiplies by ``1 + weight``, a quarter of each
head is rotated (``partial_rotary_factor`` 0.25; the multimodal rotary sections are the plain rotation for
text), and the context is 32768 positions.

Checkpoint (under ``model.``): Llama's, except in a full layer ``self_attn.q_proj`` (Hq, 2, Dh, D): each head's
query rows then its gate rows (``W_Q``, ``W_G``), and a linear layer holds ``linear_attn.`` with
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm`` and
``out_proj`` (:mod:`attnkit.layers.gated_deltanet` maps them) in place of ``self_attn.``.

:func:`hybrid_config` and :func:`hybrid_tensors` are these rules with the MLP left open; Qwen3-Next calls them
with its experts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ...layers.gated_deltanet import GatedDeltaNetConfig
from ...models.config import AttentionConfig, DecoderConfig
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, common_config, rotated_features
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, LayerTensors, gated_mlp_tensors, pre_norm_tensors, rotary_config

__all__ = ["FAMILY", "HYBRID_KEYS", "hybrid_config", "hybrid_tensors", "linear_attention_tensors"]

DEFAULTS = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
            "eos_token_id": None, "num_key_value_heads": 4, "head_dim": 256}
HYBRID_KEYS = COMMON_KEYS + ("attention_bias", "layer_types", "full_attention_interval", "linear_conv_kernel_dim",
                             "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                             "linear_num_value_heads")
# Qwen3.5's multimodal rotary splits the rotated features into time, height and width sections; a text's three
# position ids are equal, so the sections rotate alike and the rotation is the plain one.
_MULTIMODAL_ROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _layer_types(read: Reader, layers: int) -> tuple[str, ...]:
    """Hugging Face's "linear_attention" and "full_attention" as attnkit's mixers: the full layers are gated."""
    given = read.raw("layer_types", None)
    if given is None:
        interval = read.int("full_attention_interval", 4)
        given = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not set(given) <= {"linear_attention",
                                                                                 "full_attention"}:
        raise ValueError(f"{read.family} config: 'layer_types' must list linear_attention or full_attention for each "
                         f"of the {layers} layers, got {given!r}")
    return tuple("gated_attention" if kind == "full_attention" else kind for kind in given)


def _without_multimodal_rope(read: Reader) -> Reader:
    config = dict(read.config)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(config.get(key), dict):
            config[key] = {k: v for k, v in config[key].items() if k not in _MULTIMODAL_ROPE_KEYS}
    return Reader(config, read.family)


def hybrid_config(read: Reader, defaults: dict[str, Any],
                  mlp_fields: Callable[[Reader, int], dict[str, Any]] = lambda read, layers: {}) -> DecoderConfig:
    """The DecoderConfig of a Qwen3.5-style hybrid: Qwen3's attention gated, Gated DeltaNet layers, (1 + w)
    norms, partial rotary; ``mlp_fields(read, layers)`` adds the MLP's fields (default: Llama's gated MLP)."""

    def fields(read: Reader, layers: int) -> dict[str, Any]:
        bias = read.bool("attention_bias", False)
        shape = GatedDeltaNetConfig(read.int("linear_num_key_heads", 16), read.int("linear_num_value_heads", 32),
                                    read.int("linear_key_head_dim", 128), read.int("linear_value_head_dim", 128),
                                    read.int("linear_conv_kernel_dim", 4))
        return dict(attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="head"),
                    layer_types=_layer_types(read, layers), mixer_parts=(shape,), **mlp_fields(read, layers))

    read = _without_multimodal_rope(read)
    if "partial_rotary_factor" not in read.config and "partial_rotary_factor" not in (
            read.config.get("rope_parameters") or {}):
        read = Reader({**read.config, "partial_rotary_factor": 0.25}, read.family)
    config = rotary_config(read, defaults, fields)
    return replace(config, norm=replace(config.norm, offset=1.0))  # every RMSNorm but the gated one: 1 + w


def _gated_attention_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    d, hq, dh = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    kv = cfg.num_kv_heads * dh
    hf, ak = hf + "self_attn.", ak + "attention."
    maps = [TensorMap(hf + "q_proj.weight", (2 * hq * dh, d), (ak + "W_Q", ak + "W_G"), "head_split_transpose",
                      heads=hq),
            TensorMap(hf + "k_proj.weight", (kv, d), (ak + "W_K",), "transpose"),
            TensorMap(hf + "v_proj.weight", (kv, d), (ak + "W_V",), "transpose"),
            TensorMap(hf + "o_proj.weight", (d, hq * dh), (ak + "W_O",), "transpose"),
            TensorMap(hf + "q_norm.weight", (dh,), (ak + "q_norm",), "copy"),
            TensorMap(hf + "k_norm.weight", (dh,), (ak + "k_norm",), "copy")]
    if cfg.attention.bias:
        maps += [TensorMap(hf + "q_proj.bias", (2 * hq * dh,), (ak + "b_Q", ak + "b_G"), "head_split", heads=hq),
                 TensorMap(hf + "k_proj.bias", (kv,), (ak + "b_K",), "copy"),
                 TensorMap(hf + "v_proj.bias", (kv,), (ak + "b_V",), "copy"),
                 TensorMap(hf + "o_proj.bias", (d,), (ak + "b_O",), "copy")]
    return maps


def linear_attention_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """Qwen3.5's split projections, one to one (the table of :mod:`attnkit.layers.gated_deltanet`)."""
    shape, d = cfg.mixer_part(GatedDeltaNetConfig), cfg.hidden_size
    kd, vd, hv = shape.num_key_heads * shape.key_head_dim, shape.num_value_heads * shape.value_head_dim, \
        shape.num_value_heads
    conv = 2 * kd + vd
    hf, ak = hf + "linear_attn.", ak + "attention."
    return [TensorMap(hf + "in_proj_qkv.weight", (conv, d), (ak + "W_qkv",), "transpose"),
            TensorMap(hf + "in_proj_z.weight", (vd, d), (ak + "W_z",), "transpose"),
            TensorMap(hf + "in_proj_b.weight", (hv, d), (ak + "W_b",), "transpose"),
            TensorMap(hf + "in_proj_a.weight", (hv, d), (ak + "W_a",), "transpose"),
            TensorMap(hf + "conv1d.weight", (conv, 1, shape.conv_kernel_size), (ak + "conv_weight",), "reshape",
                      sizes=(conv, shape.conv_kernel_size)),
            TensorMap(hf + "dt_bias", (hv,), (ak + "dt_bias",), "copy"),
            TensorMap(hf + "A_log", (hv,), (ak + "A_log",), "copy"),
            TensorMap(hf + "norm.weight", (shape.value_head_dim,), (ak + "norm_gamma",), "copy"),
            TensorMap(hf + "out_proj.weight", (d, vd), (ak + "W_out",), "transpose")]


def hybrid_tensors(cfg: DecoderConfig, linear: LayerTensors = linear_attention_tensors,
                   mlp: LayerTensors = gated_mlp_tensors) -> tuple[list[TensorMap], str]:
    """The hybrid's checkpoint and the base prefix ``"model."``: per layer its input norm, its mixer's tensors
    (gated attention, or ``linear(cfg, hf_prefix, attnkit_prefix)`` for a linear layer), the MLP's input norm
    and ``mlp(cfg, hf_prefix, attnkit_prefix)``."""
    return pre_norm_tensors(cfg, _gated_attention_tensors, mlp, {"linear_attention": linear})


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """llama.cpp's ``qwen35`` metadata as Qwen3.5's ``config.json``: the Gated DeltaNet shape from the ``ssm.*`` keys
    (``group_count`` key heads of ``state_size``, ``time_step_rank`` value heads sharing ``inner_size``) and every
    ``full_attention_interval``-th layer full."""
    config = common_config(file, meta)
    value_heads, inner = meta.int("ssm.time_step_rank"), meta.int("ssm.inner_size")
    if inner % value_heads:
        raise file.fail(f"metadata '{meta.arch}.ssm.inner_size' = {inner} is not a multiple of "
                        f"'{meta.arch}.ssm.time_step_rank' = {value_heads} (the value heads)")
    rotated = rotated_features(meta, config["head_dim"])
    config.update(linear_conv_kernel_dim=meta.int("ssm.conv_kernel"), linear_key_head_dim=meta.int("ssm.state_size"),
                  linear_num_key_heads=meta.int("ssm.group_count"), linear_num_value_heads=value_heads,
                  linear_value_head_dim=inner // value_heads,
                  full_attention_interval=meta.int("full_attention_interval"),
                  # always stated: Qwen3.5's default (a quarter) is not the whole head common_config assumes
                  partial_rotary_factor=rotated / config["head_dim"])
    return config


def _grouped(values: np.ndarray, axis: int, key_heads: int, width: int) -> np.ndarray:
    """Value heads back in Hugging Face's order along ``axis``: llama.cpp's converter stores them tiled (the first
    of each key head's group, then the second, ...) where Hugging Face groups them by key head."""
    shape = values.shape
    per_key = shape[axis] // (key_heads * width)
    tiled = values.reshape(shape[:axis] + (per_key, key_heads, width) + shape[axis + 1:])  # (..., R, K, W, ...)
    return np.swapaxes(tiled, axis, axis + 1).reshape(shape)  # (..., K*R*W, ...)


def _gguf_restore(name: str, values: np.ndarray, cfg: DecoderConfig) -> np.ndarray:
    """What llama.cpp's converter changed in a Gated DeltaNet tensor, undone: ``A`` stored as ``-exp(A_log)``, the
    convolution squeezed to (C, K), and the value heads reordered (when there are more than key heads)."""
    s = cfg.mixer_part(GatedDeltaNetConfig)
    qk = 2 * s.num_key_heads * s.key_head_dim  # the q and k channels, ahead of the values
    if name.endswith("ssm_a"):
        values = np.log(-values.astype(np.float64))  # A_log; -exp(A_log) is negative
    if name.endswith(("ssm_a", "ssm_dt.bias", "ssm_beta.weight", "ssm_alpha.weight")):
        return _grouped(values, 0, s.num_key_heads, 1)  # (Hv, ...)
    if name.endswith("ssm_out.weight"):
        return _grouped(values, 1, s.num_key_heads, s.value_head_dim)  # (D, Hv*Dv)
    if name.endswith("attn_gate.weight"):
        return _grouped(values, 0, s.num_key_heads, s.value_head_dim)  # (Hv*Dv, D)
    # ssm_conv1d.weight (C, K) and attn_qkv.weight (C, D): only the value channels moved
    return np.concatenate([values[:qk], _grouped(values[qk:], 0, s.num_key_heads, s.value_head_dim)])


GGUF = GGUFArchitecture(
    "qwen35", _gguf_config, norm_offset=True, plain_norms=("ssm_norm.weight",), renamed=(("dt_bias", "dt_proj.bias"),),
    restored=("ssm_a", "ssm_dt.bias", "ssm_beta.weight", "ssm_alpha.weight", "ssm_out.weight", "attn_gate.weight",
              "ssm_conv1d.weight", "attn_qkv.weight"),
    restore=_gguf_restore)


FAMILY = Family(
    model_type="qwen3_5_text",
    keys=frozenset(HYBRID_KEYS),
    read_config=lambda read: hybrid_config(read, DEFAULTS),
    tensors=lambda cfg, mxfp4=False: hybrid_tensors(cfg),
    architecture="Qwen3_5ForCausalLM", hf_config_class="Qwen3_5TextConfig", gguf=GGUF,
    # the benchmark's shape: 3 Gated DeltaNet layers to 1 gated full layer, heads of 64
    benchmark=dict(BENCHMARK_SHAPE, num_hidden_layers=28, head_dim=64, linear_num_key_heads=3,
                   linear_num_value_heads=6, linear_key_head_dim=64, linear_value_head_dim=64))

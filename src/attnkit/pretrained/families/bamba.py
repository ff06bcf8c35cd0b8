"""Bamba (IBM): Llama, except that every layer but those ``attn_layer_indices`` lists is a Mamba-2 mixer
(:class:`~attnkit.layers.mamba2.Mamba2`: ``mamba_n_heads`` heads of ``mamba_d_head``, ``mamba_n_groups`` groups
of ``mamba_d_state`` B and C channels, a ``mamba_d_conv`` SiLU convolution, the SSD scan, a gated group RMSNorm),
half of each attention head is rotated, and the context is 262144 positions.

Checkpoint (under ``model.``): Llama's, except that a Mamba layer holds ``mamba.`` with ``in_proj``, ``conv1d``,
``dt_bias``, ``A_log``, ``D``, ``norm`` and ``out_proj`` (:mod:`attnkit.layers.mamba2` maps them) in place of
``self_attn.``, the MLP is ``feed_forward.`` with its input norm ``pre_ff_layernorm``, and the final norm is
``final_layernorm``.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from ...layers.attention_mamba2 import AttentionMamba2Config
from ...layers.mamba2 import Mamba2Config
from ...models.config import AttentionConfig, DecoderConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .llama import BENCHMARK_SHAPE, gated_mlp_tensors, pre_norm_tensors, rotary_config

__all__ = ["FAMILY", "MAMBA_KEYS", "MAMBA2_GGUF_RENAMED", "MAMBA2_GGUF_RESTORED", "attention_tensors",
           "mamba2_config", "mamba2_shape", "mamba2_tensors", "mamba2_gguf_restore"]

DEFAULTS = {"max_position_embeddings": 262144, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-5}
MAMBA_KEYS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
              "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit")
# training and generation settings that change no forward pass: the loss's z-term, how many logits generate keeps
_TRAINING_KEYS = ("z_loss_coefficient", "num_logits_to_keep")


def _check_time_step_limit(read: Reader) -> None:
    """transformers clamps dt to ``time_step_limit``; attnkit reads only the default (0, inf), which clamps
    nothing (json writes the infinity as ``{"__float__": "Infinity"}``)."""
    limit = read.raw("time_step_limit", None)
    if limit is None:
        return
    high = limit[1] if isinstance(limit, list) and len(limit) == 2 else None
    high = float(high["__float__"]) if isinstance(high, dict) and high.get("__float__") == "Infinity" else high
    if not (isinstance(limit, list) and limit[0] in (0, 0.0) and isinstance(high, float) and math.isinf(high)):
        raise ValueError(f"{read.family} config: 'time_step_limit' other than [0, inf] (a clamp of the step sizes) "
                         f"is not supported, got {limit!r}")


def mamba2_config(read: Reader) -> Mamba2Config:
    """The Mamba-2 layers' shape from the ``mamba_*`` keys (transformers' defaults, ``mamba_d_head`` "auto":
    ``mamba_expand * hidden_size / mamba_n_heads``)."""
    _check_time_step_limit(read)
    heads, inner = read.int("mamba_n_heads", 128), read.int("mamba_expand", 2) * read.int("hidden_size")
    head_dim = read.raw("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else read.int("mamba_d_head")
    if heads * head_dim != inner:
        raise ValueError(f"{read.family} config: mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must equal "
                         f"mamba_expand * hidden_size ({inner})")
    return Mamba2Config(heads, head_dim, read.int("mamba_d_state", 256), read.int("mamba_n_groups", 1),
                        read.int("mamba_d_conv", 4), read.bool("mamba_conv_bias", True),
                        read.bool("mamba_proj_bias", False), read.int("mamba_chunk_size", 256))


# llama.cpp's converter renames dt_bias and changes these Mamba-2 tensors (its GGUF files of Bamba, Granite 4
# hybrid and Nemotron-H): mamba2_gguf_restore undoes it
MAMBA2_GGUF_RENAMED = (("dt_bias", "dt_proj.bias"),)
MAMBA2_GGUF_RESTORED = ("ssm_a", "ssm_d", "ssm_norm.weight", "ssm_conv1d.weight")


def mamba2_gguf_restore(name: str, values: np.ndarray, cfg: DecoderConfig) -> np.ndarray:
    """A Mamba-2 tensor of llama.cpp's converter (``Mamba2Model.modify_tensors``) as Hugging Face stores it:
    ``A`` is stored as ``-exp(A_log)``; ``D`` and ``A`` as (H, 1), the gated norm as (groups, features per group)
    and the convolution squeezed to (C, K) change only their shape, which the loader gives back."""
    if not name.endswith("ssm_a"):
        return values
    if not np.all(values < 0):
        raise ValueError(f"GGUF tensor {name!r} must hold Mamba-2's A = -exp(A_log), all negative; it holds "
                         f"{float(np.max(values))}")
    return np.log(-values.astype(np.float64))  # A_log, (H, 1)


def _layer_types(read: Reader, layers: int) -> tuple[str, ...]:
    full = read.raw("attn_layer_indices", None) or []
    if not isinstance(full, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in full):
        raise ValueError(f"{read.family} config: 'attn_layer_indices' must be a list of layer indices or null, "
                         f"got {full!r}")
    return tuple("full_attention" if i in full else "mamba2" for i in range(layers))


def _config(read: Reader) -> DecoderConfig:
    read = Reader({"pad_token_id": 0, **read.config}, read.family)  # transformers' Bamba default (Llama's: none)
    if not any(key in read.config for key in ("partial_rotary_factor", "rope_parameters", "rope_scaling")):
        read = Reader({**read.config, "partial_rotary_factor": 0.5}, read.family)  # transformers' fixed half

    def fields(read: Reader, layers: int) -> dict[str, Any]:
        types = _layer_types(read, layers)
        return dict(attention=AttentionConfig(bias=read.bool("attention_bias", False),
                                              output_bias=read.bool("attention_bias", False)),
                    mlp_bias=read.bool("mlp_bias", False), layer_types=types,
                    mixer_parts=(mamba2_config(read),) if "mamba2" in types else ())

    return rotary_config(read, DEFAULTS, fields)


def mamba2_shape(cfg: DecoderConfig) -> Mamba2Config:
    """The Mamba-2 shape of a model's ``mamba2`` layers, or of the Mamba-2 half of its ``attention_mamba2`` ones."""
    shape = cfg.mixer_part(Mamba2Config)
    return shape if shape is not None else cfg.mixer_part(AttentionMamba2Config).mamba2


def mamba2_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """The table of :mod:`attnkit.layers.mamba2`, one to one (the norm's weight and each bias where the shape has
    them)."""
    s, d = mamba2_shape(cfg), cfg.hidden_size
    inner = s.num_heads * s.head_dim
    conv, width, h = inner + 2 * s.n_groups * s.state_size, 2 * inner + 2 * s.n_groups * s.state_size + s.num_heads, \
        s.num_heads
    hf, ak = hf + "mamba.", ak + "attention."
    maps = [TensorMap(hf + "in_proj.weight", (width, d), (ak + "W_in",), "transpose"),
            TensorMap(hf + "conv1d.weight", (conv, 1, s.conv_kernel_size), (ak + "conv_weight",), "reshape",
                      sizes=(conv, s.conv_kernel_size)),
            TensorMap(hf + "dt_bias", (h,), (ak + "dt_bias",), "copy"),
            TensorMap(hf + "A_log", (h,), (ak + "A_log",), "copy"),
            TensorMap(hf + "D", (h,), (ak + "D_skip",), "copy")]
    if s.norm is not None:
        maps.append(TensorMap(hf + "norm.weight", (inner,), (ak + "norm_gamma",), "copy"))
    maps.append(TensorMap(hf + "out_proj.weight", (d, inner), (ak + "W_out",), "transpose"))
    if s.conv_bias:
        maps.append(TensorMap(hf + "conv1d.bias", (conv,), (ak + "conv_bias",), "copy"))
    if s.proj_bias:
        maps.append(TensorMap(hf + "in_proj.bias", (width,), (ak + "b_in",), "copy"))
    if s.output_bias:
        maps.append(TensorMap(hf + "out_proj.bias", (d,), (ak + "b_out",), "copy"))
    return maps


def attention_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """A Llama attention layer's ``self_attn.`` projections (their biases with ``attention.bias``)."""
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hf, ak = hf + "self_attn.", ak + "attention."
    maps = []
    for proj, shape, name in (("q_proj", (q, d), "Q"), ("k_proj", (kv, d), "K"), ("v_proj", (kv, d), "V"),
                              ("o_proj", (d, q), "O")):
        maps.append(TensorMap(f"{hf}{proj}.weight", shape, (ak + "W_" + name,), "transpose"))
        if cfg.attention.bias:
            maps.append(TensorMap(f"{hf}{proj}.bias", (shape[0],), (ak + "b_" + name,), "copy"))
    return maps


def _feed_forward_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """Llama's gated MLP under the name ``feed_forward``."""
    return [replace(m, source=m.source.replace(".mlp.", ".feed_forward.")) for m in gated_mlp_tensors(cfg, hf, ak)]


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    return pre_norm_tensors(cfg, attention_tensors, _feed_forward_tensors, {"mamba2": mamba2_tensors},
                            norms=("input_layernorm", "pre_ff_layernorm"), final_norm="final_layernorm")


FAMILY = Family(
    model_type="bamba",
    keys=frozenset(COMMON_KEYS + MAMBA_KEYS + _TRAINING_KEYS + ("attn_layer_indices", "attention_bias", "mlp_bias")),
    read_config=_config, tensors=_tensors, architecture="BambaForCausalLM", hf_config_class="BambaConfig",
    # the benchmark's shape with one attention layer in six and Mamba-2 heads of 64
    benchmark=dict(BENCHMARK_SHAPE, attn_layer_indices=list(range(5, 30, 6)), mamba_n_heads=18, mamba_d_state=64,
                   mamba_chunk_size=64))

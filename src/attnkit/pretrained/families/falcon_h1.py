"""Falcon-H1 (TII): Bamba, except that every layer runs attention and the Mamba-2 mixer side by side on the same
normed input and sums their scaled outputs (an ``attention_mamba2`` layer,
:class:`~attnkit.layers.attention_mamba2.AttentionMamba2Mixer`), the whole head is rotated, and muP multipliers
scale the embeddings (``embedding_multiplier``), the logits (``lm_head_multiplier``), the attention's input,
output and keys (``attention_in_multiplier``, ``attention_out_multiplier``, ``key_multiplier``), the Mamba-2
mixer's input and output (``ssm_in_multiplier``, ``ssm_out_multiplier``) and each of its projection's z, x, B, C
and dt columns (``ssm_multipliers``), the MLP's gate pre-activation and output (``mlp_multipliers``). The Mamba-2
inner width is ``mamba_d_ssm``, its group RMSNorm present only with ``mamba_rms_norm`` and before the gate with
``mamba_norm_before_gate``; its output projection's bias is ``projectors_bias``.

Every multiplier is a fixed factor applied where transformers applies it (a ``Scale`` part, a factor of the Mamba-2
projection or of the MLP), none folded into the weights, so the gradients are those of the checkpoint's own
parameters; the one exception is ``key_multiplier``, which is exactly a factor of the attention scores and is
folded into the attention's scale (``key_multiplier * head_dim ** -0.5``): the keys the cache and ``hook_k``
hold are the projection's, unscaled.

Checkpoint (under ``model.``): Bamba's layer (``input_layernorm``, ``mamba.``, ``pre_ff_layernorm``,
``feed_forward.``, ``final_layernorm``) with ``self_attn.`` beside ``mamba.`` in every layer.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...layers.mamba2 import Mamba2Config
from ...models.config import AttentionConfig, AttentionMamba2Config, DecoderConfig, ScalesConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .bamba import _check_time_step_limit, attention_tensors, mamba2_tensors
from .llama import BENCHMARK_SHAPE, gated_mlp_tensors, rotary_config

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-5}
MAMBA_KEYS = ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
              "mamba_expand", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "mamba_norm_before_gate",
              "mamba_rms_norm", "time_step_limit", "projectors_bias")
MULTIPLIER_KEYS = ("lm_head_multiplier", "embedding_multiplier", "mlp_multipliers", "key_multiplier",
                   "attention_out_multiplier", "attention_in_multiplier", "ssm_multipliers", "ssm_in_multiplier",
                   "ssm_out_multiplier")
# Keys TII's config.json files carry that change no forward pass of transformers' Falcon-H1: how many logits generate
# keeps, the step sizes' initialisation range, the MLP's width as a factor (intermediate_size is the width read), and
# mamba_use_mlp (every layer has its MLP whatever it says). attn_layer_indices is read: only null (every layer has
# its attention) is what transformers computes.
_IGNORED_KEYS = ("num_logits_to_keep", "time_step_min", "time_step_max", "time_step_floor", "mlp_expansion_factor",
                 "mamba_use_mlp")


def _factors(read: Reader, key: str, count: int) -> tuple[float, ...]:
    """A list of ``count`` multipliers (all 1 when absent or null, as transformers fills it)."""
    value = read.raw(key, None)
    if value is None:
        return (1.0,) * count
    if not isinstance(value, list) or len(value) != count:
        raise ValueError(f"{read.family} config: {key!r} must be a list of {count} numbers, got {value!r}")
    return tuple(Reader({key: v}, read.family).factor(key) for v in value)


def _mamba2_config(read: Reader) -> Mamba2Config:
    """The Mamba-2 half's shape: ``mamba_d_ssm`` inner features (``mamba_expand * hidden_size`` when null) in
    ``mamba_n_heads`` heads of ``mamba_d_head`` ("auto": the inner width / heads)."""
    _check_time_step_limit(read)
    heads = read.int("mamba_n_heads", 128)
    inner = read.int("mamba_d_ssm", 1024, optional=True) or read.int("mamba_expand", 2) * read.int("hidden_size")
    head_dim = read.raw("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else read.int("mamba_d_head")
    if heads * head_dim != inner:
        raise ValueError(f"{read.family} config: mamba_n_heads * mamba_d_head ({heads} * {head_dim}) must equal the "
                         f"Mamba inner width mamba_d_ssm ({inner})")
    norm = None if not read.bool("mamba_rms_norm", False) else \
        "before_gate" if read.bool("mamba_norm_before_gate", True) else "after_gate"
    return Mamba2Config(heads, head_dim, read.int("mamba_d_state", 256), read.int("mamba_n_groups", 1),
                        read.int("mamba_d_conv", 4), read.bool("mamba_conv_bias", True),
                        read.bool("mamba_proj_bias", False), read.int("mamba_chunk_size", 256), norm=norm,
                        out_bias=read.bool("projectors_bias", False),
                        projection_multipliers=_factors(read, "ssm_multipliers", 5))


def _config(read: Reader) -> DecoderConfig:
    read = Reader({"pad_token_id": 0, **read.config}, read.family)  # transformers' Falcon-H1 default
    if read.raw("attn_layer_indices", None) is not None:
        raise ValueError(f"{read.family} config: 'attn_layer_indices' other than null is not supported (transformers "
                         f"runs attention in every layer), got {read.raw('attn_layer_indices')!r}")

    def fields(read: Reader, layers: int) -> dict[str, Any]:
        bias = read.bool("attention_bias", False)
        heads = read.int("num_attention_heads")
        head_dim = read.int("head_dim", None, optional=True) or read.int("hidden_size") // heads
        # key_multiplier multiplies every score exactly as the scale does: folded into it (see the module's text)
        scale = read.factor("key_multiplier", 1.0) * head_dim ** -0.5
        gate, output = _factors(read, "mlp_multipliers", 2)
        return dict(attention=AttentionConfig(bias=bias, output_bias=bias, scale=scale), mlp_kind="scaled_gated",
                    mlp_bias=read.bool("mlp_bias", False), layer_types=("attention_mamba2",) * layers,
                    mixer_parts=(AttentionMamba2Config(_mamba2_config(read),
                                                       read.factor("attention_in_multiplier", 1.0),
                                                       read.factor("attention_out_multiplier", 1.0),
                                                       read.factor("ssm_in_multiplier", 1.0),
                                                       read.factor("ssm_out_multiplier", 1.0)),),
                    scales=ScalesConfig(embedding=read.factor("embedding_multiplier", 1.0),
                                        logit=read.factor("lm_head_multiplier", 1.0), mlp_gate=gate,
                                        mlp_output=output))

    return rotary_config(read, DEFAULTS, fields)


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    d, v = cfg.hidden_size, cfg.vocab_size
    maps = [TensorMap("embed_tokens.weight", (v, d), ("embed.weight",), "copy")]
    for i in range(cfg.num_layers):
        hf = ak = f"layers.{i}."
        mlp = [replace(m, source=m.source.replace(".mlp.", ".feed_forward.")) for m in gated_mlp_tensors(cfg, hf, ak)]
        attention = [replace(m, targets=tuple(t.replace(".attention.", ".attention.attn.") for t in m.targets))
                     for m in attention_tensors(cfg, hf, ak)]
        mamba = [replace(m, targets=tuple(t.replace(".attention.", ".attention.mamba.") for t in m.targets))
                 for m in mamba2_tensors(cfg, hf, ak)]
        maps += [TensorMap(hf + "input_layernorm.weight", (d,), (ak + "attn_norm.gamma",), "copy"), *attention,
                 *mamba, TensorMap(hf + "pre_ff_layernorm.weight", (d,), (ak + "mlp_norm.gamma",), "copy"), *mlp]
    maps.append(TensorMap("final_layernorm.weight", (d,), ("norm.gamma",), "copy"))
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head.weight", (v, d), ("head.weight",), "copy"))
    return maps, "model."


FAMILY = Family(
    model_type="falcon_h1",
    keys=frozenset(COMMON_KEYS + MAMBA_KEYS + MULTIPLIER_KEYS + _IGNORED_KEYS
                   + ("attention_bias", "mlp_bias", "attn_layer_indices")),
    read_config=_config, tensors=_tensors, architecture="FalconH1ForCausalLM", hf_config_class="FalconH1Config",
    # the benchmark's shape with Mamba-2 heads of 64 beside every attention, muP-like multipliers
    benchmark=dict(BENCHMARK_SHAPE, mamba_d_ssm=1152, mamba_n_heads=18, mamba_d_head=64, mamba_d_state=64,
                   mamba_chunk_size=64, embedding_multiplier=5.0, lm_head_multiplier=0.25,
                   attention_in_multiplier=0.5, attention_out_multiplier=0.75, ssm_in_multiplier=1.25,
                   ssm_out_multiplier=0.5, key_multiplier=0.5, mlp_multipliers=[0.8, 0.6],
                   ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0]))

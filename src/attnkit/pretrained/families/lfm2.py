"""LFM2 (LiquidAI): Qwen3 (per-head q/k RMSNorm, no biases), except that only the layers ``layer_types`` marks
"full_attention" (or ``full_attn_idxs`` lists) attend, the others ("conv") mixing tokens by a gated short
convolution over ``conv_L_cache`` tokens (:class:`~attnkit.layers.short_conv.ShortConv`, biases with
``conv_bias``); the gated SiLU MLP's width is ``intermediate_size`` scaled by 2/3, ``block_ffn_dim_multiplier``
and rounded up to a multiple of ``block_multiple_of`` (unless ``block_auto_adjust_ff_dim`` is false); the RMSNorm
epsilon is ``norm_eps``, the rotary base 1e6, the head tied by default.

Checkpoint (under ``model.``): ``embed_tokens``; per layer ``operator_norm`` (the mixer's input norm), either
``self_attn.{q,k,v,out}_proj`` with ``self_attn.{q,k}_layernorm`` or ``conv.in_proj``, ``conv.conv`` and
``conv.out_proj`` (with biases when ``conv_bias``), ``ffn_norm`` and ``feed_forward.w1`` (gate), ``w3`` (up),
``w2`` (down); the final norm ``embedding_norm``; ``lm_head`` when untied.

llama.cpp's GGUF files (``lfm2``) state the layer kinds as the key/value head counts, one per layer (0 for a
convolution), the MLP's width as adjusted, and store each convolution's weights (C, 1, K) as (C, K).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...layers.short_conv import ShortConvConfig
from ...models.config import AttentionConfig, DecoderConfig
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, rope_scaling, special_ids, vocab_size
from ..tensor_map import TensorMap
from . import Family
from ._reader import Reader
from .llama import BENCHMARK_SHAPE, pre_norm_tensors, rotary_config

__all__ = ["FAMILY"]

# LiquidAI's own config.json files carry their training code's names beside transformers'; transformers ignores
# them. A repeated size must equal the one read and a switch must hold the value the architecture has; the
# initialisation settings change no forward pass, and transformers reads the norm's epsilon and the rotary base
# from norm_eps and rope_theta / rope_parameters, not from block_norm_eps and theta (nor does attnkit).
_REPEATS = {"block_dim": "hidden_size", "conv_dim": "hidden_size", "conv_dim_out": "hidden_size",
            "num_heads": "num_attention_heads"}
_SETTLED = {"block_use_swiglu": True, "use_pos_enc": True}
_IGNORED = ("block_mlp_init_scale", "block_out_init_scale", "block_use_xavier_init", "conv_use_xavier_init",
            "block_norm_eps", "theta")

DEFAULTS = {"max_position_embeddings": 128000, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "num_key_value_heads": 8}
KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
        "conv_bias", "conv_L_cache", "block_multiple_of", "block_ffn_dim_multiplier", "block_auto_adjust_ff_dim",
        "full_attn_idxs", "layer_types",
        # the older names transformers' config still reads (and drops): intermediate_size, tie_word_embeddings
        "block_ff_dim", "tie_embedding") + tuple(_REPEATS) + tuple(_SETTLED) + _IGNORED


def _layer_types(read: Reader, layers: int) -> tuple[str, ...]:
    """Hugging Face's "conv" and "full_attention" as attnkit's layer types; without ``layer_types``, the layers
    ``full_attn_idxs`` lists (default: all) are full and the others convolutions."""
    given = read.raw("layer_types", None)
    if given is None:
        full = read.raw("full_attn_idxs", None)
        full = list(range(layers)) if full is None else full
        if not isinstance(full, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in full):
            raise ValueError(f"{read.family} config: 'full_attn_idxs' must be a list of layer indices or null, "
                             f"got {full!r}")
        given = ["full_attention" if i in full else "conv" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not set(given) <= {"conv", "full_attention"}:
        raise ValueError(f"{read.family} config: 'layer_types' must list conv or full_attention for each of the "
                         f"{layers} layers, got {given!r}")
    return tuple("short_conv" if kind == "conv" else kind for kind in given)


def _mlp_width(read: Reader) -> int:
    """transformers' ``Lfm2MLP`` width: ``intermediate_size`` (or ``block_ff_dim``), adjusted unless
    ``block_auto_adjust_ff_dim`` is false."""
    width = read.int("block_ff_dim") if "block_ff_dim" in read.config else read.int("intermediate_size")
    if not read.bool("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = read.raw("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        width = int(read.float("block_ffn_dim_multiplier", 1.0) * width)
        step = read.int("block_multiple_of", 256)
        width = step * ((width + step - 1) // step)
    if width < 1:
        raise ValueError(f"{read.family} config: the MLP's adjusted width is {width}; intermediate_size and "
                         "block_ffn_dim_multiplier must make it positive")
    return width


def _check_training_keys(read: Reader) -> None:
    """LiquidAI's repeated sizes equal transformers' and its switches hold LFM2's values (module comment)."""
    for key, same in _REPEATS.items():
        if key in read.config and read.int(key) != read.int(same):
            raise ValueError(f"{read.family} config: {key!r} ({read.config[key]}) must equal {same!r} "
                             f"({read.config[same]}): transformers builds the model from {same!r}")
    for key, value in _SETTLED.items():
        if read.bool(key, value) != value:
            raise ValueError(f"{read.family} config: {key!r} must be {str(value).lower()}: LFM2 "
                             f"{'has a SwiGLU MLP' if key == 'block_use_swiglu' else 'rotates its queries and keys'}")


def _config(read: Reader) -> DecoderConfig:
    _check_training_keys(read)
    config = dict(read.config, rms_norm_eps=read.eps("norm_eps", 1e-5), intermediate_size=_mlp_width(read))
    config.setdefault("pad_token_id", 0)  # transformers' LFM2 default (Llama's is none)
    if "tie_embedding" in config:
        config["tie_word_embeddings"] = read.bool("tie_embedding")
    if not any(key in config for key in ("rope_theta", "rope_scaling", "rope_parameters")):
        config["rope_theta"] = 1e6  # transformers' default_theta for LFM2

    def fields(read: Reader, layers: int) -> dict[str, Any]:
        shape = ShortConvConfig(read.int("conv_L_cache", 3), read.bool("conv_bias", False))
        types = _layer_types(read, layers)
        return dict(attention=AttentionConfig(qk_norm="head"), layer_types=types,
                    mixer_parts=(shape,) if "short_conv" in types else ())

    return rotary_config(Reader(config, read.family), DEFAULTS, fields)


def _attention_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hf, ak = hf + "self_attn.", ak + "attention."
    return [TensorMap(hf + "q_proj.weight", (q, d), (ak + "W_Q",), "transpose"),
            TensorMap(hf + "k_proj.weight", (kv, d), (ak + "W_K",), "transpose"),
            TensorMap(hf + "v_proj.weight", (kv, d), (ak + "W_V",), "transpose"),
            TensorMap(hf + "out_proj.weight", (d, q), (ak + "W_O",), "transpose"),
            TensorMap(hf + "q_layernorm.weight", (cfg.head_dim,), (ak + "q_norm",), "copy"),
            TensorMap(hf + "k_layernorm.weight", (cfg.head_dim,), (ak + "k_norm",), "copy")]


def _conv_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """The table of :mod:`attnkit.layers.short_conv`, one to one."""
    shape = cfg.mixer_part(ShortConvConfig)
    d, taps = cfg.hidden_size, shape.kernel_size
    hf, ak = hf + "conv.", ak + "attention."
    maps = [TensorMap(hf + "in_proj.weight", (3 * d, d), (ak + "W_in",), "transpose"),
            TensorMap(hf + "conv.weight", (d, 1, taps), (ak + "conv_weight",), "reshape", sizes=(d, taps)),
            TensorMap(hf + "out_proj.weight", (d, d), (ak + "W_out",), "transpose")]
    if shape.bias:
        maps += [TensorMap(hf + "in_proj.bias", (3 * d,), (ak + "b_in",), "copy"),
                 TensorMap(hf + "conv.bias", (d,), (ak + "conv_bias",), "copy"),
                 TensorMap(hf + "out_proj.bias", (d,), (ak + "b_out",), "copy")]
    return maps


def _mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    d, f = cfg.hidden_size, cfg.mlp.intermediate_size
    return [TensorMap(hf + "feed_forward.w1.weight", (f, d), (ak + "mlp.W_gate",), "transpose"),
            TensorMap(hf + "feed_forward.w3.weight", (f, d), (ak + "mlp.W_up",), "transpose"),
            TensorMap(hf + "feed_forward.w2.weight", (d, f), (ak + "mlp.W_down",), "transpose")]


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    return pre_norm_tensors(cfg, _attention_tensors, _mlp_tensors, {"short_conv": _conv_tensors},
                            norms=("operator_norm", "ffn_norm"), final_norm="embedding_norm")


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """transformers' config of an ``lfm2`` file: the layers with key/value heads attend, the others convolve."""
    arch, layers = meta.arch, meta.int("block_count")
    heads = meta.int("attention.head_count")
    kv = meta.get("attention.head_count_kv", heads)
    counts = [int(n) for n in kv.tolist()] if isinstance(kv, np.ndarray) else [kv] * layers
    attending = sorted({n for n in counts if n})
    if len(counts) != layers or len(attending) > 1 or any(n < 0 for n in counts):
        raise file.fail(f"metadata {arch}.attention.head_count_kv must hold one count per layer ({arch}.block_count "
                        f"= {layers}), 0 for a convolution and one count for every attention layer, got {kv!r}")
    context = meta.int("context_length")
    config = {
        "model_type": file.model_type, "vocab_size": vocab_size(file, meta),
        "hidden_size": meta.int("embedding_length"),
        # the width as llama.cpp computes with it: already adjusted
        "intermediate_size": meta.int("feed_forward_length"), "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": attending[0] if attending else heads, "max_position_embeddings": context,
        "norm_eps": meta.float("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.float("rope.freq_base", 1000000.0), "conv_L_cache": meta.int("shortconv.l_cache", 3),
        "conv_bias": any(name.endswith("shortconv.in_proj.bias") for name in file.tensors),
        "layer_types": ["full_attention" if n else "conv" for n in counts],
        "tie_word_embeddings": "output.weight" not in file.tensors, **special_ids(file)}
    scaling = rope_scaling(file, meta, context)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


FAMILY = Family(
    model_type="lfm2", keys=frozenset(KEYS), read_config=_config, tensors=_tensors,
    architecture="Lfm2ForCausalLM", hf_config_class="Lfm2Config",
    # the benchmark's shape with LFM2's mix: 2 of every 3 layers convolutions, an unadjusted MLP width
    benchmark=dict({k: v for k, v in BENCHMARK_SHAPE.items() if k != "rms_norm_eps"}, norm_eps=1e-5,
                   block_auto_adjust_ff_dim=False,
                   layer_types=["full_attention" if i % 3 == 2 else "conv"
                                for i in range(BENCHMARK_SHAPE["num_hidden_layers"])]),
    gguf=GGUFArchitecture("lfm2", _gguf_config, squeezed=("shortconv.conv.weight",)))

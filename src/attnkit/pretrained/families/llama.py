"""Llama: the family every rotary family is stated against.

RMSNorm before attention and before the MLP, rotary positions (default, linear, dynamic, YaRN and llama3
scalings) on every layer, grouped key/value heads, a gated SiLU MLP, no biases unless ``attention_bias`` (q, k,
v and o) or ``mlp_bias`` says so, a head of its own unless ``tie_word_embeddings``.

Checkpoint (under ``model.``): ``embed_tokens``; per layer ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm`` (the MLP's input norm), ``mlp.{gate,up,down}_proj``; ``norm``; ``lm_head``.

:func:`rotary_config` and :func:`rotary_tensors` are Llama's rules with the places where other families
differ left open; the other rotary families call them with their differences.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, MLPConfig, NormConfig, RotaryConfig, SpecialTokens
from ..gguf_metadata import GGUFArchitecture
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader, read_rope

__all__ = ["FAMILY", "BENCHMARK_SHAPE", "rotary_config", "rotary_tensors", "gated_mlp_tensors",
           "fused_gated_mlp_tensors", "plain_tensors", "pre_norm_tensors", "LayerTensors"]

DEFAULTS = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "num_key_value_heads": None}

# One shape for every rotary family in the decode benchmark (SmolLM-135M's: 30 layers, width 576, 9 query and
# 3 key/value heads), so that the ratios compare what each family adds rather than model sizes.
BENCHMARK_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def rotary_config(read: Reader, defaults: Mapping[str, Any], fields: Callable[[Reader, int], dict[str, Any]],
                  *, rope_aliases: Mapping[str, str] | None = None, norm_placement: str = "pre",
                  rotary: Callable[[Reader, int], RotaryConfig] | None = None) -> DecoderConfig:
    """The DecoderConfig of a Llama-like family: sizes, heads and rotary read by Llama's rules with the family's
    ``defaults``, and ``fields(read, num_layers)``: the DecoderConfig fields where the family differs (its
    ``attention`` part, ``layer_types``, ``experts``, the ``scales`` part (its fixed factors)), and three keys of
    its own: ``mlp_kind`` and ``mlp_bias``, the kind and biases of the ``mlp`` part whose width and activation are
    read here (default ``"gated"``, no biases), and ``skip_rotary``: the layers without rotary; Llama's own: no
    biases, no window).
    ``norm_placement`` is the family's :class:`~attnkit.models.config.NormConfig` placement; ``rotary(read,
    max_position_embeddings)`` its rotary part where it is not :func:`read_rope`'s default layout (the
    interleaved pairs of GLM-4, a base per layer type)."""
    family = read.family
    hidden = read.int("hidden_size")
    heads = read.int("num_attention_heads")
    layers = read.layers()
    kv_default = defaults["num_key_value_heads"] or heads
    kv_heads = read.int("num_key_value_heads", kv_default, optional=True) or heads
    head_dim = read.int("head_dim", defaults.get("head_dim"), optional=True)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{family} config: hidden_size ({hidden}) must be a multiple of num_attention_heads "
                             f"({heads}) when head_dim is not given")
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ValueError(f"{family} config: num_key_value_heads ({kv_heads}) must divide num_attention_heads "
                         f"({heads})")
    max_positions = read.int("max_position_embeddings", defaults["max_position_embeddings"])
    if rotary is None:
        theta, scaling, partial = read_rope(read, max_positions, rope_aliases)
        part = RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial)
    else:
        part = rotary(read, max_positions)
    settings: dict[str, Any] = dict(attention=AttentionConfig(), layer_types=())
    settings.update(fields(read, layers))
    skip = settings.pop("skip_rotary", ())
    mlp = MLPConfig(read.int("intermediate_size"), kind=settings.pop("mlp_kind", "gated"),
                    activation=read.activation("hidden_act", "silu"), bias=settings.pop("mlp_bias", False))
    return DecoderConfig(
        family=family, vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        mlp=mlp, max_position_embeddings=max_positions,
        norm=NormConfig(eps=read.eps("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)), placement=norm_placement),
        rotary=replace(part, skip_layers=skip),
        tie_word_embeddings=read.bool("tie_word_embeddings", defaults["tie_word_embeddings"]),
        tokens=SpecialTokens(bos=read.token_ids("bos_token_id", defaults["bos_token_id"], many=False),
                             eos=read.token_ids("eos_token_id", defaults["eos_token_id"], many=True),
                             pad=read.token_ids("pad_token_id", defaults.get("pad_token_id"), many=False)),
        **settings,
    )


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    return dict(attention=AttentionConfig(bias=bias, output_bias=bias), mlp_bias=read.bool("mlp_bias", False))


def gated_mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """A gated MLP's ``gate_proj``, ``up_proj`` and ``down_proj`` (with biases when ``mlp.bias``)."""
    d, f = cfg.hidden_size, cfg.mlp.intermediate_size
    maps = []
    for proj, shape, name, width in (("gate_proj", (f, d), "gate", f), ("up_proj", (f, d), "up", f),
                                     ("down_proj", (d, f), "down", d)):
        maps.append(TensorMap(f"{hf}mlp.{proj}.weight", shape, (ak + "mlp.W_" + name,), "transpose"))
        if cfg.mlp.bias:
            maps.append(TensorMap(f"{hf}mlp.{proj}.bias", (width,), (ak + "mlp.b_" + name,), "copy"))
    return maps


def fused_gated_mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """A gated MLP whose gate and up projections are one ``gate_up_proj`` (2F, D), gate rows first (Phi-3,
    GLM-4), split on load; and ``down_proj``."""
    d, f = cfg.hidden_size, cfg.mlp.intermediate_size
    return [TensorMap(hf + "mlp.gate_up_proj.weight", (2 * f, d), (ak + "mlp.W_gate", ak + "mlp.W_up"),
                      "row_split_transpose", sizes=(f, f)),
            TensorMap(hf + "mlp.down_proj.weight", (d, f), (ak + "mlp.W_down",), "transpose")]


def rotary_tensors(cfg: DecoderConfig, mlp: Callable[[DecoderConfig, str, str], list[TensorMap]] = gated_mlp_tensors
                   ) -> tuple[list[TensorMap], str]:
    """Llama's checkpoint as ``cfg`` shapes it, and the base prefix ``"model."``: q/k norms when
    ``cfg.attention.qk_norm`` (per head, or over the whole projection), the norms ``cfg.norm.placement`` places,
    sinks, and
    ``mlp(cfg, hf_prefix, attnkit_prefix)``'s tensors for each layer's MLP."""
    d, v = cfg.hidden_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention, before, after = cfg.attention, cfg.norm.before, cfg.norm.after
    maps = [TensorMap("embed_tokens.weight", (v, d), ("embed.weight",), "copy")]
    for i in range(cfg.num_layers):
        hf = ak = f"layers.{i}."
        attn = ak + "attention."
        if before:
            maps.append(TensorMap(hf + "input_layernorm.weight", (d,), (ak + "attn_norm.gamma",), "copy"))
        for proj, width, name in (("q_proj", q, "Q"), ("k_proj", kv, "K"), ("v_proj", kv, "V")):
            maps.append(TensorMap(f"{hf}self_attn.{proj}.weight", (width, d), (attn + "W_" + name,), "transpose"))
            if attention.bias:
                maps.append(TensorMap(f"{hf}self_attn.{proj}.bias", (width,), (attn + "b_" + name,), "copy"))
        if attention.qk_norm not in (None, "unit_after_rotary"):  # the unit norm has no weights
            whole = attention.qk_norm == "projection"
            for norm, width in (("q_norm", q), ("k_norm", kv)):
                maps.append(TensorMap(f"{hf}self_attn.{norm}.weight", (width if whole else cfg.head_dim,),
                                      (attn + norm,), "copy"))
        maps.append(TensorMap(hf + "self_attn.o_proj.weight", (d, q), (attn + "W_O",), "transpose"))
        if attention.output_bias:
            maps.append(TensorMap(hf + "self_attn.o_proj.bias", (d,), (attn + "b_O",), "copy"))
        # Llama's "post_attention_layernorm" is the MLP's input norm; OLMo 2's and Gemma's is the attention's
        # output norm (Gemma names the MLP's input norm "pre_feedforward_layernorm").
        if after:
            maps.append(TensorMap(hf + "post_attention_layernorm.weight", (d,), (ak + "attn_post_norm.gamma",),
                                  "copy"))
        if before:
            name = "pre_feedforward_layernorm" if after else "post_attention_layernorm"
            maps.append(TensorMap(f"{hf}{name}.weight", (d,), (ak + "mlp_norm.gamma",), "copy"))
        if attention.sinks:
            maps.append(TensorMap(hf + "self_attn.sinks", (cfg.num_heads,), (attn + "sinks",), "copy"))
        maps += mlp(cfg, hf, ak)
        if after:
            maps.append(TensorMap(hf + "post_feedforward_layernorm.weight", (d,), (ak + "mlp_post_norm.gamma",),
                                  "copy"))
    maps.append(TensorMap("norm.weight", (d,), ("norm.gamma",), "copy"))
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head.weight", (v, d), ("head.weight",), "copy"))
    return maps, "model."


LayerTensors = Callable[[DecoderConfig, str, str], list[TensorMap]]
"""A part of a layer's checkpoint: ``(cfg, hf_prefix, attnkit_prefix) -> [TensorMap, ...]``."""


def pre_norm_tensors(cfg: DecoderConfig, attention: LayerTensors, mlp: LayerTensors,
                     states: Mapping[str, LayerTensors] | None = None, *,
                     norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm"),
                     final_norm: str = "norm") -> tuple[list[TensorMap], str]:
    """The checkpoint of a pre-norm family whose layers differ in their token mixer, and the base prefix
    ``"model."``: the embedding; per layer its input norm (``norms[0]``), its mixer's tensors (``states[kind]`` for
    a layer whose type ``states`` names, e.g. ``{"mamba2": ...}``, else ``attention``), the MLP's input norm
    (``norms[1]``) and ``mlp``; the final norm and the head."""
    d, v, states = cfg.hidden_size, cfg.vocab_size, states or {}
    maps = [TensorMap("embed_tokens.weight", (v, d), ("embed.weight",), "copy")]
    for spec in cfg.layers:
        hf = ak = f"layers.{spec.index}."
        mixer = states.get(spec.layer_type, attention)
        maps += [TensorMap(f"{hf}{norms[0]}.weight", (d,), (ak + "attn_norm.gamma",), "copy"), *mixer(cfg, hf, ak),
                 TensorMap(f"{hf}{norms[1]}.weight", (d,), (ak + "mlp_norm.gamma",), "copy"), *mlp(cfg, hf, ak)]
    maps.append(TensorMap(f"{final_norm}.weight", (d,), ("norm.gamma",), "copy"))
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head.weight", (v, d), ("head.weight",), "copy"))
    return maps, "model."


def with_norm_names(maps: list[TensorMap], names: Mapping[str, str]) -> list[TensorMap]:
    """``maps`` with each layer norm's checkpoint name renamed as ``names`` says (``{"input_layernorm":
    "attention_layernorm"}``: ``layers.{i}.input_layernorm.weight`` becomes ``layers.{i}.attention_layernorm.weight``),
    for a family that names Llama's norms its own way."""
    renamed = []
    for m in maps:
        layer, dot, name = m.source.rpartition(".weight")[0].rpartition(".")
        renamed.append(replace(m, source=f"{layer}{dot}{names[name]}.weight") if name in names else m)
    return renamed


def plain_tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """:func:`rotary_tensors` with the gated MLP: the checkpoint of every family that differs from Llama only
    in its configuration (``mxfp4`` is for families with MXFP4 experts; the registry refuses it for others)."""
    return rotary_tensors(cfg)


# GGUF: Llama 3's rope_freqs.weight holds one divisor per rotary frequency (read as a scaling), and llama.cpp
# loads the attention's biases when the file has them.
LLAMA3_ROPE_TENSORS = ("rope_freqs.weight",)
GGUF_ATTENTION_BIAS = (("attention_bias", "blk.0.attn_q.bias"),)


FAMILY = Family(
    model_type="llama", keys=frozenset(COMMON_KEYS + ("attention_bias", "mlp_bias")),
    read_config=lambda read: rotary_config(read, DEFAULTS, _fields), tensors=plain_tensors,
    architecture="LlamaForCausalLM", hf_config_class="LlamaConfig", benchmark=dict(BENCHMARK_SHAPE),
    gguf=GGUFArchitecture("llama", rope_tensors=LLAMA3_ROPE_TENSORS, permuted_qk=True,
                          bias_flags=(*GGUF_ATTENTION_BIAS, ("mlp_bias", "blk.0.ffn_up.bias"))))

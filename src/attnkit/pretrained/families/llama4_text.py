"""Llama 4 (text): Llama, except that the rotary layers attend within chunks of ``attention_chunk_size`` positions
(``chunked_attention``) while every ``no_rope_layer_interval``-th layer (or each ``no_rope_layers[i] == 0``) has
no rotary, sees the whole text and scales its queries by a temperature that grows with the position
(``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``); the rotary pairs are interleaved (Llama 4's
complex-number rotation), followed on the rotary layers by an RMS norm without weights of each query and key
head (``use_qk_norm``); and the MLP of every ``interleave_moe_layer_step``-th layer (or of ``moe_layers``) is a
mixture of ``num_local_experts`` SwiGLU experts of width ``intermediate_size``: the top ``num_experts_per_tok``
logits, each expert's input scaled by its logit's sigmoid, plus a shared expert of the same width; the dense
layers' MLP is ``intermediate_size_mlp`` wide.

Checkpoint (under ``model.``): Llama's, with each layer's MLP under ``feed_forward.``: a dense layer's
``{gate,up,down}_proj``; a mixture's ``router`` (E, D), its fused experts ``experts.gate_up_proj`` (E, D, 2F),
gate columns first, and ``experts.down_proj`` (E, F, D), both stored for ``x @ W`` as attnkit stores them, and
``shared_expert.{gate,up,down}_proj``.

The temperature follows the tokens' positions, counted from a row's first real token as every position in
attnkit is; transformers counts the cache's slots instead, pads included, so on a left-padded row whose
position reaches ``floor_scale - 1`` the two differ (the same row alone agrees). A full ``llama4`` folder (the
multimodal model, its text in ``text_config``) is not read: load a text-only ``llama4_text`` checkpoint.
"""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, ExpertsConfig, RotaryConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader, read_rope
from .llama import BENCHMARK_SHAPE, rotary_config, rotary_tensors

__all__ = ["FAMILY"]

DEFAULTS = {"max_position_embeddings": 4096 * 32, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5}
KEYS = ("attention_bias", "intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers",
        "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers", "no_rope_layer_interval",
        "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale", "attn_scale",
        "output_router_logits", "router_aux_loss_coef", "router_jitter_noise")


def _indices(read: Reader, key: str, layers: int) -> tuple[int, ...] | None:
    """A list of layer indices, or None when the config has none."""
    given = read.raw(key, None)
    if given is None:
        return None
    if not isinstance(given, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers
                                              for i in given):
        raise ValueError(f"{read.family} config: {key!r} must be a list of layer indices below {layers}, got "
                         f"{given!r}")
    return tuple(sorted(set(given)))


def _nope_layers(read: Reader, layers: int) -> tuple[int, ...]:
    """The layers without rotary, by transformers' rule: ``no_rope_layers[i] == 0`` (a list of at least
    ``num_hidden_layers`` flags), else every ``no_rope_layer_interval``-th."""
    flags = read.raw("no_rope_layers", None)
    if not flags:  # transformers takes an empty list for none given
        interval = read.int("no_rope_layer_interval", 4)
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) < layers or not all(f in (0, 1) and not isinstance(f, float)
                                                                     for f in flags):
        raise ValueError(f"{read.family} config: 'no_rope_layers' must be a list of at least {layers} entries 0 or "
                         f"1 (1 = the layer uses rotary), got {flags!r}")
    return tuple(i for i in range(layers) if not flags[i])


def _layer_types(read: Reader, layers: int, nope: tuple[int, ...], chunk: int | None) -> tuple[str, ...]:
    given = read.raw("layer_types", None)
    if given is None:  # transformers': the rotary layers chunked when there is a chunk size
        return tuple("chunked_attention" if chunk is not None and i not in nope else "full_attention"
                     for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or not set(given) <= {"full_attention",
                                                                                 "chunked_attention"}:
        raise ValueError(f"{read.family} config: 'layer_types' must list {layers} entries full_attention or "
                         f"chunked_attention, got {given!r}")
    if "chunked_attention" in given and chunk is None:
        raise ValueError(f"{read.family} config: 'layer_types' has chunked_attention layers but "
                         f"'attention_chunk_size' is null")
    return tuple(given)


def _experts(read: Reader, layers: int) -> dict[str, Any]:
    moe = _indices(read, "moe_layers", layers)
    if moe is None:
        step = read.int("interleave_moe_layer_step", 1)
        moe = tuple(range(step - 1, layers, step))
    if not moe:
        return {}
    width = read.int("intermediate_size", 8192)
    experts = read.int("num_local_experts", 16)
    return dict(experts=ExpertsConfig(
        num_experts=experts, num_experts_per_tok=read.int("num_experts_per_tok", 1, maximum=experts),
        moe_intermediate_size=width, layers=moe, router="topk_sigmoid", norm_topk_prob=False,
        shared_expert_intermediate_size=width, weigh_inputs=True))


def _fields(read: Reader, layers: int) -> dict[str, Any]:
    bias = read.bool("attention_bias", False)
    nope = _nope_layers(read, layers)
    chunk = read.int("attention_chunk_size", 8192, optional=True)
    types = _layer_types(read, layers, nope, chunk)
    temperature = None
    if read.bool("attn_temperature_tuning", True):
        temperature = (read.float("floor_scale", 8192), read.float("attn_scale", 0.1))
    attention = AttentionConfig(bias=bias, output_bias=bias, qk_norm="unit_after_rotary" if read.bool(
        "use_qk_norm", True) else None, chunk_size=chunk if "chunked_attention" in types else None,
        query_temperature=temperature)
    return dict(attention=attention, skip_rotary=nope, layer_types=types, **_experts(read, layers))


def _rotary(read: Reader, max_positions: int) -> RotaryConfig:
    """Llama 4 rotates each interleaved pair ``(x_{2i}, x_{2i+1})`` as the complex number ``x_{2i} + i x_{2i+1}``
    by ``exp(i p inv_freq_i)``: attnkit's interleaved rotary."""
    theta, scaling, partial = read_rope(read, max_positions)
    return RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial, interleaved=True)


def _read(read: Reader) -> DecoderConfig:
    """The dense MLP's width is ``intermediate_size_mlp`` (the model's); ``intermediate_size`` is the experts'
    (read from the config as given by :func:`_experts`)."""
    dense = {"rope_theta": 500000.0, **read.config, "intermediate_size": read.int("intermediate_size_mlp", 16384)}
    return rotary_config(Reader(dense, read.family), DEFAULTS, lambda _, layers: _fields(read, layers),
                         rotary=_rotary)


def _mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    d = cfg.hidden_size
    hf, mlp = hf + "feed_forward.", ak + "mlp."
    part = cfg.experts
    if part is None or int(ak.split(".")[1]) not in part.layers:
        f = cfg.mlp.intermediate_size
        return [TensorMap(f"{hf}{proj}.weight", shape, (f"{mlp}W_{name}",), "transpose")
                for proj, shape, name in (("gate_proj", (f, d), "gate"), ("up_proj", (f, d), "up"),
                                          ("down_proj", (d, f), "down"))]
    e, f, fs = part.num_experts, part.moe_intermediate_size, part.shared_expert_intermediate_size
    return [TensorMap(hf + "router.weight", (e, d), (mlp + "router.W_router",), "transpose"),
            TensorMap(hf + "experts.gate_up_proj", (e, d, 2 * f), (mlp + "W_gate", mlp + "W_up"), "split"),
            TensorMap(hf + "experts.down_proj", (e, f, d), (mlp + "W_down",), "copy"),
            *(TensorMap(f"{hf}shared_expert.{proj}.weight", shape, (f"{mlp}shared_expert.W_{name}",), "transpose")
              for proj, shape, name in (("gate_proj", (fs, d), "gate"), ("up_proj", (fs, d), "up"),
                                        ("down_proj", (d, fs), "down")))]


FAMILY = Family(
    model_type="llama4_text",
    keys=frozenset(COMMON_KEYS + KEYS),
    read_config=_read,
    tensors=lambda cfg, mxfp4=False: rotary_tensors(cfg, _mlp_tensors),
    architecture="Llama4ForCausalLM", hf_config_class="Llama4TextConfig", multimodal_model_types=("llama4",),
    # Llama's benchmark shape, every second layer eight experts of width 768 (one per token) and a shared one,
    # chunks of 8192 (longer than the benchmark's text) and every fourth layer without rotary
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64, intermediate_size=768, intermediate_size_mlp=1536,
                   num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2))

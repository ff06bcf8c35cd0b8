"""Gemma 2: Llama, except RMSNorm with ``1 + weight``, norms both before and after the attention and the MLP
(``pre_feedforward_layernorm`` is the MLP's input norm, ``post_attention_layernorm`` and
``post_feedforward_layernorm`` the branches' output norms), embeddings scaled by ``sqrt(hidden_size)``, scores
scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped (``attn_logit_softcapping``, default 50), logits
soft-capped (``final_logit_softcapping``, default 30), sliding (4096) and full layers alternating, a GeGLU MLP
(tanh GELU), a tied head. :func:`gemma_config` also reads Gemma 3 (text), whose module states its differences.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...models.config import (
    AttentionConfig,
    DecoderConfig,
    MLPConfig,
    NormConfig,
    RotaryConfig,
    ScalesConfig,
    SpecialTokens,
)
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, common_config, rope_scaling
from . import Family
from ._reader import COMMON_KEYS, Reader, per_layer_type, read_layer_types, read_rope, read_rope_by_layer_type
from .llama import BENCHMARK_SHAPE, plain_tensors
from .llama import GGUF_ATTENTION_BIAS as GGUF_BIASES

__all__ = ["FAMILY", "GEMMA_KEYS", "GemmaRules", "gemma_config"]

GEMMA_KEYS = COMMON_KEYS + ("attention_bias", "hidden_activation", "query_pre_attn_scalar", "sliding_window",
                            "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                            "use_bidirectional_attention")


@dataclass(frozen=True)
class GemmaRules:
    """Where Gemma generations differ when their ``config.json`` is read.

    Attributes
    ----------
    max_positions : int
        The default context.
    full_every : int or None
        Without ``layer_types``, every this-th layer is full, the others sliding; None: read
        ``sliding_window_pattern`` (default 6).
    rope_theta : float
        The default rotary base (of the full layers).
    rope_per_layer_type : bool
        ``rope_parameters`` may be keyed by layer type, and ``rope_local_base_freq`` gives the sliding layers'
        base.
    softcaps : (float or None, float or None)
        The default soft-caps of the scores and of the logits.
    qk_norm : bool
        Per-head RMSNorms of queries and keys.
    """

    max_positions: int = 8192
    full_every: int | None = 2
    rope_theta: float = 10000.0
    rope_per_layer_type: bool = False
    softcaps: tuple[float | None, float | None] = (50.0, 30.0)
    qk_norm: bool = False


def _gemma_rope(read: Reader, rules: GemmaRules, max_positions: int
                ) -> tuple[float, dict | None, float, float | None, dict | None]:
    """(theta, scaling, partial factor) of the full layers, and the sliding layers' own theta and scaling (None:
    the same as the full layers')."""
    sliding_theta, sliding_scaling = None, None
    if rules.rope_per_layer_type and per_layer_type(read):
        per_type = read_rope_by_layer_type(read, max_positions, {"full_attention": rules.rope_theta,
                                                                 "sliding_attention": 10000.0})
        (theta, scaling, partial), (sliding_theta, sliding_scaling, _) = (per_type["full_attention"],
                                                                         per_type["sliding_attention"])
    else:
        theta, scaling, partial = read_rope(Reader({**read.config, "rope_theta": read.raw(
            "rope_theta", rules.rope_theta)}, read.family), max_positions)
        if rules.rope_per_layer_type:
            sliding_theta = read.float("rope_local_base_freq", 10000.0)
    return theta, scaling, partial, sliding_theta, sliding_scaling


def gemma_config(read: Reader, rules: GemmaRules = GemmaRules()) -> DecoderConfig:
    """A Gemma ``config.json`` by Gemma 2's rules and ``rules``' differences: RMSNorm with ``1 + weight``, norms
    before and after each branch, embeddings scaled by ``sqrt(hidden_size)``, scores scaled by
    ``query_pre_attn_scalar ** -0.5``, optional soft-caps, sliding and full layers."""
    family = read.family
    hidden = read.int("hidden_size")
    heads = read.int("num_attention_heads")
    layers = read.layers()
    kv_heads = read.int("num_key_value_heads", None, optional=True) or heads
    if heads % kv_heads:
        raise ValueError(f"{family} config: num_key_value_heads ({kv_heads}) must divide num_attention_heads "
                         f"({heads})")
    if read.raw("use_bidirectional_attention", None):
        raise ValueError(f"{family} config: use_bidirectional_attention=true (an encoder) is not supported")
    max_positions = read.int("max_position_embeddings", rules.max_positions)
    window = read.int("sliding_window", 4096, optional=True)
    types = read_layer_types(read, layers, window)
    if types is None:
        every = rules.full_every or read.int("sliding_window_pattern", read.raw("_sliding_window_pattern", 6))
        types = tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers))
    if "sliding_attention" not in types:
        window = None
    elif window is None:
        raise ValueError(f"{family} config: layer_types has sliding_attention layers but sliding_window is null")
    head_dim = read.int("head_dim", 256)
    theta, scaling, partial, sliding_theta, sliding_scaling = _gemma_rope(read, rules, max_positions)
    bias = read.bool("attention_bias", False)
    act = read.raw("hidden_activation", None)
    activation = read.activation("hidden_activation") if act is not None else read.activation("hidden_act",
                                                                                              "gelu_pytorch_tanh")
    softcaps = {}
    for key, name, default in (("attn_logit_softcapping", "attn_logit_softcap", rules.softcaps[0]),
                               ("final_logit_softcapping", "final_logit_softcap", rules.softcaps[1])):
        value = read.raw(key, default)
        softcaps[name] = None if value is None else read.factor(key, default)
    return DecoderConfig(
        family=family, vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        mlp=MLPConfig(read.int("intermediate_size"), kind="gated", activation=activation),
        max_position_embeddings=max_positions,
        norm=NormConfig(eps=read.eps("rms_norm_eps", 1e-6), offset=1.0, placement="sandwich"),
        rotary=RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial, sliding_theta=sliding_theta,
                            sliding_scaling=sliding_scaling),
        attention=AttentionConfig(bias=bias, output_bias=bias, qk_norm="head" if rules.qk_norm else None,
                                  scale=read.factor("query_pre_attn_scalar", 256) ** -0.5,
                                  logit_softcap=softcaps["attn_logit_softcap"], sliding_window=window),
        # Hugging Face multiplies by a float32 tensor of sqrt(hidden_size), in every dtype
        scales=ScalesConfig(embedding=float(np.float32(math.sqrt(hidden))),
                            final_logit_softcap=softcaps["final_logit_softcap"]),
        tie_word_embeddings=read.bool("tie_word_embeddings", True),
        layer_types=types,
        tokens=SpecialTokens(bos=read.token_ids("bos_token_id", 2, many=False),
                             eos=read.token_ids("eos_token_id", 1, many=True),
                             pad=read.token_ids("pad_token_id", 0, many=False)),
    )


def gemma_gguf_config(file: Any, meta: GGUFMetadata, three: bool = False) -> dict[str, Any]:
    """Gemma 2 (``three``: Gemma 3) from GGUF metadata. llama.cpp keeps no ``query_pre_attn_scalar``: it scales
    scores by ``head_dim ** -0.5``, except in the 27B models (46 and 62 layers), which scale by
    ``(hidden_size / heads) ** -0.5``, as their configs say."""
    config = common_config(file, meta)
    config.pop("rope_scaling", None)
    config.pop("rope_theta")
    big = config["num_hidden_layers"] == (62 if three else 46)
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if big
                                       else config["head_dim"])
    layers = config["num_hidden_layers"]
    if three and not meta.get("attention.sliding_window"):  # llama.cpp: no window, no sliding layer
        config["sliding_window"] = None
        config["layer_types"] = ["full_attention"] * layers
    else:
        config["sliding_window"] = meta.int("attention.sliding_window")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        config[key] = meta.float(key) if meta.get(key) is not None else None
    if not three:
        config["rope_theta"] = meta.float("rope.freq_base", 10000.0)
        return config
    # Gemma 3: full layers rotate with the file's base (and scaling), sliding ones with base 10000 unscaled.
    full = {"rope_type": "default", "rope_theta": meta.float("rope.freq_base", 1000000.0)}
    scaling = rope_scaling(file, meta, config["max_position_embeddings"])
    if scaling is not None:
        full.update(scaling)
    config["rope_parameters"] = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": meta.float("rope.freq_base_swa", 10000.0)}}
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if "layer_types" in config:
        return config
    if isinstance(pattern, np.ndarray):  # one flag per layer (an array of bools): True = sliding
        if len(pattern) != layers:
            raise file.fail(f"metadata {meta.arch}.attention.sliding_window_pattern must be {layers} bools (one per "
                            f"layer, {meta.arch}.block_count = {layers}) or a period, got {len(pattern)} bools")
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern.tolist()]
    else:
        config["sliding_window_pattern"] = meta.int("attention.sliding_window_pattern", 6)
    return config


FAMILY = Family(
    model_type="gemma2", keys=frozenset(GEMMA_KEYS), read_config=gemma_config,
    tensors=plain_tensors, architecture="Gemma2ForCausalLM", hf_config_class="Gemma2Config",
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64, query_pre_attn_scalar=64, sliding_window=512),
    gguf=GGUFArchitecture("gemma2", gemma_gguf_config, bias_flags=GGUF_BIASES, norm_offset=True,
                          tokenizer_style="gemma"))

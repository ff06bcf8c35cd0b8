"""Gemma 4 (text): Gemma 3, except RMSNorms with ``weight`` (not ``1 + weight``) and values RMS-normalised
without a gain, scores unscaled (``q k^T``, the q/k norms set their size), global (full-attention) layers with
heads of their own width and count (``per_layer_config``, or ``global_head_dim`` and
``num_global_key_value_heads``) whose keys are also the values when ``attention_k_eq_v``, the last
``num_kv_shared_layers`` layers reusing the keys and values of the last earlier layer of their type (with a
double-wide MLP when ``use_double_wide_mlp``), proportional rotary on the global layers (``rope_type``
``"proportional"``: a quarter of the frequencies turn, by default), per-layer inputs (a second embedding of
``hidden_size_per_layer_input`` features per layer, gated into each layer after its MLP), a learned scalar on
every layer's output, the last layer always full, sliding windows of 512 and a context of 131072 positions.

Checkpoint (under ``model.``), beyond Gemma 3's: per layer ``layer_scalar``, ``per_layer_input_gate``,
``per_layer_projection``, ``post_per_layer_input_norm`` (no ``k_proj``, ``v_proj``, ``k_norm`` on the layers that
reuse keys and values; no ``v_proj`` on global layers whose keys are the values); ``embed_tokens_per_layer``,
``per_layer_model_projection``, ``per_layer_projection_norm``. Gemma 4's mixture-of-experts block
(``enable_moe_block``) is refused.
"""
from __future__ import annotations

from dataclasses import replace

from ...models.config import DecoderConfig
from ...models.layerwise import LayerwiseConfig
from ..tensor_map import TensorMap
from . import Family
from ._reader import Reader
from .gemma2 import GEMMA_KEYS, GemmaRules, gemma_config
from .llama import BENCHMARK_SHAPE

__all__ = ["FAMILY"]

RULES = GemmaRules(max_positions=131072, full_every=None, rope_theta=1000000.0, rope_per_layer_type=True,
                   softcaps=(None, None), qk_norm=True)
# transformers' rotary when config.json has no rope_parameters
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}
KEYS = tuple(k for k in GEMMA_KEYS if k not in ("query_pre_attn_scalar", "attn_logit_softcapping")) + (
    "sliding_window_pattern", "vocab_size_per_layer_input", "hidden_size_per_layer_input", "attention_k_eq_v",
    "num_kv_shared_layers", "use_double_wide_mlp", "per_layer_config", "global_head_dim",
    "num_global_key_value_heads", "enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")


def _global_heads(read: Reader, types: tuple[str, ...], head_dim: int, kv_heads: int, k_eq_v: bool
                  ) -> tuple[int, int]:
    """(Dh, Hkv) of the global layers: from ``per_layer_config`` (which must give every global layer the same
    and the sliding layers nothing else), or from ``global_head_dim`` / ``num_global_key_value_heads``."""
    family = read.family
    per_layer = read.raw("per_layer_config", None)
    if per_layer is None:
        width = read.int("global_head_dim", 512)
        heads = read.int("num_global_key_value_heads", None, optional=True) if k_eq_v else None
        return width, heads or kv_heads
    if not isinstance(per_layer, dict):
        raise ValueError(f"{family} config: 'per_layer_config' must be a dict of layer index -> settings, got "
                         f"{per_layer!r}")
    by_index = {}
    for key, given in per_layer.items():  # transformers writes the indices zero-padded ("05") as JSON keys
        if not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())) or not 0 <= int(key) < len(types):
            raise ValueError(f"{family} config: per_layer_config keys must be layer indices below "
                             f"{len(types)}, got {key!r}")
        by_index[int(key)] = given
    found = set()
    for index, kind in enumerate(types):
        given = by_index.get(index, {})
        if not isinstance(given, dict) or set(given) - {"head_dim", "num_key_value_heads"}:
            raise ValueError(f"{family} config: per_layer_config[{index!r}] may set only head_dim and "
                             f"num_key_value_heads, got {given!r}")
        where = Reader(given, f"{family} config: per_layer_config[{index!r}]")
        shape = (where.int("head_dim", head_dim), where.int("num_key_value_heads", kv_heads))
        if kind == "sliding_attention" and shape != (head_dim, kv_heads):
            raise ValueError(f"{family} config: per_layer_config[{index!r}] changes a sliding layer's heads to "
                             f"{shape}; attnkit reads per-layer heads only on the full-attention layers")
        if kind == "full_attention":
            found.add(shape)
    if len(found) > 1:
        raise ValueError(f"{family} config: per_layer_config gives the full-attention layers different heads: "
                         f"{sorted(found)}")
    return found.pop() if found else (head_dim, kv_heads)


def _refuse_absent_features(read: Reader) -> None:
    family = read.family
    if read.bool("enable_moe_block", False):
        raise ValueError(f"{family} config: enable_moe_block=true (Gemma 4's mixture-of-experts block) is not "
                         f"supported")
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if read.raw(key, None) is not None:
            raise ValueError(f"{family} config: {key!r} must be null without the mixture-of-experts block, got "
                             f"{read.raw(key)!r}")
    if read.bool("attention_bias", False):
        raise ValueError(f"{family} config: attention_bias=true is not supported for {family}")


def _count(read: Reader, key: str, default: int) -> int:
    """A size that may be 0 (or null: 0), else a positive integer."""
    return 0 if read.raw(key, default) in (0, None) else read.int(key)


def gemma4_config(read: Reader) -> DecoderConfig:
    """A Gemma 4 text ``config.json`` as a DecoderConfig: Gemma 3's reading, then the differences above."""
    family = read.family
    _refuse_absent_features(read)
    raw = dict(read.config)
    if raw.get("use_bidirectional_attention") == "vision":  # only image tokens attend both ways: text is causal
        raw.pop("use_bidirectional_attention")
    raw["rope_parameters"] = raw.get("rope_parameters") or DEFAULT_ROPE
    raw.setdefault("sliding_window", 512)
    base = gemma_config(Reader(raw, family), RULES)
    if base.rotary.partial_factor != 1.0:
        raise ValueError(f"{family} config: partial_rotary_factor is read only with rope_type 'proportional' "
                         f"(transformers' default rotary of {family} turns every feature)")
    types = base.layer_types[:-1] + ("full_attention",)  # transformers makes the last layer full, whatever given
    k_eq_v = read.bool("attention_k_eq_v", False)
    global_dim, global_kv = _global_heads(read, types, base.head_dim, base.num_kv_heads, k_eq_v)
    per_layer_size = _count(read, "hidden_size_per_layer_input", 256)
    part = LayerwiseConfig(
        global_head_dim=global_dim, global_kv_heads=global_kv, keys_are_values=k_eq_v,
        shared_kv_layers=_count(read, "num_kv_shared_layers", 0),
        wide_shared_mlp=read.bool("use_double_wide_mlp", False), per_layer_input_size=per_layer_size,
        per_layer_vocab_size=read.int("vocab_size_per_layer_input", 262144) if per_layer_size else 0)
    window = base.attention.sliding_window if "sliding_attention" in types else None
    return replace(base, norm=replace(base.norm, offset=0.0), attention=replace(base.attention, scale=1.0,
                                                                                 sliding_window=window),
                   layer_types=types, layerwise=part)


def _layer_tensors(cfg: DecoderConfig, i: int) -> list[TensorMap]:
    part, d, spec = cfg.layerwise, cfg.hidden_size, cfg.layers[i]
    head_dim, kv = spec.head_dim, spec.num_kv_heads * spec.head_dim
    q, f, owner = cfg.num_heads * head_dim, spec.intermediate_size, spec.kv_owner
    hf = ak = f"layers.{i}."
    attn = ak + "attention."
    projections = [("q_proj", q, "W_Q")]
    norms = [("q_norm", "q_norm")]
    if owner is None:
        projections.append(("k_proj", kv, "W_K"))
        norms.append(("k_norm", "k_norm"))
        if not (part.keys_are_values and cfg.layer_types[i] == "full_attention"):
            projections.append(("v_proj", kv, "W_V"))
    maps = [TensorMap(f"{hf}self_attn.{proj}.weight", (width, d), (attn + name,), "transpose")
            for proj, width, name in projections]
    maps += [TensorMap(f"{hf}self_attn.{norm}.weight", (head_dim,), (attn + name,), "copy") for norm, name in norms]
    maps.append(TensorMap(hf + "self_attn.o_proj.weight", (d, q), (attn + "W_O",), "transpose"))
    for norm, name in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "attn_post_norm"),
                       ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "mlp_post_norm")):
        maps.append(TensorMap(f"{hf}{norm}.weight", (d,), (f"{ak}{name}.gamma",), "copy"))
    for proj, shape, name in (("gate_proj", (f, d), "W_gate"), ("up_proj", (f, d), "W_up"),
                              ("down_proj", (d, f), "W_down")):
        maps.append(TensorMap(f"{hf}mlp.{proj}.weight", shape, (f"{ak}mlp.{name}",), "transpose"))
    if part.per_layer_input_size:
        p = part.per_layer_input_size
        maps += [TensorMap(hf + "per_layer_input_gate.weight", (p, d), (ak + "per_layer.W_gate",), "transpose"),
                 TensorMap(hf + "per_layer_projection.weight", (d, p), (ak + "per_layer.W_up",), "transpose"),
                 TensorMap(hf + "post_per_layer_input_norm.weight", (d,), (ak + "per_layer.norm.gamma",), "copy")]
    maps.append(TensorMap(hf + "layer_scalar", (1,), (ak + "layer_scalar",), "copy"))
    return maps


def gemma4_tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """The checkpoint as ``cfg`` shapes it, and the base prefix ``"model."``."""
    part, d, v = cfg.layerwise, cfg.hidden_size, cfg.vocab_size
    maps = [TensorMap("embed_tokens.weight", (v, d), ("embed.weight",), "copy")]
    for i in range(cfg.num_layers):
        maps += _layer_tensors(cfg, i)
    maps.append(TensorMap("norm.weight", (d,), ("norm.gamma",), "copy"))
    if part.per_layer_input_size:
        width, p = cfg.num_layers * part.per_layer_input_size, part.per_layer_input_size
        maps += [TensorMap("embed_tokens_per_layer.weight", (part.per_layer_vocab_size, width),
                           ("per_layer_inputs.embed.weight",), "copy"),
                 TensorMap("per_layer_model_projection.weight", (width, d), ("per_layer_inputs.W_proj",),
                           "transpose"),
                 TensorMap("per_layer_projection_norm.weight", (p,), ("per_layer_inputs.norm.gamma",), "copy")]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head.weight", (v, d), ("head.weight",), "copy"))
    return maps, "model."


def unused_tensors(cfg: DecoderConfig) -> frozenset[str]:
    """The key/value projections and norms a checkpoint may still hold for the layers that reuse another
    layer's keys and values (transformers ignores them on loading; so does attnkit)."""
    readers = [spec.index for spec in cfg.layers if spec.kv_owner is not None]
    return frozenset(f"layers.{i}.self_attn.{name}.weight" for i in readers
                     for name in ("k_proj", "v_proj", "k_norm"))


FAMILY = Family(
    model_type="gemma4_text", keys=frozenset(KEYS), read_config=gemma4_config, tensors=gemma4_tensors,
    unused_tensors=unused_tensors,
    architecture="Gemma4ForCausalLM", hf_config_class="Gemma4TextConfig",
    benchmark=dict(BENCHMARK_SHAPE, head_dim=64, global_head_dim=128, sliding_window=512,
                   hidden_size_per_layer_input=64, vocab_size_per_layer_input=BENCHMARK_SHAPE["vocab_size"],
                   num_kv_shared_layers=10))

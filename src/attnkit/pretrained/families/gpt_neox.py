"""GPT-NeoX (Pythia): Llama's rotary, except only a part of each head rotated (``rotary_pct``, default a
quarter), LayerNorm with biases, a plain GELU MLP with biases, biases on attention, one fused head-interleaved
``attention.query_key_value`` (every head's q, k and v rows together), and by default the parallel residual
(attention and MLP both read the block's input). Older folders name the rotary base ``rotary_emb_base``.

Checkpoint (under ``gpt_neox.``): ``embed_in``; per layer ``input_layernorm``, ``post_attention_layernorm``,
``attention.query_key_value``, ``attention.dense``, ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``;
``final_layer_norm``; ``embed_out`` when untied.
"""
from __future__ import annotations

from ...models.config import AttentionConfig, DecoderConfig, MLPConfig, NormConfig, RotaryConfig, SpecialTokens
from ..tensor_map import TensorMap
from . import Family
from ._reader import ROPE_KEYS, Reader, read_rope

__all__ = ["FAMILY"]

KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
        "max_position_embeddings", "layer_norm_eps", "use_parallel_residual", "attention_bias", "rotary_pct",
        "rotary_emb_base") + ROPE_KEYS


def _read_config(read: Reader) -> DecoderConfig:
    """GPT-NeoX (Pythia): LayerNorm, partial rotary, plain GELU MLP with biases, a fused head-interleaved
    ``query_key_value`` and, by default, the parallel residual."""
    hidden = read.int("hidden_size")
    heads = read.int("num_attention_heads")
    if hidden % heads:
        raise ValueError(f"gpt_neox config: hidden_size ({hidden}) must be a multiple of num_attention_heads "
                         f"({heads})")
    max_positions = read.int("max_position_embeddings", 2048)
    # Older folders name the rotary base and fraction rotary_emb_base and rotary_pct (default 0.25).
    legacy = dict(read.config)
    params = legacy.get("rope_scaling") or legacy.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"gpt_neox config: 'rope_parameters' must be a dict or null, got {params!r}")
    params = dict(params)
    if "rotary_emb_base" in legacy:
        params.setdefault("rope_theta", legacy["rotary_emb_base"])
    params.setdefault("partial_rotary_factor", legacy.get("rotary_pct", 0.25))
    legacy["rope_parameters" if not legacy.get("rope_scaling") else "rope_scaling"] = params
    theta, scaling, partial = read_rope(Reader(legacy, "gpt_neox"), max_positions)
    bias = read.bool("attention_bias", True)
    return DecoderConfig(
        family="gpt_neox", vocab_size=read.int("vocab_size"), hidden_size=hidden,
        num_layers=read.layers(), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        mlp=MLPConfig(read.int("intermediate_size"), kind="plain", activation=read.activation("hidden_act", "gelu"),
                      bias=True),
        max_position_embeddings=max_positions,
        norm=NormConfig(kind="layernorm", eps=read.eps("layer_norm_eps", 1e-5)),
        rotary=RotaryConfig(theta=theta, scaling=scaling, partial_factor=partial),
        attention=AttentionConfig(bias=bias, output_bias=bias),
        residual="parallel" if read.bool("use_parallel_residual", True) else "sequential",
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        tokens=SpecialTokens(bos=read.token_ids("bos_token_id", 0, many=False),
                             eos=read.token_ids("eos_token_id", 2, many=True),
                             pad=read.token_ids("pad_token_id", None, many=False)),
    )


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    d, f, v = cfg.hidden_size, cfg.mlp.intermediate_size, cfg.vocab_size
    maps = [TensorMap("embed_in.weight", (v, d), ("embed.weight",), "copy")]
    for i in range(cfg.num_layers):
        hf, ak = f"layers.{i}.", f"layers.{i}."
        attn = ak + "attention."
        qkv = (attn + "W_Q", attn + "W_K", attn + "W_V")
        maps += [TensorMap(hf + "input_layernorm.weight", (d,), (ak + "attn_norm.gamma",), "copy"),
                 TensorMap(hf + "input_layernorm.bias", (d,), (ak + "attn_norm.beta",), "copy"),
                 TensorMap(hf + "post_attention_layernorm.weight", (d,), (ak + "mlp_norm.gamma",), "copy"),
                 TensorMap(hf + "post_attention_layernorm.bias", (d,), (ak + "mlp_norm.beta",), "copy"),
                 TensorMap(hf + "attention.query_key_value.weight", (3 * d, d), qkv, "head_split_transpose",
                           cfg.num_heads)]
        if cfg.attention.bias:
            maps.append(TensorMap(hf + "attention.query_key_value.bias", (3 * d,),
                                  (attn + "b_Q", attn + "b_K", attn + "b_V"), "head_split", cfg.num_heads))
        maps.append(TensorMap(hf + "attention.dense.weight", (d, d), (attn + "W_O",), "transpose"))
        if cfg.attention.output_bias:
            maps.append(TensorMap(hf + "attention.dense.bias", (d,), (attn + "b_O",), "copy"))
        maps += [TensorMap(hf + "mlp.dense_h_to_4h.weight", (f, d), (ak + "mlp.W1",), "transpose"),
                 TensorMap(hf + "mlp.dense_h_to_4h.bias", (f,), (ak + "mlp.b1",), "copy"),
                 TensorMap(hf + "mlp.dense_4h_to_h.weight", (d, f), (ak + "mlp.W2",), "transpose"),
                 TensorMap(hf + "mlp.dense_4h_to_h.bias", (d,), (ak + "mlp.b2",), "copy")]
    maps += [TensorMap("final_layer_norm.weight", (d,), ("norm.gamma",), "copy"),
             TensorMap("final_layer_norm.bias", (d,), ("norm.beta",), "copy")]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("embed_out.weight", (v, d), ("head.weight",), "copy"))
    return maps, "gpt_neox."


# -- reading the files -------------------------------------------------------------------------------------


FAMILY = Family(
    model_type="gpt_neox", keys=frozenset(KEYS), read_config=_read_config,
    tensors=_tensors, architecture="GPTNeoXForCausalLM", hf_config_class="GPTNeoXConfig",
    benchmark=dict(hidden_size=576, intermediate_size=2304, num_hidden_layers=30, num_attention_heads=9,
                   vocab_size=49152, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0))

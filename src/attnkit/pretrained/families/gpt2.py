"""GPT-2: learned positions instead of rotary, LayerNorm (with biases), a plain GELU (tanh) MLP, biases on
every projection, one fused ``attn.c_attn`` for q, k and v, weights stored (in, out) (``Conv1D``), a tied head by
default; its own key names (``n_embd``, ``n_head``, ``n_layer``, ``n_positions``, ``n_inner``).

Checkpoint (under ``transformer.``): ``wte``, ``wpe``; per layer ``ln_1``, ``attn.c_attn`` (split column-wise into
q, k, v), ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``; ``ln_f``; ``lm_head`` when untied.
"""
from __future__ import annotations

from typing import Any

from ...models.config import AttentionConfig, DecoderConfig, MLPConfig, NormConfig, SpecialTokens
from ..gguf_metadata import GGUFArchitecture, GGUFMetadata, special_ids, vocab_size
from ..tensor_map import TensorMap
from . import Family
from ._reader import Reader

__all__ = ["FAMILY"]

# summary_* size the sequence-summary head of GPT2DoubleHeadsModel, which a causal LM does not have;
# reorder_and_upcast_attn computes the same scores in float32, which attnkit's float32 does anyway.
KEYS = ("vocab_size", "n_embd", "n_head", "n_layer", "n_positions", "n_ctx", "n_inner", "activation_function",
        "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
        "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
        "add_cross_attention")


def _read_config(read: Reader) -> DecoderConfig:
    hidden = read.int("n_embd")
    heads = read.int("n_head")
    if hidden % heads:
        raise ValueError(f"gpt2 config: n_embd ({hidden}) must be a multiple of n_head ({heads})")
    if read.bool("add_cross_attention", False):
        raise ValueError("gpt2 config: add_cross_attention=true (an encoder-decoder GPT-2) is not supported")
    if not read.bool("scale_attn_weights", True):
        raise ValueError("gpt2 config: scale_attn_weights=false is not supported (scores are scaled by 1/sqrt(Dh))")
    if read.bool("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("gpt2 config: scale_attn_by_inverse_layer_idx=true is not supported")
    return DecoderConfig(
        family="gpt2", vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=read.layers("n_layer"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        mlp=MLPConfig(read.int("n_inner", None, optional=True) or 4 * hidden, kind="plain",
                      activation=read.activation("activation_function", "gelu_new"), bias=True),
        max_position_embeddings=read.int("n_positions", 1024),
        norm=NormConfig(kind="layernorm", eps=read.eps("layer_norm_epsilon", 1e-5)), rotary=None,
        attention=AttentionConfig(bias=True, output_bias=True),
        tie_word_embeddings=read.bool("tie_word_embeddings", True),
        tokens=SpecialTokens(bos=read.token_ids("bos_token_id", 50256, many=False),
                             eos=read.token_ids("eos_token_id", 50256, many=True),
                             pad=read.token_ids("pad_token_id", None, many=False)),
    )


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    d, f, v = cfg.hidden_size, cfg.mlp.intermediate_size, cfg.vocab_size
    maps = [TensorMap("wte.weight", (v, d), ("embed.weight",), "copy"),
            TensorMap("wpe.weight", (cfg.max_position_embeddings, d), ("pos_embed.weight",), "copy")]
    for i in range(cfg.num_layers):
        hf, ak = f"h.{i}.", f"layers.{i}."
        attn = ak + "attention."
        maps += [
            TensorMap(hf + "ln_1.weight", (d,), (ak + "attn_norm.gamma",), "copy"),
            TensorMap(hf + "ln_1.bias", (d,), (ak + "attn_norm.beta",), "copy"),
            TensorMap(hf + "attn.c_attn.weight", (d, 3 * d), (attn + "W_Q", attn + "W_K", attn + "W_V"), "split"),
            TensorMap(hf + "attn.c_attn.bias", (3 * d,), (attn + "b_Q", attn + "b_K", attn + "b_V"), "split"),
            TensorMap(hf + "attn.c_proj.weight", (d, d), (attn + "W_O",), "copy"),
            TensorMap(hf + "attn.c_proj.bias", (d,), (attn + "b_O",), "copy"),
            TensorMap(hf + "ln_2.weight", (d,), (ak + "mlp_norm.gamma",), "copy"),
            TensorMap(hf + "ln_2.bias", (d,), (ak + "mlp_norm.beta",), "copy"),
            TensorMap(hf + "mlp.c_fc.weight", (d, f), (ak + "mlp.W1",), "copy"),
            TensorMap(hf + "mlp.c_fc.bias", (f,), (ak + "mlp.b1",), "copy"),
            TensorMap(hf + "mlp.c_proj.weight", (f, d), (ak + "mlp.W2",), "copy"),
            TensorMap(hf + "mlp.c_proj.bias", (d,), (ak + "mlp.b2",), "copy"),
        ]
    maps += [TensorMap("ln_f.weight", (d,), ("norm.gamma",), "copy"),
             TensorMap("ln_f.bias", (d,), ("norm.beta",), "copy")]
    if not cfg.tie_word_embeddings:
        maps.append(TensorMap("lm_head.weight", (v, d), ("head.weight",), "copy"))
    return maps, "transformer."


def _gguf_config(file: Any, meta: GGUFMetadata) -> dict[str, Any]:
    """GPT-2: LayerNorm, learned positions, tanh-GELU (the GELU llama.cpp computes)."""
    return {"model_type": "gpt2", "vocab_size": vocab_size(file, meta), "n_embd": meta.int("embedding_length"),
            "n_layer": meta.int("block_count"), "n_head": meta.int("attention.head_count"),
            "n_positions": meta.int("context_length"), "n_inner": meta.int("feed_forward_length"),
            "layer_norm_epsilon": meta.float("attention.layer_norm_epsilon"), "activation_function": "gelu_new",
            "tie_word_embeddings": "output.weight" not in file.tensors, **special_ids(file)}


FAMILY = Family(
    model_type="gpt2", keys=frozenset(KEYS), read_config=_read_config,
    tensors=_tensors, architecture="GPT2LMHeadModel", hf_config_class="GPT2Config",
    benchmark=dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, resid_pdrop=0.0,
                   embd_pdrop=0.0, attn_pdrop=0.0),
    gguf=GGUFArchitecture("gpt2", _gguf_config, transposed=("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                                          "ffn_down.weight")))

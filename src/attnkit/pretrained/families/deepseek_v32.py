"""DeepSeek-V3.2: DeepSeek-V3, except that every layer's latent attention is sparse (DeepSeek Sparse Attention):
a lightning indexer of ``index_n_heads`` ReLU heads ``index_head_dim`` wide (queries from the attention's query
latent, one LayerNorm-ed key per token, the first ``qk_rope_head_dim`` features turned as half-split pairs) scores
every key a query may see, and the query attends to its ``index_topk`` best only; the indexer's keys are cached
beside the latent. Queries always pass through the ``q_lora_rank`` bottleneck, the attention's rotary pairs are
always interleaved (no ``rope_interleave`` key), ``mlp_layer_types`` may name the dense and sparse MLP layers,
and the context is 163840 tokens by default.

Checkpoint (under ``model.``): DeepSeek-V3's, plus ``self_attn.indexer.{wq_b, wk, weights_proj}.weight`` and
``self_attn.indexer.k_norm.{weight, bias}`` in every layer.
"""
from __future__ import annotations

from ...attention.latent import LatentAttentionConfig
from ...models.config import DecoderConfig
from ..tensor_map import TensorMap
from . import Family
from ._multi_token import multi_token_tensors
from ._reader import Reader
from .deepseek_v3 import FAMILY as DEEPSEEK_V3
from .deepseek_v3 import keys, latent_attention_tensors, model_tensors, read_config

__all__ = ["FAMILY"]

# transformers' DeepseekV32Config defaults where they differ from DeepseekV3Config's, and the indexer's
DEFAULTS = dict(max_position_embeddings=163840, index_topk=2048, index_n_heads=64, index_head_dim=128)
LAYER_TYPE = "indexed_attention"  # the one attention layer type transformers writes into layer_types
MLP_TYPES = ("dense", "sparse")


def _sparse_layers(read: Reader, layers: int) -> tuple[int, ...] | None:
    """The layers whose MLP is the mixture, from ``mlp_layer_types`` (None: from ``first_k_dense_replace``)."""
    types = read.raw("mlp_layer_types", None)
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != layers or any(t not in MLP_TYPES for t in types):
        raise ValueError(f"{read.family} config: 'mlp_layer_types' must list {layers} of {MLP_TYPES}, got {types!r}")
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def _read(read: Reader) -> DecoderConfig:
    layers = read.layers()
    types = read.raw("layer_types", None)
    if types is not None and types != [LAYER_TYPE] * layers:
        raise ValueError(f"{read.family} config: 'layer_types' must be {layers} x {LAYER_TYPE!r} (every layer is "
                         f"sparse latent attention), got {types!r}")
    if read.raw("q_lora_rank", 1) is None:
        raise ValueError(f"{read.family} config: 'q_lora_rank' must be a positive integer (the indexer reads the "
                         f"query latent; DeepSeek-V3.2 has no q_proj), got None")
    if read.bool("mlp_bias", False):
        raise ValueError(f"{read.family} config: 'mlp_bias' must be false (no DeepSeek-V3.2 MLP has biases)")
    indexer = {key: read.int(key, DEFAULTS[key]) for key in ("index_topk", "index_n_heads", "index_head_dim")}
    # transformers' default num_key_value_heads (128) ignores num_attention_heads, and its SDPA path never reads it:
    # latent attention up-projects a key and a value for every query head
    read = Reader({k: v for k, v in read.config.items() if k != "num_key_value_heads"}, read.family)
    return read_config(read, indexer=indexer, sparse=_sparse_layers(read, layers),
                       max_positions_default=DEFAULTS["max_position_embeddings"])


def _attention_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """DeepSeek-V3's latent attention, then its indexer's projections and key norm."""
    lat = cfg.mixer_part(LatentAttentionConfig)
    hi, di = lat.index_n_heads, lat.index_head_dim
    d, hf_index, ak_index = cfg.hidden_size, hf + "self_attn.indexer.", ak + "attention.indexer."
    return latent_attention_tensors(cfg, hf, ak) + [
        TensorMap(hf_index + "wq_b.weight", (hi * di, lat.q_lora_rank), (ak_index + "W_QB",), "transpose"),
        TensorMap(hf_index + "wk.weight", (di, d), (ak_index + "W_K",), "transpose"),
        TensorMap(hf_index + "k_norm.weight", (di,), (ak_index + "k_norm",), "copy"),
        TensorMap(hf_index + "k_norm.bias", (di,), (ak_index + "k_norm_bias",), "copy"),
        TensorMap(hf_index + "weights_proj.weight", (hi, d), (ak_index + "W_weights",), "transpose")]


FAMILY = Family(
    model_type="deepseek_v32",
    keys=(keys() - {"rope_interleave"}) | {"index_topk", "index_n_heads", "index_head_dim", "mlp_layer_types",
                                           "layer_types", "mlp_bias"},
    read_config=_read, tensors=lambda cfg, mxfp4=False: model_tensors(cfg, mxfp4, _attention_tensors),
    mtp_tensors=lambda cfg: multi_token_tensors(cfg, lambda c: model_tensors(c, False, _attention_tensors)),
    architecture="DeepseekV32ForCausalLM", hf_config_class="DeepseekV32Config",
    # DeepSeek-V3's benchmark shape, with an indexer of 4 heads of 32 choosing 64 keys per query
    benchmark=dict(DEEPSEEK_V3.benchmark, index_topk=64, index_n_heads=4, index_head_dim=32))

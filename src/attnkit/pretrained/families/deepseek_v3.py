"""DeepSeek-V3: Llama, except multi-head latent attention in every layer and, past the first
``first_k_dense_replace`` layers, a mixture of many small experts with shared experts. Attention compresses
each token into a latent of ``kv_lora_rank`` features (RMS-normalised) and one rotary key of
``qk_rope_head_dim`` features shared by the heads, from which the per-head keys and values are up-projected;
queries pass through a rank-``q_lora_rank`` bottleneck with its RMSNorm (or one ``q_proj`` when it is null);
the rotary pairs are interleaved unless ``rope_interleave`` is false, and a YaRN scaling's ``mscale_all_dim``
sharpens the softmax scale too. The cache keeps only the latent and the rotary key. The router scores every
expert with a sigmoid, chooses ``num_experts_per_tok`` of them by score plus a correction bias within the
``topk_group`` best of ``n_group`` groups, and weighs them by their uncorrected scores (normalised when
``norm_topk_prob``) times ``routed_scaling_factor``.

Checkpoint (under ``model.``): Llama's, with ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj}`` (or ``q_proj``),
``self_attn.{kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`` (biases on ``q_a_proj``,
``kv_a_proj_with_mqa`` and ``o_proj`` with ``attention_bias``) and, in the expert layers, ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.experts.{j}.{gate,up,down}_proj`` for each expert j (one tensor per
expert on disk, as DeepSeek publishes them and transformers saves them, Qwen3-MoE's layout; in memory
transformers stacks them into ``gate_up_proj`` and ``down_proj``) and ``mlp.shared_experts.{gate,up,down}_proj``
(attnkit's one ``shared_expert`` of width ``n_shared_experts * moe_intermediate_size``).
"""
from __future__ import annotations

from functools import partial

from ..._validation import check_factor
from ...attention.latent import LatentAttentionConfig, yarn_softmax_scale
from ...models.config import DecoderConfig, ExpertsConfig, MLPConfig, NormConfig, RotaryConfig, SpecialTokens
from ..tensor_map import TensorMap
from . import Family
from ._multi_token import MTP_KEYS, mtp_layer_count, multi_token_tensors
from ._reader import COMMON_KEYS, Reader, read_rope
from .llama import BENCHMARK_SHAPE, pre_norm_tensors
from .qwen3_moe import mlp_tensors

__all__ = ["FAMILY", "group_routed_experts", "keys", "latent_attention_tensors", "model_tensors", "read_config"]

# transformers' DeepseekV3Config defaults (DeepSeek-V3's own shape) for the keys a config.json may leave out
DEFAULTS = dict(max_position_embeddings=4096, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                rms_norm_eps=1e-6, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                topk_group=4, n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5)

# keys of DeepSeek's own config.json (remote code) that name the one routing transformers implements
_FIXED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
# parallelism, training losses and the multi-token-prediction heads: none changes the next-token forward
_INERT = ("ep_size", "aux_loss_alpha", "seq_aux", "output_router_logits", "auto_map")


def _read_int(read: Reader, key: str, *, optional: bool = False) -> int | None:
    return read.int(key, DEFAULTS[key], optional=optional)


def _latent(read: Reader, hidden: int, heads: int, scaling: dict | None, **indexer: int) -> LatentAttentionConfig:
    nope, rope = _read_int(read, "qk_nope_head_dim"), _read_int(read, "qk_rope_head_dim")
    for key, value in (("head_dim", rope), ("qk_head_dim", nope + rope)):  # derived keys transformers writes
        given = read.raw(key, value)
        if given != value:
            raise ValueError(f"{read.family} config: {key!r} ({given!r}) must be {value}, as transformers derives "
                             f"it from the qk_*_head_dim keys")
    scale = yarn_softmax_scale(nope + rope, scaling)
    try:
        check_factor(scale, "the softmax scale")
    except ValueError:
        raise ValueError(f"{read.family} config: the softmax scale, (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 "
                         f"times the square of YaRN's mscale of mscale_all_dim, is {scale!r}; it must be in "
                         f"[2**-14, 65504] (float16's normal range)") from None
    return LatentAttentionConfig(
        hidden_size=hidden, num_heads=heads, kv_lora_rank=_read_int(read, "kv_lora_rank"), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=_read_int(read, "v_head_dim"),
        q_lora_rank=_read_int(read, "q_lora_rank", optional=True), attention_bias=read.bool("attention_bias", False),
        rope_interleaved=read.bool("rope_interleave", True), attention_scale=scale, **indexer)


def group_routed_experts(read: Reader, layers: int, defaults: dict = DEFAULTS,
                         sparse: tuple[int, ...] | None = None) -> ExpertsConfig | None:
    """DeepSeek-V3's mixture (sigmoid scores, a bias-corrected choice within the best groups, shared experts) on
    the layers from ``first_k_dense_replace`` on, or on the ``sparse`` ones, its sizes read with the family's
    ``defaults`` (None when every layer is dense). GLM-4.5 reads its mixture alike."""
    for key, value in _FIXED.items():
        if read.raw(key, value) != value:
            raise ValueError(f"{read.family} config: {key!r} must be {value!r} (the routing attnkit and "
                             f"transformers implement), got {read.raw(key)!r}")
    experts = read.int("n_routed_experts", read.raw("num_local_experts", defaults["n_routed_experts"]))
    first_dense = read.count("first_k_dense_replace", defaults["first_k_dense_replace"])
    width = read.int("moe_intermediate_size", defaults["moe_intermediate_size"])
    sparse = tuple(range(first_dense, layers)) if sparse is None else sparse
    if not sparse:
        return None
    # each read names its key; the try adds the family only to what ExpertsConfig itself checks
    read_values = dict(
        num_experts_per_tok=read.int("num_experts_per_tok", defaults["num_experts_per_tok"]),
        n_group=read.int("n_group", defaults["n_group"]), topk_group=read.int("topk_group", defaults["topk_group"]),
        norm_topk_prob=read.bool("norm_topk_prob", True),
        routed_scaling_factor=read.factor("routed_scaling_factor", defaults["routed_scaling_factor"]),
        shared_expert_intermediate_size=read.int("n_shared_experts", defaults["n_shared_experts"]) * width)
    try:
        return ExpertsConfig(num_experts=experts, moe_intermediate_size=width, layers=sparse,
                             router="sigmoid_group_topk", **read_values)
    except ValueError as error:
        raise ValueError(f"{read.family} config: {error}") from None


def read_config(read: Reader, *, indexer: dict | None = None, sparse: tuple[int, ...] | None = None,
                max_positions_default: int = DEFAULTS["max_position_embeddings"]) -> DecoderConfig:
    """DeepSeek-V3's config; DeepSeek-V3.2 adds its sparse attention ``indexer`` (the latent part's ``index_*``
    fields), the ``sparse`` layers of its mixture and its longer default context."""
    family = read.family
    hidden, heads, layers = read.int("hidden_size"), read.int("num_attention_heads"), read.layers()
    kv_heads = read.int("num_key_value_heads", heads, optional=True) or heads
    if kv_heads != heads:
        raise ValueError(f"{family} config: 'num_key_value_heads' ({kv_heads}) must equal num_attention_heads "
                         f"({heads}): every latent attention head has its own keys and values")
    max_positions = read.int("max_position_embeddings", max_positions_default)
    rope = _read_int(read, "qk_rope_head_dim")
    theta, scaling, partial = read_rope(read, max_positions)
    if partial != 1.0:
        raise ValueError(f"{family} config: 'partial_rotary_factor' must be 1 (the rotary part is qk_rope_head_dim "
                         f"wide), got {partial}")
    latent = _latent(read, hidden, heads, scaling, **(indexer or {}))
    return DecoderConfig(
        family=family, vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, head_dim=rope,
        mlp=MLPConfig(read.int("intermediate_size"), activation=read.activation("hidden_act", "silu")),
        max_position_embeddings=max_positions, norm=NormConfig(eps=read.eps("rms_norm_eps", 1e-6)),
        rotary=RotaryConfig(theta=theta, scaling=scaling, interleaved=latent.rope_interleaved),
        tie_word_embeddings=read.bool("tie_word_embeddings", DEFAULTS["tie_word_embeddings"]),
        tokens=SpecialTokens(bos=read.token_ids("bos_token_id", DEFAULTS["bos_token_id"], many=False),
                             eos=read.token_ids("eos_token_id", DEFAULTS["eos_token_id"], many=True),
                             pad=read.token_ids("pad_token_id", None, many=False)),
        mixer_parts=(latent,), experts=group_routed_experts(read, layers, sparse=sparse),
        mtp_layers=mtp_layer_count(read))


def latent_attention_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """A latent attention layer's ``self_attn.`` tensors (the module docstring's list)."""
    lat = cfg.mixer_part(LatentAttentionConfig)
    d, q_width = cfg.hidden_size, cfg.num_heads * lat.qk_head_dim
    hf, ak = hf + "self_attn.", ak + "attention."
    maps = []
    if lat.q_lora_rank:
        maps += [TensorMap(hf + "q_a_proj.weight", (lat.q_lora_rank, d), (ak + "W_QA",), "transpose"),
                 TensorMap(hf + "q_a_layernorm.weight", (lat.q_lora_rank,), (ak + "q_a_norm",), "copy"),
                 TensorMap(hf + "q_b_proj.weight", (q_width, lat.q_lora_rank), (ak + "W_QB",), "transpose")]
        if lat.attention_bias:
            maps.append(TensorMap(hf + "q_a_proj.bias", (lat.q_lora_rank,), (ak + "b_QA",), "copy"))
    else:
        maps.append(TensorMap(hf + "q_proj.weight", (q_width, d), (ak + "W_Q",), "transpose"))
    kv_width = cfg.num_heads * (lat.qk_nope_head_dim + lat.v_head_dim)
    maps += [TensorMap(hf + "kv_a_proj_with_mqa.weight", (lat.latent_dim, d), (ak + "W_KVA",), "transpose"),
             TensorMap(hf + "kv_a_layernorm.weight", (lat.kv_lora_rank,), (ak + "kv_a_norm",), "copy"),
             TensorMap(hf + "kv_b_proj.weight", (kv_width, lat.kv_lora_rank), (ak + "W_KVB",), "transpose"),
             TensorMap(hf + "o_proj.weight", (d, cfg.num_heads * lat.v_head_dim), (ak + "W_O",), "transpose")]
    if lat.attention_bias:
        maps += [TensorMap(hf + "kv_a_proj_with_mqa.bias", (lat.latent_dim,), (ak + "b_KVA",), "copy"),
                 TensorMap(hf + "o_proj.bias", (d,), (ak + "b_O",), "copy")]
    return maps


def model_tensors(cfg: DecoderConfig, mxfp4: bool = False,
                  attention=latent_attention_tensors) -> tuple[list[TensorMap], str]:
    """Llama's embedding, norms and head around each layer's latent ``attention`` and MLP (dense or experts)."""
    return pre_norm_tensors(cfg, attention, partial(mlp_tensors, shared="shared_experts"))


def keys() -> frozenset[str]:
    own = ("attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "qk_head_dim", "rope_interleave", "moe_intermediate_size", "n_routed_experts", "num_local_experts",
           "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
           "routed_scaling_factor", "first_k_dense_replace")
    return frozenset(COMMON_KEYS + own + tuple(_FIXED) + _INERT + MTP_KEYS)


FAMILY = Family(
    model_type="deepseek_v3", keys=keys(), read_config=read_config, tensors=model_tensors,
    mtp_tensors=lambda cfg: multi_token_tensors(cfg, model_tensors),
    architecture="DeepseekV3ForCausalLM", hf_config_class="DeepseekV3Config",
    # the shared shape's width and depth, 9 heads of latent attention, and after one dense layer eight experts of
    # width 512, two per token plus one shared: the active MLP width of the other families (1536)
    benchmark=dict(BENCHMARK_SHAPE, num_key_value_heads=9, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=48,
                   qk_rope_head_dim=16, v_head_dim=64, moe_intermediate_size=512, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1))

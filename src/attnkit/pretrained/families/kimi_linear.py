"""Kimi Linear: DeepSeek-V3 (multi-head latent attention, grouped sigmoid-routed experts with shared experts after
the first dense layers), except that most layers are Kimi Delta Attention (``layer_types`` "linear_attention":
Gated DeltaNet with a decay per key channel, :mod:`attnkit.layers.kimi_delta_attention`), the latent attention
layers ("full_attention", by default every fourth from layer 4) rotate nothing (NoPE: the ``qk_rope_head_dim``
features of the queries and of the shared key pass unturned) and always scale by ``qk_head_dim ** -0.5``, and the
dense layers are ``mlp_layer_types``' "dense" ones (by default the first ``first_k_dense_replace`` = 1).

Checkpoint (under ``model.``, Moonshot's layout, which transformers writes back): Llama's embedding, norms and
head; a latent layer's ``self_attn.`` as DeepSeek-V3's
(:func:`~attnkit.pretrained.families.deepseek_v3.latent_attention_tensors`); a Kimi Delta Attention layer's
``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d`` (E, 1, K) each, ``f_a_proj``,
``f_b_proj``, ``dt_bias``, ``A_log`` (1, 1, H, 1), ``b_proj``, ``g_a_proj``, ``g_b_proj``, ``o_norm``, ``o_proj``;
every MLP under ``block_sparse_moe.``: a dense layer's ``{gate,up,down}_proj``, an expert layer's ``gate`` (with
``e_score_correction_bias``), ``experts.{j}.{w1,w3,w2}`` (gate, up, down) and ``shared_experts.{gate,up,down}_proj``.
The config names may be transformers' (``num_experts``, ``num_experts_per_token``, ``num_shared_experts``,
``num_expert_group``, ``moe_renormalize``, ``model_max_length``, ``linear_num_heads``, ...) or Moonshot's
(``num_experts``, ``num_experts_per_token``, ``linear_attn_config`` with ``head_dim``, ``num_heads``,
``short_conv_kernel_size``, ``kda_layers`` and ``full_attn_layers`` counted from 1).
"""
from __future__ import annotations

from ...attention.latent import LatentAttentionConfig
from ...layers.kimi_delta_attention import KimiDeltaAttentionConfig
from ...models.config import DecoderConfig, ExpertsConfig, MLPConfig, NormConfig, RotaryConfig, SpecialTokens
from ..tensor_map import TensorMap
from . import Family
from ._reader import COMMON_KEYS, Reader
from .deepseek_v3 import latent_attention_tensors
from .llama import BENCHMARK_SHAPE, pre_norm_tensors
from .qwen3_moe import mlp_tensors

__all__ = ["FAMILY"]

# transformers' KimiLinearConfig defaults for the keys a config.json may leave out
DEFAULTS = dict(max_position_embeddings=1048576, rms_norm_eps=1e-5, q_lora_rank=None, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1024,
                num_experts=256, num_experts_per_token=8, num_expert_group=1, topk_group=1, num_shared_experts=1,
                routed_scaling_factor=2.446, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
                first_k_dense_replace=1, bos_token_id=163584, eos_token_id=163586, pad_token_id=163839)

# each setting's names: transformers' (as it saves them) first, then the aliases its config class accepts
_NAMES = {"max_position_embeddings": ("model_max_length", "max_position_embeddings"),
          "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
          "num_experts_per_token": ("num_experts_per_token", "num_experts_per_tok"),
          "num_shared_experts": ("num_shared_experts", "n_shared_experts"),
          "num_expert_group": ("num_expert_group", "n_group"),
          "moe_renormalize": ("moe_renormalize", "norm_topk_prob")}
# Moonshot's linear_attn_config: its key -> transformers' flat key
_LINEAR_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                "short_conv_kernel_size": "linear_conv_kernel_dim"}
# training-only and derived keys: none changes the next-token forward (qk_head_dim and head_dim are checked)
_INERT = ("output_router_logits", "num_mtp_layers", "num_nextn_predict_layers", "auto_map", "qk_head_dim")


def _key(read: Reader, name: str) -> str:
    """The first of the setting's names the config uses (its first name if none)."""
    names = _NAMES.get(name, (name,))
    return next((key for key in names if key in read.config), names[0])


def _int(read: Reader, name: str, *, optional: bool = False) -> int | None:
    return read.int(_key(read, name), DEFAULTS[name], optional=optional)


def _linear_read(read: Reader) -> Reader:
    """The reader with Moonshot's ``linear_attn_config`` entries as transformers' flat keys (flat keys win)."""
    nested = read.raw("linear_attn_config", None) or {}
    if not isinstance(nested, dict):
        raise ValueError(f"{read.family} config: 'linear_attn_config' must be a dict, got {nested!r}")
    flat = {flat: nested[key] for key, flat in _LINEAR_KEYS.items() if key in nested}
    return Reader({**flat, **read.config}, read.family)


def _layer_types(read: Reader, layers: int) -> tuple[str, ...]:
    """transformers' ``layer_types``, else ``linear_attn_config``'s 1-based ``kda_layers`` / ``full_attn_layers``,
    else every fourth layer from layer 4 full; as attnkit's ``kimi_delta_attention`` / ``full_attention``."""
    given = read.raw("layer_types", None)
    nested = read.raw("linear_attn_config", None) or {}
    if given is None and "full_attn_layers" in nested and "kda_layers" in nested:
        given = [None] * layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for index in nested[key]:
                if not isinstance(index, int) or not 1 <= index <= layers:
                    raise ValueError(f"{read.family} config: linear_attn_config[{key!r}] must hold layer numbers "
                                     f"in [1, {layers}], got {nested[key]!r}")
                given[index - 1] = kind
    if given is None:
        given = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not set(given) <= {"linear_attention",
                                                                                 "full_attention"}:
        raise ValueError(f"{read.family} config: 'layer_types' must list linear_attention or full_attention for each "
                         f"of the {layers} layers, got {given!r}")
    return tuple("kimi_delta_attention" if kind == "linear_attention" else kind for kind in given)


def _sparse_layers(read: Reader, layers: int) -> tuple[int, ...]:
    """The layers whose MLP is the mixture: ``mlp_layer_types``' "sparse" ones, else those from
    ``first_k_dense_replace`` on."""
    given = read.raw("mlp_layer_types", None)
    if given is None:
        first = read.count("first_k_dense_replace", DEFAULTS["first_k_dense_replace"])
        given = ["dense" if i < first else "sparse" for i in range(layers)]
    if not isinstance(given, list) or len(given) != layers or not set(given) <= {"dense", "sparse"}:
        raise ValueError(f"{read.family} config: 'mlp_layer_types' must list dense or sparse for each of the "
                         f"{layers} layers, got {given!r}")
    return tuple(i for i, kind in enumerate(given) if kind == "sparse")


def _experts(read: Reader, layers: int) -> ExpertsConfig | None:
    sparse, width = _sparse_layers(read, layers), _int(read, "moe_intermediate_size")
    values = dict(num_experts=_int(read, "num_experts"), num_experts_per_tok=_int(read, "num_experts_per_token"),
                  n_group=_int(read, "num_expert_group"), topk_group=_int(read, "topk_group"),
                  norm_topk_prob=read.bool(_key(read, "moe_renormalize"), True),
                  routed_scaling_factor=read.factor("routed_scaling_factor", DEFAULTS["routed_scaling_factor"]),
                  shared_expert_intermediate_size=read.count(_key(read, "num_shared_experts"),
                                                             DEFAULTS["num_shared_experts"]) * width)
    if not sparse:
        return None
    try:
        return ExpertsConfig(moe_intermediate_size=width, layers=sparse, router="sigmoid_group_topk", **values)
    except ValueError as error:
        raise ValueError(f"{read.family} config: {error}") from None


def _read_config(read: Reader) -> DecoderConfig:
    read = _linear_read(read)
    family = read.family
    hidden, heads, layers = read.int("hidden_size"), read.int("num_attention_heads"), read.layers()
    kv_heads = read.int("num_key_value_heads", heads, optional=True) or heads
    if kv_heads != heads:
        raise ValueError(f"{family} config: 'num_key_value_heads' ({kv_heads}) must equal num_attention_heads "
                         f"({heads}): every latent attention head has its own keys and values")
    nope, rope = _int(read, "qk_nope_head_dim"), _int(read, "qk_rope_head_dim")
    for key, value in (("head_dim", rope), ("qk_head_dim", nope + rope)):  # derived keys transformers writes
        if read.raw(key, value) != value:
            raise ValueError(f"{family} config: {key!r} ({read.raw(key)!r}) must be {value}, as transformers "
                             f"derives it from the qk_*_head_dim keys")
    latent = LatentAttentionConfig(
        hidden_size=hidden, num_heads=heads, kv_lora_rank=_int(read, "kv_lora_rank"), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=_int(read, "v_head_dim"),
        q_lora_rank=_int(read, "q_lora_rank", optional=True), attention_bias=read.bool("attention_bias", False),
        rope_interleaved=False)
    kda = KimiDeltaAttentionConfig(num_heads=_int(read, "linear_num_heads"), head_dim=_int(read, "linear_head_dim"),
                                   conv_kernel_size=_int(read, "linear_conv_kernel_dim"))
    return DecoderConfig(
        family=family, vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, head_dim=rope,
        mlp=MLPConfig(read.int("intermediate_size"), activation=read.activation("hidden_act", "silu")),
        max_position_embeddings=_int(read, "max_position_embeddings"),
        norm=NormConfig(eps=read.eps("rms_norm_eps", DEFAULTS["rms_norm_eps"])),
        # no layer turns its rotary features (NoPE); the part only says so, and that there is no position table
        rotary=RotaryConfig(interleaved=False, skip_layers=tuple(range(layers))),
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        tokens=SpecialTokens(bos=read.token_ids("bos_token_id", DEFAULTS["bos_token_id"], many=False),
                             eos=read.token_ids("eos_token_id", DEFAULTS["eos_token_id"], many=True),
                             pad=read.token_ids("pad_token_id", DEFAULTS["pad_token_id"], many=False)),
        layer_types=_layer_types(read, layers), mixer_parts=(kda, latent), experts=_experts(read, layers))


def _kda_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """A Kimi Delta Attention layer's ``self_attn.`` (the table of :mod:`attnkit.layers.kimi_delta_attention`)."""
    shape, d = cfg.mixer_part(KimiDeltaAttentionConfig), cfg.hidden_size
    h, dh, taps = shape.num_heads, shape.head_dim, shape.conv_kernel_size
    e = h * dh
    hf, ak = hf + "self_attn.", ak + "attention."
    maps = [TensorMap(f"{hf}{name}.weight", (width, d), (ak + ours,), "transpose")
            for name, width, ours in (("q_proj", e, "W_q"), ("k_proj", e, "W_k"), ("v_proj", e, "W_v"),
                                      ("f_a_proj", dh, "W_fa"), ("b_proj", h, "W_b"), ("g_a_proj", dh, "W_ga"))]
    maps += [TensorMap(f"{hf}{part}_conv1d.weight", (e, 1, taps), (ak + "conv_weight",), "reshape", sizes=(e, taps),
                       stack_index=j, stack_size=3) for j, part in enumerate("qkv")]
    return maps + [TensorMap(hf + "f_b_proj.weight", (e, dh), (ak + "W_fb",), "transpose"),
                   TensorMap(hf + "dt_bias", (e,), (ak + "dt_bias",), "copy"),
                   TensorMap(hf + "A_log", (1, 1, h, 1), (ak + "A_log",), "reshape", sizes=(h,)),
                   TensorMap(hf + "g_b_proj.weight", (e, dh), (ak + "W_gb",), "transpose"),
                   TensorMap(hf + "o_norm.weight", (dh,), (ak + "norm_gamma",), "copy"),
                   TensorMap(hf + "o_proj.weight", (d, e), (ak + "W_out",), "transpose")]


def _mlp_tensors(cfg: DecoderConfig, hf: str, ak: str) -> list[TensorMap]:
    """Every MLP under ``block_sparse_moe.``: the experts as Mixtral names them, a dense layer's as Llama's."""
    if cfg.experts is not None and int(hf.split(".")[1]) in cfg.experts.layers:
        return mlp_tensors(cfg, hf, ak, moe="block_sparse_moe.", projections=("w1", "w3", "w2"),
                           shared="shared_experts")
    d, f = cfg.hidden_size, cfg.mlp.intermediate_size
    return [TensorMap(f"{hf}block_sparse_moe.{proj}.weight", shape, (f"{ak}mlp.W_{name}",), "transpose")
            for proj, shape, name in (("gate_proj", (f, d), "gate"), ("up_proj", (f, d), "up"),
                                      ("down_proj", (d, f), "down"))]


def _tensors(cfg: DecoderConfig, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    return pre_norm_tensors(cfg, latent_attention_tensors, _mlp_tensors, {"kimi_delta_attention": _kda_tensors})


def _keys() -> frozenset[str]:
    own = ("attention_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "moe_intermediate_size", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "layer_types",
           "mlp_layer_types", "linear_attn_config", *_LINEAR_KEYS.values())
    aliases = tuple(name for names in _NAMES.values() for name in names)
    return frozenset(COMMON_KEYS + own + aliases + _INERT)


FAMILY = Family(
    model_type="kimi_linear", keys=_keys(), read_config=_read_config, tensors=_tensors,
    architecture="KimiLinearForCausalLM", hf_config_class="KimiLinearConfig",
    # the shared shape's width and depth, 9 heads of latent attention every fourth layer, 9 Kimi Delta Attention
    # heads of 64 in the others, and after one dense layer eight experts of width 512, two per token plus one shared
    benchmark=dict(BENCHMARK_SHAPE, num_key_value_heads=9, kv_lora_rank=128, qk_nope_head_dim=48,
                   qk_rope_head_dim=16, v_head_dim=64, moe_intermediate_size=512, num_experts=8,
                   num_experts_per_token=2, num_expert_group=2, topk_group=1, num_shared_experts=1,
                   linear_num_heads=9, linear_head_dim=64))

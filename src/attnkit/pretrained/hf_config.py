"""A Hugging Face ``config.json`` (as a dict) read into a :class:`~attnkit.models.DecoderConfig`.

The families of :data:`SUPPORTED_MODEL_TYPES` are understood, keyed by ``model_type``. Their
keys differ (GPT-2 says ``n_embd``, the others ``hidden_size``), their defaults differ (Mistral has 8 key/value
heads and a 4096-token window unless told otherwise, GPT-2 ties its head) and rotary settings come in two
styles: the older ``rope_theta`` + ``rope_scaling`` (with ``"type"`` or ``"rope_type"``) and the newer
``rope_parameters`` dict that holds the theta too. Everything lands in one normalised form: ``rope_theta`` a
float and ``rope_scaling`` either None or a dict with ``"rope_type"`` and that type's numbers.

The dimensions that size a checkpoint's tensors (vocabulary, width, layers, heads, MLP width) are required;
a key Hugging Face gives a default is read with the same default, so a folder written by
``save_pretrained`` and a hand-trimmed ``config.json`` load alike. Anything missing, of the wrong type, or
an architecture switch attnkit does not implement is a ``ValueError`` that names the key.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..kernels import rotary as _rotary
from ..models.config import DecoderConfig

__all__ = ["decoder_config_from_hf", "supported_model_types", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "smollm3", "gpt_neox", "gemma2",
                         "gemma3_text", "phi3", "gpt_oss")

_MISSING = object()
_MAX_SIZE = 2**31 - 1

# Hugging Face activation names -> DecoderConfig.activation. gelu_new, gelu_fast and gelu_pytorch_tanh are
# the same tanh approximation written three ways.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}

# The numbers each scaling needs (beyond rope_type), and the optional ones attnkit's rotary understands.
_ROPE_REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
                  "yarn": ("factor", "original_max_position_embeddings"),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
_ROPE_OPTIONAL = {"default": (), "linear": (), "dynamic": (),
                  "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
                  "llama3": (), "longrope": ("factor", "attention_factor")}

# Per-family defaults where Hugging Face's config classes differ.
_FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2, "num_key_value_heads": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
              "eos_token_id": None, "num_key_value_heads": 32, "sliding_window": 4096,
              "use_sliding_window": False, "max_window_layers": 28},
    "qwen3": {"max_position_embeddings": 32768, "tie_word_embeddings": False, "bos_token_id": None,
              "eos_token_id": None, "num_key_value_heads": 32, "sliding_window": 4096,
              "use_sliding_window": False, "max_window_layers": 28, "head_dim": 128},
    "olmo2": {"max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": None,
              "eos_token_id": 50279, "num_key_value_heads": None, "rms_norm_eps": 1e-5},
    "phi3": {"max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 1,
             "eos_token_id": 32000, "num_key_value_heads": None, "rms_norm_eps": 1e-5},
    "gpt_oss": {"max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": None,
                "eos_token_id": None, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                "rms_norm_eps": 1e-5},
    "smollm3": {"max_position_embeddings": 32768, "tie_word_embeddings": True, "bos_token_id": 128000,
                "eos_token_id": 128001, "num_key_value_heads": 4, "sliding_window": None},
}

# The key policy, one for every family: a key that can change the computation must be one the family's reader
# understands, or the folder is refused naming it; metadata is accepted. Metadata is a key starting with "_"
# (transformers' private bookkeeping, e.g. _name_or_path), any "*_token_id" (special ids; the ones that matter
# are read and checked), and the generic keys of transformers' PretrainedConfig and of the 4.x releases that
# wrote generation defaults into config.json: saving, labels, training-only settings (dropout, initialisation)
# and generate's defaults, none of which changes a forward pass.
_GENERIC_KEYS = frozenset((
    # saving and identity
    "model_type", "transformers_version", "architectures", "dtype", "torch_dtype", "use_bfloat16", "torchscript",
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder", "pruned_heads",
    "chunk_size_feed_forward", "tf_legacy_loss", "quantization_config",
    # outputs and labels
    "output_hidden_states", "output_attentions", "output_scores", "return_dict", "use_return_dict",
    "return_dict_in_generate", "problem_type", "id2label", "label2id", "num_labels",
    # training only
    "use_cache", "initializer_range", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
    "attn_pdrop", "classifier_dropout", "pretraining_tp", "gradient_checkpointing",
    # generate's defaults as 4.x wrote them into config.json (attnkit reads generation_config.json)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # the tensors decide: a tied head is a checkpoint without lm_head.weight
    "tie_word_embeddings"))


def _is_metadata_key(key: str) -> bool:
    """Whether a ``config.json`` key is metadata, accepted by every family whether read or not (see above)."""
    return key.startswith("_") or key.endswith("_token_id") or key in _GENERIC_KEYS


# The keys each family's reader understands beyond metadata (the rope keys are read by _rope).
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
              "original_max_position_embeddings")
_COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps") + _ROPE_KEYS
_QWEN_WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
_FAMILY_KEYS = {
    # summary_* size the sequence-summary head of GPT2DoubleHeadsModel, which a causal LM does not have;
    # reorder_and_upcast_attn computes the same scores in float32, which attnkit's float32 does anyway
    "gpt2": ("vocab_size", "n_embd", "n_head", "n_layer", "n_positions", "n_ctx", "n_inner", "activation_function",
             "layer_norm_epsilon", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
             "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
             "summary_first_dropout"),
    "llama": _COMMON_KEYS + ("attention_bias", "mlp_bias"),
    "mistral": _COMMON_KEYS + ("sliding_window",),
    "qwen2": _COMMON_KEYS + _QWEN_WINDOW_KEYS,
    "qwen3": _COMMON_KEYS + _QWEN_WINDOW_KEYS + ("attention_bias",),
    "olmo2": _COMMON_KEYS + ("attention_bias",),
    "smollm3": _COMMON_KEYS + ("attention_bias", "mlp_bias", "use_sliding_window", "sliding_window",
                               "layer_types", "no_rope_layers", "no_rope_layer_interval"),
    "phi3": _COMMON_KEYS + ("sliding_window",),
    # experts_per_token and initial_context_length are the names of OpenAI's own format, kept in its folders
    "gpt_oss": _COMMON_KEYS + ("attention_bias", "sliding_window", "layer_types", "num_local_experts",
                               "num_experts_per_tok", "experts_per_token", "swiglu_alpha", "swiglu_limit",
                               "router_aux_loss_coef", "output_router_logits", "initial_context_length"),
    "gemma2": _COMMON_KEYS + ("attention_bias", "hidden_activation", "query_pre_attn_scalar", "sliding_window",
                              "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                              "use_bidirectional_attention"),
    "gemma3_text": _COMMON_KEYS + ("attention_bias", "hidden_activation", "query_pre_attn_scalar", "sliding_window",
                                   "layer_types", "attn_logit_softcapping", "final_logit_softcapping",
                                   "use_bidirectional_attention", "sliding_window_pattern", "rope_local_base_freq"),
    "gpt_neox": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "hidden_act", "max_position_embeddings", "layer_norm_eps", "use_parallel_residual",
                 "attention_bias", "rotary_pct", "rotary_emb_base") + _ROPE_KEYS,
}


def _refuse_unknown_keys(config: dict, family: str) -> None:
    """A key that is neither metadata nor read by this family's reader is refused by name rather than ignored."""
    understood = _FAMILY_KEYS[family]
    unknown = sorted(k for k in config if not (_is_metadata_key(k) or k in understood))
    if unknown:
        raise ValueError(f"{family} config: key {unknown[0]!r} is not understood by attnkit"
                         + (f" (nor {unknown[1:]})" if len(unknown) > 1 else "")
                         + "; refusing to load rather than ignore it (metadata keys are accepted: see "
                         "docs/reliability.md)")


class _Reader:
    """Typed access to one config dict; every error names the key and what it held."""

    def __init__(self, config: dict, family: str) -> None:
        self.config = config
        self.family = family

    def _fail(self, key: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"{self.family} config: {key!r} must be {expected}, got {value!r}")

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.config:
            if default is _MISSING:
                raise ValueError(f"{self.family} config: required key {key!r} is missing")
            return default
        return self.config[key]

    def int(self, key: str, default: Any = _MISSING, *, optional: bool = False) -> int | None:
        value = self.raw(key, default)
        if value is None and optional:
            return None
        # No size of a real model comes near 2**31; a larger one could only allocate without end.
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= _MAX_SIZE:
            raise self._fail(key, f"a positive integer up to {_MAX_SIZE}" + (" or null" if optional else ""), value)
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self._fail(key, "a finite positive number", value)
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false", value)
        return value

    def token_ids(self, key: str, default: Any, *, many: bool) -> int | tuple[int, ...] | None:
        value = self.raw(key, default)
        if value is None:
            return None
        if many and isinstance(value, list):
            if not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
                raise self._fail(key, "a non-negative integer, a non-empty list of them, or null", value)
            return tuple(value) if len(value) > 1 else value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._fail(key, "a non-negative integer" + (", a list of them" if many else "") + " or null",
                             value)
        return value

    def activation(self, key: str, default: Any = _MISSING) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or value not in _ACTIVATIONS:
            raise self._fail(key, f"one of {', '.join(sorted(_ACTIVATIONS))}", value)
        return _ACTIVATIONS[value]


def supported_model_types() -> list[str]:
    """The ``model_type`` values of ``config.json`` that :func:`~attnkit.pretrained.load_causal_lm` loads.

    Examples
    --------
    >>> supported_model_types()  # doctest: +NORMALIZE_WHITESPACE
    ['gpt2', 'llama', 'mistral', 'qwen2', 'qwen3', 'olmo2', 'smollm3', 'gpt_neox', 'gemma2', 'gemma3_text', 'phi3',
     'gpt_oss']
    """
    return list(SUPPORTED_MODEL_TYPES)


def decoder_config_from_hf(config: dict) -> DecoderConfig:
    """Read a Hugging Face decoder ``config.json`` (already parsed) into a :class:`DecoderConfig`.

    Parameters
    ----------
    config : dict
        The parsed ``config.json``; ``model_type`` must be one of :data:`SUPPORTED_MODEL_TYPES`. A key that is
        neither metadata (``_``-prefixed, ``*_token_id``, transformers' generic ``PretrainedConfig`` keys) nor
        read by the family's reader is refused by name.

    Returns
    -------
    DecoderConfig
        GPT-2: LayerNorm, learned positions, plain MLP, biases everywhere, tied head by default.
        Llama / Mistral / Qwen2: RMSNorm, rotary (half-split), gated MLP; Qwen2 has query/key/value biases,
        Llama has them (and the output bias) when ``attention_bias`` is true.

    Raises
    ------
    ValueError
        An unknown ``model_type``, a missing or wrongly typed key (named in the message), a rotary scaling
        or architecture switch attnkit does not implement.
    TypeError
        If ``config`` is not a dict.

    Notes
    -----
    Sliding windows follow Hugging Face's classes: Mistral slides every layer when ``sliding_window`` is set
    (its default is 4096); Qwen2 slides only when ``use_sliding_window`` is true, and then either the layers
    ``layer_types`` marks ``"sliding_attention"`` or, without ``layer_types``, layers ``i >= max_window_layers``.

    Examples
    --------
    >>> cfg = decoder_config_from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
    ...     "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    ...     "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    >>> cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta, cfg.rope_scaling
    (8, 2, 500000.0, {'rope_type': 'linear', 'factor': 2.0})
    >>> decoder_config_from_hf({"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2,
    ...     "n_head": 4}).activation
    'gelu_tanh'
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    family = config.get("model_type", _MISSING)
    if family is _MISSING:
        raise ValueError("config has no 'model_type'; expected one of " + ", ".join(SUPPORTED_MODEL_TYPES))
    if family not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {family!r} is not supported; attnkit loads "
                         + ", ".join(SUPPORTED_MODEL_TYPES))
    _refuse_unknown_keys(config, family)
    quantization = config.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if not (family == "gpt_oss" and method == "mxfp4"):
            raise ValueError(f"{family} config: 'quantization_config' with quant_method {method!r} is not supported; "
                             "attnkit reads float checkpoints and gpt-oss's MXFP4 experts")
    read = _Reader(config, family)
    if family == "gpt2":
        return _gpt2(read)
    if family == "gpt_neox":
        return _gpt_neox(read)
    if family in ("gemma2", "gemma3_text"):
        return _gemma(read)
    return _rotary_family(read)


def _gpt2(read: _Reader) -> DecoderConfig:
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
        family="gpt2", vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=read.int("n_layer"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=read.int("n_inner", None, optional=True) or 4 * hidden,
        max_position_embeddings=read.int("n_positions", 1024),
        norm="layernorm", norm_eps=read.float("layer_norm_epsilon", 1e-5),
        activation=read.activation("activation_function", "gelu_new"), mlp="plain", position="learned",
        attention_bias=True, output_bias=True, mlp_bias=True,
        tie_word_embeddings=read.bool("tie_word_embeddings", True),
        bos_token_id=read.token_ids("bos_token_id", 50256, many=False),
        eos_token_id=read.token_ids("eos_token_id", 50256, many=True),
        pad_token_id=read.token_ids("pad_token_id", None, many=False),
    )


def _rotary_family(read: _Reader) -> DecoderConfig:
    family = read.family
    if family == "gpt_oss":  # GptOssConfig's rotary defaults: base 150000, YaRN x32 from 4096 positions
        config = {"rope_theta": 150000.0, **read.config}
        if not config.get("rope_scaling") and config.get("rope_parameters") is None:
            config["rope_parameters"] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096}
        read = _Reader(config, family)
    defaults = _FAMILY_DEFAULTS[family]
    hidden = read.int("hidden_size")
    heads = read.int("num_attention_heads")
    layers = read.int("num_hidden_layers")
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
    theta, scaling, partial = _rope(read, max_positions, head_dim)
    extra: dict[str, Any] = {}
    if family == "olmo2":  # RMSNorm of the whole q and k projections; norms after each branch, none before
        extra.update(qk_norm=True, qk_norm_scope="projection", pre_norm=False, post_norm=True)
    if family == "llama":
        qkv_bias = output_bias = read.bool("attention_bias", False)
        mlp_bias = read.bool("mlp_bias", False)
        window, layer_types = None, ()
    elif family == "mistral":
        qkv_bias = output_bias = mlp_bias = False
        window = read.int("sliding_window", defaults["sliding_window"], optional=True)
        layer_types = ("sliding_attention",) * layers if window is not None else ()
    elif family == "qwen2":
        qkv_bias, output_bias, mlp_bias = True, False, False
        window, layer_types = _qwen2_windows(read, layers)
    elif family == "qwen3":  # the bias switch covers the output projection too
        qkv_bias = output_bias = read.bool("attention_bias", False)
        mlp_bias = False
        window, layer_types = _qwen2_windows(read, layers)
    elif family == "olmo2":
        qkv_bias = output_bias = read.bool("attention_bias", False)
        mlp_bias = False
        window, layer_types = None, ()
    elif family == "gpt_oss":  # sinks, biases on every projection, a routed mixture of experts
        qkv_bias = output_bias = read.bool("attention_bias", True)
        mlp_bias = False
        window = read.int("sliding_window", defaults["sliding_window"], optional=True)
        types = _layer_types(read, layers, window)
        if types is None:  # gpt-oss alternates sliding and full layers, sliding first
            types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
        window, layer_types = (window if "sliding_attention" in types else None), types
        extra.update(_gpt_oss_experts(read))
    elif family == "phi3":  # fused qkv_proj and gate_up_proj (the loader splits them), a window on every layer
        qkv_bias = output_bias = mlp_bias = False
        window = read.int("sliding_window", None, optional=True)
        layer_types = ("sliding_attention",) * layers if window is not None else ()
    else:  # smollm3
        qkv_bias = output_bias = read.bool("attention_bias", False)
        mlp_bias = read.bool("mlp_bias", False)
        nope = _smollm3_nope_layers(read, layers)
        window, layer_types = _smollm3_windows(read, layers, nope)
        extra["no_rope_layers"] = nope
    return DecoderConfig(
        family=family, vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=read.int("intermediate_size"), max_position_embeddings=max_positions,
        norm="rmsnorm", norm_eps=read.float("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)),
        activation=read.activation("hidden_act", "silu"), mlp=extra.pop("mlp", "gated"), position="rotary",
        rope_theta=theta, rope_scaling=scaling, rope_interleaved=False, partial_rotary_factor=partial,
        attention_bias=qkv_bias, output_bias=output_bias, mlp_bias=mlp_bias,
        qk_norm=extra.pop("qk_norm", family == "qwen3"),
        tie_word_embeddings=read.bool("tie_word_embeddings", defaults["tie_word_embeddings"]),
        sliding_window=window, layer_types=layer_types,
        bos_token_id=read.token_ids("bos_token_id", defaults["bos_token_id"], many=False),
        eos_token_id=read.token_ids("eos_token_id", defaults["eos_token_id"], many=True),
        pad_token_id=read.token_ids("pad_token_id", None, many=False),
        **extra,
    )


def _layer_types(read: _Reader, layers: int, window: int | None) -> tuple[str, ...] | None:
    """The checked ``layer_types`` list as a tuple, or None when the config has none."""
    given = read.raw("layer_types", None)
    if given is None:
        return None
    if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
        raise ValueError(f"{read.family} config: 'layer_types' must be a list of strings, got {given!r}")
    if len(given) != layers:
        raise ValueError(f"{read.family} config: 'layer_types' has {len(given)} entries but num_hidden_layers is "
                         f"{layers}")
    bad = sorted(set(given) - {"full_attention", "sliding_attention"})
    if bad:
        raise ValueError(f"{read.family} config: 'layer_types' may hold only full_attention and sliding_attention, "
                         f"got {bad}")
    if "sliding_attention" in given and window is None:
        raise ValueError(f"{read.family} config: 'layer_types' has sliding_attention layers but there is no window "
                         "(use_sliding_window is false or sliding_window is null)")
    return tuple(given)


def _smollm3_nope_layers(read: _Reader, layers: int) -> tuple[int, ...]:
    """The layers without rotary: ``no_rope_layers[i] == 0`` (1 = rotary), or by default every
    ``no_rope_layer_interval``-th layer (the 4th, 8th, ...), as in Hugging Face's ``SmolLM3Config``."""
    flags = read.raw("no_rope_layers", None)
    if flags is None:
        interval = read.int("no_rope_layer_interval", 4)
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) != layers or not all(f in (0, 1) and not isinstance(f, float)
                                                                      for f in flags):
        raise ValueError(f"smollm3 config: 'no_rope_layers' must be a list of {layers} entries 0 or 1 (1 = the "
                         f"layer uses rotary), got {flags!r}")
    return tuple(i for i, f in enumerate(flags) if not f)


def _smollm3_windows(read: _Reader, layers: int, nope: tuple[int, ...]) -> tuple[int | None, tuple[str, ...]]:
    """SmolLM3's window: only with ``use_sliding_window``; ``layer_types`` says where, else the NoPE layers."""
    use = read.bool("use_sliding_window", False)
    window = read.int("sliding_window", None, optional=True) if use else None
    types = _layer_types(read, layers, window if use else 0)
    if types is None:
        types = tuple("sliding_attention" if window is not None and i in nope else "full_attention"
                      for i in range(layers))
    if window is None:  # Hugging Face slides no layer without the switch, whatever layer_types says
        types = ("full_attention",) * layers
    return (window if "sliding_attention" in types else None), types


def _gemma(read: _Reader) -> DecoderConfig:
    """Gemma 2 and Gemma 3 (text): RMSNorm with ``1 + weight``, norms before and after each branch, embeddings
    scaled by ``sqrt(hidden_size)``, scores scaled by ``query_pre_attn_scalar ** -0.5``, optional soft-caps,
    sliding and full layers; Gemma 3 adds per-head q/k norms and a rotary base per layer type."""
    family = read.family
    three = family == "gemma3_text"
    hidden = read.int("hidden_size")
    heads = read.int("num_attention_heads")
    layers = read.int("num_hidden_layers")
    kv_heads = read.int("num_key_value_heads", None, optional=True) or heads
    if heads % kv_heads:
        raise ValueError(f"{family} config: num_key_value_heads ({kv_heads}) must divide num_attention_heads "
                         f"({heads})")
    if read.raw("use_bidirectional_attention", None):
        raise ValueError(f"{family} config: use_bidirectional_attention=true (an encoder) is not supported")
    max_positions = read.int("max_position_embeddings", 131072 if three else 8192)
    window = read.int("sliding_window", 4096, optional=True)
    types = _layer_types(read, layers, window)
    if types is None:
        every = read.int("sliding_window_pattern", read.raw("_sliding_window_pattern", 6)) if three else 2
        types = tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers))
    if "sliding_attention" not in types:
        window = None
    elif window is None:
        raise ValueError(f"{family} config: layer_types has sliding_attention layers but sliding_window is null")
    sliding_theta, sliding_scaling = None, None
    head_dim = read.int("head_dim", 256)
    params = read.raw("rope_parameters", None)
    if three and isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"gemma3_text config: 'rope_parameters' has layer types attnkit does not know: {unknown}")
        per_type = {}
        for kind, default_theta in (("full_attention", 1000000.0), ("sliding_attention", 10000.0)):
            sub = dict(params.get(kind) or {})
            sub.setdefault("rope_theta", default_theta)
            per_type[kind] = _rope(_Reader({"rope_parameters": sub,
                                            "max_position_embeddings": max_positions}, f"{family} {kind}"),
                                   max_positions, head_dim)
        (theta, scaling, partial), (sliding_theta, sliding_scaling, _) = (per_type["full_attention"],
                                                                         per_type["sliding_attention"])
    else:
        theta, scaling, partial = _rope(_Reader({**read.config, "rope_theta": read.raw(
            "rope_theta", 1000000.0 if three else 10000.0)}, family), max_positions, head_dim)
        if three:
            sliding_theta = read.float("rope_local_base_freq", 10000.0)
    bias = read.bool("attention_bias", False)
    act = read.raw("hidden_activation", None)
    activation = read.activation("hidden_activation") if act is not None else read.activation("hidden_act",
                                                                                              "gelu_pytorch_tanh")
    softcaps = {}
    for key, name in (("attn_logit_softcapping", "attn_logit_softcap"),
                      ("final_logit_softcapping", "final_logit_softcap")):
        default = None if three else (50.0 if key.startswith("attn") else 30.0)
        value = read.raw(key, default)
        softcaps[name] = None if value is None else read.float(key, default)
    return DecoderConfig(
        family=family, vocab_size=read.int("vocab_size"), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=read.int("intermediate_size"), max_position_embeddings=max_positions,
        norm="rmsnorm", norm_eps=read.float("rms_norm_eps", 1e-6), norm_offset=1.0,
        activation=activation, mlp="gated", position="rotary",
        rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
        sliding_rope_theta=sliding_theta, sliding_rope_scaling=sliding_scaling,
        attention_bias=bias, output_bias=bias, qk_norm=three, pre_norm=True, post_norm=True,
        # Hugging Face multiplies by a float32 tensor of sqrt(hidden_size), in every dtype
        embedding_scale=float(np.float32(math.sqrt(hidden))),
        attention_scale=read.float("query_pre_attn_scalar", 256) ** -0.5, **softcaps,
        tie_word_embeddings=read.bool("tie_word_embeddings", True),
        sliding_window=window, layer_types=types,
        bos_token_id=read.token_ids("bos_token_id", 2, many=False),
        eos_token_id=read.token_ids("eos_token_id", 1, many=True),
        pad_token_id=read.token_ids("pad_token_id", 0, many=False),
    )


def _gpt_neox(read: _Reader) -> DecoderConfig:
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
    theta, scaling, partial = _rope(_Reader(legacy, "gpt_neox"), max_positions, hidden // heads)
    bias = read.bool("attention_bias", True)
    return DecoderConfig(
        family="gpt_neox", vocab_size=read.int("vocab_size"), hidden_size=hidden,
        num_layers=read.int("num_hidden_layers"), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=read.int("intermediate_size"), max_position_embeddings=max_positions,
        norm="layernorm", norm_eps=read.float("layer_norm_eps", 1e-5),
        activation=read.activation("hidden_act", "gelu"), mlp="plain", position="rotary",
        rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
        attention_bias=bias, output_bias=bias, mlp_bias=True,
        parallel_residual=read.bool("use_parallel_residual", True),
        tie_word_embeddings=read.bool("tie_word_embeddings", False),
        bos_token_id=read.token_ids("bos_token_id", 0, many=False),
        eos_token_id=read.token_ids("eos_token_id", 2, many=True),
        pad_token_id=read.token_ids("pad_token_id", None, many=False),
    )


def _qwen2_windows(read: _Reader, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """Qwen2's window and per-layer types, by the rule of Hugging Face's ``Qwen2Config``.

    The window exists only when ``use_sliding_window`` is true; ``layer_types`` (if given) says which layers
    use it, else layers from ``max_window_layers`` on do.
    """
    use = read.bool("use_sliding_window", False)
    window = read.int("sliding_window", 4096, optional=True) if use else None
    given = _layer_types(read, layers, window)
    if given is not None:
        return (window if "sliding_attention" in given else None), given
    if window is None:
        return None, ()
    first = read.raw("max_window_layers", 28)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{read.family} config: 'max_window_layers' must be a non-negative integer, got {first!r}")
    types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
    return (window if "sliding_attention" in types else None), types


def _gpt_oss_experts(read: _Reader) -> dict[str, Any]:
    """gpt-oss's sinks and mixture-of-experts settings as DecoderConfig arguments."""
    experts = read.int("num_local_experts", 128)
    top_k = read.int("num_experts_per_tok", 4)
    legacy = read.raw("experts_per_token", None)
    if legacy is not None and legacy != top_k:
        raise ValueError(f"gpt_oss config: 'experts_per_token' ({legacy!r}) disagrees with 'num_experts_per_tok' "
                         f"({top_k})")
    if top_k > experts:
        raise ValueError(f"gpt_oss config: 'num_experts_per_tok' ({top_k}) exceeds 'num_local_experts' ({experts})")
    return dict(attention_sinks=True, mlp="experts", num_experts=experts, num_experts_per_tok=top_k,
                swiglu_alpha=read.float("swiglu_alpha", 1.702), swiglu_limit=read.float("swiglu_limit", 7.0))


def _divisors(read: _Reader, key: str) -> tuple[float, ...]:
    """longrope's per-frequency divisors: a non-empty list of finite positive numbers."""
    value = read.raw(key)
    if not isinstance(value, list) or not value or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value):
        raise read._fail(key, "a non-empty list of finite positive numbers", value)
    return tuple(float(v) for v in value)


def _rope(read: _Reader, max_positions: int, head_dim: int) -> tuple[float, dict | None, float]:
    """(theta, normalised scaling or None, partial rotary factor) from either config style.

    As in Hugging Face, a non-empty ``rope_scaling`` takes the place of ``rope_parameters``; the theta comes
    from that dict, else the top-level ``rope_theta``, else 10000. A scaling whose cos/sin tables would not be
    finite is refused naming its key (:func:`_refuse_overflowing_tables`).
    """
    family = read.family
    scaling = read.raw("rope_scaling", None)
    params = scaling or read.raw("rope_parameters", None)
    key = "rope_scaling" if scaling else "rope_parameters"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"{family} config: {key!r} must be a dict or null, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{family} config: {key!r} holds per-layer-type rotary settings "
                         f"({', '.join(k for k, v in params.items() if isinstance(v, dict))}), which attnkit "
                         f"does not support")
    params = dict(params)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if family == "phi3" and kind in ("su", "yarn"):  # Phi-3's older names of longrope, as Phi3Config reads them
        kind = "longrope"
    if not isinstance(kind, str) or kind not in _ROPE_REQUIRED:
        raise ValueError(f"{family} config: {key}['rope_type'] {kind!r} is not supported; expected one of "
                         f"{', '.join(_ROPE_REQUIRED)}")
    theta_value = params.pop("rope_theta", _MISSING)
    if theta_value is _MISSING:
        theta = read.float("rope_theta", 10000.0)
    else:
        theta = _Reader({"rope_theta": theta_value}, f"{family} config: {key}").float("rope_theta")
    partial_value = params.pop("partial_rotary_factor", read.raw("partial_rotary_factor", 1.0))
    partial = _Reader({"partial_rotary_factor": partial_value}, family).float("partial_rotary_factor")
    if kind == "default":
        return theta, None, partial
    if kind in ("yarn", "llama3", "longrope"):
        # Hugging Face fills the pre-scaling length in from the top level (or the context length itself).
        params.setdefault("original_max_position_embeddings",
                          read.raw("original_max_position_embeddings", max_positions))
    where = _Reader(params, f"{family} config: {key}")
    normalised: dict[str, Any] = {"rope_type": kind}
    for name in _ROPE_REQUIRED[kind]:
        if name in ("short_factor", "long_factor"):
            normalised[name] = _divisors(where, name)
        else:
            normalised[name] = where.int(name) if name == "original_max_position_embeddings" else where.float(name)
    for name in _ROPE_OPTIONAL[kind]:
        if params.get(name) is not None:
            normalised[name] = where.bool(name) if name == "truncate" else where.float(name)
    if kind == "yarn" and theta <= 1.0:
        # YaRN places its correction range by log(theta): a base of 1 or less has no such range.
        raise ValueError(f"{family} config: rope_theta must be greater than 1 for rope_type 'yarn', got {theta!r}")
    if kind == "llama3" and not normalised["low_freq_factor"] < normalised["high_freq_factor"]:
        raise ValueError(f"{family} config: {key}['low_freq_factor'] ({normalised['low_freq_factor']}) must be "
                         f"smaller than ['high_freq_factor'] ({normalised['high_freq_factor']}): llama3 scaling "
                         f"blends between them")
    if kind == "yarn":
        original = normalised["original_max_position_embeddings"]
        for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            # YaRN's ramp runs between the features whose wavelengths fit beta times into the original context:
            # log(original / (beta * 2 pi)), which a huge or a subnormal beta takes to log(0) or inf.
            beta = normalised.get(name, default)
            if not 0 < original / (beta * 2 * math.pi) < math.inf:
                raise ValueError(f"{family} config: {key}[{name!r}] = {beta!r} puts YaRN's correction range at "
                                 f"log({original} / ({beta!r} * 2 pi)), which is not a finite number")
    if (kind == "longrope" and "attention_factor" not in normalised
            and normalised["original_max_position_embeddings"] == 1 and normalised.get("factor", max_positions) > 1):
        raise ValueError(f"{family} config: {key}['original_max_position_embeddings'] = 1 leaves longrope's attention "
                         f"factor sqrt(1 + ln(factor) / ln(1)) undefined; give ['attention_factor'] or the original "
                         f"context length")
    # Hugging Face ignores the pre-scaling length for linear and dynamic scaling; so does attnkit.
    unknown = sorted(set(params) - set(normalised) - {"original_max_position_embeddings"})
    if unknown:
        raise ValueError(f"{family} config: {key} has keys attnkit does not implement for rope_type {kind!r}: "
                         f"{unknown}")
    _refuse_overflowing_tables(f"{family} config: {key}", theta, normalised, int(head_dim * min(partial, 1.0)),
                               max_positions)
    return theta, normalised, partial


def _refuse_overflowing_tables(where: str, theta: float, scaling: dict, rotary_dim: int, max_positions: int) -> None:
    """Refuse, naming the key, a scaling whose rotary cos/sin tables would hold inf or NaN.

    Every number of a scaling is finite and positive by then, yet the tables ``cos(p * inv_freq) *
    attention_factor`` could still overflow: YaRN's attention factor ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` (with ``mscale(s, m) = 0.1 m ln s + 1``) is 1e307 for ``mscale`` 1e308,
    inf / inf = NaN or 1 / inf = 0 when both overflow, and a divisor of 5e-324 makes inverse frequencies of
    inf. The frequencies are computed as the rotary layer computes them, and the tables' extreme rows checked
    by :func:`attnkit.kernels.rotary.rotary_table_fault`, in float16 (the narrowest dtype a model computes
    them in). ``dynamic`` is left out: its factor only grows the base, which lowers the frequencies.
    """
    kind = scaling["rope_type"]
    if kind == "dynamic":
        return
    sets = [("short_factor" if kind == "longrope" else "factor", None)]
    if kind == "longrope":  # the long factors serve the positions past the original context
        sets.append(("long_factor", scaling["original_max_position_embeddings"] + 1))
    for divisor_key, seq_len in sets:
        with np.errstate(all="ignore"):  # an overflow is refused below, by the tables it makes
            inv_freq, factor = _rotary.rotary_frequencies(rotary_dim, theta, scaling, seq_len=seq_len,
                                                          max_position_embeddings=max_positions)
        fault = _rotary.rotary_table_fault(inv_freq, factor, max_positions)
        if fault is None:
            continue
        if fault == "frequencies":
            largest = float(np.max(inv_freq))
            cause = f"[{divisor_key!r}] = {_plain(scaling[divisor_key])} gives inverse frequencies up to {largest!r}"
        elif "attention_factor" in scaling:
            cause = f"['attention_factor'] = {scaling['attention_factor']!r} gives an attention factor of {factor!r}"
        elif scaling.get("mscale") and scaling.get("mscale_all_dim"):
            cause = (f"['mscale'] = {scaling['mscale']!r} with ['mscale_all_dim'] = {scaling['mscale_all_dim']!r} "
                     f"gives an attention factor of {factor!r}")
        else:
            cause = f"['factor'] = {scaling['factor']!r} gives an attention factor of {factor!r}"
        largest_entry = float(np.finfo(_rotary.TABLE_DTYPE).max)
        raise ValueError(f"{where}{cause}; the rotary cos/sin tables must be finite in {_rotary.TABLE_DTYPE} (at "
                         f"most {largest_entry:g}) at every position below {max_positions}, and their largest entry "
                         f"is the attention factor")


def _plain(value: Any) -> Any:
    """A normalised value as the config wrote it (longrope's divisor tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value

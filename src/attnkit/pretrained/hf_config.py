"""A Hugging Face ``config.json`` (as a dict) read into a :class:`~attnkit.models.DecoderConfig`, by the module
of its ``model_type`` in :mod:`attnkit.pretrained.families` (which holds each family's keys, defaults and rules).

The dimensions that size a checkpoint's tensors (vocabulary, width, layers, heads, MLP width) are required;
a key Hugging Face gives a default is read with the same default, so a folder written by
``save_pretrained`` and a hand-trimmed ``config.json`` load alike. Anything missing, of the wrong type, or
an architecture switch attnkit does not implement is a ``ValueError`` that names the key.
"""
from __future__ import annotations

from ..models.config import DecoderConfig
from .families import REGISTRY, family, model_types
from .families._reader import check_rope_tables

__all__ = ["decoder_config_from_hf", "read_decoder_keys", "check_rope_tables", "supported_model_types",
           "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = tuple(REGISTRY)


def supported_model_types() -> list[str]:
    """The ``model_type`` values of ``config.json`` that :func:`~attnkit.pretrained.load_causal_lm` loads: one per
    module of :mod:`attnkit.pretrained.families`.

    Examples
    --------
    >>> "llama" in supported_model_types(), "gemma3_text" in supported_model_types()
    (True, True)
    """
    return model_types()


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
        An unknown ``model_type``, a missing or wrongly typed key (named in the message), a number out of its
        range (``10**400`` included), a rotary scaling whose cos/sin tables would not be finite, a rotary
        scaling or architecture switch attnkit does not implement.
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
    >>> cfg.head_dim, cfg.num_kv_heads, cfg.rotary.theta, cfg.rotary.scaling
    (8, 2, 500000.0, {'rope_type': 'linear', 'factor': 2.0})
    >>> decoder_config_from_hf({"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2,
    ...     "n_head": 4}).mlp.activation
    'gelu_tanh'
    """
    cfg = read_decoder_keys(config)
    check_rope_tables(cfg, config)
    return cfg


def read_decoder_keys(config: dict) -> DecoderConfig:
    """:func:`decoder_config_from_hf` without its last check, :func:`check_rope_tables`: every key is read and
    checked, in time and memory that do not grow with any size the config claims.

    The loaders read a folder's (or a GGUF file's) config with it, check its sizes against the checkpoint's
    tensor shapes, and only then call :func:`check_rope_tables`, which computes a frequency per rotated
    feature pair: so a claimed ``head_dim`` of 10**9 is refused by the tensor it contradicts, having cost
    nothing.

    Raises
    ------
    ValueError, TypeError
        As :func:`decoder_config_from_hf`, except a rotary scaling whose tables overflow.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    if "model_type" not in config:
        raise ValueError("config has no 'model_type'; expected one of " + ", ".join(SUPPORTED_MODEL_TYPES))
    return family(config["model_type"]).config_from_hf(config)

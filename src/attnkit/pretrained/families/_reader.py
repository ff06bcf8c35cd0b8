"""What every family module shares: typed access to a ``config.json``, the one key policy, the rotary settings.

:class:`Reader` gives typed access to one parsed ``config.json`` whose every error names the family and the key;
:func:`refuse_unknown_keys` applies the key policy (see below and docs/reliability.md); :func:`read_rope`
reads the rotary settings in either of Hugging Face's styles (the older ``rope_theta`` + ``rope_scaling`` with
``"type"`` or ``"rope_type"``, and the newer ``rope_parameters`` that holds the theta too) into one normalised
form: ``rope_theta`` a float and ``rope_scaling`` None or a dict with ``"rope_type"`` and that type's numbers.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..._validation import check_eps, check_factor, check_real, shown
from ...kernels import rotary as _rotary
from ...models.config import MAX_LAYERS, DecoderConfig

__all__ = ["Reader", "MISSING", "ROPE_KEYS", "COMMON_KEYS", "refuse_unknown_keys", "is_metadata_key",
           "read_rope", "read_rope_by_layer_type", "per_layer_type", "check_rope_tables", "read_layer_types"]

MISSING = object()
_MAX_SIZE = 2**31 - 1

# Hugging Face activation names -> DecoderConfig.activation. gelu_new, gelu_fast and gelu_pytorch_tanh are
# the same tanh approximation written three ways.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "relu2": "relu2"}

# The numbers each scaling needs (beyond rope_type), and the optional ones attnkit's rotary understands.
_ROPE_REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
                  "yarn": ("factor", "original_max_position_embeddings"),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                  "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
                  "proportional": ()}
_ROPE_OPTIONAL = {"default": (), "linear": (), "dynamic": (),
                  "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
                  "llama3": (), "longrope": ("factor", "attention_factor"), "proportional": ("factor",)}

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


def is_metadata_key(key: str) -> bool:
    """Whether a ``config.json`` key is metadata, accepted by every family whether read or not (see above)."""
    return key.startswith("_") or key.endswith("_token_id") or key in _GENERIC_KEYS


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
              "original_max_position_embeddings")
COMMON_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps") + ROPE_KEYS


def refuse_unknown_keys(config: Mapping[str, Any], family: str, understood: Iterable[str]) -> None:
    """A key that is neither metadata nor ``understood`` by the family's reader is refused by name rather than
    ignored."""
    understood = frozenset(understood)
    unknown = sorted(k for k in config if not (is_metadata_key(k) or k in understood))
    if unknown:
        raise ValueError(f"{family} config: key {unknown[0]!r} is not understood by attnkit"
                         + (f" (nor {unknown[1:]})" if len(unknown) > 1 else "")
                         + "; refusing to load rather than ignore it (metadata keys are accepted: see "
                         "docs/reliability.md)")


class Reader:
    """Typed access to one config dict; every error names the key and what it held."""

    def __init__(self, config: dict, family: str) -> None:
        self.config = config
        self.family = family

    def _fail(self, key: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"{self.family} config: {key!r} must be {expected}, got {shown(value)}")

    def raw(self, key: str, default: Any = MISSING) -> Any:
        if key not in self.config:
            if default is MISSING:
                raise ValueError(f"{self.family} config: required key {key!r} is missing")
            return default
        return self.config[key]

    def int(self, key: str, default: Any = MISSING, *, optional: bool = False, minimum: int = 1,
            maximum: int = _MAX_SIZE) -> int | None:
        """A size or count in [``minimum``, ``maximum``] (null too when ``optional``). No size of a real model
        comes near 2**31; a larger one could only allocate without end."""
        value = self.raw(key, default)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
            raise self._fail(key, f"{kind} up to {maximum}" + (" or null" if optional else ""), value)
        return value

    def count(self, key: str, default: Any = MISSING) -> int:
        """A count that may be 0: an integer in [0, 2**31 - 1]."""
        return self.int(key, default, minimum=0)

    def layers(self, key: str = "num_hidden_layers") -> int:
        """The depth, at most :data:`~attnkit.models.config.MAX_LAYERS` (2**20): read before anything is built
        per layer, so that a claimed depth costs nothing until the checkpoint confirms it."""
        return self.int(key, maximum=MAX_LAYERS)

    def float(self, key: str, default: Any = MISSING) -> float:
        """A finite positive number, through the one checked conversion (:func:`attnkit._validation.check_real`):
        ``10**400`` or ``1e999`` is refused naming the key, never an ``OverflowError``."""
        value = self.raw(key, default)
        try:
            return check_real(value, repr(key), low=0, low_open=True)
        except (TypeError, ValueError):
            raise self._fail(key, "a finite positive number", value) from None

    def eps(self, key: str, default: Any = MISSING) -> float:
        """A norm's epsilon: a number in (0, 65504] (:func:`attnkit._validation.check_eps`), added to the variance
        in the model's dtype."""
        value = self.raw(key, default)
        try:
            return check_eps(value, repr(key))
        except ValueError as exc:
            raise ValueError(f"{self.family} config: {exc}") from None

    def factor(self, key: str, default: Any = MISSING) -> float:
        """A scale, multiplier or soft-cap: a number in float16's normal range, ``[2**-14, 65504]``
        (:func:`attnkit._validation.check_factor`), whose use in a model can neither overflow nor vanish."""
        value = self.raw(key, default)
        try:
            return check_factor(value, repr(key))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.family} config: {exc}") from None

    def bool(self, key: str, default: Any = MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false", value)
        return value

    def token_ids(self, key: str, default: Any, *, many: bool) -> int | tuple[int, ...] | None:
        """A special id (or, with ``many``, a list of them), each below ``vocab_size``: an id the config gives past
        the vocabulary is refused naming the key; a default past it (transformers' class default, e.g. GPT-2's
        50256, with a smaller vocabulary) is not the folder's statement and reads as None."""
        value = self.raw(key, default)
        if value is None:
            return None
        if many and isinstance(value, list):
            if not value or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
                raise self._fail(key, "a non-negative integer, a non-empty list of them, or null", value)
            ids = tuple(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._fail(key, "a non-negative integer" + (", a list of them" if many else "") + " or null",
                             value)
        else:
            ids = (value,)
        vocab = self.config.get("vocab_size")
        past = [i for i in ids if isinstance(vocab, int) and i >= vocab]
        if past and key in self.config:
            raise ValueError(f"{self.family} config: {key!r} = {past[0]} is past the vocabulary (vocab_size = "
                             f"{vocab}): no embedding row has that id")
        if past:
            return None
        return ids if len(ids) > 1 else ids[0]

    def activation(self, key: str, default: Any = MISSING) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str) or value not in _ACTIVATIONS:
            raise self._fail(key, f"one of {', '.join(sorted(_ACTIVATIONS))}", value)
        return _ACTIVATIONS[value]


def read_layer_types(read: Reader, layers: int, window: int | None) -> tuple[str, ...] | None:
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


def _divisors(read: Reader, key: str) -> tuple[float, ...]:
    """longrope's per-frequency divisors: a non-empty list of finite positive numbers."""
    value = read.raw(key)
    if not isinstance(value, list) or not value:
        raise read._fail(key, "a non-empty list of finite positive numbers", value)
    try:
        return tuple(check_real(v, f"{key!r}[{i}]", low=0, low_open=True) for i, v in enumerate(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{read.family} config: {exc}") from None


def read_rope(read: Reader, max_positions: int, aliases: Mapping[str, str] | None = None
              ) -> tuple[float, dict | None, float]:
    """(theta, normalised scaling or None, partial rotary factor) from either config style (``aliases``: the
    family's older names of rope types).

    As in Hugging Face, a non-empty ``rope_scaling`` takes the place of ``rope_parameters``; the theta comes
    from that dict, else the top-level ``rope_theta``, else 10000. Every number is checked here, in time and
    memory that do not grow with any size; whether the scaling's cos/sin tables are finite is
    :func:`check_rope_tables`'s question, asked once the head widths are known to be real.
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
    if aliases and kind in aliases:  # a family's own older names of a scaling (Phi-3's "su" for longrope)
        kind = aliases[kind]
    if not isinstance(kind, str) or kind not in _ROPE_REQUIRED:
        raise ValueError(f"{family} config: {key}['rope_type'] {kind!r} is not supported; expected one of "
                         f"{', '.join(_ROPE_REQUIRED)}")
    # transformers fills the top-level theta and partial factor into rope_parameters only where it has none
    # (setdefault); a number the file holds is checked either way.
    theta = read.float("rope_theta", 10000.0)
    partial = read.float("partial_rotary_factor", 1.0)
    theta_value = params.pop("rope_theta", MISSING)
    if theta_value is not MISSING:
        theta = Reader({"rope_theta": theta_value}, f"{family} config: {key}").float("rope_theta")
    partial_value = params.pop("partial_rotary_factor", MISSING)
    if partial_value is not MISSING:
        partial = Reader({"partial_rotary_factor": partial_value}, family).float("partial_rotary_factor")
    if kind == "default":
        return theta, None, partial
    if kind in ("yarn", "llama3", "longrope"):
        # Hugging Face fills the pre-scaling length in from the top level (or the context length itself).
        params.setdefault("original_max_position_embeddings",
                          read.raw("original_max_position_embeddings", max_positions))
    where = Reader(params, f"{family} config: {key}")
    normalised: dict[str, Any] = {"rope_type": kind}
    for name in _ROPE_REQUIRED[kind]:
        if name in ("short_factor", "long_factor"):
            normalised[name] = _divisors(where, name)
        else:
            normalised[name] = where.int(name) if name == "original_max_position_embeddings" else where.float(name)
    for name in _ROPE_OPTIONAL[kind]:
        if params.get(name) is not None:
            normalised[name] = where.bool(name) if name == "truncate" else where.float(name)
    if kind == "proportional":
        # The share of the head that turns is part of the frequencies: the table still spans the whole head.
        normalised["partial_rotary_factor"], partial = min(partial, 1.0), 1.0
    _check_scaling(f"{family} config", key, theta, normalised, max_positions)
    # Hugging Face ignores the pre-scaling length for linear and dynamic scaling; so does attnkit.
    unknown = sorted(set(params) - set(normalised) - {"original_max_position_embeddings"})
    if unknown:
        raise ValueError(f"{family} config: {key} has keys attnkit does not implement for rope_type {kind!r}: "
                         f"{unknown}")
    return theta, normalised, partial


def read_rope_by_layer_type(read: Reader, max_positions: int, default_thetas: Mapping[str, float]
                            ) -> dict[str, tuple[float, dict | None, float]]:
    """:func:`read_rope` of each layer type of a ``rope_parameters`` keyed by layer type (``{"full_attention":
    {...}, "sliding_attention": {...}}``, as Gemma 3 and OLMo 3 write it): layer type -> (theta, normalised
    scaling or None, partial factor), a type the file leaves out reading as the default rotary with its
    ``default_thetas`` base. A layer type outside ``default_thetas`` is refused by name."""
    params = read.raw("rope_parameters")
    unknown = sorted(set(params) - set(default_thetas))
    if unknown:
        raise ValueError(f"{read.family} config: 'rope_parameters' has layer types attnkit does not know: {unknown}")
    out = {}
    for kind, theta in default_thetas.items():
        sub = params.get(kind) or {}
        if not isinstance(sub, dict):
            raise ValueError(f"{read.family} config: rope_parameters[{kind!r}] must be a dict, got {sub!r}")
        sub = dict(sub)
        sub.setdefault("rope_theta", theta)
        out[kind] = read_rope(Reader({"rope_parameters": sub, "max_position_embeddings": max_positions},
                                     f"{read.family} {kind}"), max_positions)
    return out


def per_layer_type(read: Reader) -> bool:
    """Whether ``rope_parameters`` is keyed by layer type (its values are dicts)."""
    params = read.raw("rope_parameters", None)
    return isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())


def check_rope_tables(cfg: DecoderConfig, config: Mapping[str, Any]) -> None:
    """Refuse, naming the key of ``config`` (the parsed ``config.json`` ``cfg`` was read from), a rotary scaling
    whose cos/sin tables would hold inf or NaN (:func:`_refuse_overflowing_tables`), for every rotary and head
    width the layers use.

    Apart from :func:`read_rope` because it computes one frequency per rotated feature pair: a claimed
    ``head_dim`` of 10**9 would allocate gigabytes. Loading calls it once the checkpoint's tensor shapes have
    confirmed the head widths; :func:`~attnkit.pretrained.decoder_config_from_hf` right after reading.
    """
    if cfg.rotary is None:
        return
    rope = config.get("rope_parameters")
    per_type = isinstance(rope, dict) and any(isinstance(v, dict) for v in rope.values())
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    checked: list[tuple[Any, int]] = []
    for spec in cfg.layers:
        rotary = spec.rotary
        if rotary is None or rotary.scaling is None:
            continue
        use = (rotary, int(spec.head_dim * min(rotary.partial_factor, 1.0)))
        if use in checked:
            continue
        checked.append(use)
        kind = "sliding_attention" if spec.window is not None else "full_attention"
        where = f"{key}[{kind!r}]" if per_type else key
        _refuse_overflowing_tables(f"{cfg.family} config: {where}", rotary.theta, rotary.scaling, use[1],
                                   cfg.max_position_embeddings)


def _check_scaling(where: str, key: str, theta: float, normalised: dict, max_positions: int) -> None:
    """Refuse, naming the key, the numbers a scaling's formulas cannot use although each is in range."""
    kind = normalised["rope_type"]
    if kind == "yarn" and theta <= 1.0:
        # YaRN places its correction range by log(theta): a base of 1 or less has no such range.
        raise ValueError(f"{where}: rope_theta must be greater than 1 for rope_type 'yarn', got {theta!r}")
    if kind == "llama3" and not normalised["low_freq_factor"] < normalised["high_freq_factor"]:
        raise ValueError(f"{where}: {key}['low_freq_factor'] ({normalised['low_freq_factor']}) must be "
                         f"smaller than ['high_freq_factor'] ({normalised['high_freq_factor']}): llama3 scaling "
                         f"blends between them")
    if kind == "yarn":
        original = normalised["original_max_position_embeddings"]
        for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            # YaRN's ramp runs between the features whose wavelengths fit beta times into the original context:
            # log(original / (beta * 2 pi)), which a huge or a subnormal beta takes to log(0) or inf.
            beta = normalised.get(name, default)
            if not 0 < original / (beta * 2 * math.pi) < math.inf:
                raise ValueError(f"{where}: {key}[{name!r}] = {beta!r} puts YaRN's correction range at "
                                 f"log({original} / ({beta!r} * 2 pi)), which is not a finite number")
    if (kind == "longrope" and "attention_factor" not in normalised
            and normalised["original_max_position_embeddings"] == 1 and normalised.get("factor", max_positions) > 1):
        raise ValueError(f"{where}: {key}['original_max_position_embeddings'] = 1 leaves longrope's attention "
                         f"factor sqrt(1 + ln(factor) / ln(1)) undefined; give ['attention_factor'] or the original "
                         f"context length")


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

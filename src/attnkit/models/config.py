"""Model architectures as frozen dataclasses: every model is built as ``Model(config, rng=...)``.

:class:`Seq2SeqConfig` and :class:`TokenTaggerConfig` describe the encoder-decoder and the token classifier;
the rest of this module is the decoder-only language model's, passed down to every layer.

One :class:`DecoderConfig` describes every decoder family attnkit loads (the modules of
:mod:`attnkit.pretrained.families` read each family's ``config.json`` into one): which norm and where, which
MLP, which positions, how many key/value heads, which layers use a sliding window. It holds architecture only
(no weights, no tokenizer) and is validated when it is made, so a layer can trust what it reads.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

from .._validation import check_eps, check_factor, check_positive_int, check_real
from ..attention.latent import LatentAttentionConfig
from ..flex.modifiers import ScoreMod, softcap
from ..kernels.activations import ACTIVATIONS
from ..layers.attention_mamba2 import AttentionMamba2Config
from ..layers.decoder import CROSS_ATTENTION_KINDS
from ..layers.experts import ExpertsConfig
from ..layers.gated_deltanet import GatedDeltaNetConfig
from ..layers.kimi_delta_attention import KimiDeltaAttentionConfig
from ..layers.mamba2 import Mamba2Config
from ..layers.short_conv import ShortConvConfig
from .layer_spec import LayerSpec
from .layerwise import LayerwiseConfig

__all__ = ["DecoderConfig", "RotaryConfig", "NormConfig", "AttentionConfig", "ExpertsConfig", "Seq2SeqConfig",
           "MAX_LAYERS",
           "TokenTaggerConfig", "ROPE_TYPES", "STATE_LAYER_TYPES", "PAIRED_LAYER_TYPES", "AttentionMamba2Config",
           "MIXER_PARTS", "ScalesConfig", "SpecialTokens", "MLPConfig"]
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")
_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "gated_attention", "linear_attention",
                "kimi_delta_attention", "short_conv", "mamba2", "mlp", "attention_mamba2")
STATE_LAYER_TYPES = ("linear_attention", "kimi_delta_attention", "short_conv", "mamba2")
"""The layer types whose cache entry is a fixed-size state (their mixer's ``new_cache``), not keys and values."""
PAIRED_LAYER_TYPES = ("attention_mamba2",)
"""The layer types whose cache entry is both: keys and values (their attention's) and a state (their mixer's
``new_cache``, the state-space half's)."""


_MAX_SIZE = 2**31 - 1  # no real model comes near it; beyond it a size could only allocate without end
MAX_LAYERS = 2**20  # one (tiny) entry per layer is built before a checkpoint is read


def _check_choice(value: Any, name: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _finite_positive(value: Any, name: str) -> float:
    try:
        return check_real(value, name, low=0, low_open=True)
    except TypeError:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}") from None


def _finite(value: Any, name: str) -> float:
    try:
        return check_real(value, name)
    except TypeError:
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None


def _factor(value: Any, name: str) -> float:
    """A scale, multiplier or soft-cap (:func:`attnkit._validation.check_factor`: in ``[2**-14, 65504]``)."""
    try:
        return check_factor(value, name)
    except TypeError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _check_flag(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_scaling(scaling: Any, name: str) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise TypeError(f"{name} must be a dict or None, got {type(scaling).__name__}")
    kind = scaling.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"{name}['rope_type'] must be one of {', '.join(ROPE_TYPES)}, got {kind!r}")


@dataclass(frozen=True)
class RotaryConfig:
    """Rotary position embeddings: how queries and keys are rotated (a part of :class:`DecoderConfig`).

    Parameters
    ----------
    theta : float, default 10000.0
        The rotary base.
    scaling : dict, optional
        Frequency scaling, normalised to Hugging Face's keys with ``"rope_type"`` one of
        ``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``, ``"llama3"``, ``"longrope"``, ``"proportional"``
        (``None`` = ``"default"``).
    interleaved : bool, default False
        Rotate pairs ``(x0, x1), (x2, x3), ...`` instead of ``(x_i, x_{i + Dh/2})`` (half-split, the layout of
        Hugging Face checkpoints).
    partial_factor : float, default 1.0
        Fraction of each head's features that are rotated, in (0, 1].
    skip_layers : tuple of int, default ()
        Layers whose attention has no rotary embedding (SmolLM3's NoPE layers).
    sliding_theta : float, optional
        The base of the sliding-window layers when it differs from ``theta`` (Gemma 3); ``sliding_scaling``
        (a normalised scaling dict or None) goes with it.
    sliding_scaling : dict, optional

    Examples
    --------
    >>> RotaryConfig(theta=1e6).kind, RotaryConfig(scaling={"rope_type": "yarn", "factor": 4.0}).kind
    ('default', 'yarn')
    """

    theta: float = 10000.0
    scaling: dict | None = None
    interleaved: bool = False
    partial_factor: float = 1.0
    skip_layers: tuple[int, ...] = ()
    sliding_theta: float | None = None
    sliding_scaling: dict | None = None

    def __post_init__(self) -> None:
        _finite_positive(self.theta, "rotary.theta")
        factor = _finite_positive(self.partial_factor, "rotary.partial_factor")
        if factor > 1.0:
            raise ValueError(f"rotary.partial_factor must be in (0, 1], got {factor}")
        _check_flag(self.interleaved, "rotary.interleaved")
        _check_scaling(self.scaling, "rotary.scaling")
        _check_scaling(self.sliding_scaling, "rotary.sliding_scaling")
        if self.sliding_theta is not None:
            _finite_positive(self.sliding_theta, "rotary.sliding_theta")
        elif self.sliding_scaling is not None:
            raise ValueError("rotary.sliding_scaling needs rotary.sliding_theta")
        skip = tuple(self.skip_layers)
        valid = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in skip)
        if not valid or len(set(skip)) != len(skip):
            raise ValueError(f"rotary.skip_layers must hold distinct non-negative layer indices, got {skip}")
        object.__setattr__(self, "skip_layers", tuple(sorted(skip)))

    @property
    def kind(self) -> str:
        """The frequency scaling in use (``"default"`` when none)."""
        return "default" if self.scaling is None else self.scaling.get("rope_type", "default")

    def sliding(self) -> RotaryConfig:
        """The rotary of the sliding-window layers: ``sliding_theta`` and ``sliding_scaling`` in place of
        ``theta`` and ``scaling`` (itself when the layers share one)."""
        if self.sliding_theta is None:
            return self
        return replace(self, theta=self.sliding_theta, scaling=self.sliding_scaling, sliding_theta=None,
                       sliding_scaling=None)


NORM_PLACEMENTS = ("pre", "post", "sandwich")


@dataclass(frozen=True)
class NormConfig:
    """The normalisation of the residual branches (a part of :class:`DecoderConfig`).

    Parameters
    ----------
    kind : {"rmsnorm", "layernorm"}, default "rmsnorm"
    eps : float, default 1e-6
    offset : float, default 0.0
        Added to every RMSNorm gain (Gemma's ``1 + weight``: 1.0).
    placement : {"pre", "post", "sandwich"}, default "pre"
        ``pre``: each branch's input is normalised (``attn_norm``, ``mlp_norm``); ``post``: each branch's output,
        before the residual add (``attn_post_norm``, ``mlp_post_norm``; OLMo 2); ``sandwich``: both (Gemma).

    Examples
    --------
    >>> NormConfig(placement="sandwich").before, NormConfig(placement="post").before
    (True, False)
    """

    kind: str = "rmsnorm"
    eps: float = 1e-6
    offset: float = 0.0
    placement: str = "pre"

    def __post_init__(self) -> None:
        _check_choice(self.kind, "norm.kind", ("rmsnorm", "layernorm"))
        _check_choice(self.placement, "norm.placement", NORM_PLACEMENTS)
        check_eps(self.eps, "norm.eps")
        _finite(self.offset, "norm.offset")
        if self.offset and self.kind != "rmsnorm":
            raise ValueError(f"norm.offset ({self.offset}) is an RMSNorm gain's offset; norm.kind is {self.kind!r}")

    @property
    def before(self) -> bool:
        """Whether each branch's input is normalised."""
        return self.placement != "post"

    @property
    def after(self) -> bool:
        """Whether each branch's output is normalised before the residual add."""
        return self.placement != "pre"


@dataclass(frozen=True)
class ScalesConfig:
    """The fixed factors of a model's streams (a part of :class:`DecoderConfig`): each is a number in
    ``[2**-14, 65504]`` (:func:`attnkit._validation.check_factor`), 1 (or None) where a model has none.

    Parameters
    ----------
    embedding : float, default 1.0
        The token embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)`` rounded to float32; Granite's
        ``embedding_multiplier``).
    residual : float, default 1.0
        Each branch's output (after its post-norm) is multiplied by it before it joins the residual stream
        (Granite's ``residual_multiplier``).
    logit : float, default 1.0
        The head's logits are multiplied by it, before a soft-cap (Granite: ``1 / logits_scaling``).
    final_logit_softcap : float, optional
        C: the output logits become ``C * tanh(logits / C)`` (Gemma 2).
    mlp_gate, mlp_output : float, default 1.0
        The ``scaled_gated`` MLP's fixed factors of the gate's pre-activation and of the output (Falcon-H1's
        ``mlp_multipliers``); 1 for every other MLP.

    Examples
    --------
    >>> ScalesConfig(embedding=2.0).residual, ScalesConfig().final_logit_softcap is None
    (1.0, True)
    """

    embedding: float = 1.0
    residual: float = 1.0
    logit: float = 1.0
    final_logit_softcap: float | None = None
    mlp_gate: float = 1.0
    mlp_output: float = 1.0

    def __post_init__(self) -> None:
        for name in ("embedding", "residual", "logit", "mlp_gate", "mlp_output"):
            object.__setattr__(self, name, _factor(getattr(self, name), f"scales.{name}"))
        if self.final_logit_softcap is not None:
            object.__setattr__(self, "final_logit_softcap",
                               _factor(self.final_logit_softcap, "scales.final_logit_softcap"))


def _token_ids(value: Any, name: str, *, many: bool) -> int | tuple[int, ...] | None:
    """A special token id (or, with ``many``, a non-empty sequence of them, kept as a tuple), or None."""
    if value is None:
        return None
    one = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    items = [value] if one else value
    if (not isinstance(items, (tuple, list)) or not items or (not many and not one)
            or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in items)):
        expected = "a non-negative token id" + (" or a non-empty sequence of them" if many else "")
        raise ValueError(f"{name} must be {expected} or None, got {value!r}")
    return int(value) if one else tuple(int(i) for i in items)


@dataclass(frozen=True)
class SpecialTokens:
    """The checkpoint's special token ids (a part of :class:`DecoderConfig`): what generation stops at and pads
    with when its own options do not say.

    Parameters
    ----------
    bos : int, tuple of int or None
        The beginning-of-sequence token.
    eos : int, tuple of int or None
        The end-of-sequence token, or several (any of them ends a sequence).
    pad : int or None
        The padding token.

    Examples
    --------
    >>> SpecialTokens(bos=1, eos=[2, 7]).eos, SpecialTokens().pad is None
    ((2, 7), True)
    """

    bos: int | tuple[int, ...] | None = None
    eos: int | tuple[int, ...] | None = None
    pad: int | None = None

    def __post_init__(self) -> None:
        for name in ("bos", "eos", "pad"):
            object.__setattr__(self, name, _token_ids(getattr(self, name), f"tokens.{name}", many=name != "pad"))


QK_NORMS = ("head", "projection", "head_after_rotary", "unit_after_rotary")


@dataclass(frozen=True)
class AttentionConfig:
    """The self-attention of every layer (a part of :class:`DecoderConfig`); the sizes of its heads are the
    decoder's.

    Parameters
    ----------
    bias : bool, default False
        Biases on the query, key and value projections.
    output_bias : bool, default False
        Bias on the output projection.
    qk_norm : {None, "head", "projection", "head_after_rotary", "unit_after_rotary"}, default None
        RMS-normalise queries and keys with learned weights (``q_norm``, ``k_norm``) before the rotary
        embedding: ``head``, over each head's Dh features, one weight per feature shared by the heads (Qwen3);
        ``projection``, over the whole projection, Hq*Dh and Hkv*Dh weights (OLMo 2); or after it,
        ``head_after_rotary``, per head as ``head`` (HunYuan); ``unit_after_rotary``: per head after the rotation
        without weights, on the rotary layers only (Llama 4's ``use_qk_norm``).
    scale : float, optional
        The factor of ``q k^T`` (default ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
    logit_softcap : float, optional
        C: scores become ``C * tanh(scores / C)`` before the mask and softmax (Gemma 2). Like every scale,
        multiplier and soft-cap of a model, ``scale`` and C lie in ``[2**-14, 65504]`` (float16's normal range,
        :data:`attnkit._validation.FACTOR_RANGE`): past it they overflow, or vanish, in float16.
    sinks : bool, default False
        Every query head has a learned sink logit ``sinks`` (Hq,) that joins its softmax and takes weight from
        the keys without contributing a value (gpt-oss).
    sliding_window : int, optional
        W, the keys a sliding-window layer sees (itself included); the decoder's ``layer_types`` say which.
    chunk_size : int, optional
        C: a ``chunked_attention`` layer's query at position p sees the keys at positions ``p - p % C`` to p, its
        own chunk of C positions (Llama 4's ``attention_chunk_size``); positions count a row's real tokens.
    query_temperature : (float, float), optional
        ``(floor_scale, attn_scale)``: on the layers without rotary, the query at position p is multiplied by
        ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` (Llama 4's ``attn_temperature_tuning``).

    Examples
    --------
    >>> AttentionConfig(logit_softcap=50.0).score_mod().cap
    50.0
    """

    bias: bool = False
    output_bias: bool = False
    qk_norm: str | None = None
    scale: float | None = None
    logit_softcap: float | None = None
    sinks: bool = False
    sliding_window: int | None = None
    chunk_size: int | None = None
    query_temperature: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("bias", "output_bias", "sinks"):
            _check_flag(getattr(self, name), f"attention.{name}")
        if self.qk_norm is not None:
            _check_choice(self.qk_norm, "attention.qk_norm", QK_NORMS)
        for name in ("scale", "logit_softcap"):
            if getattr(self, name) is not None:
                _factor(getattr(self, name), f"attention.{name}")
        if self.sliding_window is not None:
            check_positive_int(self.sliding_window, "attention.sliding_window", maximum=_MAX_SIZE)
        if self.chunk_size is not None:
            check_positive_int(self.chunk_size, "attention.chunk_size", maximum=_MAX_SIZE)
        if self.query_temperature is not None:
            given = tuple(self.query_temperature)
            if len(given) != 2:
                raise ValueError(f"attention.query_temperature must be (floor_scale, attn_scale), got {given!r}")
            checked = tuple(_finite_positive(v, f"attention.query_temperature[{i}]") for i, v in enumerate(given))
            object.__setattr__(self, "query_temperature", checked)

    def score_mod(self) -> ScoreMod | None:
        """The :mod:`attnkit.flex` score modifier of the scores (Gemma 2's soft-cap), or None for plain scores."""
        return None if self.logit_softcap is None else softcap(self.logit_softcap)


MLP_KINDS = ("gated", "plain", "xielu", "ungated", "scaled_gated")


@dataclass(frozen=True)
class MLPConfig:
    """The dense MLP of the layers without experts (a part of :class:`DecoderConfig`).

    Parameters
    ----------
    intermediate_size : int
        F, the MLP's hidden width.
    kind : {"gated", "plain", "xielu", "ungated", "scaled_gated"}, default "gated"
        ``gated``: ``down(act(x @ W_gate) * (x @ W_up))`` (SwiGLU for silu); ``plain``: ``act(x W1 + b1) W2 + b2``;
        ``xielu``: ``xielu(x W_up) W_down`` without biases, the xIELU activation with two learned slopes of its own
        (Apertus; ``activation`` is not read); ``ungated``: ``act(x W_up + b_up) W_down + b_down``, the biases with
        ``bias`` (Nemotron-H's squared ReLU); ``scaled_gated``: ``gated`` with the fixed factors of the decoder's
        ``scales`` part (``mlp_gate``, ``mlp_output``; Falcon-H1).
    activation : {"silu", "gelu", "gelu_tanh", "relu", "relu2"}, default "silu"
        The activation (of the gate, in a gated MLP; the experts' too).
    bias : bool, default False
        Biases in a gated or ungated MLP (a plain MLP always has them).

    Examples
    --------
    >>> MLPConfig(24).kind, MLPConfig(64, kind="plain", activation="gelu").activation
    ('gated', 'gelu')
    """

    intermediate_size: int
    kind: str = "gated"
    activation: str = "silu"
    bias: bool = False

    def __post_init__(self) -> None:
        check_positive_int(self.intermediate_size, "mlp.intermediate_size", maximum=_MAX_SIZE)
        _check_choice(self.kind, "mlp.kind", MLP_KINDS)
        _check_choice(self.activation, "mlp.activation", ACTIVATIONS)
        _check_flag(self.bias, "mlp.bias")
RESIDUALS = ("sequential", "parallel", "single")
# DecoderConfig's parts: field name -> its dataclass; the optional ones may be None
_PARTS = {"norm": NormConfig, "rotary": RotaryConfig, "attention": AttentionConfig, "experts": ExpertsConfig,
          "layerwise": LayerwiseConfig, "scales": ScalesConfig, "tokens": SpecialTokens, "mlp": MLPConfig}
_OPTIONAL_PARTS = ("rotary", "experts", "layerwise")
MIXER_PARTS = {GatedDeltaNetConfig: "linear_attention", KimiDeltaAttentionConfig: "kimi_delta_attention",
               ShortConvConfig: "short_conv", Mamba2Config: "mamba2", AttentionMamba2Config: "attention_mamba2",
               LatentAttentionConfig: "full_attention"}
"""The parts :attr:`DecoderConfig.mixer_parts` may hold, in their canonical order, each with the layer type it
shapes: a Gated DeltaNet, Kimi Delta Attention, short-convolution, Mamba-2 or attention-beside-Mamba-2 part is the
shape of every layer of its type (given exactly when there are some); a latent part turns the ``full_attention``
layers into multi-head latent attention."""
_MIXER_PARTS_BY_NAME = {cls.__name__: cls for cls in MIXER_PARTS}
_NESTED_PARTS = {AttentionMamba2Config: {"mamba2": Mamba2Config}}  # a part's fields that are parts themselves
# from_dict reads configs saved with the flat fields that are now in parts: old name -> where it went
_OLD_MIXER_FIELDS = {"linear_attention": GatedDeltaNetConfig, "kimi_delta": KimiDeltaAttentionConfig,
                     "short_conv": ShortConvConfig, "mamba2": Mamba2Config,
                     "attention_mamba2": AttentionMamba2Config, "latent": LatentAttentionConfig}
_OLD_PART_FIELDS = {"embedding_scale": ("scales", ("embedding",)), "residual_scale": ("scales", ("residual",)),
                    "logit_scale": ("scales", ("logit",)),
                    "final_logit_softcap": ("scales", ("final_logit_softcap",)),
                    "mlp_multipliers": ("scales", ("mlp_gate", "mlp_output")),
                    "bos_token_id": ("tokens", ("bos",)), "eos_token_id": ("tokens", ("eos",)),
                    "pad_token_id": ("tokens", ("pad",)), "intermediate_size": ("mlp", ("intermediate_size",)),
                    "activation": ("mlp", ("activation",)), "mlp_bias": ("mlp", ("bias",))}


def _moved_into_parts(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with the flat fields of a config saved before they moved into parts put in their parts."""
    moved = {k: v for k, v in fields.items() if k not in _OLD_MIXER_FIELDS and k not in _OLD_PART_FIELDS}
    if isinstance(fields.get("mlp"), str):  # the MLP's kind, when it was a flat field beside its width
        moved["mlp"] = {"kind": fields["mlp"]}
    for name, (part, keys) in _OLD_PART_FIELDS.items():
        if name in fields:
            values = fields[name] if len(keys) > 1 else (fields[name],)
            if not isinstance(values, (list, tuple)) or len(values) != len(keys):
                raise ValueError(f"{name} must be {len(keys)} values ({', '.join(keys)}), got {fields[name]!r}")
            moved[part] = {**(moved.get(part) or {}), **dict(zip(keys, values))}
    old = {name: fields[name] for name in _OLD_MIXER_FIELDS if fields.get(name) is not None}
    if not old:
        return moved
    parts = dict(moved.get("mixer_parts") or {})
    if "attention_mamba2" in old and "mamba2" in old:  # the Mamba-2 shape was one field for both layer types
        old["attention_mamba2"] = {**old["attention_mamba2"], "mamba2": old["mamba2"]}
        if "mamba2" not in (fields.get("layer_types") or ()):
            del old["mamba2"]
    for name, value in old.items():
        parts[_OLD_MIXER_FIELDS[name].__name__] = value
    moved["mixer_parts"] = parts
    return moved


def _tupled(value: Any) -> Any:
    """JSON's lists back to the tuples a frozen config holds (nested lists too)."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _part_from_dict(kind: type, values: dict[str, Any]) -> Any:
    """The part ``kind`` from its :func:`dataclasses.asdict` (lists back to tuples, nested parts rebuilt)."""
    if isinstance(values, kind):
        return values
    nested = _NESTED_PARTS.get(kind, {})
    return kind(**{k: _part_from_dict(nested[k], v) if k in nested and isinstance(v, dict) else _tupled(v)
                   for k, v in values.items()})


@dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a decoder-only Transformer language model: sizes, and the parts a block is made of.

    The sizes are flat fields; each kind of part (the MLP, norms, positions, attention, experts, fixed factors,
    special tokens, the shapes of the other token mixers) is a small frozen dataclass of its own, validated when it
    is made, and the checks that join them (the rotated features are even, sliding layers have a window, the
    experts' layers exist, a mixer's part is given exactly when its layers are) are made here, once. Configs saved
    with the older flat fields load through :meth:`from_dict`. Combinations
    no architecture has (a block without norms, projection-wide q/k norms without q/k norms) cannot be written.

    Parameters
    ----------
    family : str
        The checkpoint family, a Hugging Face ``model_type`` (``attnkit.pretrained.supported_model_types()``
        lists those it loads and saves): it decides the tensor names of a Hugging Face folder, nothing else.
    vocab_size : int
        V, the number of token ids.
    hidden_size : int
        D, the width of the residual stream.
    num_layers : int
        Number of decoder layers.
    num_heads : int
        Hq, query heads.
    num_kv_heads : int
        Hkv, key/value heads; must divide ``num_heads`` (Hkv = Hq: multi-head, 1: multi-query, else
        grouped-query attention).
    head_dim : int
        Dh, features per head (``hidden_size // num_heads`` in most checkpoints, but not required).
    mlp : MLPConfig
        The MLP of the layers without experts: its hidden width F, kind, activation and biases.
    max_position_embeddings : int, default 2048
        The longest context the model was trained for (the size of GPT-2's position table).
    residual : {"sequential", "parallel", "single"}, default "sequential"
        ``parallel``: ``x + attention(attn_norm(x)) + mlp(mlp_norm(x))``, both branches read the block's input
        (GPT-NeoX); ``single``: each layer is one branch, ``x + mixer(attn_norm(x))``, or for an ``"mlp"`` layer
        ``x + mlp(mlp_norm(x))`` (Nemotron-H: each layer's ``block`` in :attr:`layers`).
    norm : NormConfig
        Which norm, its epsilon and gain offset, and where it sits (the final norm is of the same kind).
    rotary : RotaryConfig or None
        Rotary embeddings on queries and keys; None: a learned absolute position table added to the input
        (GPT-2).
    attention : AttentionConfig
        Biases, q/k norms, scale, soft-cap, sinks and the sliding window of the self-attention.
    experts : ExpertsConfig, optional
        The mixture of experts (:class:`~attnkit.layers.experts.MixtureOfExperts`) that is the MLP of the layers
        it lists (``experts.layers``); with it ``mlp.kind`` must be ``gated``.
    scales : ScalesConfig
        The fixed factors of the embeddings, of each branch's output, of the logits (and their soft-cap), and of the
        ``scaled_gated`` MLP's gate and output; all identities by default.
    tie_word_embeddings : bool, default False
        The output head reuses the token embedding matrix.
    layer_types : tuple of {"full_attention", "sliding_attention", "gated_attention", "linear_attention", \
"kimi_delta_attention", "short_conv", "mamba2", "mlp", "attention_mamba2"}
        Each layer's token mixer; default: every layer full. ``gated_attention``: full attention whose heads'
        outputs pass through a sigmoid gate (Qwen3-Next, Qwen3.5); ``linear_attention``: a Gated DeltaNet layer
        shaped by a :class:`~attnkit.layers.gated_deltanet.GatedDeltaNetConfig` in ``mixer_parts``;
        ``kimi_delta_attention``: a Kimi Delta Attention layer (shaped by a ``KimiDeltaAttentionConfig``);
        ``short_conv``: LFM2's gated short convolution (a ``ShortConvConfig``); ``mamba2``: a Mamba-2 mixer (a
        ``Mamba2Config``; the cache entry of these four is a fixed-size state, not keys and values:
        :data:`STATE_LAYER_TYPES`); ``mlp``: no token mixer, the layer is its MLP alone (with ``residual="single"``
        only; its cache entry holds nothing); ``attention_mamba2``: attention and a Mamba-2 mixer side by side
        (Falcon-H1; an :class:`AttentionMamba2Config`, the Mamba-2 shape and the branches' factors), whose cache
        entry is keys and values and a state (:data:`PAIRED_LAYER_TYPES`).
    tokens : SpecialTokens
        The checkpoint's special token ids, ``bos``, ``eos`` (which may list several) and ``pad``; none by default.
    layerwise : LayerwiseConfig, optional
        Layers that differ in more than their window (Gemma 4: wider global heads, keys that are the values,
        keys and values reused by the last layers, per-layer inputs, a scalar per layer); see
        :class:`LayerwiseConfig`.
    mixer_parts : tuple of parts, default ()
        The shapes of the token mixers that are not plain attention, at most one part of each class of
        :data:`MIXER_PARTS` (kept in that order; each layer's is its spec's ``part``): a
        :class:`~attnkit.layers.gated_deltanet.GatedDeltaNetConfig`, a
        :class:`~attnkit.layers.kimi_delta_attention.KimiDeltaAttentionConfig`, a
        :class:`~attnkit.layers.short_conv.ShortConvConfig`, a :class:`~attnkit.layers.mamba2.Mamba2Config` or an
        :class:`AttentionMamba2Config` shapes every layer of its type (``linear_attention``,
        ``kimi_delta_attention``, ``short_conv``, ``mamba2``, ``attention_mamba2``) and is given exactly when
        there are some. A :class:`~attnkit.attention.latent.LatentAttentionConfig` makes every ``full_attention``
        layer multi-head latent attention (:class:`~attnkit.attention.latent.MultiHeadLatentAttention`,
        DeepSeek-V3) instead of grouped-query attention; its ``hidden_size`` and heads are this config's,
        ``head_dim`` is its rotary width R, ``rotary.interleaved`` its ``rope_interleaved``, the ``attention`` part
        stays the default (the latent part holds its biases and scale), and those layers' cache entries are
        :class:`~attnkit.attention.cache_entry.Latents`. :meth:`mixer_part` looks one up by class.
    mtp_layers : int, default 0
        Multi-token-prediction layers the checkpoint may carry after the last layer (DeepSeek-V3's
        ``num_nextn_predict_layers``): not part of the model's forward; read on request as a draft for speculative
        decoding (:func:`attnkit.pretrained.load_multi_token_predictor`).

    Examples
    --------
    >>> cfg = DecoderConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
    ...                     num_kv_heads=2, head_dim=4, mlp=MLPConfig(24))
    >>> cfg.num_groups, cfg.layer_types, cfg.norm.placement
    (2, ('full_attention', 'full_attention'), 'pre')
    >>> cfg.layers[1].window is None, cfg.layers[1].mixer, cfg.layers[1].mlp
    (True, 'full_attention', 'gated')
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp: MLPConfig
    max_position_embeddings: int = 2048
    residual: str = "sequential"
    norm: NormConfig = field(default_factory=NormConfig)
    rotary: RotaryConfig | None = field(default_factory=RotaryConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    experts: ExpertsConfig | None = None
    scales: ScalesConfig = field(default_factory=ScalesConfig)
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = field(default=())
    tokens: SpecialTokens = field(default_factory=SpecialTokens)
    layerwise: LayerwiseConfig | None = None
    mixer_parts: tuple[Any, ...] = ()
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        self._check_sizes_and_kinds()
        self._check_parts()
        self._check_rotary()
        self._check_layers()
        if self.layerwise is not None:
            self.layerwise.check(self)

    def _check_sizes_and_kinds(self) -> None:
        if not isinstance(self.family, str) or not self.family.isidentifier():
            raise ValueError(f"family must be a model_type such as 'llama' (attnkit.pretrained."
                             f"supported_model_types() lists those with checkpoints), got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings"):
            check_positive_int(getattr(self, name), name, maximum=MAX_LAYERS if name == "num_layers" else _MAX_SIZE)
        check_positive_int(self.mtp_layers, "mtp_layers", allow_zero=True, maximum=MAX_LAYERS)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        _check_choice(self.residual, "residual", RESIDUALS)
        _check_flag(self.tie_word_embeddings, "tie_word_embeddings")

    def _check_parts(self) -> None:
        for name, kind in _PARTS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and not (name in _OPTIONAL_PARTS and value is None):
                expected = f"a {kind.__name__}" + (" or None" if name in _OPTIONAL_PARTS else "")
                hint = (f" (the MLP's kind is mlp.kind: mlp=MLPConfig(intermediate_size, kind={value!r}))"
                        if name == "mlp" and isinstance(value, str) else "")
                raise TypeError(f"{name} must be {expected}, got {type(value).__name__}{hint}")
        self._check_mixer_parts()
        multipliers = (self.scales.mlp_gate, self.scales.mlp_output)
        if multipliers != (1.0, 1.0) and self.mlp.kind != "scaled_gated":
            raise ValueError(f"scales.mlp_gate and scales.mlp_output {multipliers} scale the 'scaled_gated' MLP only; "
                             f"mlp.kind is {self.mlp.kind!r}")
        latent, rotary = self.mixer_part(LatentAttentionConfig), self.rotary
        if latent is not None:
            if (latent.hidden_size, latent.num_heads) != (self.hidden_size, self.num_heads):
                raise ValueError(f"the LatentAttentionConfig in mixer_parts describes hidden_size {latent.hidden_size} "
                                 f"and {latent.num_heads} heads, the model {self.hidden_size} and {self.num_heads}")
            if rotary is None or self.head_dim != latent.qk_rope_head_dim or rotary.partial_factor != 1.0 \
                    or rotary.interleaved != latent.rope_interleaved:
                raise ValueError("latent attention rotates its qk_rope_head_dim features (except in the rotary "
                                 "part's skip_layers: NoPE, Kimi Linear): the model needs a rotary part with "
                                 "partial_factor 1 and the latent's rope_interleaved as interleaved, and head_dim = "
                                 "qk_rope_head_dim")
            if self.attention != AttentionConfig():
                raise ValueError(f"latent attention takes no setting of the attention part (its biases, scale and "
                                 f"window are the latent part's), got {self.attention}")

    def _check_mixer_parts(self) -> None:
        given = self.mixer_parts
        if not isinstance(given, (tuple, list)):
            raise TypeError(f"mixer_parts must be a tuple of parts, got {type(given).__name__}")
        names = ", ".join(cls.__name__ for cls in MIXER_PARTS)
        for part in given:
            if type(part) not in MIXER_PARTS:
                raise TypeError(f"mixer_parts must hold parts of the classes {names}, got {type(part).__name__}")
        kinds = [type(part) for part in given]
        twice = sorted({cls.__name__ for cls in kinds if kinds.count(cls) > 1})
        if twice:
            raise ValueError(f"mixer_parts must hold at most one part of each class, got {len(given)} parts with "
                             f"more than one {twice[0]}")
        order = list(MIXER_PARTS)
        object.__setattr__(self, "mixer_parts", tuple(sorted(given, key=lambda part: order.index(type(part)))))

    def mixer_part(self, kind: type) -> Any:
        """The part of class ``kind`` (one of :data:`MIXER_PARTS`) in ``mixer_parts``, or None.

        Examples
        --------
        >>> from attnkit.layers import GatedDeltaNetConfig, ShortConvConfig
        >>> cfg = DecoderConfig(family="qwen3_next", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
        ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(8), layer_types=("linear_attention",),
        ...                     mixer_parts=(GatedDeltaNetConfig(1, 2, 4, 3),))
        >>> cfg.mixer_part(GatedDeltaNetConfig).num_value_heads, cfg.mixer_part(ShortConvConfig)
        (2, None)
        """
        if kind not in MIXER_PARTS:
            names = ", ".join(cls.__name__ for cls in MIXER_PARTS)
            raise ValueError(f"kind must be one of the classes {names}, got {kind!r}")
        return next((part for part in self.mixer_parts if type(part) is kind), None)

    def _check_rotary(self) -> None:
        if self.rotary is None:
            return
        rotated = self.head_dim * self.rotary.partial_factor
        if int(rotated) % 2:
            raise ValueError(f"the rotated features per head (head_dim * rotary.partial_factor = {rotated:g}) must "
                             f"be even")
        for name in ("scaling", "sliding_scaling"):
            scaling = getattr(self.rotary, name)
            if scaling is not None and scaling.get("rope_type") == "longrope":
                half = int(rotated) // 2
                for key in ("short_factor", "long_factor"):
                    if len(scaling.get(key, ())) != half:
                        raise ValueError(f"rotary.{name}[{key!r}] must hold one divisor per rotated feature pair "
                                         f"(head_dim * rotary.partial_factor / 2 = {half}), got "
                                         f"{len(scaling.get(key, ()))}")
        if any(i >= self.num_layers for i in self.rotary.skip_layers):
            raise ValueError(f"rotary.skip_layers must hold layer indices in [0, {self.num_layers}), got "
                             f"{self.rotary.skip_layers}")

    def _check_layers(self) -> None:
        types = tuple(self.layer_types) if self.layer_types else ("full_attention",) * self.num_layers
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_layers is {self.num_layers}")
        bad = sorted(set(types) - set(_LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types must hold only {', '.join(_LAYER_TYPES)}, got {bad}")
        if "mlp" in types and self.residual != "single":
            raise ValueError(f"layer_types has mlp layers (a layer of the MLP alone), which only residual='single' "
                             f"builds, got residual={self.residual!r}")
        if "sliding_attention" in types and self.attention.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but attention.sliding_window is None")
        if "chunked_attention" in types and self.attention.chunk_size is None:
            raise ValueError("layer_types has chunked_attention layers but attention.chunk_size is None")
        # a latent part shapes the full-attention layers when given, none otherwise: it is not checked here
        shaped = [(cls, kind) for cls, kind in MIXER_PARTS.items() if cls is not LatentAttentionConfig]
        for cls, kind in shaped:
            if kind in types and self.mixer_part(cls) is None:
                article = "an" if cls.__name__[0] in "AEIOU" else "a"
                raise ValueError(f"layer_types has {kind} layers, so mixer_parts needs {article} {cls.__name__} "
                                 f"(their shape); it has {[type(p).__name__ for p in self.mixer_parts]}")
        for cls, kind in shaped:
            if kind not in types and self.mixer_part(cls) is not None:
                raise ValueError(f"mixer_parts has a {cls.__name__}, the shape of the {kind} layers, but layer_types "
                                 f"has none: {types}")
        moe = self.experts
        if moe is not None and (any(i >= self.num_layers for i in moe.layers) or self.mlp.kind != "gated"):
            raise ValueError(f"experts.layers must be layer indices below num_layers ({self.num_layers}) and the "
                             f"other layers' mlp.kind 'gated' (experts are gated MLPs), got {moe.layers} and "
                             f"{self.mlp.kind!r}")
        object.__setattr__(self, "layer_types", types)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON values (parts as dicts, tuples as lists); :meth:`from_dict` reads it back.

        Examples
        --------
        >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
        ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(8))
        >>> DecoderConfig.from_dict(cfg.to_dict()) == cfg, cfg.to_dict()["norm"]["placement"]
        (True, 'pre')
        """
        def plain(value: Any) -> Any:
            if isinstance(value, (tuple, list)):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value

        fields = plain(asdict(self))
        fields["mixer_parts"] = {type(part).__name__: plain(asdict(part)) for part in self.mixer_parts}
        return fields

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> DecoderConfig:
        """The config :meth:`to_dict` wrote (lists back to tuples, parts back to their dataclasses).

        A dict saved before fields moved into parts is read too: its flat fields go to their parts (a
        ``linear_attention``, ``kimi_delta``, ``short_conv``, ``mamba2``, ``attention_mamba2`` or ``latent`` dict
        to its class in ``mixer_parts``, ``mamba2`` also into the ``attention_mamba2`` part; ``embedding_scale``,
        ``residual_scale``, ``logit_scale``, ``final_logit_softcap`` and the two ``mlp_multipliers`` to ``scales``;
        ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` to ``tokens``; ``intermediate_size``,
        ``activation``, ``mlp_bias`` and the kind ``mlp`` to the ``mlp`` part).

        Raises
        ------
        TypeError
            ``fields`` is not a dict, or names a field (or a part class in ``mixer_parts``) the config does not have.
        ValueError
            An old ``mlp_multipliers`` is not two factors; or a value its part refuses.

        Examples
        --------
        >>> old = {"family": "lfm2", "vocab_size": 8, "hidden_size": 8, "num_layers": 1, "num_heads": 2,
        ...        "num_kv_heads": 1, "head_dim": 4, "intermediate_size": 8, "layer_types": ["short_conv"],
        ...        "short_conv": {"kernel_size": 3, "bias": True}}
        >>> DecoderConfig.from_dict(old).mixer_parts
        (ShortConvConfig(kernel_size=3, bias=True),)
        """
        if not isinstance(fields, dict):
            raise TypeError(f"fields must be a dict, got {type(fields).__name__}")
        fields = _moved_into_parts(fields)
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            names = ", ".join(f.name for f in dataclasses.fields(cls))
            raise TypeError(f"DecoderConfig has no field {unknown[0]!r} (fields: {names})")
        values = {k: _tupled(v) for k, v in fields.items()}
        for name, part in _PARTS.items():
            if isinstance(values.get(name), dict):
                values[name] = _part_from_dict(part, fields[name])
        parts = fields.get("mixer_parts", {})
        if isinstance(parts, dict):
            unknown = sorted(set(parts) - set(_MIXER_PARTS_BY_NAME))
            if unknown:
                raise TypeError(f"mixer_parts has no part class {unknown[0]!r} (classes: "
                                f"{', '.join(_MIXER_PARTS_BY_NAME)})")
            values["mixer_parts"] = tuple(_part_from_dict(_MIXER_PARTS_BY_NAME[name], part)
                                          for name, part in parts.items())
        return cls(**values)

    @property
    def num_groups(self) -> int:
        """G = Hq / Hkv, the query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads

    @cached_property
    def layers(self) -> tuple[LayerSpec, ...]:
        """What each layer is (:class:`~attnkit.models.layer_spec.LayerSpec`), resolved once from the parts: its
        token mixer and MLP, its block, its sizes, window, rotary and q/k norm, and what its cache entry holds.

        Examples
        --------
        >>> cfg = DecoderConfig(family="gemma3_text", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2,
        ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(8),
        ...                     rotary=RotaryConfig(theta=1e6, sliding_theta=1e4),
        ...                     attention=AttentionConfig(sliding_window=4),
        ...                     layer_types=("sliding_attention", "full_attention"))
        >>> [(s.rotary.theta, s.window) for s in cfg.layers]
        [(10000.0, 4), (1000000.0, None)]
        """
        owners = (None,) * self.num_layers if self.layerwise is None else self.layerwise.kv_owners(self.layer_types)
        return tuple(self._layer_spec(i, owners[i]) for i in range(self.num_layers))

    def _layer_spec(self, index: int, kv_owner: int | None) -> LayerSpec:
        kind, part, latent = self.layer_types[index], self.layerwise, self.mixer_part(LatentAttentionConfig)
        window = self.attention.sliding_window if kind == "sliding_attention" else None
        chunk = self.attention.chunk_size if kind == "chunked_attention" else None
        if self.rotary is None or index in self.rotary.skip_layers:
            rotary = None
        else:
            rotary = self.rotary.sliding() if window is not None else self.rotary
        if self.residual == "single":
            block = "mlp_only" if kind == "mlp" else "mixer_only"
        else:
            block = self.residual if part is None else part.block
        if kind == "mlp":
            mixer = None
        elif latent is not None and kind == "full_attention":
            mixer = "latent_attention"
        elif part is not None:
            mixer = "kv_owner_attention" if kv_owner is None else "kv_reader_attention"
        else:
            mixer = kind
        if block == "mixer_only":
            mlp = None
        else:
            mlp = "experts" if self.experts is not None and index in self.experts.layers else self.mlp.kind
        head_dim, kv_heads, width = self.head_dim, self.num_kv_heads, self.mlp.intermediate_size
        if part is not None:
            if kind == "full_attention":
                head_dim, kv_heads = part.global_head_dim, part.global_kv_heads
            if part.wide_shared_mlp and kv_owner is not None:
                width *= 2
        if kind == "mlp":
            cache = "none"
        elif kind in STATE_LAYER_TYPES:
            cache = "state"
        elif kind in PAIRED_LAYER_TYPES:
            cache = "paired"
        elif mixer == "latent_attention":
            cache = "latent"
        else:
            cache = "keys_values" if kv_owner is None else "shared"
        qk_norm = self.attention.qk_norm
        if qk_norm == "unit_after_rotary" and rotary is None:  # the unit norm acts on the rotary layers only
            qk_norm = None
        temperature = self.attention.query_temperature if rotary is None else None  # the NoPE layers'
        if mixer == "latent_attention":
            shape = latent
        else:  # the part of the layer's own type; plain attention has none
            shape = next((p for p in self.mixer_parts if mixer == kind == MIXER_PARTS[type(p)]
                          and type(p) is not LatentAttentionConfig), None)
        return LayerSpec(index=index, layer_type=kind, mixer=mixer, part=shape, mlp=mlp, block=block,
                         head_dim=head_dim, num_kv_heads=kv_heads, intermediate_size=width, rotary=rotary,
                         window=window, chunk=chunk,
                         kv_owner=kv_owner, qk_norm=qk_norm, query_temperature=temperature, cache=cache,
                         score_mod=self.attention.score_mod())


_POSITIONAL = ("sinusoidal", "learned")


def _check_dropout(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"dropout must be a number in [0, 1), got {value!r}")


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Architecture of a :class:`~attnkit.models.Seq2SeqTransformer` (pre-norm encoder-decoder).

    Parameters
    ----------
    src_vocab_size, tgt_vocab_size : int
    d_model : int
    num_heads : int
        Must divide ``d_model``.
    num_encoder_layers, num_decoder_layers : int
    d_ff : int, optional
        Feed-forward hidden size (default ``4 * d_model``).
    max_length : int, default 256
        Longest source and target sequence.
    cross_attention : {"dot", "additive"}, default "dot"
        Scaled dot-product cross-attention heads, or Bahdanau's additive ones.
    dropout : float, default 0.0
        Dropout of the decoder blocks (training mode only).
    activation : {"relu", "gelu", "gelu_tanh", "silu"}, default "relu"

    Examples
    --------
    >>> Seq2SeqConfig(20, 20, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1).max_length
    256
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int
    num_heads: int
    num_encoder_layers: int
    num_decoder_layers: int
    d_ff: int | None = None
    max_length: int = 256
    cross_attention: str = "dot"
    dropout: float = 0.0
    activation: str = "relu"

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "num_encoder_layers",
                     "num_decoder_layers", "max_length"):
            check_positive_int(getattr(self, name), name, maximum=_MAX_SIZE)
        if self.d_ff is not None:
            check_positive_int(self.d_ff, "d_ff", maximum=_MAX_SIZE)
        _check_choice(self.cross_attention, "cross_attention", CROSS_ATTENTION_KINDS)
        _check_choice(self.activation, "activation", ACTIVATIONS)
        _check_dropout(self.dropout)


@dataclass(frozen=True)
class TokenTaggerConfig:
    """Architecture of a :class:`~attnkit.models.TokenTagger` (encoder-only per-token classifier).

    Parameters
    ----------
    vocab_size : int
        V, number of input token ids.
    num_classes : int
        C, number of output classes per token.
    max_length : int
        Longest sequence accepted.
    d_model : int, default 64
    num_heads : int, default 4
    num_layers : int, default 2
    d_ff : int, optional
        Feed-forward hidden size (default ``4 * d_model``).
    norm_first : bool, default True
        Pre-norm blocks (with a final LayerNorm) or post-norm blocks.
    activation : {"relu", "gelu", "gelu_tanh", "silu"}, default "relu"
    positional : {"sinusoidal", "learned"}, default "sinusoidal"

    Examples
    --------
    >>> TokenTaggerConfig(vocab_size=10, num_classes=10, max_length=8).d_model
    64
    """

    vocab_size: int
    num_classes: int
    max_length: int
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int | None = None
    norm_first: bool = True
    activation: str = "relu"
    positional: str = "sinusoidal"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_classes", "max_length", "d_model", "num_heads", "num_layers"):
            check_positive_int(getattr(self, name), name, maximum=_MAX_SIZE)
        if self.d_ff is not None:
            check_positive_int(self.d_ff, "d_ff", maximum=_MAX_SIZE)
        if not isinstance(self.norm_first, bool):
            raise TypeError(f"norm_first must be True or False, got {self.norm_first!r}")
        _check_choice(self.activation, "activation", ACTIVATIONS)
        _check_choice(self.positional, "positional", _POSITIONAL)

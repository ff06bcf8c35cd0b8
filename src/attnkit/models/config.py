"""Model architectures as frozen dataclasses: every model is built as ``Model(config, rng=...)``.

:class:`Seq2SeqConfig` and :class:`TokenTaggerConfig` describe the encoder-decoder and the token classifier;
the rest of this module is the decoder-only language model's, passed down to every layer.

One :class:`DecoderConfig` describes every decoder family attnkit loads (the modules of
:mod:`attnkit.pretrained.families` read each family's ``config.json`` into one): which norm and where, which
MLP, which positions, how many key/value heads, which layers use a sliding window. It holds architecture only
(no weights, no tokenizer) and is validated when it is made, so a layer can trust what it reads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .._validation import check_positive_int
from ..attention.latent import LatentAttentionConfig
from ..flex.modifiers import ScoreMod, softcap
from ..kernels.activations import ACTIVATIONS
from ..layers.decoder import CROSS_ATTENTION_KINDS
from ..layers.shared_experts import SharedExpertsConfig

__all__ = ["DecoderConfig", "Seq2SeqConfig", "TokenTaggerConfig", "ROPE_TYPES"]
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_LAYER_TYPES = ("full_attention", "sliding_attention")
_QK_NORM_SCOPES = ("head", "projection")


_MAX_SIZE = 2**31 - 1  # no real model comes near it; beyond it a size could only allocate without end
_MAX_LAYERS = 2**20  # one (tiny) entry per layer is built before a checkpoint is read


def _finite_positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a decoder-only Transformer language model.

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
    intermediate_size : int
        F, the hidden width of the MLP.
    max_position_embeddings : int
        The longest context the model was trained for (the size of GPT-2's position table).
    norm : {"layernorm", "rmsnorm"}
    norm_eps : float
    activation : {"silu", "gelu", "gelu_tanh", "relu"}
    mlp : {"gated", "plain", "experts"}
        ``gated``: ``down(act(x @ W_gate) * (x @ W_up))`` (SwiGLU for silu); ``plain``: ``act(x W1 + b1) W2 + b2``;
        ``experts``: a routed mixture of clamped-SwiGLU experts (see ``num_experts``).
    position : {"rotary", "learned"}
        Rotary embeddings on queries and keys, or a learned absolute position table added to the input.
    rope_theta : float
        The rotary base.
    rope_scaling : dict, optional
        Frequency scaling, normalised to Hugging Face's keys with ``"rope_type"`` one of
        ``"default"``, ``"linear"``, ``"dynamic"``, ``"yarn"``, ``"llama3"``, ``"longrope"`` (``None`` =
        ``"default"``).
    rope_interleaved : bool
        Rotate pairs ``(x0, x1), (x2, x3), ...`` (interleaved) instead of ``(x_i, x_{i + Dh/2})`` (half-split,
        the layout of Hugging Face checkpoints).
    partial_rotary_factor : float
        Fraction of each head's features that are rotated (1.0 = all).
    attention_bias : bool
        Biases on the query, key and value projections.
    output_bias : bool
        Bias on the attention output projection.
    mlp_bias : bool
        Biases in the MLP (gated MLPs; a plain MLP always has them).
    qk_norm : bool
        RMS-normalise queries and keys with learned weights (``q_norm``, ``k_norm``) before the rotary
        embedding.
    qk_norm_scope : {"head", "projection"}
        ``head``: over each head's Dh features, one weight per feature shared by the heads (Qwen3);
        ``projection``: over the whole projection, Hq*Dh (queries) and Hkv*Dh (keys) weights (OLMo 2).
    pre_norm : bool
        Normalise the input of the attention and of the MLP (``attn_norm``, ``mlp_norm``).
    post_norm : bool
        Normalise the output of the attention and of the MLP before the residual add (``attn_post_norm``,
        ``mlp_post_norm``; OLMo 2 has only these).
    parallel_residual : bool
        ``x + attention(attn_norm(x)) + mlp(mlp_norm(x))``: both branches read the block's input (GPT-NeoX).
    no_rope_layers : tuple of int
        Indices of layers whose attention has no rotary embedding (SmolLM3's NoPE layers).
    norm_offset : float
        Added to every RMSNorm gain (Gemma's ``1 + weight``: 1.0).
    embedding_scale : float
        The token embeddings are multiplied by it (Gemma: ``sqrt(hidden_size)`` rounded to float32).
    attention_scale : float, optional
        The factor of ``q k^T`` (default ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
    attn_logit_softcap : float, optional
        C: attention scores become ``C * tanh(scores / C)`` before the mask and softmax (Gemma 2).
    final_logit_softcap : float, optional
        C: the output logits become ``C * tanh(logits / C)`` (Gemma 2).
    sliding_rope_theta : float, optional
        The rotary base of the sliding-window layers when it differs from ``rope_theta`` (Gemma 3);
        ``sliding_rope_scaling`` (a normalised scaling dict or None) goes with it.
    sliding_rope_scaling : dict, optional
    attention_sinks : bool
        Every query head has a learned sink logit ``sinks`` (Hq,) that joins its softmax and takes weight from
        the keys without contributing a value (gpt-oss).
    num_experts : int
        E > 0 with ``mlp="experts"``: the mixture-of-experts MLP's experts (gpt-oss); 0 otherwise.
    num_experts_per_tok : int
        k <= E: the experts a router picks per token (softmax over their k router logits).
    swiglu_alpha, swiglu_limit : float
        The experts' clamped SwiGLU: ``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``,
        ``(up + 1) * gate * sigmoid(alpha * gate)`` (gpt-oss: 1.702 and 7.0).
    tie_word_embeddings : bool
        The output head reuses the token embedding matrix.
    sliding_window : int, optional
        W, the number of keys a sliding-window layer sees (itself included).
    layer_types : tuple of {"full_attention", "sliding_attention"}
        One entry per layer; default: every layer full.
    bos_token_id, eos_token_id, pad_token_id : int, tuple of int or None
        Special tokens from the checkpoint (``eos_token_id`` may list several).
    latent : LatentAttentionConfig, optional
        The part that makes every layer's token mixer multi-head latent attention
        (:class:`~attnkit.attention.latent.MultiHeadLatentAttention`, DeepSeek-V3) instead of grouped-query
        attention; its ``hidden_size`` is this config's, ``head_dim`` is its rotary width R, and the cache is a
        :class:`~attnkit.decoding.cache.LatentCache`.
    shared_experts : SharedExpertsConfig, optional
        The part that makes the MLP of every layer past ``first_dense_layers`` a
        :class:`~attnkit.layers.shared_experts.SharedExpertsMoE` (group-limited routing and shared experts); the
        dense layers keep the gated MLP of ``intermediate_size``.

    Examples
    --------
    >>> cfg = DecoderConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4,
    ...                     num_kv_heads=2, head_dim=4, intermediate_size=24)
    >>> cfg.num_groups, cfg.layer_types
    (2, ('full_attention', 'full_attention'))
    >>> cfg.window_of(1) is None
    True
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    activation: str = "silu"
    mlp: str = "gated"
    position: str = "rotary"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleaved: bool = False
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    pre_norm: bool = True
    post_norm: bool = False
    parallel_residual: bool = False
    no_rope_layers: tuple[int, ...] = field(default=())
    norm_offset: float = 0.0
    embedding_scale: float = 1.0
    attention_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict | None = None
    attention_sinks: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default=())
    bos_token_id: int | tuple[int, ...] | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    latent: LatentAttentionConfig | None = None
    shared_experts: SharedExpertsConfig | None = None

    def __post_init__(self) -> None:
        self._check_sizes_and_kinds()
        self._check_rotary()
        self._check_scales()
        self._check_experts()
        self._check_layers()
        self._check_parts()

    def _check_parts(self) -> None:
        latent, shared = self.latent, self.shared_experts
        if latent is not None:
            if not isinstance(latent, LatentAttentionConfig):
                raise TypeError(f"latent must be a LatentAttentionConfig or None, got {type(latent).__name__}")
            if (latent.hidden_size, latent.num_heads) != (self.hidden_size, self.num_heads):
                raise ValueError(f"latent describes hidden_size {latent.hidden_size} and {latent.num_heads} heads, "
                                 f"the model {self.hidden_size} and {self.num_heads}")
            if self.position != "rotary" or self.head_dim != latent.qk_rope_head_dim \
                    or self.rope_interleaved != latent.rope_interleaved or self.partial_rotary_factor != 1.0:
                raise ValueError("latent attention rotates its qk_rope_head_dim features: the model needs "
                                 "position='rotary', head_dim = qk_rope_head_dim, partial_rotary_factor 1 and the "
                                 "same rope_interleaved")
            if self.sliding_window is not None or self.attention_sinks or self.qk_norm or \
                    self.attn_logit_softcap is not None or self.no_rope_layers:
                raise ValueError("latent attention has no sliding window, sinks, q/k norm, soft-cap or NoPE layers "
                                 "in any checkpoint attnkit reads")
        if shared is not None:
            if not isinstance(shared, SharedExpertsConfig):
                raise TypeError(f"shared_experts must be a SharedExpertsConfig or None, got {type(shared).__name__}")
            if self.mlp != "gated" or self.mlp_bias:
                raise ValueError("shared_experts needs mlp='gated' without mlp_bias (its dense layers and experts "
                                 "are gated MLPs without biases)")

    def _check_sizes_and_kinds(self) -> None:
        if not isinstance(self.family, str) or not self.family.isidentifier():
            raise ValueError(f"family must be a model_type such as 'llama' (attnkit.pretrained."
                             f"supported_model_types() lists those with checkpoints), got {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            check_positive_int(getattr(self, name), name, maximum=_MAX_LAYERS if name == "num_layers" else _MAX_SIZE)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        for name, value, allowed in (("norm", self.norm, ("layernorm", "rmsnorm")),
                                     ("activation", self.activation, ACTIVATIONS),
                                     ("mlp", self.mlp, ("gated", "plain", "experts")),
                                     ("position", self.position, ("rotary", "learned")),
                                     ("qk_norm_scope", self.qk_norm_scope, _QK_NORM_SCOPES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if not (self.pre_norm or self.post_norm):
            raise ValueError("pre_norm and post_norm are both False: a block needs a norm before or after its "
                             "branches")
        if self.qk_norm_scope == "projection" and not self.qk_norm:
            raise ValueError("qk_norm_scope='projection' needs qk_norm=True")

    def _check_rotary(self) -> None:
        _finite_positive(self.rope_theta, "rope_theta")
        factor = _finite_positive(self.partial_rotary_factor, "partial_rotary_factor")
        if factor > 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
        if self.position == "rotary" and int(self.head_dim * factor) % 2:
            raise ValueError(f"the rotated features per head (head_dim * partial_rotary_factor = "
                             f"{self.head_dim * factor:g}) must be even")
        for name in ("rope_scaling", "sliding_rope_scaling"):
            scaling = getattr(self, name)
            if scaling is None:
                continue
            if not isinstance(scaling, dict):
                raise TypeError(f"{name} must be a dict or None, got {type(scaling).__name__}")
            kind = scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ValueError(f"{name}['rope_type'] must be one of {', '.join(ROPE_TYPES)}, got {kind!r}")
            if kind == "longrope" and self.position == "rotary":
                half = int(self.head_dim * factor) // 2
                for key in ("short_factor", "long_factor"):
                    if len(scaling.get(key, ())) != half:
                        raise ValueError(f"{name}[{key!r}] must hold one divisor per rotated feature pair "
                                         f"(head_dim * partial_rotary_factor / 2 = {half}), got "
                                         f"{len(scaling.get(key, ()))}")

    def _check_scales(self) -> None:
        _finite_positive(self.norm_eps, "norm_eps")
        if isinstance(self.norm_offset, bool) or not isinstance(self.norm_offset, (int, float)) \
                or not math.isfinite(self.norm_offset):
            raise ValueError(f"norm_offset must be a finite number, got {self.norm_offset!r}")
        _finite_positive(self.embedding_scale, "embedding_scale")
        for name in ("attention_scale", "attn_logit_softcap", "final_logit_softcap", "sliding_rope_theta"):
            if getattr(self, name) is not None:
                _finite_positive(getattr(self, name), name)
        if self.sliding_rope_scaling is not None and self.sliding_rope_theta is None:
            raise ValueError("sliding_rope_scaling needs sliding_rope_theta")

    def _check_experts(self) -> None:
        if self.mlp == "experts":
            check_positive_int(self.num_experts, "num_experts")
            check_positive_int(self.num_experts_per_tok, "num_experts_per_tok")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_experts "
                                 f"({self.num_experts})")
            _finite_positive(self.swiglu_alpha, "swiglu_alpha")
            _finite_positive(self.swiglu_limit, "swiglu_limit")
        elif self.num_experts or self.num_experts_per_tok:
            raise ValueError(f"num_experts and num_experts_per_tok need mlp='experts', got mlp={self.mlp!r}")

    def _check_layers(self) -> None:
        if self.sliding_window is not None:
            check_positive_int(self.sliding_window, "sliding_window")
        types = tuple(self.layer_types) if self.layer_types else ("full_attention",) * self.num_layers
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries but num_layers is {self.num_layers}")
        bad = sorted(set(types) - set(_LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types must hold only {', '.join(_LAYER_TYPES)}, got {bad}")
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
        object.__setattr__(self, "layer_types", types)
        nope = tuple(self.no_rope_layers)
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_layers for i in nope) \
                or len(set(nope)) != len(nope):
            raise ValueError(f"no_rope_layers must hold distinct layer indices in [0, {self.num_layers}), got {nope}")
        if nope and self.position != "rotary":
            raise ValueError("no_rope_layers needs position='rotary'")
        object.__setattr__(self, "no_rope_layers", tuple(sorted(nope)))

    @property
    def num_groups(self) -> int:
        """G = Hq / Hkv, the query heads that share one key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_type(self) -> str:
        """The rotary frequency scaling in use (``"default"`` when none)."""
        return "default" if self.rope_scaling is None else self.rope_scaling.get("rope_type", "default")

    def rotary_of(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates its queries and keys."""
        return self.position == "rotary" and layer not in self.no_rope_layers

    def window_of(self, layer: int) -> int | None:
        """The sliding window W of layer ``layer``, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def score_mod_of(self, layer: int) -> ScoreMod | None:
        """The :mod:`attnkit.flex` score modifier of layer ``layer``'s attention, or None for plain scores.

        Every layer of a family is modified alike today (Gemma 2's soft-capping); the attention layer asks
        here, so a family whose layers differ is a change to this method, not a new flag on the layer.

        >>> DecoderConfig(family="gemma2", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
        ...               head_dim=4, intermediate_size=8, attn_logit_softcap=50.0).score_mod_of(0).cap
        50.0
        """
        return None if self.attn_logit_softcap is None else softcap(self.attn_logit_softcap)


_POSITIONAL = ("sinusoidal", "learned")


def _check_choice(value: Any, name: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


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

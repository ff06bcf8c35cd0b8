"""``LayerwiseConfig``: the part of a decoder config whose layers differ in more than their window.

Gemma 4's text model is the one that has it: its full-attention ("global") layers have wider heads, fewer
key/value heads and keys that are also the values; its last layers compute no keys or values of their own but
attend to those of the last earlier layer of their kind; every layer adds a small per-layer input (a second
embedding of the token, gated by the residual stream) and scales its output by a learned scalar; values are
RMS-normalised without a gain.
"""
from __future__ import annotations

from dataclasses import dataclass

from .._validation import check_positive_int

__all__ = ["LayerwiseConfig"]

_MAX_SIZE = 2**31 - 1


@dataclass(frozen=True)
class LayerwiseConfig:
    """Settings that change from layer to layer (held by :class:`~attnkit.models.DecoderConfig` as ``layerwise``).

    Every layer's output is multiplied by a learned scalar (``layer_scalar``), and every layer that owns its
    values RMS-normalises them without a gain.

    Parameters
    ----------
    global_head_dim : int
        Dh of the ``full_attention`` layers (the sliding layers keep the config's ``head_dim``).
    global_kv_heads : int
        Hkv of the ``full_attention`` layers; must divide ``num_heads``.
    keys_are_values : bool
        The ``full_attention`` layers have no value projection: the values are the key projection's output
        (before the key norm and the rotation), RMS-normalised.
    shared_kv_layers : int
        N: the last N layers reuse the keys and values of the last earlier layer of their own type (sliding or
        full) and have no key/value projections; 0: every layer has its own.
    wide_shared_mlp : bool
        The layers that reuse keys and values have an MLP of twice ``mlp.intermediate_size``.
    per_layer_input_size : int
        P > 0: every layer adds ``norm(W_proj (act(W_gate h) * e_i))``, ``e_i`` (B, L, P) its per-layer input
        (see :class:`~attnkit.layers.per_layer_input.PerLayerInputs`); 0: none.
    per_layer_vocab_size : int
        The rows of the per-layer input embedding (ids at or past it are refused); with P > 0.

    Examples
    --------
    >>> part = LayerwiseConfig(global_head_dim=16, global_kv_heads=1, keys_are_values=True, shared_kv_layers=2)
    >>> part.kv_owners(("sliding_attention", "full_attention", "sliding_attention", "full_attention"))
    (None, None, 0, 1)
    """

    global_head_dim: int
    global_kv_heads: int
    keys_are_values: bool = False
    shared_kv_layers: int = 0
    wide_shared_mlp: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0

    def __post_init__(self) -> None:
        check_positive_int(self.global_head_dim, "global_head_dim", maximum=_MAX_SIZE)
        check_positive_int(self.global_kv_heads, "global_kv_heads", maximum=_MAX_SIZE)
        for name in ("shared_kv_layers", "per_layer_input_size", "per_layer_vocab_size"):
            check_positive_int(getattr(self, name), name, allow_zero=True, maximum=_MAX_SIZE)
        for name in ("keys_are_values", "wide_shared_mlp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if (self.per_layer_input_size == 0) != (self.per_layer_vocab_size == 0):
            raise ValueError(f"per_layer_input_size ({self.per_layer_input_size}) and per_layer_vocab_size "
                             f"({self.per_layer_vocab_size}) must both be positive or both 0")

    def check(self, config) -> None:
        """Refuse what does not fit ``config`` (a DecoderConfig holding this part): the heads, the layers
        that would reuse a kind of layer no earlier layer computes."""
        if config.num_heads % self.global_kv_heads:
            raise ValueError(f"layerwise.global_kv_heads ({self.global_kv_heads}) must divide num_heads "
                             f"({config.num_heads})")
        if self.shared_kv_layers >= config.num_layers:
            raise ValueError(f"layerwise.shared_kv_layers ({self.shared_kv_layers}) must be smaller than "
                             f"num_layers ({config.num_layers}): some layer must compute the keys they reuse")
        if config.norm.placement != "sandwich" or config.residual != "sequential" or config.mlp.kind != "gated":
            raise ValueError(f"layerwise needs norms before and after both branches, a sequential residual and a "
                             f"gated MLP, got norm.placement={config.norm.placement!r}, "
                             f"residual={config.residual!r}, mlp.kind={config.mlp.kind!r}")
        others = sorted(set(config.layer_types) - {"full_attention", "sliding_attention"})
        temperature = config.attention.query_temperature is not None
        if others or temperature or config.attention.qk_norm == "unit_after_rotary":
            raise ValueError(f"layerwise layers are full_attention and sliding_attention layers with weighted q/k "
                             f"norms and no query temperature, got layer types {others}, attention "
                             f"{config.attention}")
        if config.rotary is not None and self.global_head_dim % 2:
            raise ValueError(f"layerwise.global_head_dim must be even with rotary positions, got "
                             f"{self.global_head_dim}")
        self.kv_owners(config.layer_types)

    @property
    def block(self) -> str:
        """The kind of block of every layer (:data:`attnkit.layers.lm_block.BLOCKS`): ``"per_layer_input"``
        with per-layer inputs, else ``"layerwise"`` (the layer scalar only)."""
        return "per_layer_input" if self.per_layer_input_size else "layerwise"

    def kv_owners(self, layer_types: tuple[str, ...]) -> tuple[int | None, ...]:
        """For every layer, None if it computes its keys and values, else the layer whose it reuses."""
        first = len(layer_types) - self.shared_kv_layers
        owners: list[int | None] = [None] * first
        for kind in layer_types[first:]:
            earlier = [i for i in range(first) if layer_types[i] == kind]
            if not earlier:
                raise ValueError(f"layer_types: the last {self.shared_kv_layers} layers reuse keys and values, but "
                                 f"no layer before them is a {kind} layer")
            owners.append(earlier[-1])
        return tuple(owners)

"""``AttentionMamba2Mixer``: attention and a Mamba-2 mixer side by side on the same input, their outputs scaled and
summed (Falcon-H1's ``"hybrid"`` layer), the token mixer of an ``"attention_mamba2"`` layer.

Dimension letters: B batch, L new tokens, D ``hidden_size``.

::

    y = attn_out * attention(attn_in * x) + mamba_out * mamba2(mamba_in * x)

Each factor is a :class:`~attnkit.layers.identity.Scale` part (an identity where it is 1), so the checkpoint's
weights are used as they are and every gradient is the gradient of the checkpoint's own parameters. The layer's
cache entry is the pair of its mixers' (a :class:`~attnkit.attention.cache_entry.PairedCache`): the attention's
keys and values and the Mamba-2 state, so marks, crops and beam reorders move both together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import check_factor
from ..attention.cache_entry import PairedCache
from ..attention.grouped_query import GroupedQueryAttention
from ..core.module import Module
from ..init import as_generator
from .identity import Identity, Scale
from .mamba2 import Mamba2Config, Mamba2Mixer

__all__ = ["AttentionMamba2Config", "AttentionMamba2Mixer"]


@dataclass(frozen=True)
class AttentionMamba2Config:
    """The shape of an ``"attention_mamba2"`` layer: its Mamba-2 half's, and the fixed factors of its two branches
    (Falcon-H1's muP multipliers); the attention half is the decoder's.

    Attributes
    ----------
    mamba2 : Mamba2Config
        The shape of the Mamba-2 half.
    attention_in, attention_out : float, default 1.0
        The attention's input and output factors (``attention_in_multiplier``, ``attention_out_multiplier``).
    mamba_in, mamba_out : float, default 1.0
        The Mamba-2 mixer's (``ssm_in_multiplier``, ``ssm_out_multiplier``).
    """

    mamba2: Mamba2Config
    attention_in: float = 1.0
    attention_out: float = 1.0
    mamba_in: float = 1.0
    mamba_out: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.mamba2, Mamba2Config):
            raise TypeError(f"attention_mamba2.mamba2 must be a Mamba2Config, got {type(self.mamba2).__name__}")
        for name in ("attention_in", "attention_out", "mamba_in", "mamba_out"):
            object.__setattr__(self, name, check_factor(getattr(self, name), f"attention_mamba2.{name}"))


def _scale(factor: float) -> Module:
    return Identity() if factor == 1.0 else Scale(factor)


class AttentionMamba2Mixer(Module):
    """Grouped-query attention and a :class:`~attnkit.layers.mamba2.Mamba2Mixer` reading the same (normed) input,
    their scaled outputs summed.

    Parameters
    ----------
    config : DecoderConfig
        The attention's settings, and the layer's part (``config.layers[layer_index].part``, an
        :class:`AttentionMamba2Config`: the Mamba-2 shape and the factors).
    layer_index : int
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    attn : GroupedQueryAttention
    mamba : Mamba2Mixer
    attn_in, attn_out, mamba_in, mamba_out : Scale or Identity

    Shapes
    ------
    x : (B, L, D) -> (B, L, D); with ``output_attentions=True`` also the attention's weights (B, Hq, L, S).

    Examples
    --------
    >>> from attnkit.layers import AttentionMamba2Config, AttentionMamba2Mixer, Mamba2Config
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="falcon_h1", vocab_size=8, hidden_size=8, num_layers=1, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(8), layer_types=("attention_mamba2",),
    ...                     mixer_parts=(AttentionMamba2Config(Mamba2Config(num_heads=2, head_dim=4, state_size=3),
    ...                                                        attention_in=0.5, mamba_out=2.0),))
    >>> mixer = AttentionMamba2Mixer(cfg, 0, rng=0)
    >>> y = mixer(np.ones((2, 5, 8)))
    >>> y.shape, mixer.backward(np.ones_like(y)).shape, type(mixer.attn_out).__name__
    ((2, 5, 8), (2, 5, 8), 'Identity')
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        factors = config.layers[layer_index].part
        self.layer_index = layer_index
        self.attn_in = _scale(factors.attention_in)
        self.attn = GroupedQueryAttention(config, layer_index, rng=gen)
        self.attn_out = _scale(factors.attention_out)
        self.mamba_in = _scale(factors.mamba_in)
        self.mamba = Mamba2Mixer(config, layer_index, shape=factors.mamba2, rng=gen)
        self.mamba_out = _scale(factors.mamba_out)

    def head_writer(self) -> tuple[GroupedQueryAttention, float]:
        """The module whose ``W_O`` rows write the heads' outputs, and the factor after it (``attention_out``):
        what direct logit attribution splits into heads; the rest of the output is the Mamba-2 half's."""
        return self.attn, getattr(self.attn_out, "factor", 1.0)

    def new_cache(self, batch_size: int, max_length: int | None = None, *, dtype: Any = None,
                  rollback: int = 0) -> PairedCache:
        """The layer's cache entry: the attention's keys and values beside the Mamba-2 half's state, which go
        back and are reordered together (:class:`~attnkit.attention.cache_entry.PairedCache`)."""
        return PairedCache(self.attn.new_cache(batch_size, max_length, dtype=dtype, rollback=rollback),
                           self.mamba.new_cache(batch_size, dtype=dtype))

    # The hook points are the two mixers' own: the attention's (hook_q, ..., hook_pattern, hook_z) then the
    # Mamba-2's (hook_conv_out, hook_ssm_out); a hook is installed on the mixer that owns the point.
    def _owner(self, point: str) -> Module:
        return self.attn if point in self.attn.hook_points() else self.mamba

    def hook_points(self) -> tuple[str, ...]:
        """The attention's hook points, then the Mamba-2 mixer's (``hook_conv_out``, ``hook_ssm_out``)."""
        return (*self.attn.hook_points(), *self.mamba.hook_points())

    def add_hook(self, point: str, fn, *, full_name: str, direction: str = "forward") -> None:
        """:meth:`Module.add_hook` on the mixer that owns ``point``."""
        if point not in self.hook_points():
            raise ValueError(f"{type(self).__name__} has no hook point {point!r}; it has {list(self.hook_points())}")
        self._owner(point).add_hook(point, fn, full_name=full_name, direction=direction)

    def remove_hook(self, point: str, fn, direction: str = "forward") -> None:
        """Undo one :meth:`add_hook`."""
        self._owner(point).remove_hook(point, fn, direction)

    def hook_replaced(self, name: str) -> bool:
        """Whether the last forward replaced the value at point ``name``."""
        return self._owner(name).hook_replaced(name)

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """The layer's output (B, L, D) (and the attention's weights with ``output_attentions=True``)."""
        kwargs = dict(rotary=rotary, attention_mask=attention_mask, cache=cache)
        attended = self.attn(self.attn_in(x), output_attentions=output_attentions, **kwargs)
        weights = None
        if output_attentions:
            attended, weights = attended
        mixed = self.mamba(self.mamba_in(x), **kwargs)  # (B, L, D)
        y = self.attn_out(attended) + self.mamba_out(mixed)  # (B, L, D)
        return (y, weights) if output_attentions else y

    def step(self, x: np.ndarray, *, rotary=None, attention_mask: np.ndarray | None = None,
             cache=None) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): both mixers' steps with the cache, nothing saved."""
        kwargs = dict(rotary=rotary, attention_mask=attention_mask, cache=cache)
        attended = self.attn.step(self.attn_in.step(x), **kwargs)  # (B, D)
        mixed = self.mamba.step(self.mamba_in.step(x), **kwargs)  # (B, D)
        return self.attn_out.step(attended) + self.mamba_out.step(mixed)  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Both branches' input gradients, summed (B, L, D); the parameters' into their ``grads``."""
        g = np.asarray(grad_output)
        g_attn = self.attn_in.backward(self.attn.backward(self.attn_out.backward(g)))  # (B, L, D)
        return g_attn + self.mamba_in.backward(self.mamba.backward(self.mamba_out.backward(g)))  # (B, L, D)

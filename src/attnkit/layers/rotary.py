"""``RotaryEmbedding``: the cos/sin tables of a decoder's rotary position embedding, from its rotary part.

Dimension letters: B batch, L positions, R rotated features per head (``head_dim * partial_rotary_factor``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.module import Module
from ..kernels import rotary as _rotary

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(Module):
    """cos/sin of the rotary angles for given positions; no parameters.

    Parameters
    ----------
    rotary : RotaryConfig
        The base, scaling, layout and rotated fraction (a :class:`~attnkit.models.DecoderConfig`'s ``rotary``, or
        its ``rotary_of(layer)``).
    head_dim : int
        Dh; ``head_dim * rotary.partial_factor`` features are rotated.
    max_position_embeddings : int
        The context the tables must stay finite over (and the scalings' original context where they need one).

    Shapes
    ------
    position_ids : (B, L) int, the rotary position of every token (from the attention mask, not the cache
    slot) -> cos, sin : (B, L, R) in ``dtype``, laid out for :func:`attnkit.kernels.rotary.rotary_apply`.

    Raises
    ------
    ValueError
        A scaling whose cos/sin tables, over the positions below ``max_position_embeddings``, would not be
        finite in float16 (the narrowest dtype they are computed in): an attention factor above 65504, not
        positive or NaN, or frequencies whose angles overflow (see
        :func:`attnkit.kernels.rotary.rotary_table_fault`).

    Notes
    -----
    ``dynamic`` scaling depends on the longest position in the call (``max(position_ids) + 1``); it is a pure
    function of its input, so a call gives what Hugging Face's module gives on a fresh instance.

    Examples
    --------
    >>> from attnkit.models import RotaryConfig
    >>> cos, sin = RotaryEmbedding(RotaryConfig(), head_dim=4, max_position_embeddings=8)(np.array([[0, 1]]))
    >>> cos.shape, cos[0, 0].tolist(), round(float(sin[0, 1, 0]), 4)
    ((1, 2, 4), [1.0, 1.0, 1.0, 1.0], 0.8415)
    """

    def __init__(self, rotary, head_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rotary.partial_factor)
        self.theta = rotary.theta
        self.scaling = None if rotary.scaling is None else dict(rotary.scaling)
        self.interleaved = rotary.interleaved
        self.max_position_embeddings = max_position_embeddings
        with np.errstate(all="ignore"):  # overflowing frequencies are refused below, by what they make
            self.inv_freq, self.attention_factor = _rotary.rotary_frequencies(
                self.rotary_dim, self.theta, self.scaling, max_position_embeddings=self.max_position_embeddings)
        # dynamic and longrope frequencies depend on the longest position of the call
        self.dynamic = rotary.kind in ("dynamic", "longrope")
        self._refuse_overflowing_tables()

    def _refuse_overflowing_tables(self) -> None:
        """Refuse a scaling whose cos/sin tables would hold inf or NaN (and the logits NaN) over the context.

        Every frequency set a call can use is checked: the one built here and, for ``longrope``, the long
        factors used past ``original_max_position_embeddings``. ``dynamic`` only grows the base, which lowers
        the frequencies. The tables must be finite in float16, the narrowest dtype :meth:`forward` makes them in.
        """
        sets = [(self.inv_freq, self.attention_factor)]
        if self.scaling is not None and self.scaling.get("rope_type") == "longrope":
            with np.errstate(all="ignore"):
                sets.append(_rotary.rotary_frequencies(
                    self.rotary_dim, self.theta, self.scaling, max_position_embeddings=self.max_position_embeddings,
                    seq_len=self.scaling["original_max_position_embeddings"] + 1))
        for inv_freq, factor in sets:
            fault = _rotary.rotary_table_fault(inv_freq, factor, self.max_position_embeddings)
            if fault is not None:
                largest = float(np.max(inv_freq)) if np.size(inv_freq) else 0.0
                raise ValueError(f"RotaryEmbedding: rope_scaling {self.scaling!r} makes the cos/sin tables of "
                                 f"positions below {self.max_position_embeddings} not finite in "
                                 f"{_rotary.TABLE_DTYPE} (the {fault}: attention factor {factor!r}, inverse "
                                 f"frequencies up to {largest!r})")

    def extra_repr(self) -> str:
        kind = "default" if self.scaling is None else self.scaling.get("rope_type", "default")
        return f"rotary_dim={self.rotary_dim}, theta={self.theta}, rope_type={kind!r}, interleaved={self.interleaved}"

    def forward(self, position_ids: Any, dtype=np.float32):
        """cos, sin (B, L, R) for ``position_ids`` (B, L)."""
        position_ids = np.asarray(position_ids)
        if position_ids.ndim != 2 or position_ids.dtype.kind not in "iu":
            raise ValueError(f"RotaryEmbedding: position_ids must be a 2-D integer array (B, L), got shape "
                             f"{position_ids.shape} and dtype {position_ids.dtype}")
        inv_freq, factor = self.inv_freq, self.attention_factor
        if self.dynamic and position_ids.size:
            inv_freq, factor = _rotary.rotary_frequencies(
                self.rotary_dim, self.theta, self.scaling, max_position_embeddings=self.max_position_embeddings,
                seq_len=int(position_ids.max()) + 1)
        return _rotary.rotary_cos_sin(position_ids, inv_freq, factor, interleaved=self.interleaved, dtype=dtype)

    def backward(self, grad_output: Any) -> None:
        """Positions are integers: nothing to differentiate."""
        return

"""The decoding cache of a layer that keeps a fixed-size state instead of keys and values (Gated DeltaNet, a short
convolution, Mamba-2): a dataclass of arrays, each with the batch on its first axis, and ``length``.

:class:`RecurrentState` gives such a dataclass what :class:`~attnkit.decoding.cache.ModelCache` asks of a state
(``reorder``, ``copy``, ``cleared``, ``nbytes``), written once over its array fields, so a new state layer declares
its fields and nothing else. :class:`StateMixer` is what such a layer does as a model's token mixer (its state
and mask from the model's), and :func:`step_padding` what its one-token step reads of the model's mask.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["RecurrentState", "StateMixer", "step_padding"]


def step_padding(attention_mask: Any, dtype: Any) -> np.ndarray | None:
    """A decoding step's rows as multipliers (B, 1) in ``dtype``: 1 for a real token, 0 for padding (a padded
    input is zeroed, as the forward zeroes it), from ``attention_mask`` (B,) or the model's (B, P + 1), whose
    last column is this position's; None for no mask."""
    if attention_mask is None:
        return None
    mask = np.asarray(attention_mask)
    return mask.reshape(mask.shape[0], -1)[:, -1:].astype(dtype)  # (B, 1)


class StateMixer:
    """A state layer as a decoder block's token mixer: put before the layer's class in the bases. The model hands
    its whole mask (B, P + L) and its cache; the layer reads the last L columns and its own state
    (``cache.state(layer_index)``)."""

    layer_index: int

    def _model_inputs(self, x: Any, attention_mask: Any, cache: Any) -> tuple[np.ndarray | None, Any]:
        """The layer's mask (B, L) of the new positions (or None) and its state in ``cache`` (or None)."""
        length = np.shape(x)[1]
        mask = None if attention_mask is None else np.asarray(attention_mask)[:, -length:]  # (B, L)
        return mask, None if cache is None else cache.state(self.layer_index)

    def step(self, x: np.ndarray, *, rotary=None, attention_mask: np.ndarray | None = None,
             cache=None) -> np.ndarray:
        """One decoding step (B, D) -> (B, D) with the model's cache (the layer's own ``step`` on its state)."""
        if cache is None:
            raise ValueError(f"{type(self).__name__}.step needs the model's cache")
        return super().step(x, cache=cache.state(self.layer_index), attention_mask=attention_mask)


class RecurrentState:
    """Base of a state layer's cache: a subclass is a ``@dataclass`` of arrays (batch first) and ``length: int``."""

    length: int

    def _arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}

    def reorder(self, index: Any) -> None:
        """Make row ``r`` a copy of row ``index[r]`` (beam search: rows may repeat; the batch size follows).

        Parameters
        ----------
        index : (B',) int
        """
        arrays = self._arrays()
        index, batch = np.asarray(index), next(iter(arrays.values())).shape[0]
        if index.ndim != 1 or index.dtype.kind not in "iu" or index.size == 0:
            raise ValueError(f"index must be a non-empty 1-D integer array, got shape {index.shape} "
                             f"and dtype {index.dtype}")
        if index.min() < -batch or index.max() >= batch:
            raise ValueError(f"index must hold rows in [0, {batch}), got {index.min()}..{index.max()}")
        for name, array in arrays.items():
            setattr(self, name, array[index])  # (B', ...)

    def copy(self):
        """An independent copy (what :meth:`attnkit.decoding.cache.ModelCache.mark` keeps)."""
        return dataclasses.replace(self, **{name: array.copy() for name, array in self._arrays().items()})

    def cleared(self):
        """The state of no position yet (zeros), with this one's shapes and dtypes."""
        return dataclasses.replace(self, length=0,
                                   **{name: np.zeros_like(array) for name, array in self._arrays().items()})

    @property
    def nbytes(self) -> int:
        """Bytes held: the same for every length."""
        return sum(array.nbytes for array in self._arrays().values())

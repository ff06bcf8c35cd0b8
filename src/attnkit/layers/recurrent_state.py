"""The decoding cache of a layer that keeps a fixed-size state instead of keys and values (Gated DeltaNet, a short
convolution, Mamba-2): a dataclass of arrays, each with the batch on its first axis, and ``length``.

:class:`RecurrentState` gives such a dataclass what :class:`~attnkit.decoding.cache.ModelCache` asks of a state
(``reorder``, ``copy``, ``cleared``, ``nbytes``), written once over its array fields, so a new state layer declares
its fields and nothing else.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["RecurrentState"]


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

"""Shared argument checks for the explain functions: token ids of one sequence or a batch."""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_array


def as_id_batch(ids: Any, vocab_size: int, name: str = "ids") -> tuple[np.ndarray, bool]:
    """``(ids (B, L) int64, was_one_sequence)``; ``ids`` is (L,) or (B, L) integers in [0, vocab_size), the
    argument ``name`` (rows of different lengths are refused naming it, as the model's forward does)."""
    arr = as_array(ids, name)
    if arr.dtype.kind not in "iu" or arr.ndim not in (1, 2) or arr.shape[-1] == 0:
        raise ValueError(f"{name} must be a non-empty integer array (L,) or (B, L), got shape {arr.shape} and dtype "
                         f"{arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"{name} must lie in [0, {vocab_size}), got values from {int(arr.min())} to "
                         f"{int(arr.max())}")
    single = arr.ndim == 1
    return arr.reshape(1, -1).astype(np.int64) if single else arr.astype(np.int64), single


def check_position(position: Any, length: int, name: str = "target_position") -> int:
    """``position`` as an index in [0, length), negative values counting from the end."""
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(position).__name__}")
    if not -length <= position < length:
        raise ValueError(f"{name} must be in [-{length}, {length}) for a sequence of {length} tokens, "
                         f"got {position}")
    return int(position) % length

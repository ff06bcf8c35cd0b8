"""Reshaping between the model dimension and attention heads (unchecked kernels)."""
from __future__ import annotations

import numpy as np

__all__ = ["split_heads", "merge_heads"]


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """(..., L, H * Dh) -> (..., H, L, Dh); head h takes features ``h*Dh:(h+1)*Dh``."""
    *lead, length, d = x.shape
    x = x.reshape(*lead, length, num_heads, d // num_heads)  # (..., L, H, Dh)
    return np.swapaxes(x, -2, -3)  # (..., H, L, Dh)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(..., H, L, Dh) -> (..., L, H * Dh), the inverse of :func:`split_heads`."""
    *lead, h, length, dh = x.shape
    return np.swapaxes(x, -2, -3).reshape(*lead, length, h * dh)  # (..., L, H*Dh)

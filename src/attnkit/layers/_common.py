"""Checks and helpers shared by the layers of :mod:`attnkit.layers` (not public API)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_float_array, check_ndim

__all__ = ["check_features", "check_grad_output"]


def check_features(x: Any, name: str, features: int, owner: str, feature_name: str) -> np.ndarray:
    """``x`` as a float array of at least 1 dim whose last axis has ``features`` entries."""
    x = as_float_array(x, name)
    check_ndim(x, name, min_ndim=1, expected=f"at least 1-D (..., {feature_name}={features})")
    if x.shape[-1] != features:
        raise ValueError(f"{owner}: {name} has {x.shape[-1]} features, expected {feature_name} = {features} "
                         f"(got shape {x.shape})")
    return x


def check_grad_output(grad_output: Any, expected_shape: tuple[int, ...], dtype: np.dtype, owner: str) -> np.ndarray:
    """``grad_output`` as an array of the forward output's shape, in the forward's compute dtype."""
    g = as_float_array(grad_output, "grad_output")
    if g.shape != tuple(expected_shape):
        raise ValueError(f"{owner}: grad_output has shape {g.shape}, expected the output shape {tuple(expected_shape)}")
    return g.astype(dtype, copy=False)

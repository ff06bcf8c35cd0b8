"""A norm held at the scale one run gave it: linear in its input, so the parts of a sum can go through it one by one.

``norm(x) = center(x) * scale + shift`` with ``scale = gain / rms(x)`` (or ``/ std(x)``) taken at the run's ``x``:
direct logit attribution and the cache's ``apply_ln`` (TransformerLens's "cached scale") split a residual stream
this way. An absent norm (:class:`~attnkit.layers.identity.Identity`) has scale 1 and no shift, a fixed factor
(:class:`~attnkit.layers.identity.Scale`, Granite's residual multiplier) that factor and no shift.

Shapes: D model width; ``x`` (..., D).
"""
from __future__ import annotations

import numpy as np

from ..kernels.norm import layer_norm_forward
from ..kernels.rms_norm import rms_norm_forward
from ..layers.identity import Identity, Scale
from ..layers.layer_norm import LayerNorm

__all__ = ["frozen_norm"]


def frozen_norm(norm, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(scale (..., D), shift (D,), center)`` of ``norm`` at ``x`` (..., D); ``center``: the norm subtracts the
    mean first (LayerNorm)."""
    if isinstance(norm, Identity):
        return np.ones_like(x), np.zeros(x.shape[-1], x.dtype), False
    if isinstance(norm, Scale):
        return np.full_like(x, norm.factor), np.zeros(x.shape[-1], x.dtype), False
    if isinstance(norm, LayerNorm):
        _, _, rstd = layer_norm_forward(x, norm.gamma, norm.beta, norm.eps)  # (..., 1)
        return (rstd * norm.gamma).astype(x.dtype), norm.beta.astype(x.dtype), True
    gain = norm.gamma + norm.gamma.dtype.type(norm.offset)
    _, _, rstd = rms_norm_forward(x, gain, norm.eps)  # (..., 1)
    return (rstd * gain).astype(x.dtype), np.zeros(x.shape[-1], x.dtype), False

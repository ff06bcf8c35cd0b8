"""Gradient clipping by the global L2 norm, as ``torch.nn.utils.clip_grad_norm_``."""
from __future__ import annotations

import numpy as np

from ..core.module import Module
from .optimizer import check_hyper

__all__ = ["clip_grad_norm"]


def clip_grad_norm(module: Module, max_norm: float) -> float:
    """Scale every gradient of ``module`` in place so that their global L2 norm is at most ``max_norm``.

    ``total = sqrt(sum of every squared gradient entry)``; when ``total > max_norm`` each gradient is
    multiplied by ``max_norm / (total + 1e-6)`` (torch's formula). A non-finite total propagates into the
    gradients, as in torch; check the returned value to skip such steps.

    Parameters
    ----------
    module : Module
    max_norm : float
        Largest allowed global norm (> 0).

    Returns
    -------
    float
        The global norm before clipping.

    Examples
    --------
    >>> from attnkit.layers import Projection
    >>> proj = Projection(2, 2, rng=0)
    >>> proj.grads["W"][:] = 3.0
    >>> proj.grads["b"][:] = 0.0
    >>> clip_grad_norm(proj, 1.0)
    6.0
    >>> round(float(np.linalg.norm(proj.grads["W"])), 6)
    1.0
    """
    if not isinstance(module, Module):
        raise TypeError(f"module must be an attnkit Module, got {type(module).__name__}")
    max_norm = check_hyper(max_norm, "max_norm", low_inclusive=False)
    grads = [g for _, g in module.named_gradients()]
    total = float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads)))
    coef = max_norm / (total + 1e-6)
    if not coef >= 1.0:  # also scales (to NaN) when total is not finite, as torch does
        for g in grads:
            g *= coef
    return total

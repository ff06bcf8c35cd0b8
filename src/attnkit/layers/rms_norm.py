"""``RMSNorm``: root-mean-square normalisation over the last axis with a learnable gain.

Dimension letters: ``...`` any leading dims, D ``normalized_shape``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..kernels import decode_step as _step
from ..kernels import rms_norm as _rms

__all__ = ["RMSNorm"]


class RMSNorm(Module):
    """``y = (offset + gamma) * x / sqrt(mean(x^2) + eps)`` over the last axis (no centring, no shift).

    Parameters
    ----------
    normalized_shape : int
        Size D of the normalised (last) axis.
    eps : float, default 1e-6
        Added to the mean square.
    offset : float, default 0.0
        Added to the gain: Gemma stores ``gamma - 1`` (its RMSNorm multiplies by ``1 + weight``), so its
        norms have ``offset=1.0`` and load the checkpoint's weights unchanged.

    Attributes
    ----------
    gamma : ndarray, shape (D,), starts at ones; ``grads["gamma"]`` the same.

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype; float16 inputs are normalised in float32.

    Examples
    --------
    >>> norm = RMSNorm(2, eps=0.0)
    >>> norm(np.array([[3.0, 4.0]])).round(4)  # the root mean square of (3, 4) is sqrt(12.5)
    array([[0.8485, 1.1314]])
    >>> norm.backward(np.array([[3.0, 4.0]])).round(6)  # scaling x along itself changes nothing
    array([[0., 0.]])
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.normalized_shape = check_positive_int(normalized_shape, "normalized_shape")
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating)) or not eps >= 0:
            raise ValueError(f"eps must be a non-negative number, got {eps!r}")
        self.eps = float(eps)
        if isinstance(offset, bool) or not isinstance(offset, (int, float, np.floating)) or not np.isfinite(offset):
            raise ValueError(f"offset must be a finite number, got {offset!r}")
        self.offset = float(offset)
        self.register_parameter("gamma", np.ones(self.normalized_shape))

    def extra_repr(self) -> str:
        return f"normalized_shape={self.normalized_shape}, eps={self.eps}" + (f", offset={self.offset}" if self.offset
                                                                              else "")

    def _gain(self) -> np.ndarray:
        gamma = self._parameters["gamma"]
        return gamma + gamma.dtype.type(self.offset) if self.offset else gamma  # (D,)

    def forward(self, x: Any) -> np.ndarray:
        """Normalise ``x`` (..., D); saves the normalised input and ``1 / rms`` for :meth:`backward`."""
        x = check_features(x, "x", self.normalized_shape, "RMSNorm", "normalized_shape")
        y, x_hat, rstd = _rms.rms_norm_forward(x, self._gain(), self.eps)  # (..., D), (..., 1)
        self.save_for_backward(x_hat, rstd, x.dtype)
        return y

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): :meth:`forward`'s numbers without saving."""
        return _step.rms_norm_into(x, self._gain(), self.eps, np.empty_like(x), np.empty_like(x))  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the gradient of ``gamma`` into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("RMSNorm.backward called before forward")
        x_hat, rstd, dtype = self.saved_tensors
        g = check_grad_output(grad_output, x_hat.shape, dtype, "RMSNorm")
        grad_x, grad_gamma = _rms.rms_norm_backward(g, x_hat, rstd, self._gain())
        self.grads["gamma"] += grad_gamma
        return grad_x

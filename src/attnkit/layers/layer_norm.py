"""``LayerNorm``: layer normalisation over the last axis with a learnable gain and shift.

Dimension letters: ``...`` any leading dims, D ``normalized_shape``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_eps, check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..kernels import norm as _norm

__all__ = ["LayerNorm"]


class LayerNorm(Module):
    """``y = gamma * (x - mean) / sqrt(var + eps) + beta`` over the last axis (biased variance, as torch).

    Parameters
    ----------
    normalized_shape : int or tuple of one int
        Size D of the normalised (last) axis.
    eps : float, default 1e-6
        Added to the variance; a finite number > 0 (note: ``torch.nn.LayerNorm`` defaults to 1e-5).

    Attributes
    ----------
    gamma : ndarray, shape (D,), starts at ones
    beta : ndarray, shape (D,), starts at zeros
    grads : dict with ``"gamma"`` and ``"beta"``.

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype. float16 inputs are normalised in float32 (their
    variance would overflow float16 above activations of ~256) and the result is rounded back to float16.

    Examples
    --------
    >>> ln = LayerNorm(3)
    >>> ln(np.array([[1.0, 2.0, 3.0]])).round(4)
    array([[-1.2247,  0.    ,  1.2247]])
    >>> ln.backward(np.ones((1, 3))).round(6)  # shifting every input alike changes nothing
    array([[0., 0., 0.]])
    >>> ln.grads["beta"]
    array([1., 1., 1.])
    """

    def __init__(self, normalized_shape: int | tuple[int], eps: float = 1e-6) -> None:
        super().__init__()
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ValueError(f"normalized_shape must be an int or a tuple of one int (the last axis), "
                                 f"got {tuple(normalized_shape)}")
            normalized_shape = normalized_shape[0]
        self.normalized_shape = check_positive_int(normalized_shape, "normalized_shape")
        self.eps = check_eps(eps)
        self.register_parameter("gamma", np.ones(self.normalized_shape))
        self.register_parameter("beta", np.zeros(self.normalized_shape))

    def extra_repr(self) -> str:
        return f"normalized_shape={self.normalized_shape}, eps={self.eps}"

    def forward(self, x: Any) -> np.ndarray:
        """Normalise ``x`` (..., D); saves the normalised input and ``1 / std`` for :meth:`backward`."""
        x = check_features(x, "x", self.normalized_shape, "LayerNorm", "normalized_shape")
        y, x_hat, rstd = _norm.layer_norm_forward(x, self._parameters["gamma"], self._parameters["beta"],
                                                  self.eps)  # (..., D), (..., D), (..., 1)
        self.save_for_backward(x_hat, rstd, x.dtype)
        return y

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): :meth:`forward`'s kernel on the rows, nothing saved."""
        return _norm.layer_norm_forward(x, self._parameters["gamma"], self._parameters["beta"], self.eps)[0]

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the gradients of ``gamma`` and ``beta`` into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("LayerNorm.backward called before forward")
        x_hat, rstd, dtype = self.saved_tensors
        g = check_grad_output(grad_output, x_hat.shape, dtype, "LayerNorm")
        grad_x, grad_gamma, grad_beta = _norm.layer_norm_backward(g, x_hat, rstd, self._parameters["gamma"])
        self.grads["gamma"] += grad_gamma
        self.grads["beta"] += grad_beta
        return grad_x

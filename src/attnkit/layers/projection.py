"""``Projection``: the learnable affine map ``x @ W + b`` (``torch.nn.Linear``, with ``W`` transposed).

Dimension letters: ``...`` any leading dims, In ``in_features``, Out ``out_features``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, xavier_uniform
from ..kernels.linear import linear, linear_backward

__all__ = ["Projection"]


class Projection(Module):
    """Affine projection ``y = x @ W + b``.

    ``W`` is stored as (in_features, out_features) and applied as ``x @ W``; ``torch.nn.Linear`` stores the
    transpose, so copy from it with ``W = linear.weight.T``.

    Parameters
    ----------
    in_features : int
    out_features : int
    bias : bool, default True
        Learn an additive bias ``b``.
    rng : numpy.random.Generator or int, optional
        Source of the Glorot-uniform initial ``W`` (``b`` starts at zero).

    Attributes
    ----------
    W : ndarray, shape (In, Out)
    b : ndarray, shape (Out,), only when ``bias``
    grads : dict with ``"W"`` (and ``"b"``), filled by :meth:`backward`.

    Shapes
    ------
    x : (..., In) -> y : (..., Out), in ``x``'s float dtype (integers compute in float64).

    Examples
    --------
    >>> proj = Projection(3, 2, rng=0)
    >>> x = np.ones((4, 5, 3))
    >>> y = proj(x)
    >>> y.shape
    (4, 5, 2)
    >>> np.allclose(y, x @ proj.W + proj.b)
    True
    >>> grad_x = proj.backward(np.ones_like(y))
    >>> grad_x.shape, proj.grads["W"].shape
    ((4, 5, 3), (3, 2))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.in_features = check_positive_int(in_features, "in_features")
        self.out_features = check_positive_int(out_features, "out_features")
        self.bias = bool(bias)
        self.register_parameter("W", xavier_uniform(as_generator(rng), self.in_features, self.out_features))
        if self.bias:
            self.register_parameter("b", np.zeros(self.out_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias}"

    def forward(self, x: Any) -> np.ndarray:
        """Return ``x @ W + b`` (..., Out); saves ``x`` for :meth:`backward`."""
        x = check_features(x, "x", self.in_features, "Projection", "in_features")
        self.save_for_backward(x)
        return linear(x, self._parameters["W"], self._parameters.get("b"))  # (..., Out)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the gradients of ``W`` (and ``b``) into ``self.grads``; return ``grad_x`` (..., In)."""
        if self.saved_tensors is None:
            raise RuntimeError("Projection.backward called before forward")
        (x,) = self.saved_tensors
        g = check_grad_output(grad_output, x.shape[:-1] + (self.out_features,), x.dtype, "Projection")
        grad_x, grad_w, grad_b = linear_backward(g, x, self._parameters["W"], need_bias=self.bias,
                                                 need_weight=self.grads.wanted)  # (..., In)
        self.grads.add("W", grad_w)
        if self.bias:
            self.grads.add("b", grad_b)
        return grad_x

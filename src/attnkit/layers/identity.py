"""``Identity``: the part a block holds where its architecture has none (a norm it does not place)."""
from __future__ import annotations

from typing import Any

from ..core.module import Module

__all__ = ["Identity"]


class Identity(Module):
    """Returns its input; its backward returns the gradient. No parameters.

    A block built without a norm before (or after) a branch holds an ``Identity`` there, so its forward reads
    the same whatever the architecture.

    Shapes
    ------
    x : any -> the same array.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.ones(3)
    >>> Identity()(x) is x, Identity().backward(x) is x
    (True, True)
    """

    def forward(self, x: Any) -> Any:
        """``x`` itself."""
        return x

    def step(self, x: Any, **kwargs: Any) -> Any:
        """``x`` itself (a decoding step's absent norm)."""
        return x

    def backward(self, grad_output: Any) -> Any:
        """``grad_output`` itself."""
        return grad_output

"""``Identity``, ``Zero`` and ``Scale``: the parts a block holds where its architecture has none (a norm it does
not place, a branch it does not add) or a fixed factor (Granite's residual multiplier)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.module import Module

__all__ = ["Identity", "Zero", "Scale"]


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


class Zero(Module):
    """Returns zeros of its input's shape; its backward returns zeros. No parameters.

    A branch that adds to a sum and is absent from an architecture (a mixture of experts without a shared
    expert) is a ``Zero``, so the sum reads the same whatever the architecture.

    Shapes
    ------
    x : any -> zeros of x's shape and dtype.

    Examples
    --------
    >>> import numpy as np
    >>> Zero()(np.ones(3)), Zero().backward(np.ones(3))
    (array([0., 0., 0.]), array([0., 0., 0.]))
    """

    def forward(self, x: Any) -> Any:
        """Zeros of ``x``'s shape and dtype."""
        return np.zeros_like(x)

    def step(self, x: Any, **kwargs: Any) -> Any:
        """Zeros of a decoding step's rows' shape and dtype."""
        return np.zeros_like(x)

    def backward(self, grad_output: Any) -> Any:
        """Zeros of ``grad_output``'s shape and dtype: nothing reaches the input."""
        return np.zeros_like(grad_output)


class Scale(Module):
    """Multiplies its input by a fixed factor (no parameter); its backward multiplies the gradient by it.

    A residual branch whose output is scaled before it joins the stream (Granite's ``residual_multiplier``)
    holds a ``Scale`` after its post-norm; the other architectures hold an :class:`Identity` there.

    Parameters
    ----------
    factor : float
        Applied in the input's dtype (``x * dtype(factor)``).

    Shapes
    ------
    x : any float array -> the same shape and dtype.

    Examples
    --------
    >>> import numpy as np
    >>> Scale(0.5)(np.ones(2, np.float32)), Scale(0.5).backward(np.ones(2))
    (array([0.5, 0.5], dtype=float32), array([0.5, 0.5]))
    """

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = float(factor)

    def extra_repr(self) -> str:
        return f"factor={self.factor}"

    def forward(self, x: Any) -> Any:
        """``x * factor`` in ``x``'s dtype."""
        x = np.asarray(x)
        return x * x.dtype.type(self.factor)

    def step(self, x: Any, **kwargs: Any) -> Any:
        """:meth:`forward` of a decoding step's rows."""
        return self.forward(x)

    def backward(self, grad_output: Any) -> Any:
        """``grad_output * factor``."""
        g = np.asarray(grad_output)
        return g * g.dtype.type(self.factor)

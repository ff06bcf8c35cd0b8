"""``XIELUMLP``: the ungated feed-forward network of Apertus, ``xielu(x W_up) W_down`` with the activation's two
learned slopes (:mod:`attnkit.kernels.xielu`).

Dimension letters: ``...`` any leading dims, D ``hidden_size``, F ``intermediate_size``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import xielu as _xielu
from ..kernels.linear import linear, linear_backward
from .gated_mlp import check_mlp_sizes

__all__ = ["XIELUMLP"]

# transformers' XIELUActivation: the slopes start at 0.8 (a_n = beta + softplus(alpha_n)), beta at 0.5, eps at -1e-6
BETA, EPS = 0.5, -1e-6
_INIT_P, _INIT_N = math.log(math.expm1(0.8)), math.log(math.expm1(0.8 - BETA))
_XIELU = ("alpha_p", "alpha_n", "beta", "eps")


class XIELUMLP(Module):
    """``y = xielu(x W_up) W_down``, no biases; xIELU's slopes ``alpha_p``, ``alpha_n`` and its ``beta``, ``eps``
    are parameters (``beta`` and ``eps`` are buffers in transformers, which does not train them).

    Parameters
    ----------
    hidden_size : int
        D.
    intermediate_size : int
        F.
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (xIELU's parameters start as transformers' do).

    Attributes
    ----------
    W_up : (D, F), W_down : (F, D), alpha_p, alpha_n, beta, eps : (1,); ``grads`` with the same names.

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> mlp = XIELUMLP(4, 6, rng=0)
    >>> y = mlp(np.ones((2, 3, 4)))
    >>> y.shape, mlp.backward(np.ones_like(y)).shape, sorted(mlp.grads)
    ((2, 3, 4), (2, 3, 4), ['W_down', 'W_up', 'alpha_n', 'alpha_p', 'beta', 'eps'])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = check_mlp_sizes(hidden_size, intermediate_size)
        gen = as_generator(rng)
        d, f = self.hidden_size, self.intermediate_size
        self.register_parameter("W_up", normal(gen, (d, f), std=0.02))
        self.register_parameter("W_down", normal(gen, (f, d), std=0.02))
        for name, value in zip(_XIELU, (_INIT_P, _INIT_N, BETA, EPS)):
            self.register_parameter(name, np.full(1, value))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"

    def _hidden(self, x: np.ndarray):
        p = self._parameters
        h = linear(x, p["W_up"])  # (..., F)
        a, negative = _xielu.xielu_forward(h, *(p[name] for name in _XIELU))  # (..., F)
        return h, a, negative

    def forward(self, x: Any) -> np.ndarray:
        """Apply the MLP to every position of ``x`` (..., D); saves what :meth:`backward` needs."""
        x = check_features(x, "x", self.hidden_size, "XIELUMLP", "hidden_size")
        h, a, negative = self._hidden(x)  # (..., F)
        self.save_for_backward(x, h, a, negative)
        return linear(a, self._parameters["W_down"])  # (..., D)

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D), nothing saved."""
        return linear(self._hidden(x)[1], self._parameters["W_down"])  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the parameter gradients into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("XIELUMLP.backward called before forward")
        x, h, a, negative = self.saved_tensors
        g = check_grad_output(grad_output, x.shape, x.dtype, "XIELUMLP")
        p = self._parameters
        wanted = self.grads.wanted
        grad_a, grad_down, _ = linear_backward(g, a, p["W_down"], False, wanted)  # (..., F), (F, D)
        grad_h, grads = _xielu.xielu_backward(grad_a, h, negative, *(p[name] for name in _XIELU))  # (..., F)
        grad_x, grad_up, _ = linear_backward(grad_h, x, p["W_up"], False, wanted)  # (..., D), (D, F)
        if wanted:
            for name, value in (("W_down", grad_down), ("W_up", grad_up), *grads.items()):
                self.grads[name] += value
        return grad_x

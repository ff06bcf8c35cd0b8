"""``UngatedMLP``: the feed-forward network without a gate of Nemotron-H, ``act(x W_up + b_up) W_down + b_down``
(squared ReLU there; the biases only with the ``mlp`` part's ``bias``).

Dimension letters: ``...`` any leading dims, D ``hidden_size``, F ``intermediate_size``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_features, check_grad_output
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels.activations import activation_backward, activation_forward
from ..kernels.linear import linear, linear_backward
from .gated_mlp import check_mlp_kind, check_mlp_sizes

__all__ = ["UngatedMLP"]


class UngatedMLP(Module):
    """``y = act(x W_up + b_up) W_down + b_down``: one projection up, the activation, one down (no gate).

    Parameters
    ----------
    hidden_size : int
        D.
    intermediate_size : int
        F.
    activation : {"silu", "gelu", "gelu_tanh", "relu", "relu2"}, default "relu2"
    bias : bool, default False
        Biases on both projections.
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (biases start at zero).

    Attributes
    ----------
    W_up : (D, F), W_down : (F, D); with ``bias`` also b_up (F,), b_down (D,). ``grads`` with the same names.
    Weights are stored for ``x @ W`` (the transpose of torch's ``nn.Linear.weight``).

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> mlp = UngatedMLP(4, 6, "relu2", rng=0)
    >>> y = mlp(np.ones((2, 3, 4)))
    >>> y.shape, mlp.backward(np.ones_like(y)).shape, sorted(mlp.grads)
    ((2, 3, 4), (2, 3, 4), ['W_down', 'W_up'])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "relu2", bias: bool = False, *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = check_mlp_sizes(hidden_size, intermediate_size)
        self.activation, self.bias = check_mlp_kind(activation, bias)
        gen = as_generator(rng)
        d, f = self.hidden_size, self.intermediate_size
        self.register_parameter("W_up", normal(gen, (d, f), std=0.02))
        self.register_parameter("W_down", normal(gen, (f, d), std=0.02))
        if self.bias:
            self.register_parameter("b_up", np.zeros(f))
            self.register_parameter("b_down", np.zeros(d))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation={self.activation!r}, bias={self.bias}")

    def _hidden(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = self._parameters
        h = linear(x, p["W_up"], p.get("b_up"))  # (..., F)
        return h, activation_forward(h, self.activation)  # (..., F) twice

    def forward(self, x: Any) -> np.ndarray:
        """Apply the MLP to every position of ``x`` (..., D); saves what :meth:`backward` needs."""
        x = check_features(x, "x", self.hidden_size, "UngatedMLP", "hidden_size")
        h, a = self._hidden(x)  # (..., F)
        self.save_for_backward(x, h, a)
        return linear(a, self._parameters["W_down"], self._parameters.get("b_down"))  # (..., D)

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D), nothing saved."""
        return linear(self._hidden(x)[1], self._parameters["W_down"], self._parameters.get("b_down"))  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the parameter gradients into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("UngatedMLP.backward called before forward")
        x, h, a = self.saved_tensors
        g = check_grad_output(grad_output, x.shape, x.dtype, "UngatedMLP")
        p, wanted = self._parameters, self.grads.wanted
        grad_a, grad_down, grad_b_down = linear_backward(g, a, p["W_down"], self.bias, wanted)  # (..., F)
        grad_h = activation_backward(grad_a, h, a, self.activation)  # (..., F)
        grad_x, grad_up, grad_b_up = linear_backward(grad_h, x, p["W_up"], self.bias, wanted)  # (..., D)
        if wanted:
            for name, value in (("W_down", grad_down), ("W_up", grad_up), ("b_down", grad_b_down),
                                ("b_up", grad_b_up)):
                if name in self._parameters:
                    self.grads[name] += value
        return grad_x

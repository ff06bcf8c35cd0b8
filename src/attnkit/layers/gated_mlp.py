"""``GatedMLP``: the gated feed-forward network of Llama-style decoders (SwiGLU with ``silu``).

Dimension letters: ``...`` any leading dims, D ``hidden_size``, F ``intermediate_size``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_factor, check_features, check_grad_output, check_positive_int
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import decode_step as _step
from ..kernels import gated_mlp as _gated
from ..kernels.activations import ACTIVATIONS, activation_forward
from ..kernels.linear import product

__all__ = ["GatedMLP", "ScaledGatedMLP", "check_mlp_sizes", "check_mlp_kind"]

_NAMES = ("W_gate", "W_up", "W_down")
_BIASES = ("b_gate", "b_up", "b_down")
_MAX_SIZE = 2**31 - 1


def check_mlp_sizes(hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """``(hidden_size, intermediate_size)`` of an MLP, each a positive int (else a ValueError naming it)."""
    return (check_positive_int(hidden_size, "hidden_size", maximum=_MAX_SIZE),
            check_positive_int(intermediate_size, "intermediate_size", maximum=_MAX_SIZE))


def check_mlp_kind(activation: str, bias: bool) -> tuple[str, bool]:
    """``(activation, bias)`` of an MLP: a name of :data:`attnkit.kernels.activations.ACTIVATIONS` and a bool."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(bias, bool):
        raise TypeError(f"bias must be True or False, got {bias!r}")
    return activation, bias


class GatedMLP(Module):
    """``y = (act(x W_gate + b_gate) * (x W_up + b_up)) W_down + b_down``.

    Parameters
    ----------
    hidden_size : int
        D.
    intermediate_size : int
        F.
    activation : {"silu", "gelu", "gelu_tanh", "relu", "relu2"}, default "silu"
    bias : bool, default False
        Biases on the three projections.
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (biases start at zero).

    Attributes
    ----------
    W_gate : (D, F), W_up : (D, F), W_down : (F, D); with ``bias`` also b_gate (F,), b_up (F,),
    b_down (D,). ``grads`` with the same names. Weights are stored for ``x @ W`` (the transpose of torch's
    ``nn.Linear.weight``).

    Shapes
    ------
    x : (..., D) -> y : (..., D), in ``x``'s float dtype.

    Examples
    --------
    >>> mlp = GatedMLP(4, 6, "silu", rng=0)
    >>> y = mlp(np.ones((2, 3, 4)))
    >>> y.shape, mlp.backward(np.ones_like(y)).shape, sorted(mlp.grads)
    ((2, 3, 4), (2, 3, 4), ['W_down', 'W_gate', 'W_up'])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False, *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = check_mlp_sizes(hidden_size, intermediate_size)
        self.activation, self.bias = check_mlp_kind(activation, bias)
        gen = as_generator(rng)
        d, f = self.hidden_size, self.intermediate_size
        for name, shape in zip(_NAMES, ((d, f), (d, f), (f, d))):
            self.register_parameter(name, normal(gen, shape, std=0.02))
        if self.bias:
            for name, size in zip(_BIASES, (f, f, d)):
                self.register_parameter(name, np.zeros(size))
        # gate and up side by side: one product computes both branches (one read of them per decoding step)
        self.fuse_parameters("W_gate_up", ("W_gate", "W_up"))
        if self.bias:
            self.fuse_parameters("b_gate_up", ("b_gate", "b_up"))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"activation={self.activation!r}, bias={self.bias}")

    def forward(self, x: Any) -> np.ndarray:
        """Apply the MLP to every position of ``x`` (..., D); saves what :meth:`backward` needs."""
        x = check_features(x, "x", self.hidden_size, "GatedMLP", "hidden_size")
        p = self._parameters
        biases = [p.get(name) for name in _BIASES]
        w_gate_up, b_gate_up = self.fused_weight_and_bias("W_gate_up", "b_gate_up") or (None, None)
        y, saved = _gated.gated_mlp_forward(x, p["W_gate"], p["W_up"], p["W_down"], *biases,
                                            activation=self.activation, w_gate_up=w_gate_up,
                                            b_gate_up=b_gate_up)  # (..., D)
        self.save_for_backward(x, saved)
        return y

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): gate and up in one product, nothing saved.

        Without the fused gate and up (a parameter was given new storage, or they are packed weights, which are
        never fused) the step is the forward's kernel on the (B, D) rows: gate and up in products of their own.
        """
        p = self._parameters
        fused = self.fused_weight_and_bias("W_gate_up", "b_gate_up")
        if fused is None:
            biases = [p.get(name) for name in _BIASES]
            y, _ = _gated.gated_mlp_forward(x, p["W_gate"], p["W_up"], p["W_down"], *biases,
                                            activation=self.activation)  # (B, D)
            return y
        return _step.gated_mlp_step(x, *fused, p["W_down"], p.get("b_down"), self.activation)  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the parameter gradients into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("GatedMLP.backward called before forward")
        x, saved = self.saved_tensors
        g = check_grad_output(grad_output, x.shape, x.dtype, "GatedMLP")
        p = self._parameters
        grad_x, grads = _gated.gated_mlp_backward(g, x, p["W_gate"], p["W_up"], p["W_down"], saved,
                                                  self.activation, need_bias=self.bias,
                                                  need_weights=self.grads.wanted)
        for name, value in grads.items():
            self.grads.add(name, value)
        return grad_x


class ScaledGatedMLP(GatedMLP):
    """:class:`GatedMLP` with two fixed factors (Falcon-H1's ``mlp_multipliers``, an MLP of kind
    ``"scaled_gated"``): ``y = m_down * (act(m_gate * (x W_gate + b_gate)) * (x W_up + b_up)) W_down + b_down``
    (``b_down`` scaled too, as ``down_proj(h) * m_down`` does).

    The factors are applied to the weights as each call reads them (``m_gate * W_gate``, ``m_gate * b_gate``,
    ``m_down * W_down``, ``m_down * b_down``, temporaries), never stored: the parameters stay the checkpoint's
    and their gradients are the chain rule's (the kernel's gradient of a scaled weight times its factor).

    Parameters
    ----------
    hidden_size, intermediate_size, activation, bias
        As :class:`GatedMLP`'s.
    gate_scale, output_scale : float, default 1.0
        m_gate and m_down (Falcon-H1's ``mlp_multipliers``).
    rng : numpy.random.Generator or int, optional

    Shapes
    ------
    x : (..., D) -> y : (..., D).

    Examples
    --------
    >>> mlp = ScaledGatedMLP(4, 6, "silu", gate_scale=0.5, output_scale=2.0, rng=0)
    >>> y = mlp(np.ones((2, 3, 4)))
    >>> y.shape, mlp.backward(np.ones_like(y)).shape, mlp.gate_scale, mlp.output_scale
    ((2, 3, 4), (2, 3, 4), 0.5, 2.0)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", bias: bool = False, *,
                 gate_scale: float = 1.0, output_scale: float = 1.0,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__(hidden_size, intermediate_size, activation, bias, rng=rng)
        self.gate_scale = check_factor(gate_scale, "gate_scale")
        self.output_scale = check_factor(output_scale, "output_scale")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gate_scale={self.gate_scale}, output_scale={self.output_scale}"

    def _scaled(self, dtype: np.dtype) -> list[np.ndarray | None]:
        """W_gate, W_up, W_down, b_gate, b_up, b_down with the factors applied (temporaries), in ``dtype``."""
        p, factors = self._parameters, (self.gate_scale, 1.0, self.output_scale)
        weights = [p[name] if f == 1.0 else p[name] * p[name].dtype.type(f) for name, f in zip(_NAMES, factors)]
        biases = [None if p.get(name) is None else p[name] if f == 1.0 else p[name] * p[name].dtype.type(f)
                  for name, f in zip(_BIASES, factors)]
        return weights + biases

    def forward(self, x: Any) -> np.ndarray:
        """Apply the MLP to every position of ``x`` (..., D); saves what :meth:`backward` needs."""
        x = check_features(x, "x", self.hidden_size, "ScaledGatedMLP", "hidden_size")
        y, saved = _gated.gated_mlp_forward(x, *self._scaled(x.dtype), activation=self.activation)  # (..., D)
        self.save_for_backward(x, saved)
        return y

    def step(self, x: np.ndarray) -> np.ndarray:
        """One decoding step (B, D) -> (B, D), nothing saved: gate and up in one product of the fused weights, the
        factors on the (B, F) gate and the (B, D) output rather than on weights (a step reads each weight once and
        copies none)."""
        fused = self.fused_weight_and_bias("W_gate_up", "b_gate_up")
        if fused is None:
            y, _ = _gated.gated_mlp_forward(x, *self._scaled(x.dtype), activation=self.activation)  # (B, D)
            return y
        w_gate_up, b_gate_up = fused
        p = self._parameters
        both = x @ w_gate_up  # (B, 2F)
        if b_gate_up is not None:
            both += b_gate_up
        width = self.intermediate_size
        gate = activation_forward(both[:, :width] * both.dtype.type(self.gate_scale), self.activation)  # (B, F)
        y = product(gate * both[:, width:], p["W_down"])  # (B, D)
        if p.get("b_down") is not None:
            y += p["b_down"]
        return y * y.dtype.type(self.output_scale)  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the parameter gradients into ``self.grads``; return ``grad_x`` (..., D)."""
        if self.saved_tensors is None:
            raise RuntimeError("ScaledGatedMLP.backward called before forward")
        x, saved = self.saved_tensors
        g = check_grad_output(grad_output, x.shape, x.dtype, "ScaledGatedMLP")
        w_gate, w_up, w_down = self._scaled(x.dtype)[:3]
        grad_x, grads = _gated.gated_mlp_backward(g, x, w_gate, w_up, w_down, saved, self.activation,
                                                  need_bias=self.bias, need_weights=self.grads.wanted)
        factors = {"W_gate": self.gate_scale, "b_gate": self.gate_scale, "W_down": self.output_scale,
                   "b_down": self.output_scale}
        for name, value in grads.items():  # d/dW of (m W) is m times the kernel's gradient of (m W)
            f = factors.get(name, 1.0)
            self.grads.add(name, value if value is None or f == 1.0 else value * value.dtype.type(f))
        return grad_x

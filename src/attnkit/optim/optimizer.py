"""``Optimizer``: the base of the optimizers, which update a module's parameter arrays in place.

The module owns its parameters; an optimizer keeps only per-parameter state (momentum, moment estimates)
keyed by the parameter's dotted name, and looks the parameters and gradients up by name at every step, so
it keeps working after ``module.astype(...)`` replaced the arrays.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..core.module import Module

__all__ = ["Optimizer"]


def check_hyper(value: Any, name: str, low: float = 0.0, high: float | None = None,
                high_inclusive: bool = False) -> float:
    """``value`` as a float in [low, high) (or [low, high]); raises ``ValueError`` naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    above = value > high if high_inclusive else value >= high if high is not None else False
    if not np.isfinite(value) or value < low or (high is not None and above):
        interval = f"[{low}, {high}{']' if high_inclusive else ')'}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return value


class Optimizer:
    """Base class: subclasses set ``hyperparameter_names`` / ``slot_names`` and implement :meth:`_update`.

    Parameters
    ----------
    module : Module
        The model whose parameters are optimised (in place) from the gradients in its ``grads``.

    Attributes
    ----------
    module : Module
    step_count : int
        Number of :meth:`step` calls so far (Adam's bias correction uses it).
    state : dict of str to dict of str to ndarray
        Per-parameter buffers (``slot_names``), keyed by dotted parameter name.
    """

    hyperparameter_names: tuple[str, ...] = ()
    slot_names: tuple[str, ...] = ()

    def __init__(self, module: Module) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"module must be an attnkit Module, got {type(module).__name__}")
        self.module = module
        self.step_count = 0
        self.state = {name: {slot: np.zeros_like(p) for slot in self.slot_names}
                      for name, p in module.named_parameters()}

    def _pairs(self) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
        grads = dict(self.module.named_gradients())
        for name, p in self.module.named_parameters():
            yield name, p, grads[name]

    def zero_grad(self) -> None:
        """Zero the module's gradients (the same as ``module.zero_grad()``)."""
        self.module.zero_grad()

    def step(self) -> None:
        """Update every parameter in place from its current gradient."""
        self.step_count += 1
        for name, p, g in self._pairs():
            self._update(p, g, self.state[name])

    def _update(self, p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Copies of the hyperparameters, the step count and every buffer.

        Returns
        -------
        dict
            ``{"step_count": int, "hyperparameters": {name: value}, "state": {param: {slot: ndarray}}}``.
        """
        return {"step_count": self.step_count,
                "hyperparameters": {n: getattr(self, n) for n in self.hyperparameter_names},
                "state": {name: {slot: buf.copy() for slot, buf in slots.items()} for name, slots in self.state.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (for the same module layout).

        Raises
        ------
        KeyError
            Missing or unknown top-level keys, parameter names or buffer names (naming them).
        ValueError
            A buffer whose shape differs from its parameter's.
        """
        expected = {"step_count", "hyperparameters", "state"}
        if set(state) != expected:
            raise KeyError(f"optimizer state dict must have keys {sorted(expected)}, got {sorted(state)}")
        hyper = dict(state["hyperparameters"])
        if set(hyper) != set(self.hyperparameter_names):
            raise KeyError(f"hyperparameters must be {sorted(self.hyperparameter_names)}, got {sorted(hyper)}")
        buffers = state["state"]
        unknown, missing = sorted(set(buffers) - set(self.state)), sorted(set(self.state) - set(buffers))
        if unknown or missing:
            raise KeyError(f"optimizer state does not match the module's parameters: unknown {unknown}, "
                           f"missing {missing}")
        for name, slots in buffers.items():
            if set(slots) != set(self.slot_names):
                raise KeyError(f"state of {name!r} must have buffers {sorted(self.slot_names)}, got {sorted(slots)}")
            for slot, value in slots.items():
                if np.shape(value) != self.state[name][slot].shape:
                    raise ValueError(f"buffer {slot!r} of {name!r} has shape {np.shape(value)}, expected "
                                     f"{self.state[name][slot].shape}")
        for n in self.hyperparameter_names:
            setattr(self, n, hyper[n])
        self.step_count = int(state["step_count"])
        self.state = {name: {slot: np.array(v, dtype=self.state[name][slot].dtype) for slot, v in slots.items()}
                      for name, slots in buffers.items()}

    def __repr__(self) -> str:
        hyper = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.hyperparameter_names)
        return f"{type(self).__name__}({hyper})"

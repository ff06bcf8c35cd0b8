"""``Optimizer``: the base of the optimizers, which update a module's parameter arrays in place.

The module owns its parameters; an optimizer keeps only per-parameter state (momentum, moment estimates)
keyed by the parameter's dotted name, and looks the parameters and gradients up by name at every step, so
it keeps working after ``module.astype(...)`` replaced the arrays.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .._validation import check_positive_int
from ..core.module import Module
from ..io import ArrayArchive, save_arrays
from ..kernels.packed import PackedWeight

__all__ = ["Optimizer"]


def check_hyper(value: Any, name: str, low: float = 0.0, high: float | None = None,
                high_inclusive: bool = False, low_inclusive: bool = True) -> float:
    """``value`` as a finite float in [low, high) (or with the bounds' inclusiveness given).

    Raises ``TypeError`` for a non-number (bools included) and ``ValueError`` naming ``name`` for NaN,
    infinities and values out of range.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    below = value < low if low_inclusive else value <= low
    above = high is not None and (value > high if high_inclusive else value >= high)
    if not np.isfinite(value) or below or above:
        interval = (f"{'[' if low_inclusive else '('}{low}, {high}{']' if high_inclusive else ')'}" if high is not None
                    else f"{'>=' if low_inclusive else '>'} {low}")
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return value


def check_step_count(value: Any, name: str = "step_count") -> int:
    """``value`` as a non-negative Python int (bools and floats refused)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    return check_positive_int(value, name, allow_zero=True)


class Optimizer:
    """Base class: subclasses set ``hyperparameter_names`` and ``slot_names`` (every buffer they can keep) and
    implement :meth:`check_hyperparameters`, :meth:`_update` and, when the buffers kept depend on the
    hyperparameters, :meth:`slots_for`.

    Parameters
    ----------
    module : Module
        The model whose parameters are optimised (in place) from the gradients in its ``grads``.
    **hyperparameters
        The subclass's hyperparameters, checked by :meth:`check_hyperparameters`.

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

    def __init__(self, module: Module, **hyperparameters: Any) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"module must be an attnkit Module, got {type(module).__name__}")
        hyper = self.check_hyperparameters(hyperparameters)
        for name, value in hyper.items():
            setattr(self, name, value)
        packed = [name for name, p in module.named_parameters() if isinstance(p, PackedWeight)]
        if packed:
            raise TypeError(f"{type(module).__name__} holds packed (quantized) weights, which take no gradient "
                            f"({packed[0]!r} and {len(packed) - 1} more): load it with keep_quantized=False to train")
        self.slot_names = self.slots_for(hyper)
        self.module = module
        self.step_count = 0
        self.state = {name: {slot: np.zeros_like(p) for slot in self.slot_names}
                      for name, p in module.named_parameters()}

    @classmethod
    def check_hyperparameters(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        """Checked hyperparameters (finite, in range), keyed as ``hyperparameter_names``; ``ValueError`` otherwise."""
        raise NotImplementedError

    @classmethod
    def slots_for(cls, hyperparameters: Mapping[str, Any]) -> tuple[str, ...]:
        """Names of the per-parameter buffers an optimizer with these hyperparameters keeps."""
        return cls.slot_names

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

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Copies of the hyperparameters, the step count and every buffer.

        Returns
        -------
        dict
            ``{"step_count": int, "hyperparameters": {name: value}, "state": {param: {slot: ndarray}}}``.
        """
        return {"step_count": self.step_count,
                "hyperparameters": {n: getattr(self, n) for n in self.hyperparameter_names},
                "state": {name: {slot: buf.copy() for slot, buf in slots.items()}
                          for name, slots in self.state.items()}}

    @classmethod
    def check_buffer(cls, slot: str, name: str, value: np.ndarray) -> None:
        """Refuse buffer values this optimizer cannot continue from (``ValueError`` naming the buffer and its
        parameter); the base class accepts any values. Called by :meth:`load_state_dict` before anything
        changes."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, all or nothing: everything is checked before anything changes.

        Checked: the top-level keys; the hyperparameters, as the constructor checks them (finite, in range);
        the step count (a non-negative integer); one buffer per parameter of the module and slot of the
        optimizer, each a real floating array of its parameter's shape.

        Raises
        ------
        KeyError
            Missing or unknown top-level keys, hyperparameter names, parameter names or buffer names (naming them).
        ValueError
            A hyperparameter out of range or not finite, a negative step count, a buffer whose shape differs
            from its parameter's, or buffer values the optimizer refuses (:meth:`check_buffer`).
        TypeError
            A hyperparameter or step count of the wrong type, or a buffer that is not a real floating array.

        Examples
        --------
        >>> from attnkit.layers import Projection
        >>> from attnkit.optim import Adam
        >>> opt = Adam(Projection(2, 2, rng=0), lr=0.1)
        >>> state = opt.state_dict()
        >>> state["hyperparameters"]["eps"] = 0.0
        >>> opt.load_state_dict(state)
        Traceback (most recent call last):
        ValueError: eps must be a finite number in > 0.0, got 0.0
        >>> opt.lr  # nothing changed
        0.1
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"optimizer state dict must be a mapping, got {type(state).__name__}")
        expected = {"step_count", "hyperparameters", "state"}
        if set(state) != expected:
            raise KeyError(f"optimizer state dict must have keys {sorted(expected)}, got {sorted(state)}")
        hyper_in, buffers = state["hyperparameters"], state["state"]
        if not isinstance(hyper_in, Mapping) or not isinstance(buffers, Mapping):
            raise TypeError("optimizer state dict entries 'hyperparameters' and 'state' must be mappings, got "
                            f"{type(hyper_in).__name__} and {type(buffers).__name__}")
        if set(hyper_in) != set(self.hyperparameter_names):
            raise KeyError(f"hyperparameters of {type(self).__name__} must be {sorted(self.hyperparameter_names)}, "
                           f"got {sorted(hyper_in)}")
        hyper = self.check_hyperparameters(hyper_in)
        step_count = check_step_count(state["step_count"])
        slots = self.slots_for(hyper)
        params = dict(self.module.named_parameters())
        unknown, missing = sorted(set(buffers) - set(params)), sorted(set(params) - set(buffers))
        if unknown or missing:
            raise KeyError(f"optimizer state does not match the module's parameters: unknown {unknown}, "
                           f"missing {missing}")
        new_state: dict[str, dict[str, np.ndarray]] = {}
        for name, p in params.items():
            given = buffers[name]
            if not isinstance(given, Mapping) or set(given) != set(slots):
                got = sorted(given) if isinstance(given, Mapping) else type(given).__name__
                raise KeyError(f"state of {name!r} must have buffers {sorted(slots)}, got {got}")
            new_state[name] = {}
            for slot in slots:
                value = np.asarray(given[slot])
                if value.shape != p.shape:
                    raise ValueError(f"buffer {slot!r} of {name!r} has shape {value.shape}, expected {p.shape}")
                if value.dtype.kind != "f":
                    raise TypeError(f"buffer {slot!r} of {name!r} has dtype {value.dtype}, expected a real "
                                    "floating dtype")
                self.check_buffer(slot, name, value)
                current = self.state.get(name, {}).get(slot)
                new_state[name][slot] = np.array(value, dtype=p.dtype if current is None else current.dtype)
        # everything is checked: apply (nothing below can fail)
        for n, value in hyper.items():
            setattr(self, n, value)
        self.slot_names = slots
        self.step_count = step_count
        self.state = new_state

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to ``path`` as an ``.npz`` archive, atomically (see :meth:`Module.save`).

        Entries: ``step_count`` (int64), ``hyperparameters/<name>`` (float64, a pair as shape (2,), bools as
        bool) and ``state/<parameter>/<buffer>``.

        Examples
        --------
        >>> import os, tempfile
        >>> from attnkit.layers import Projection
        >>> from attnkit.optim import Adam
        >>> proj = Projection(2, 2, rng=0)
        >>> opt = Adam(proj, lr=0.01)
        >>> proj.grads["W"][:] = 1.0
        >>> opt.step()
        >>> path = os.path.join(tempfile.mkdtemp(), "adam.npz")
        >>> opt.save(path)
        >>> restored = Adam(proj)
        >>> restored.load(path)
        >>> restored.step_count, restored.lr, np.array_equal(restored.state["W"]["exp_avg"], opt.state["W"]["exp_avg"])
        (1, 0.01, True)
        """
        arrays: dict[str, np.ndarray] = {"step_count": np.asarray(self.step_count, dtype=np.int64)}
        for n in self.hyperparameter_names:
            arrays[f"hyperparameters/{n}"] = self._hyper_array(getattr(self, n))
        for name, slots in self.state.items():
            for slot, buf in slots.items():
                arrays[f"state/{name}/{slot}"] = buf
        save_arrays(path, arrays)

    @staticmethod
    def _hyper_array(value: Any) -> np.ndarray:
        if isinstance(value, (bool, np.bool_)):
            return np.asarray(value, dtype=bool)
        return np.asarray(value, dtype=np.float64)

    def load(self, path: str | os.PathLike) -> None:
        """Restore state written by :meth:`save`, checking the file's headers before reading any array.

        Every entry's name, shape and dtype is compared with this optimizer and its module from the
        archive's ``.npy`` headers; then each array is read once and the whole state goes through
        :meth:`load_state_dict` (all or nothing).

        Raises
        ------
        KeyError, ValueError, TypeError
            As :meth:`load_state_dict`; also ``ValueError`` for a damaged or crafted archive, and
            ``KeyError`` for an entry this optimizer does not have, naming it.
        """
        params = dict(self.module.named_parameters())
        possible_slots = set(type(self).slot_names)  # the class lists every buffer it can keep
        with ArrayArchive(path) as archive:
            unknown = []
            for key, header in archive.headers.items():
                expected = self._expected_entry(key, params, possible_slots)
                if expected is None:
                    unknown.append(key)
                    continue
                shape, kinds = expected
                if header.shape != shape:
                    raise ValueError(f"{archive.path}: entry {key!r} has shape {header.shape}, expected {shape}")
                if header.dtype.kind not in kinds:
                    raise TypeError(f"{archive.path}: entry {key!r} has dtype {header.dtype}, expected kind {kinds!r}")
            if unknown:
                raise KeyError(f"{archive.path}: entries {sorted(unknown)} are not part of a {type(self).__name__} "
                               f"state for this module")
            arrays = {key: archive.read(key) for key in archive.headers}
        if "step_count" not in arrays:
            raise KeyError(f"{path}: no 'step_count' entry")
        state: dict[str, Any] = {"step_count": arrays.pop("step_count")[()], "hyperparameters": {}, "state": {}}
        for key, value in arrays.items():
            kind, _, rest = key.partition("/")
            if kind == "hyperparameters":
                state["hyperparameters"][rest] = value[()] if value.shape == () else tuple(value.tolist())
            else:
                name, slot = rest.rsplit("/", 1)
                state["state"].setdefault(name, {})[slot] = value
        for name in params:  # parameters without buffers (plain SGD) have none in the file
            state["state"].setdefault(name, {})
        for n, value in state["hyperparameters"].items():
            if isinstance(value, np.generic):
                state["hyperparameters"][n] = value.item()
        self.load_state_dict(state)

    def _expected_entry(self, key: str, params: Mapping[str, np.ndarray],
                        slots: set[str]) -> tuple[tuple[int, ...], str] | None:
        """``(shape, dtype kinds)`` an entry of :meth:`save`'s archive must have, or None if it cannot be one."""
        if key == "step_count":
            return (), "iu"
        kind, _, rest = key.partition("/")
        if kind == "hyperparameters" and rest in self.hyperparameter_names:
            current = self._hyper_array(getattr(self, rest))
            return current.shape, "b" if current.dtype == bool else "fiu"
        if kind == "state" and "/" in rest:
            name, slot = rest.rsplit("/", 1)
            if name in params and slot in slots:
                return params[name].shape, "f"
        return None

    def __repr__(self) -> str:
        hyper = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.hyperparameter_names)
        return f"{type(self).__name__}({hyper})"

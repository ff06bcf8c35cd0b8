"""``Module``: the base of every attnkit layer that owns parameters.

A module holds its parameters as plain numpy arrays, registered by name in ``__init__`` (shapes fixed
there, never inferred from the first input), and a gradient of the same name and shape for each in
``self.grads``. ``forward`` caches what ``backward`` needs; ``backward`` consumes the cache, returns the
gradient of the inputs and *adds* the parameter gradients into ``self.grads`` (so shared weights work),
which stay until :meth:`zero_grad`.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["Module", "ModuleList"]


class Module:
    """Base class of layers with parameters and child modules.

    Attributes
    ----------
    grads : dict of str to ndarray
        Gradient of each of this module's own parameters (same names and shapes).
    training : bool
        Training mode (dropout active); set with :meth:`train` / :meth:`eval`.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "grads", {})
        object.__setattr__(self, "training", True)

    # -- registration -------------------------------------------------------------------------------
    def register_parameter(self, name: str, value: np.ndarray) -> None:
        """Register ``value`` as parameter ``name`` (an attribute too) with a zero gradient."""
        if "." in name:
            raise ValueError(f"parameter name {name!r} must not contain '.'")
        arr = np.array(value, dtype=np.result_type(np.asarray(value).dtype, np.float32), copy=True)
        self._parameters[name] = arr
        self.grads[name] = np.zeros_like(arr)

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        if params is None:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting attributes")
        if name in params:
            arr = np.asarray(value)
            if arr.shape != params[name].shape:
                raise ValueError(f"parameter {name} has shape {params[name].shape}, got an array of shape {arr.shape}")
            np.copyto(params[name], arr, casting="same_kind")
            return
        if isinstance(value, Module):
            self._modules[name] = value
        elif name in self._modules:
            del self._modules[name]
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        params = self.__dict__.get("_parameters", {})
        if name in params:
            return params[name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    # -- traversal -----------------------------------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """Yield ``(dotted name, module)`` for this module and every descendant, depth first."""
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(dotted name, array)`` for every parameter of this module and its children."""
        for mod_name, mod in self.named_modules(prefix):
            for name, arr in mod._parameters.items():
                yield (f"{mod_name}.{name}" if mod_name else name), arr

    def named_gradients(self, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(dotted name, gradient)`` with the same names and order as :meth:`named_parameters`."""
        for mod_name, mod in self.named_modules(prefix):
            for name in mod._parameters:
                yield (f"{mod_name}.{name}" if mod_name else name), mod.grads[name]

    def parameters(self) -> list[np.ndarray]:
        """All parameter arrays (the module's own storage: optimizers update them in place)."""
        return [p for _, p in self.named_parameters()]

    def num_parameters(self) -> int:
        """Total number of scalar parameters."""
        return int(sum(p.size for p in self.parameters()))

    # -- state ---------------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Set every gradient of this module and its children to zero."""
        for _, g in self.named_gradients():
            g.fill(0)

    def train(self, mode: bool = True) -> "Module":
        """Set training mode (dropout on) for this module and its children; returns self."""
        for _, mod in self.named_modules():
            object.__setattr__(mod, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        """Set evaluation mode (dropout off); returns self."""
        return self.train(False)

    def astype(self, dtype: Any) -> "Module":
        """Convert every parameter and gradient to ``dtype`` (e.g. ``np.float32``) in place; returns self."""
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        for _, mod in self.named_modules():
            for name in mod._parameters:
                mod._parameters[name] = mod._parameters[name].astype(dtype)
                mod.grads[name] = mod.grads[name].astype(dtype)
        return self

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every parameter, keyed by dotted name (save with ``np.savez(path, **state)``)."""
        return {name: p.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Copy parameters in from ``state`` (e.g. ``np.load(path)``).

        Parameters
        ----------
        state : mapping of str to array
        strict : bool, default True
            Refuse missing keys too; unknown keys and wrong shapes are always refused.

        Raises
        ------
        KeyError
            Unknown keys, or (strict) missing keys, naming them.
        ValueError
            A value whose shape differs from the parameter's.
        """
        own = dict(self.named_parameters())
        unknown = sorted(set(state) - set(own))
        missing = sorted(set(own) - set(state)) if strict else []
        if unknown or missing:
            raise KeyError(f"state dict does not match {type(self).__name__}: unknown keys {unknown}, "
                           f"missing keys {missing}")
        for name in state:
            value = np.asarray(state[name])
            if value.shape != own[name].shape:
                raise ValueError(f"state dict entry {name!r} has shape {value.shape}, expected {own[name].shape}")
            if value.dtype.kind not in "fiu":
                raise TypeError(f"state dict entry {name!r} has non-numeric dtype {value.dtype}")
        for name in state:
            np.copyto(own[name], np.asarray(state[name]), casting="unsafe")

    def save(self, path: Any) -> None:
        """Write :meth:`state_dict` to ``path`` as an ``.npz`` archive (``np.savez``), exactly at ``path``.

        Examples
        --------
        >>> import os, tempfile
        >>> from attnkit.layers import Projection
        >>> a, b = Projection(3, 2, rng=0), Projection(3, 2, rng=1)
        >>> path = os.path.join(tempfile.mkdtemp(), "proj.npz")
        >>> a.save(path)
        >>> b.load(path)
        >>> np.array_equal(a.W, b.W)
        True
        """
        with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a bare name
            np.savez(f, **self.state_dict())

    def load(self, path: Any) -> None:
        """Load parameters saved by :meth:`save` (``load_state_dict(np.load(path))``, strict).

        Raises ``KeyError``/``ValueError`` like :meth:`load_state_dict` for unknown, missing or wrongly shaped
        entries.
        """
        with np.load(path, allow_pickle=False) as archive:
            self.load_state_dict(archive)

    # -- calling -------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        extra = self.extra_repr()
        children = "".join(f"\n  ({n}): " + repr(m).replace("\n", "\n  ") for n, m in self._modules.items())
        return f"{type(self).__name__}({extra}{children}{chr(10) if children else ''})"

    def extra_repr(self) -> str:
        return ""


class ModuleList(Module):
    """An ordered list of modules whose parameters are named ``"0.W"``, ``"1.W"``, ..."""

    def __init__(self, modules: list[Module] | tuple[Module, ...] = ()) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList holds Modules, got {type(module).__name__}")
        self._modules[str(len(self._modules))] = module

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))

"""``Module``: the base of every attnkit layer that owns parameters.

A module holds its parameters as plain numpy arrays, registered by name in ``__init__`` (shapes fixed
there, never inferred from the first input), and a gradient of the same name and shape for each in
``self.grads``. ``forward`` caches what ``backward`` needs; ``backward`` consumes the cache, returns the
gradient of the inputs and *adds* the parameter gradients into ``self.grads`` (so shared weights work),
which stay until :meth:`zero_grad`.

Gradient buffers are created when first read (as zeros), like torch's ``.grad`` that stays ``None`` until a
backward writes it: a model used only for inference holds its weights and nothing else.
:meth:`Module.zero_grad` zeroes the buffers that exist, and ``zero_grad(set_to_none=True)`` frees them.

Packed parameters. A parameter may be a :class:`~attnkit.kernels.packed.PackedWeight` (a file's quantized
blocks, ``load(..., keep_quantized=True)``) wherever a layer multiplies it with :func:`attnkit.kernels.linear`
or looks rows up in it. It has no gradient: reading its gradient buffer raises a ``TypeError`` naming it, so
training through it (a backward that wants parameter gradients, an optimizer) is refused, while a backward
inside :meth:`Module.input_gradients_only` (what the explanations run) returns the input's gradient exactly.
:meth:`Module.astype` changes the dtype its values are dequantized to, :meth:`Module.state_dict` copies its
blocks, and assigning an array to it (or loading one into it) replaces it by that dense array.
"""
from __future__ import annotations

import difflib
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..init import empty_init_dtype, is_placeholder, uninitialised
from ..io import ArrayArchive, save_arrays
from ..kernels.packed import PackedWeight
from . import exclusive as _exclusive
from .exclusive import Holder, claim, release
from .hooks import Hook, HookTable

__all__ = ["Module", "ModuleList", "GradientBuffers"]


class GradientBuffers(MutableMapping):
    """A module's parameter gradients by name, each created as zeros of its parameter's shape and dtype when
    first read.

    Every registered parameter is a key (``len``, iteration and ``in`` see them all), but only the buffers
    that were read or written hold memory (:meth:`allocated`). Deleting a name frees its buffer; reading it
    again gives fresh zeros.

    Examples
    --------
    >>> from attnkit.layers import Projection
    >>> proj = Projection(3, 2, rng=0)
    >>> sorted(proj.grads), proj.grads.allocated()
    (['W', 'b'], [])
    >>> proj.grads["W"].shape, proj.grads.allocated()
    ((3, 2), ['W'])
    """

    __slots__ = ("_parameters", "_buffers", "wanted")

    def __init__(self, parameters: Mapping[str, np.ndarray]) -> None:
        self._parameters = parameters
        self._buffers: dict[str, np.ndarray] = {}
        # False inside Module.input_gradients_only: a backward may skip forming these gradients
        self.wanted = True

    def add(self, name: str, value: np.ndarray | None) -> None:
        """Add ``value`` into the gradient of ``name``; ``None`` (a gradient not formed) adds nothing."""
        if value is not None:
            self[name] += value

    def __getitem__(self, name: str) -> np.ndarray:
        buffer = self._buffers.get(name)
        if buffer is None:
            param = self._parameters[name]
            if isinstance(param, PackedWeight):
                raise TypeError(f"parameter {name!r} is a packed {param.kind} weight (kept quantized): it has no "
                                f"gradient. Run the backward inside module.input_gradients_only() for the inputs' "
                                f"gradient, or load the model with keep_quantized=False to train it")
            # C order whatever the parameter's layout: backward kernels write rows (an embedding's scatter-add)
            buffer = self._buffers[name] = np.zeros(param.shape, param.dtype)
        return buffer

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        if name not in self._parameters:
            raise KeyError(f"no parameter {name!r}: gradients exist only for registered parameters")
        self._buffers[name] = value

    def __delitem__(self, name: str) -> None:
        if name not in self._parameters:
            raise KeyError(name)
        self._buffers.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._parameters)

    def __len__(self) -> int:
        return len(self._parameters)

    def __contains__(self, name: object) -> bool:
        return name in self._parameters

    def allocated(self) -> list[str]:
        """Names whose buffers exist (in registration order)."""
        return [name for name in self._parameters if name in self._buffers]

    def __repr__(self) -> str:
        return f"GradientBuffers(parameters={list(self._parameters)}, allocated={self.allocated()})"


class Module:
    """Base class of layers with parameters and child modules.

    Attributes
    ----------
    grads : GradientBuffers
        Gradient of each of this module's own parameters (same names and shapes), created when first read.
    training : bool
        Training mode (dropout active); set with :meth:`train` / :meth:`eval`.
    saved_tensors : tuple or None
        What the last forward kept for :meth:`backward` (:meth:`save_for_backward`); the one place a module
        keeps it, so copies and the PyTorch twin drop it without knowing the module.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_fused", {})  # group name -> (buffer, parameter names, their views of it)
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_column_major", set())  # names store_column_major keeps in Fortran order
        object.__setattr__(self, "grads", GradientBuffers(self._parameters))
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_saved_tensors", None)

    # -- hook points (installed by attnkit.explain.hooks) ----------------------------------------------
    _hook_table: HookTable | None = None  # the class default: no hooks, nothing to consult
    _holder: Holder | None = None  # the class default: no thread holds the module (see core.exclusive)
    FORWARD_ONLY_HOOKS: tuple[str, ...] = ()

    def hook_points(self) -> tuple[str, ...]:
        """Local names of this module's hook points (see :mod:`attnkit.core.hooks`); none by default."""
        return ()

    def hook_point(self, name: str, value: np.ndarray) -> np.ndarray:
        """``value`` through the forward hooks at point ``name``, or ``value`` itself when none are installed."""
        table = self._hook_table
        if table is None:
            return value
        if self._holder is not None:
            self._holder.check()
        return table.apply(name, value)

    def hook_backward(self, name: str, grad: np.ndarray) -> np.ndarray:
        """The gradient arriving at point ``name`` through its backward hooks; zeros if the last forward
        replaced the value there (a replaced value is a constant, so nothing upstream of it gets a gradient) with a
        hook that does not pass the gradient (:mod:`attnkit.core.hooks`)."""
        table = self._hook_table
        if table is None:
            return grad
        if self._holder is not None:
            self._holder.check()
        grad = table.apply(name, grad, "backward")
        return np.zeros_like(grad) if name in table.cut else grad

    def hook_replaced(self, name: str) -> bool:
        """Whether the last forward replaced the value at point ``name`` (a forward hook returned one)."""
        return self._hook_table is not None and name in self._hook_table.replaced

    def add_hook(self, point: str, fn: Hook, *, full_name: str, direction: str = "forward") -> None:
        """Call ``fn(value, full_name)`` at hook point ``point`` (``direction`` "forward" or "backward") until
        :meth:`remove_hook`; a non-None return replaces the value."""
        if point not in self.hook_points():
            raise ValueError(f"{type(self).__name__} has no hook point {point!r}; it has {list(self.hook_points())}")
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        if direction == "backward" and point in self.FORWARD_ONLY_HOOKS:
            raise ValueError(f"{full_name} takes forward hooks only (its gradient is never formed)")
        if self._hook_table is None:
            object.__setattr__(self, "_hook_table", HookTable())
        self._hook_table.add(direction, point, full_name, fn)

    def remove_hook(self, point: str, fn: Hook, direction: str = "forward") -> None:
        """Undo one :meth:`add_hook`; the module has no table again once its last hook is gone."""
        table = self._hook_table
        if table is not None:
            table.remove(direction, point, fn)
            if not table:
                del self.__dict__["_hook_table"]  # back to the class default

    def save_for_backward(self, *values: Any) -> None:
        """Keep ``values`` for :meth:`backward`, replacing what the last forward kept; with no values keep
        nothing (an inference-only forward, e.g. with a KV cache). Every forward passes here: a thread other than
        the one holding the module (:meth:`exclusive`) is refused here."""
        with _exclusive.lock:  # checked and written at once: a claim cannot come between them
            if self._holder is not None:
                self._holder.check()
            object.__setattr__(self, "_saved_tensors", values or None)

    @property
    def saved_tensors(self) -> tuple | None:
        """What the last forward kept for :meth:`backward`, or None (a thread other than the holder's is refused)."""
        with _exclusive.lock:
            if self._holder is not None:
                self._holder.check()
            return self.__dict__.get("_saved_tensors")

    @contextmanager
    def exclusive(self, what: str):
        """A block in which only the calling thread may run this module and its children.

        Another thread that runs them inside the block (a forward, ``generate``, a backward) gets a
        ``RuntimeError`` naming this thread and ``what``; a block of another thread on any of them is refused the
        same way, and blocks of the calling thread nest. :meth:`input_gradients_only` and
        :func:`attnkit.explain.hooks` hold the model this way (see :mod:`attnkit.core.exclusive`).

        Parameters
        ----------
        what : str
            What the block is for, as the refusal names it (``"attnkit.explain.hooks"``).
        """
        taken = claim((mod for _, mod in self.named_modules()), what)
        try:
            yield self
        finally:
            release(taken)

    # -- registration -------------------------------------------------------------------------------
    def register_parameter(self, name: str, value: np.ndarray) -> None:
        """Register ``value`` as parameter ``name`` (an attribute too); its gradient starts at zero when read."""
        if "." in name:
            raise ValueError(f"parameter name {name!r} must not contain '.'")
        empty = empty_init_dtype()
        if empty is not None:  # a loader fills it: allocate once, in the target dtype, copy nothing
            arr = uninitialised(np.shape(value), empty)  # a placeholder, in a placeholders block
        else:
            arr = np.array(value, dtype=np.result_type(np.asarray(value).dtype, np.float32), copy=True)
        self._parameters[name] = arr
        del self.grads[name]  # a re-registered name starts from a zero gradient

    def fuse_parameters(self, group: str, names: tuple[str, ...]) -> None:
        """Store the parameters ``names`` side by side in one array, along their last axis, and keep each as a
        view of it, so that one product can use them all (``x @ [W_Q W_K W_V]`` reads the three weights in one
        pass, which a matrix-vector product of one decoding step does faster than three).

        The parameters stay what they were to everything else (names, shapes, gradients, state dicts, loaders
        that copy into them). Rebinding one (``register_parameter``, :meth:`set_parameter`; :meth:`astype`
        re-fuses) ends the group: :meth:`fused_parameter` then returns None and the caller uses the parameters one
        by one. Packed parameters are never fused; placeholders (``empty_init(placeholders=True)``) are fused by
        :meth:`allocate_parameters`, once they all have storage.
        """
        params = [self._parameters[name] for name in names]
        if any(isinstance(p, PackedWeight) for p in params):
            raise ValueError(f"parameters {names} include packed weights, which are multiplied one by one")
        if any(is_placeholder(p) for p in params):
            self._fused[group] = (None, tuple(names), tuple(params))  # fused when they have storage
            return
        lead, dtype = params[0].shape[:-1], params[0].dtype
        if any(p.shape[:-1] != lead or p.dtype != dtype for p in params):
            raise ValueError(f"parameters {names} must share their leading shape and dtype to be fused, got "
                             f"{[(p.shape, str(p.dtype)) for p in params]}")
        buffer = np.empty(lead + (sum(p.shape[-1] for p in params),), dtype)  # (..., sum of widths)
        uninitialised = empty_init_dtype() is not None  # a loader fills them: nothing worth copying yet
        views, start = [], 0
        for name, param in zip(names, params):
            view = buffer[..., start:start + param.shape[-1]]
            if not uninitialised:
                np.copyto(view, param)
            self._parameters[name] = view
            views.append(view)
            start += param.shape[-1]
        self._fused[group] = (buffer, tuple(names), tuple(views))

    def store_column_major(self, name: str) -> None:
        """Keep the 2-D parameter ``name`` in column-major (Fortran) order: same shape and values, but its
        transpose is the contiguous array.

        ``x @ W.T`` with ``W`` (Out, In) then reads ``W.T`` (In, Out) row by row, the layout in which a
        one-row product (a decoding step's language-model head) streams fastest: on a 2-core AMD EPYC with
        OpenBLAS, a (49152, 576) head took 3.1 ms this way against 4.2 ms row-major. Everything else
        (names, shapes, gradients, which stay C-ordered, state dicts, loaders that copy in, :meth:`astype`)
        is unchanged.
        """
        param = self._parameters[name]
        if param.ndim != 2:
            raise ValueError(f"only a 2-D parameter can be stored column-major, {name!r} has shape {param.shape}")
        # kept when set_parameter or allocate_parameters gives it new storage (a module unpickled from before
        # the set existed has none yet)
        self.__dict__.setdefault("_column_major", set()).add(name)
        if isinstance(param, PackedWeight) or is_placeholder(param) or param.flags.f_contiguous:
            return
        if empty_init_dtype() is not None:  # a loader fills it: nothing worth copying yet
            self._parameters[name] = np.empty(param.shape, param.dtype, order="F")
        else:
            self._parameters[name] = np.asfortranarray(param)

    def fused_parameter(self, group: str) -> np.ndarray | None:
        """The array made by :meth:`fuse_parameters` for ``group`` while its parameters are still its views."""
        entry = self._fused.get(group)
        if entry is None:
            return None
        buffer, names, views = entry
        if buffer is None:
            return None
        params = self._parameters
        for name, view in zip(names, views):  # a loop, not all(generator): a decoding step asks twice a layer
            if params.get(name) is not view:
                return None
        return buffer

    def fused_weight_and_bias(self, weights: str, biases: str) -> tuple[np.ndarray, np.ndarray | None] | None:
        """``(fused weights, fused biases)`` of a fused linear map, biases None when the group was never made;
        None when either group no longer holds (the caller then uses the parameters one by one)."""
        weight = self.fused_parameter(weights)
        if weight is None:
            return None
        if biases not in self._fused:
            return weight, None
        bias = self.fused_parameter(biases)
        return None if bias is None else (weight, bias)

    def set_parameter(self, name: str, value: np.ndarray | PackedWeight) -> None:
        """Give parameter ``name`` (a dotted name of :meth:`named_parameters`) new storage: ``value``.

        A :class:`~attnkit.kernels.packed.PackedWeight` of the parameter's shape is taken as it is (its values
        dequantized to the parameter's dtype); an array is copied into a new array of the parameter's dtype
        (column-major where :meth:`store_column_major` asked). Unlike assigning the attribute, which copies into
        the parameter's storage, this replaces it: a fused group the parameter was in ends
        (:meth:`fused_parameter` is then None) and its gradient starts from zero.

        Raises
        ------
        KeyError
            No parameter ``name``.
        ValueError
            ``value`` does not have the parameter's shape.
        """
        path, _, local = name.rpartition(".")
        module = self
        for part in path.split(".") if path else ():
            if part not in module._modules:
                raise KeyError(f"{type(self).__name__} has no parameter {name!r} (no module {path!r})")
            module = module._modules[part]
        if local not in module._parameters:
            raise KeyError(f"{type(self).__name__} has no parameter {name!r}")
        current = module._parameters[local]
        if tuple(value.shape) != tuple(current.shape):
            raise ValueError(f"parameter {name} has shape {current.shape}, got a value of shape {tuple(value.shape)}")
        if isinstance(value, PackedWeight):
            stored = value.astype(current.dtype)
        else:
            order = "F" if local in module.__dict__.get("_column_major", ()) else "C"
            stored = np.array(value, dtype=current.dtype, order=order)
        module._parameters[local] = stored
        del module.grads[local]

    def allocate_parameters(self) -> None:
        """Give every placeholder parameter (``empty_init(placeholders=True)``) storage of its own, uninitialised
        (column-major where :meth:`store_column_major` asked), and fuse every group whose parameters all have
        storage (:meth:`fuse_parameters`); parameters already set (packed ones) are left as they are."""
        for _, mod in self.named_modules():
            for name, param in mod._parameters.items():
                if is_placeholder(param):
                    order = "F" if name in mod.__dict__.get("_column_major", ()) else "C"
                    mod._parameters[name] = np.empty(param.shape, param.dtype, order=order)
            for group, (buffer, names, _) in list(mod._fused.items()):
                params = [mod._parameters[name] for name in names]
                if buffer is None and all(isinstance(p, np.ndarray) and not is_placeholder(p) for p in params):
                    mod.fuse_parameters(group, names)

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        if params is None:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() before setting attributes")
        if name in params and (isinstance(params[name], PackedWeight) or isinstance(value, PackedWeight)):
            self.set_parameter(name, value if isinstance(value, PackedWeight) else np.asarray(value))
            return  # a packed weight has no storage to copy into: the value replaces it
        if name in params:
            arr = np.asarray(value)
            if arr.shape != params[name].shape:
                raise ValueError(f"parameter {name} has shape {params[name].shape}, got an array of shape {arr.shape}")
            if is_placeholder(params[name]):  # no storage yet: a placeholder stays one, a value becomes its storage
                if not is_placeholder(arr):
                    self.set_parameter(name, arr)
                return
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
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
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
    @contextmanager
    def input_gradients_only(self):
        """A block in which :meth:`backward` is asked for the inputs' gradient alone.

        Inside it, a backward returns the gradient with respect to its input exactly as always, and the layers
        with the largest parameter products (projections, attention and MLP weights, the output head and the
        token embedding) skip forming their parameters' gradients: for a short prompt those products are most
        of a backward. The parameters' gradient buffers are meaningless inside the block and freed when it ends
        (reading one then gives zeros), whatever happens in it. Explanations (:mod:`attnkit.explain`) run
        their backwards in one. The switch is the model's: inside the block only the calling thread may run the
        module (:meth:`exclusive`).

        Examples
        --------
        >>> from attnkit.layers import Projection
        >>> proj = Projection(3, 2, rng=0)
        >>> y = proj(np.ones((4, 3)))
        >>> with proj.input_gradients_only():
        ...     grad_x = proj.backward(np.ones_like(y))
        >>> grad_x.shape, proj.grads.allocated()
        ((4, 3), [])
        """
        modules = [mod for _, mod in self.named_modules()]
        with self.exclusive("Module.input_gradients_only"):
            for mod in modules:
                mod.grads.wanted = False
            try:
                yield self
            finally:
                for mod in modules:
                    mod.grads.wanted = True
                self.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every existing gradient buffer of this module and its children (none is created).

        Parameters
        ----------
        set_to_none : bool, default False
            Free the buffers instead; the next read or backward creates them again as zeros.
        """
        for _, mod in self.named_modules():
            for name in mod.grads.allocated():
                if set_to_none:
                    del mod.grads[name]
                else:
                    mod.grads[name].fill(0)

    def train(self, mode: bool = True) -> Module:
        """Set training mode (dropout on) for this module and its children; returns self."""
        for _, mod in self.named_modules():
            object.__setattr__(mod, "training", bool(mode))
        return self

    def eval(self) -> Module:
        """Set evaluation mode (dropout off); returns self."""
        return self.train(False)

    def astype(self, dtype: Any) -> Module:
        """Convert every parameter and gradient to ``dtype`` (e.g. ``np.float32``) in place; returns self.

        A packed parameter keeps its blocks and is dequantized to ``dtype`` from then on."""
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        for _, mod in self.named_modules():
            fused = [(group, names) for group, (_, names, _) in mod._fused.items()
                     if mod.fused_parameter(group) is not None]
            for name in mod._parameters:
                mod._parameters[name] = mod._parameters[name].astype(dtype)
            for group, names in fused:
                mod.fuse_parameters(group, names)
            for name in mod.grads.allocated():
                mod.grads[name] = mod.grads[name].astype(dtype)
        return self

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every parameter, keyed by dotted name (write it to a file with :meth:`save`); a packed one is
        a packed copy (its blocks copied, not dequantized)."""
        return {name: p.copy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Copy parameters in from ``state``, all or nothing: every entry is checked before any is copied.

        Checkpoints of an earlier parameter layout load too: a module class may declare
        ``STATE_DICT_RENAMES = {"earlier local name": "current local name"}`` (a name may also be a child module's
        name, renaming everything under it). Each module's table is applied to the incoming keys, prefixed by
        that module's dotted path, parents before children, before anything is checked.

        Parameters
        ----------
        state : mapping of str to array
            Real floating arrays (any float dtype: each is cast to its parameter's dtype), keyed by dotted name.
        strict : bool, default True
            Refuse missing keys too; unknown keys, duplicates and wrong shapes or dtypes are always refused.

        Raises
        ------
        KeyError
            Unknown keys, or (strict) missing keys, naming them and saying how to map earlier names.
        ValueError
            A value whose shape differs from its parameter's, or two keys naming the same parameter.
        TypeError
            ``state`` not a mapping, a key not a string, or a value that is not a real floating array.

        Examples
        --------
        >>> from attnkit.layers import LayerNorm
        >>> class Norm(Module):  # a layout that keeps its LayerNorm under "norm"; "gamma"/"beta" were its own
        ...     STATE_DICT_RENAMES = {"gamma": "norm.gamma", "beta": "norm.beta"}
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm = LayerNorm(2)
        >>> layer = Norm()
        >>> layer.load_state_dict({"gamma": np.array([2.0, 3.0]), "beta": np.zeros(2)})
        >>> layer.norm.gamma
        array([2., 3.])
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of parameter name to array (as state_dict() returns), got "
                            f"{type(state).__name__}")
        if not all(isinstance(key, str) for key in state):
            bad = next(key for key in state if not isinstance(key, str))
            raise TypeError(f"state's keys must be parameter names (str), got {type(bad).__name__} {bad!r}")
        values = {key: state[key] if isinstance(state[key], PackedWeight) else np.asarray(state[key])
                  for key in state}  # each entry read once
        plan = self._check_state({key: (v.shape, v.dtype) for key, v in values.items()}, strict)
        own = dict(self.named_parameters())
        for key, name in plan.items():
            self._assign(name, own[name], values[key])

    def _assign(self, name: str, own: np.ndarray | PackedWeight, value: np.ndarray | PackedWeight) -> None:
        """Load ``value`` into parameter ``name``: copied into its storage, or replacing a packed parameter (which
        has none); a packed value copied into a dense parameter is dequantized."""
        if isinstance(own, PackedWeight):
            self.set_parameter(name, value)
        elif isinstance(value, PackedWeight):
            np.copyto(own, value.dequantize(), casting="unsafe")
        else:
            np.copyto(own, value, casting="unsafe")

    def _state_renames(self) -> list[tuple[str, dict[str, str]]]:
        """``(dotted path, STATE_DICT_RENAMES)`` of every module that declares renames, parents first."""
        tables = []
        for path, mod in self.named_modules():
            table = getattr(type(mod), "STATE_DICT_RENAMES", None)
            if not table:
                continue
            if not isinstance(table, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and k and v
                                                         for k, v in table.items()):
                raise TypeError(f"{type(mod).__name__}.STATE_DICT_RENAMES must map str to str, got {table!r}")
            tables.append((path, dict(table)))
        return tables

    def _renamed_key(self, key: str, tables: list[tuple[str, dict[str, str]]]) -> str:
        """``key`` in the current layout: each table renames an exact name or everything below a name."""
        for path, table in tables:
            prefix = f"{path}." if path else ""
            if not key.startswith(prefix):
                continue
            local = key[len(prefix):]
            for earlier, current in table.items():
                if local == earlier:
                    local = current
                    break
                if local.startswith(earlier + "."):
                    local = current + local[len(earlier):]
                    break
            key = prefix + local
        return key

    def _check_state(self, entries: Mapping[str, tuple[tuple[int, ...], np.dtype]], strict: bool) -> dict[str, str]:
        """Check names (after renames), shapes and dtypes of incoming entries; map each key to its parameter.

        ``entries`` holds only what a header declares (shape, dtype), so files are checked before any
        array is read.
        """
        own = dict(self.named_parameters())
        tables = self._state_renames()
        plan: dict[str, str] = {}
        claimed: dict[str, str] = {}
        unknown = []
        for key in entries:
            if not isinstance(key, str):
                raise KeyError(f"state dict keys must be strings, got {key!r}")
            name = self._renamed_key(key, tables)
            if name in claimed:
                raise ValueError(f"state dict entries {claimed[name]!r} and {key!r} both name parameter {name!r}")
            claimed[name] = key
            if name in own:
                plan[key] = name
            else:
                unknown.append(key if name == key else f"{key} (renamed {name})")
        missing = sorted(set(own) - set(claimed)) if strict else []
        if unknown or missing:
            raise KeyError(self._mismatch_message(sorted(unknown), missing, own))
        for key, name in plan.items():
            shape, dtype = entries[key]
            if tuple(shape) != own[name].shape:
                raise ValueError(f"state dict entry {key!r} has shape {tuple(shape)}, expected {own[name].shape}")
            if np.dtype(dtype).kind != "f":
                want = own[name].dtype
                raise TypeError(f"state dict entry {key!r} has dtype {np.dtype(dtype)}, expected a real floating "
                                f"dtype (the parameter is {want}; convert with .astype(np.{want.name}))")
        return plan

    def _mismatch_message(self, unknown: list[str], missing: list[str], own: Mapping[str, np.ndarray]) -> str:
        message = (f"state dict does not match {type(self).__name__}: unknown keys {unknown}, "
                   f"missing keys {missing}")
        if unknown:
            hints = []
            for key in unknown[:3]:
                close = difflib.get_close_matches(key.split(" ")[0], missing or list(own), n=1, cutoff=0.5)
                if close:
                    hints.append(f"{key!r} -> {close[0]!r}?")
            message += (". If the checkpoint comes from an earlier parameter layout, map each earlier name to its "
                        "current name, either in the dict (state[current] = state.pop(earlier)) or, for every "
                        "checkpoint, in the module class's STATE_DICT_RENAMES = {'earlier': 'current'} (local names)")
            if hints:
                message += f"; closest current names: {', '.join(hints)}"
        return message

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to ``path`` as an ``.npz`` archive, atomically and exactly at ``path``.

        The archive is written to a temporary file in the same folder and renamed over ``path`` only when
        complete, so a failed or interrupted save leaves the previous file intact (:func:`attnkit.io.atomic_write`).
        ``np.load`` reads it too.

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

        Raises
        ------
        TypeError
            The module holds packed weights (the archive holds float arrays; keep the file they came from).
        """
        packed = [name for name, p in self.named_parameters() if isinstance(p, PackedWeight)]
        if packed:
            raise TypeError(f"{type(self).__name__} holds {len(packed)} packed weights ({packed[0]!r}, ...): save "
                            f"writes float arrays. Keep the quantized file, or load it with keep_quantized=False "
                            f"to save the dequantized model")
        save_arrays(path, self.state_dict())

    def load(self, path: str | os.PathLike, strict: bool = True) -> None:
        """Load parameters saved by :meth:`save`, checking the file's headers before reading any array.

        Names (after ``STATE_DICT_RENAMES``), shapes and dtypes are compared with the parameters from the
        archive's ``.npy`` headers alone; only then is each array read, once, and all are copied in
        together (on any error no parameter changes).

        Raises
        ------
        KeyError
            Unknown or (strict) missing entries, as :meth:`load_state_dict`.
        ValueError
            A file that is not a valid archive (damaged, duplicate entries, sizes that disagree with the
            headers), or an entry whose shape differs from its parameter's.
        TypeError
            An entry that is not a real floating array.
        """
        with ArrayArchive(path) as archive:
            plan = self._check_state({name: (h.shape, h.dtype) for name, h in archive.headers.items()}, strict)
            values = {key: archive.read(key) for key in plan}
        own = dict(self.named_parameters())
        for key, name in plan.items():
            self._assign(name, own[name], values[key])

    # -- calling -------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def step(self, x: np.ndarray, **kwargs: Any) -> np.ndarray:
        """One decoding step: this module on one new position per row, ``x`` (B, D) -> (B, D'), keeping nothing
        for a backward (a step is inference; with a cache, the cache is the only state it changes).

        This default runs :meth:`forward` on the position as a sequence of one and forgets what it saved; a
        layer on the decoding path (the norms, the MLPs, the token mixers, the blocks) overrides it with its
        own step, which skips the sequence bookkeeping one position does not need. ``kwargs`` are
        :meth:`forward`'s (``rotary``, ``attention_mask``, ``cache`` for a token mixer).
        """
        y = self.forward(x[:, None], **kwargs)[:, 0]  # (B, D')
        self.save_for_backward()
        return y

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

"""Hook points: named places in a module's forward (and backward) where a caller may read or replace a value.

A module that has hook points lists their local names in ``hook_points()`` and passes each value through
:meth:`~attnkit.core.module.Module.hook_point` where it is made (and each gradient through
:meth:`~attnkit.core.module.Module.hook_backward` where backward reaches it). Without a table (the default) both
return their argument: the path without hooks is one attribute read per point. :func:`attnkit.explain.hooks`
installs and removes the tables; this module only holds them.

A replaced forward value is a constant: the gradient that reaches its hook point in backward is reported to the
backward hooks and then stops there (upstream of it gets zeros), which is the exact gradient of the hooked model.
A forward hook that is a differentiable function of the value (a sparse autoencoder spliced in) says so with an
attribute ``passes_gradient = True``: its replacement then does not stop the gradient, and a backward hook it
installs at the same point maps the gradient of its output to that of its input.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["HookTable", "block_hook_points", "hook_heads", "hook_heads_backward"]

Hook = Callable[[np.ndarray, str], Any]


class HookTable:
    """One module's hooks: per local point name, the forward and backward functions (applied in the order they
    were added) and the full name they are called with; and which points the last forward replaced."""

    __slots__ = ("forward", "backward", "full_names", "replaced", "cut")

    def __init__(self) -> None:
        self.forward: dict[str, list[Hook]] = {}
        self.backward: dict[str, list[Hook]] = {}
        self.full_names: dict[str, str] = {}
        self.replaced: set[str] = set()
        self.cut: set[str] = set()  # replaced by a hook that is not differentiable: the gradient stops there

    def __bool__(self) -> bool:
        return bool(self.forward or self.backward)

    def add(self, direction: str, point: str, full_name: str, fn: Hook) -> None:
        getattr(self, direction).setdefault(point, []).append(fn)
        self.full_names[point] = full_name

    def remove(self, direction: str, point: str, fn: Hook) -> None:
        table = getattr(self, direction)
        fns = table.get(point, [])
        for i, added in enumerate(fns):  # by identity: the same function may be added twice
            if added is fn:
                del fns[i]
                break
        if not fns:
            table.pop(point, None)

    def apply(self, point: str, value: np.ndarray, direction: str = "forward") -> np.ndarray:
        """``value`` through the point's hooks; a forward replacement is recorded (and a None return clears the
        record, so it always describes the last forward), and so is whether every replacing hook passes the
        gradient (``passes_gradient``)."""
        fns = getattr(self, direction).get(point)
        replaced = cut = False
        for fn in fns or ():
            # A read-only view: an edit in place would change the model's arrays without being seen as a
            # replacement (and so without cutting the gradient); the hook returns its new value instead.
            seen = value.view()
            seen.flags.writeable = False
            out = fn(seen, self.full_names[point])
            if out is not None and out is not seen:
                value = _checked_replacement(out, value, self.full_names[point])
                replaced = True
                cut = cut or not getattr(fn, "passes_gradient", False)
        if direction == "forward":
            for record, flag in ((self.replaced, replaced), (self.cut, cut)):
                if flag:
                    record.add(point)
                else:
                    record.discard(point)
        return value


def _checked_replacement(out: Any, value: np.ndarray, name: str) -> np.ndarray:
    out = np.asarray(out)
    if out.shape != value.shape:
        raise ValueError(f"the hook at {name} returned shape {out.shape}, but the value there has shape "
                         f"{value.shape}")
    if out.dtype.kind not in "fiu":
        raise TypeError(f"the hook at {name} returned an array of dtype {out.dtype}, expected numbers")
    return out.astype(value.dtype, copy=False)


def hook_heads(module, name: str, heads: np.ndarray) -> np.ndarray:
    """An attention's ``heads`` (B, H, L, Dh) through ``module``'s hooks at ``name``, which see them in
    TransformerLens's layout (B, L, H, Dh)."""
    hooked = module.hook_point(name, heads.transpose(0, 2, 1, 3))  # (B, L, H, Dh)
    return hooked.transpose(0, 2, 1, 3)  # (B, H, L, Dh)


def hook_heads_backward(module, name: str, grad: np.ndarray) -> np.ndarray:
    """The gradient of :func:`hook_heads`' value (B, H, L, Dh) through the backward hooks at ``name``."""
    hooked = module.hook_backward(name, grad.transpose(0, 2, 1, 3))  # (B, L, H, Dh)
    return hooked.transpose(0, 2, 1, 3)  # (B, H, L, Dh)


def block_hook_points(index: int, block, attention, mlp=None) -> list[tuple[str, Any, str]]:
    """Block ``index``'s hook points as ``(full name, module, local name)`` in forward order, with
    TransformerLens's prefixes: ``blocks.{index}.hook_resid_pre``, then the attention's
    (``blocks.{index}.attn.hook_q``, ...), then the block's others, the MLP's (``blocks.{index}.mlp.``, a
    mixture of experts' ``hook_expert_indices``, ...) just before ``hook_mlp_out``."""
    first, *rest = block.hook_points()  # hook_resid_pre comes first
    points = [(f"blocks.{index}.{first}", block, first)]
    points += [(f"blocks.{index}.attn.{p}", attention, p) for p in attention.hook_points()]
    for p in rest:
        if p == "hook_mlp_out" and mlp is not None:
            points += [(f"blocks.{index}.mlp.{q}", mlp, q) for q in mlp.hook_points()]
        points.append((f"blocks.{index}.{p}", block, p))
    return points

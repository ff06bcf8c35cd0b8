"""Converters between attnkit modules and their ``torch.nn`` counterparts, registered by class.

The layers sit below the bridge and must not import it, yet ``MultiHeadAttention.from_torch(m)`` reads best
on the class itself. So the bridge (:mod:`attnkit.interop.torch_nn`, imported by the package root) registers
one :class:`TorchConverter` per attnkit class here, and the classes' ``from_torch`` / ``to_torch_state_dict``
methods only look their converter up.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["TorchConverter", "register_torch_converter", "torch_converter", "torch_converters"]


@dataclass(frozen=True)
class TorchConverter:
    """How one attnkit class maps to one ``torch.nn`` class.

    Attributes
    ----------
    torch_class : str
        Name of the counterpart in ``torch.nn`` (e.g. ``"MultiheadAttention"``).
    from_torch : callable
        ``torch.nn`` module -> attnkit module with the same weights and configuration.
    state_dict : callable
        attnkit module -> ``torch.nn`` state dict (name -> torch tensor).
    to_torch : callable
        attnkit module -> a new ``torch.nn`` module with the same configuration and weights.
    """

    torch_class: str
    from_torch: Callable[[Any], Any]
    state_dict: Callable[[Any], dict[str, Any]]
    to_torch: Callable[[Any], Any]


_REGISTRY: dict[type, TorchConverter] = {}


def register_torch_converter(cls: type, converter: TorchConverter) -> None:
    """Register ``converter`` for the attnkit class ``cls`` (and, unless they register their own, its subclasses)."""
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    if not isinstance(converter, TorchConverter):
        raise TypeError(f"converter must be a TorchConverter, got {type(converter).__name__}")
    _REGISTRY[cls] = converter


def torch_converter(cls: type) -> TorchConverter:
    """The converter registered for ``cls`` or its nearest registered base class.

    Raises
    ------
    TypeError
        If no class in ``cls``'s method resolution order has a converter.
    """
    for klass in cls.__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass]
    raise TypeError(f"{cls.__name__} has no torch.nn counterpart registered (see attnkit.interop.torch_nn)")


def torch_converters() -> dict[type, TorchConverter]:
    """Every registered converter, by attnkit class (a copy)."""
    return dict(_REGISTRY)

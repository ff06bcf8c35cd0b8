"""The one place where alternative names of an argument or attribute are resolved.

Where the specification, PyTorch and the textbook name one thing differently, attnkit accepts the names
listed in :data:`ALIASES` and maps each to one canonical name here; ``docs/names.md`` shows the same table.
Code never reads an alias directly: constructors and ``forward`` methods call :func:`resolve`, and alias
attributes are :func:`alias_property` objects that read (and write) the canonical attribute.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ALIASES", "resolve", "alias_property"]

# (owner, alias) -> canonical name. Owners are classes, or "Class.method" for per-call arguments.
ALIASES: dict[tuple[str, str], str] = {
    ("MultiHeadAttention", "d_model"): "embed_dim",
    ("MultiHeadAttention", "head_dim"): "d_k",
    ("MultiHeadAttention.forward", "mask"): "attn_mask",
    ("Attention", "future_mask"): "is_causal",
}


def _same(a: Any, b: Any) -> bool:
    """Whether two values given under both names agree (equal numbers, or the very same object)."""
    if a is b:
        return True
    return bool(np.isscalar(a) and np.isscalar(b) and a == b)


def resolve(owner: str, canonical: str, value: Any, alias: str, alias_value: Any) -> Any:
    """The value of argument ``canonical`` of ``owner``, given under its own name or under ``alias``.

    ``None`` means "not given". Both given with different values is a ``ValueError`` naming both.

    Examples
    --------
    >>> resolve("MultiHeadAttention", "embed_dim", None, "d_model", 8)
    8
    >>> resolve("MultiHeadAttention", "embed_dim", 8, "d_model", 4)
    Traceback (most recent call last):
    ...
    ValueError: MultiHeadAttention: give embed_dim or its alias d_model, not both (got 8 and 4)
    """
    if ALIASES.get((owner, alias)) != canonical:
        raise KeyError(f"{alias!r} is not a registered alias of {owner}'s {canonical!r}")
    if alias_value is None:
        return value
    if value is not None and not _same(value, alias_value):
        shown = (value, alias_value) if np.isscalar(value) else ("an array", "an array")
        raise ValueError(f"{owner}: give {canonical} or its alias {alias}, not both (got {shown[0]} and {shown[1]})")
    return alias_value


def alias_property(owner: str, alias: str) -> property:
    """A property named ``alias`` on class ``owner`` that reads and writes the canonical attribute.

    Examples
    --------
    >>> class Box:
    ...     embed_dim = 8
    ...     d_model = alias_property("MultiHeadAttention", "d_model")
    >>> Box().d_model
    8
    """
    canonical = ALIASES[(owner, alias)]

    def get(self: Any) -> Any:
        return getattr(self, canonical)

    def set_(self: Any, value: Any) -> None:
        setattr(self, canonical, value)

    return property(get, set_, doc=f"Alias of ``{canonical}`` (see docs/names.md).")

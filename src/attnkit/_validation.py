"""Input checks shared by the public functions.

Every public function converts and checks its arguments here, so that bad input fails at the boundary
with a message naming the argument, the shape it got and the shape it expected, and never as a numpy
traceback from deep inside a kernel. Checks raise explicitly (never ``assert``, which ``python -O`` drops).
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "as_float_array",
    "common_float_dtype",
    "check_ndim",
    "check_mask",
    "check_positive_int",
    "unbroadcast",
]


def as_float_array(x: Any, name: str) -> np.ndarray:
    """Return ``x`` as a floating ndarray without copying floats; integers and bools become float64.

    Raises
    ------
    TypeError
        If ``x`` is not numeric (strings, objects, complex numbers).
    """
    arr = np.asarray(x)
    if arr.dtype.kind == "f":
        return arr
    if arr.dtype.kind in "iub":
        return arr.astype(np.float64)
    raise TypeError(f"{name} must be a real numeric array, got dtype {arr.dtype} (shape {arr.shape})")


def common_float_dtype(*arrays: np.ndarray) -> np.dtype:
    """The dtype every computation on ``arrays`` runs in: float32 only if all are float32 (or narrower)."""
    return np.result_type(*[a.dtype for a in arrays], np.float32)


def check_ndim(x: np.ndarray, name: str, ndim: int | None = None, min_ndim: int | None = None,
               expected: str = "") -> None:
    """Raise ``ValueError`` unless ``x`` has exactly ``ndim`` (or at least ``min_ndim``) dimensions."""
    bad = (ndim is not None and x.ndim != ndim) or (min_ndim is not None and x.ndim < min_ndim)
    if bad:
        want = expected or (f"{ndim}-D" if ndim is not None else f"at least {min_ndim}-D")
        raise ValueError(f"{name} must be {want}, got shape {x.shape}")


def check_positive_int(value: Any, name: str, allow_zero: bool = False) -> int:
    """Return ``value`` as an int, raising ``TypeError``/``ValueError`` for non-integers and bad signs."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value}")
    return int(value)


def check_mask(mask: Any, name: str, target_shape: tuple[int, ...], target_desc: str = "scores") -> np.ndarray | None:
    """Validate a boolean attention mask (``True`` = may attend) against the scores it will mask.

    The mask must be boolean and broadcast to ``target_shape`` by numpy's rules without enlarging it:
    a mask may not add batch dimensions the scores do not have.

    Returns
    -------
    numpy.ndarray or None
        The mask as a boolean array (``None`` passes through).
    """
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = may attend), got dtype {m.dtype} with shape {m.shape}; "
            f"convert a 0/1 mask with `{name}.astype(bool)`"
        )
    try:
        out_shape = np.broadcast_shapes(m.shape, target_shape)
    except ValueError:
        out_shape = None
    if out_shape != tuple(target_shape):
        raise ValueError(
            f"{name} of shape {m.shape} does not broadcast to the {target_desc} shape {tuple(target_shape)}; "
            f"a (batch, seq_k) padding mask must be reshaped, e.g. mask[:, None, None, :] for (B, H, Lq, Lk)"
        )
    return m


def unbroadcast(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``grad`` over the axes that broadcasting added or stretched, so that it has ``shape``."""
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(extra))) if extra > 0 else grad
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad

"""Products where a zero weight means "not seen", even against a NaN or an infinity.

A masked attention entry has weight exactly 0, but IEEE arithmetic gives ``0 * NaN = NaN`` and
``0 * inf = NaN``: a non-finite value at a key that a query may not see would still reach that query
through ``weights @ V`` (and through ``dS @ K`` in the backward). The kernels call
:func:`zero_safe_matmul` only on tiles that have both masked entries and a non-finite key row, so
the common, finite path pays one ``isfinite`` pass over the keys and values, nothing per tile.
"""
from __future__ import annotations

import numpy as np

__all__ = ["nonfinite_rows", "tile_product", "zero_safe_matmul"]


def tile_product(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``np.matmul(a, b, out=out)`` of two tiles, with NumPy's invalid-value flag ignored.

    A tile product of finite float32 tiles once raised NumPy's "invalid value encountered in matmul" in a
    full test run (a 2 x 5 by 5 x 1 product of the tiled forward; not reproduced in 2,000 reruns): the flag
    came from inside BLAS, not from the numbers. Whatever is non-finite in a tile is handled by the masks or
    shows in the result, so the flag carries nothing a caller could act on.
    """
    with np.errstate(invalid="ignore"):
        return np.matmul(a, b, out=out)


def nonfinite_rows(x: np.ndarray) -> np.ndarray | None:
    """(L,) bool: rows (axis -2) of ``x`` (..., L, F) holding a NaN or infinity in any leading slice;
    None when every value is finite (the common case, checked with one pass)."""
    finite = np.isfinite(x)  # (..., L, F)
    if finite.all():
        return None
    bad = ~finite.all(axis=-1)  # (..., L)
    return bad.reshape(-1, bad.shape[-1]).any(axis=0)  # (L,)


def zero_safe_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a @ b`` in which an entry of ``a`` that is exactly 0 contributes exactly 0, whatever ``b`` holds.

    Parameters
    ----------
    a : ndarray, shape (..., M, K)
        Weights (probabilities or score gradients); masked entries are exactly 0.
    b : ndarray, shape (..., K, N)
        May hold NaN or infinities in some rows.
    out : ndarray, shape (..., M, N), optional

    Returns
    -------
    ndarray, shape (..., M, N)
        Equal to ``a @ b`` wherever no zero meets a non-finite value; where the nonzero entries of a row
        of ``a`` meet only finite values, bit for bit equal to ``a @ b`` with those rows of ``b`` replaced
        by any finite numbers. Non-finite values that meet nonzero weights propagate as usual.
    """
    finite = np.isfinite(b)  # (..., K, N)
    b_finite = np.where(finite, b, 0).astype(b.dtype, copy=False)  # (..., K, N)
    result = np.matmul(a, b_finite, out=out)  # (..., M, N)
    bad = ~finite.all(axis=-1)  # (..., K)
    bad = np.flatnonzero(bad.reshape(-1, bad.shape[-1]).any(axis=0))  # (nb,) key rows with a non-finite value
    if bad.size == 0:
        return result
    a_bad = a[..., bad]  # (..., M, nb)
    b_rest = np.where(finite, 0, b)[..., bad, :]  # (..., nb, N) only the non-finite values
    seen = a_bad != 0  # (..., M, nb)
    shape = np.broadcast_shapes(a_bad.shape[:-1] + (len(bad), 1), b_rest.shape[:-2] + (1,) + b_rest.shape[-2:])
    terms = np.zeros(shape, result.dtype)  # (..., M, nb, N)
    np.multiply(a_bad[..., None], b_rest[..., None, :, :], out=terms, where=seen[..., None])
    result += terms.sum(axis=-2)  # (..., M, N)
    return result

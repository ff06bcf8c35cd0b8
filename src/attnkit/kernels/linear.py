"""Affine maps ``y = x @ W + b`` over any leading dims, and their gradients (unchecked kernels).

Large products run on attnkit's own threads (:func:`product`): each thread multiplies a block of rows with BLAS
on one thread. OpenBLAS's threads busy-wait for about 0.1 s after every product they share; the tiled attention
and the activations that follow a projection run on attnkit's threads, and beside a spinning BLAS thread they
ran 1.6-2.6x slower (a 1024-token causal attention of 9 heads: 16 ms alone, 33-42 ms right after a two-thread
BLAS product; ``docs/benchmarks.md``). With one owner of the cores, nothing spins beside the work.

A weight is a float array or a :class:`~attnkit.kernels.packed.PackedWeight` (a file's quantized blocks kept as
they are): :func:`product` is the one place weights are multiplied, and hands a packed one to
:func:`~attnkit.kernels.packed.packed_product`, so every layer, the output head and the decoding steps take
packed weights without knowing.
"""
from __future__ import annotations

import numpy as np

from ._threads import default_num_threads, in_worker, run_tasks
from .packed import PackedWeight, packed_product
from .tuning import current_choices

__all__ = ["linear", "linear_backward", "product", "split_product"]

# A product runs split when it has at least ``split_rows`` rows (blocks of at least half as many) and this much
# work (multiply-adds): below them one BLAS call on BLAS's own threads was faster (15-30% at 256 rows of a
# SmolLM-135M projection on AMD EPYC: handing work to a thread costs about 0.1 ms, and each thread packs the
# whole right-hand side). The row count is a tuned choice (:mod:`attnkit.kernels.tuning`, default 256).
_SPLIT_WORK = 1 << 25  # about 0.3 ms of one thread's BLAS: far above the hand-off


def product(a: np.ndarray, b: np.ndarray | PackedWeight) -> np.ndarray:
    """``a @ b`` for 2-D ``a`` (M, K) and ``b`` (K, N), split by rows over attnkit's threads when large.

    Every row is computed by the same single-threaded BLAS kernel whatever the split, in NumPy's result dtype.
    Small products (fewer than the tuned ``split_rows``, 256 by default, or 2**25 multiply-adds), one
    configured thread, or a call from inside one of attnkit's workers take one plain ``a @ b``. A packed ``b``
    is multiplied by :func:`~attnkit.kernels.packed.packed_product` (blocks of its rows dequantized in turn).

    Returns
    -------
    ndarray (M, N)
    """
    if not isinstance(b, np.ndarray):  # a PackedWeight
        return packed_product(a, b)
    rows, split_rows = a.shape[0], current_choices().split_rows
    # a decoding step's few rows decide here, before the thread count is looked up (five products a layer)
    if rows < split_rows or rows * a.shape[1] * b.shape[1] < _SPLIT_WORK:
        return a @ b
    workers = min(default_num_threads(), rows // max(1, split_rows // 2))
    if workers < 2 or in_worker():
        return a @ b
    return split_product(a, b, workers)


def split_product(a: np.ndarray, b: np.ndarray, workers: int) -> np.ndarray:
    """``a @ b`` (M, K) x (K, N) cut into ``workers`` blocks of rows, each one single-threaded BLAS call on one of
    attnkit's threads (:func:`product` decides when; the calibration times it against a plain ``a @ b``).

    Returns
    -------
    ndarray (M, N)
    """
    rows = a.shape[0]
    out = np.empty((rows, b.shape[1]), np.result_type(a.dtype, b.dtype))  # (M, N)
    cuts = [rows * i // workers for i in range(workers + 1)]

    def block(i: int, _worker: int) -> None:
        np.matmul(a[cuts[i]:cuts[i + 1]], b, out=out[cuts[i]:cuts[i + 1]])  # (rows of block i, N)

    run_tasks(range(workers), block, workers)
    return out


def linear(x: np.ndarray, w: np.ndarray | PackedWeight, b: np.ndarray | None = None) -> np.ndarray:
    """``x @ w (+ b)`` computed in ``x``'s dtype: x (..., In), w (In, Out) (an array or packed), b (Out,) ->
    (..., Out)."""
    # Flattened to 2-D: numpy runs (B, L, In) @ (In, Out) as B separate small products otherwise.
    y = product(x.reshape(-1, x.shape[-1]), w.astype(x.dtype, copy=False)).reshape(*x.shape[:-1], w.shape[1])
    if b is not None:  # y: (..., Out)
        y += b.astype(x.dtype, copy=False)
    return y


def linear_backward(grad_y: np.ndarray, x: np.ndarray, w: np.ndarray, need_bias: bool = False,
                    need_weight: bool = True):
    """Gradients of :func:`linear`; ``need_weight=False`` skips the weight's (and the bias's) product.

    ``grad_x`` is exact for a packed ``w`` too (its product dequantizes blocks of rows, as the forward's does); a
    packed weight has no gradient of its own, which :class:`attnkit.core.Module` refuses to hold.

    Returns
    -------
    grad_x : (..., In)
    grad_w : (In, Out) or None
    grad_b : (Out,) or None
    """
    out = w.shape[1]
    flat_g = grad_y.reshape(-1, out)  # (N, Out): one BLAS call instead of one per leading row
    grad_x = product(flat_g, w.astype(grad_y.dtype, copy=False).T)  # (N, In)
    grad_x = grad_x.reshape(*grad_y.shape[:-1], w.shape[0])  # (..., In)
    grad_w = x.reshape(-1, x.shape[-1]).T @ flat_g if need_weight else None  # (In, Out)
    grad_b = flat_g.sum(axis=0) if need_bias and need_weight else None  # (Out,)
    return grad_x, grad_w, grad_b

"""Loss functions returning the loss and its gradient together (there is no autograd to ask later).

Dimension letters: ``...`` any leading dims (e.g. (B, L) for per-token classification), C classes.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._validation import as_float_array, check_ndim

__all__ = ["softmax_cross_entropy"]


def softmax_cross_entropy(logits: Any, targets: Any, ignore_index: int | None = None) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy over the positions whose target is not ``ignore_index``, and its gradient.

    ``loss = mean_n( logsumexp(logits[n]) - logits[n, targets[n]] )``, computed stably (the row max is
    subtracted before ``exp``), as ``torch.nn.functional.cross_entropy(reduction="mean")`` does.

    Parameters
    ----------
    logits : ndarray, shape (..., C)
        Unnormalised class scores.
    targets : integer ndarray, shape (...)
        Class indices in [0, C), or ``ignore_index``.
    ignore_index : int, optional
        Target value of positions that contribute neither loss nor gradient (e.g. padding).

    Returns
    -------
    loss : float
        The mean over counted positions (0.0 if none is counted).
    grad_logits : ndarray, shape (..., C), in ``logits``' float dtype
        ``(softmax(logits) - onehot(targets)) / count`` on counted positions, zero on ignored ones.

    Raises
    ------
    TypeError
        Non-integer targets, non-numeric logits.
    ValueError
        Shapes that do not match, targets out of range.

    Examples
    --------
    >>> logits = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    >>> loss, grad = softmax_cross_entropy(logits, np.array([0, 2]))
    >>> round(loss, 4)  # mean of -log(e^2 / (e^2 + 2)) and -log(1/3)
    0.6691
    >>> grad.round(3)
    array([[-0.107,  0.053,  0.053],
           [ 0.167,  0.167, -0.333]])
    >>> softmax_cross_entropy(logits, np.array([0, -100]), ignore_index=-100)[0] < loss
    True
    """
    logits = as_float_array(logits, "logits")
    check_ndim(logits, "logits", min_ndim=1, expected="at least 1-D (..., num_classes)")
    targets = np.asarray(targets)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"targets must be an integer array of class indices, got dtype {targets.dtype}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets has shape {targets.shape}, expected logits.shape[:-1] = {logits.shape[:-1]} "
                         f"(logits: {logits.shape})")
    num_classes = logits.shape[-1]
    counted = np.ones(targets.shape, bool) if ignore_index is None else targets != ignore_index  # (...)
    bad = counted & ((targets < 0) | (targets >= num_classes))
    if bad.any():
        raise ValueError(f"targets must lie in [0, {num_classes}) (or equal ignore_index={ignore_index}), got "
                         f"{targets[bad][:5].tolist()} ...")
    safe_targets = np.where(counted, targets, 0)  # (...)
    shifted = logits - logits.max(axis=-1, keepdims=True)  # (..., C)
    exp = np.exp(shifted)  # (..., C)
    sum_exp = exp.sum(axis=-1, keepdims=True)  # (..., 1)
    picked = np.take_along_axis(shifted, safe_targets[..., None], axis=-1)  # (..., 1)
    nll = (np.log(sum_exp) - picked)[..., 0]  # (...)
    count = int(counted.sum())
    scale = 1.0 / max(count, 1)
    loss = float(np.sum(nll, where=counted, dtype=np.float64) * scale)
    probs = exp / sum_exp  # (..., C)
    onehot = np.arange(num_classes) == safe_targets[..., None]  # (..., C)
    grad = np.where(counted[..., None], (probs - onehot) * scale, 0).astype(logits.dtype, copy=False)  # (..., C)
    return loss, grad

"""Learning-rate schedules: the learning rate as a function of the step, set on an optimizer by the loop.

Examples
--------
>>> from attnkit.optim import Adam, warmup_cosine
>>> # in a training loop: optimizer.lr = warmup_cosine(step, peak=3e-3, warmup=100, total=2000)
"""
from __future__ import annotations

import math

from .._validation import check_positive_int

__all__ = ["warmup_cosine"]


def warmup_cosine(step: int, *, peak: float, warmup: int, total: int, floor: float = 0.0) -> float:
    """Linear warm-up times a cosine decay from ``peak`` to ``floor * peak`` over the whole run.

    ``lr(s) = peak * min(1, (s + 1) / warmup) * (floor + (1 - floor) * (1 + cos(pi * s / (total - 1))) / 2)``
    for the 0-based step ``s``. The two factors overlap: the decay starts at step 0, and during a short
    warm-up it is still close to 1.

    Parameters
    ----------
    step : int
        0-based step; steps past ``total - 1`` stay at the final value.
    peak : float
        Largest learning rate (> 0).
    warmup : int
        Steps of linear warm-up (0 for none).
    total : int
        Steps of the run (>= 1).
    floor : float, default 0.0
        Final learning rate as a fraction of ``peak``, in [0, 1].

    Returns
    -------
    float

    Examples
    --------
    >>> [round(warmup_cosine(s, peak=1.0, warmup=10, total=100, floor=0.1), 3) for s in (0, 9, 50, 99)]
    [0.1, 1.0, 0.543, 0.1]
    """
    step = check_positive_int(step, "step", allow_zero=True)
    if not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
        raise ValueError(f"peak must be a finite number > 0, got {peak!r}")
    warmup = check_positive_int(warmup, "warmup", allow_zero=True)
    total = check_positive_int(total, "total")
    if not (isinstance(floor, (int, float)) and 0.0 <= floor <= 1.0):
        raise ValueError(f"floor must be a number in [0, 1], got {floor!r}")
    warm = min(1.0, (step + 1) / max(warmup, 1))
    progress = min(step, total - 1) / max(total - 1, 1)
    return peak * warm * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))

"""What the demos' training loops share: stopping at the first non-finite loss with a message that says why.

A learning rate far too high makes the weights overflow within a step or two; every later step, the saved
model and its pictures would then be NaN. The loops call :func:`check_loss` after each step instead.
"""
from __future__ import annotations

import math

__all__ = ["TrainingDiverged", "check_loss"]


class TrainingDiverged(ValueError):
    """Training produced a non-finite loss (the learning rate is too high for the model)."""


def check_loss(loss: float, step: int, lr: float) -> float:
    """``loss`` as a float, or :class:`TrainingDiverged` if it is NaN or infinite.

    Examples
    --------
    >>> check_loss(0.5, 3, 1e-3)
    0.5
    >>> check_loss(float("nan"), 2, 1e30)
    Traceback (most recent call last):
    attnkit.demos.training.TrainingDiverged: training diverged at step 2 (loss nan) with learning rate 1e+30: \
use a smaller one
    """
    loss = float(loss)
    if not math.isfinite(loss):
        raise TrainingDiverged(f"training diverged at step {step} (loss {loss}) with learning rate {lr:g}: use a "
                               f"smaller one")
    return loss

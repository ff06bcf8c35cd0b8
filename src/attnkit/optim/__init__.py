"""Optimizers over a :class:`attnkit.core.Module`'s parameters (updated in place), gradient clipping, and the
learning-rate schedule the demos and the trainer share.

Typical step::

    model.zero_grad()
    loss, grad = softmax_cross_entropy(model(x), y)
    model.backward(grad)
    clip_grad_norm(model, 1.0)
    optimizer.step()
"""
from .adam import Adam, AdamW
from .clip import clip_grad_norm
from .optimizer import Optimizer
from .schedules import warmup_cosine
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm", "warmup_cosine"]

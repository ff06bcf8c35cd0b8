"""Optimizers over a :class:`attnkit.core.Module`'s parameters (updated in place) and gradient clipping.

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
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "clip_grad_norm"]

"""``SGD``: stochastic gradient descent with (Nesterov) momentum and L2 weight decay, as ``torch.optim.SGD``."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.module import Module
from .optimizer import Optimizer, check_hyper

__all__ = ["SGD"]


class SGD(Optimizer):
    """Stochastic gradient descent, updating ``module``'s parameters in place.

    For each parameter ``p`` with gradient ``g`` (``torch.optim.SGD`` with ``dampening=0``)::

        g = g + weight_decay * p
        buf = momentum * buf + g                      (buf starts at 0, so the first buf is g)
        g = g + momentum * buf if nesterov else buf   (when momentum > 0)
        p = p - lr * g

    Parameters
    ----------
    module : Module
    lr : float
        Learning rate (>= 0).
    momentum : float, default 0.0
        In [0, 1).
    weight_decay : float, default 0.0
        L2 penalty added to the gradient.
    nesterov : bool, default False
        Nesterov momentum (needs ``momentum > 0``).

    Examples
    --------
    >>> from attnkit.layers import Projection
    >>> proj = Projection(2, 1, bias=False, rng=0)
    >>> opt = SGD(proj, lr=0.1, momentum=0.9)
    >>> before = proj.W.copy()
    >>> proj.grads["W"][:] = 1.0
    >>> opt.step()
    >>> (proj.W - before).ravel()
    array([-0.1, -0.1])
    >>> opt.step()  # momentum: 0.9 * 1 + 1
    >>> (proj.W - before).ravel().round(6)
    array([-0.29, -0.29])
    """

    hyperparameter_names = ("lr", "momentum", "weight_decay", "nesterov")
    slot_names = ("momentum_buffer",)

    def __init__(self, module: Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        super().__init__(module, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)

    @classmethod
    def check_hyperparameters(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        nesterov = values["nesterov"]
        if not isinstance(nesterov, (bool, np.bool_)):
            raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__} {nesterov!r}")
        hyper = {"lr": check_hyper(values["lr"], "lr"),
                 "momentum": check_hyper(values["momentum"], "momentum", 0.0, 1.0),
                 "weight_decay": check_hyper(values["weight_decay"], "weight_decay"),
                 "nesterov": bool(nesterov)}
        if hyper["nesterov"] and hyper["momentum"] == 0:
            raise ValueError("nesterov=True requires momentum > 0")
        return hyper

    @classmethod
    def slots_for(cls, hyperparameters: Mapping[str, Any]) -> tuple[str, ...]:
        return cls.slot_names if hyperparameters["momentum"] else ()

    def _update(self, p, g, state) -> None:
        if self.weight_decay:
            g = g + self.weight_decay * p
        if self.momentum:
            buf = state["momentum_buffer"]
            buf *= self.momentum
            buf += g
            g = g + self.momentum * buf if self.nesterov else buf
        p -= self.lr * g

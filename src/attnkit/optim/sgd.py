"""``SGD``: stochastic gradient descent with (Nesterov) momentum and L2 weight decay, as ``torch.optim.SGD``."""
from __future__ import annotations

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

    def __init__(self, module: Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        self.lr = check_hyper(lr, "lr")
        self.momentum = check_hyper(momentum, "momentum", 0.0, 1.0, high_inclusive=True)
        self.weight_decay = check_hyper(weight_decay, "weight_decay")
        self.nesterov = bool(nesterov)
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True requires momentum > 0")
        self.slot_names = ("momentum_buffer",) if self.momentum else ()
        super().__init__(module)

    def _update(self, p, g, state) -> None:
        if self.weight_decay:
            g = g + self.weight_decay * p
        if self.momentum:
            buf = state["momentum_buffer"]
            buf *= self.momentum
            buf += g
            g = g + self.momentum * buf if self.nesterov else buf
        p -= self.lr * g

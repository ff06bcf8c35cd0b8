"""``Adam`` (L2 penalty in the gradient) and ``AdamW`` (decoupled weight decay), as in ``torch.optim``."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.module import Module
from .optimizer import Optimizer, check_hyper

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam (Kingma & Ba), updating ``module``'s parameters in place, step for step as ``torch.optim.Adam``.

    At step ``t`` for each parameter ``p`` with gradient ``g``::

        g = g + weight_decay * p                      (L2 penalty, coupled to the moments)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    Parameters
    ----------
    module : Module
    lr : float, default 1e-3
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moment estimates, each in [0, 1).
    eps : float, default 1e-8
        Added to the denominator (> 0).
    weight_decay : float, default 0.0
        L2 penalty added to the gradient (use :class:`AdamW` for decoupled decay).

    Examples
    --------
    >>> from attnkit.layers import Projection
    >>> proj = Projection(2, 1, bias=False, rng=0)
    >>> opt = Adam(proj, lr=0.01)
    >>> before = proj.W.copy()
    >>> proj.grads["W"][:] = [[3.0], [-0.5]]
    >>> opt.step()  # the first step moves every weight by about lr, against its gradient's sign
    >>> (proj.W - before).ravel().round(6)
    array([-0.01,  0.01])
    """

    hyperparameter_names = ("lr", "betas", "eps", "weight_decay")
    slot_names = ("exp_avg", "exp_avg_sq")
    decoupled_weight_decay = False

    def __init__(self, module: Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(module, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @classmethod
    def check_hyperparameters(cls, values: Mapping[str, Any]) -> dict[str, Any]:
        betas = values["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        return {"lr": check_hyper(values["lr"], "lr"),
                "betas": (check_hyper(betas[0], "betas[0]", 0.0, 1.0), check_hyper(betas[1], "betas[1]", 0.0, 1.0)),
                "eps": check_hyper(values["eps"], "eps", low_inclusive=False),
                "weight_decay": check_hyper(values["weight_decay"], "weight_decay")}

    @classmethod
    def check_buffer(cls, slot: str, name: str, value: np.ndarray) -> None:
        """``exp_avg_sq`` is a running mean of squares: a negative or non-finite entry makes ``sqrt`` NaN and
        turns the parameter into NaN at the next step, so such a state is refused."""
        if slot != "exp_avg_sq":
            return
        bad = ~(np.isfinite(value) & (value >= 0))  # NaN compares False: caught as well
        if bad.any():
            first = value.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]]
            raise ValueError(f"buffer 'exp_avg_sq' of {name!r} must be finite and non-negative (a mean of squared "
                             f"gradients), got {int(bad.sum())} entries that are not, such as {float(first)!r}")

    def _update(self, p, g, state) -> None:
        beta1, beta2 = self.betas
        if self.weight_decay:
            if self.decoupled_weight_decay:
                p *= 1.0 - self.lr * self.weight_decay
            else:
                g = g + self.weight_decay * p
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m += (1.0 - beta1) * (g - m)
        v *= beta2
        v += (1.0 - beta2) * g * g
        t = self.step_count
        step_size = self.lr / (1.0 - beta1**t)
        denom = np.sqrt(v) / np.sqrt(1.0 - beta2**t) + self.eps
        p -= step_size * (m / denom)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as ``torch.optim.AdamW``.

    Each step first shrinks every parameter, ``p = p * (1 - lr * weight_decay)``, then takes the Adam step on
    the raw gradient (the decay never enters the moment estimates).

    Parameters
    ----------
    module : Module
    lr : float, default 1e-3
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
    weight_decay : float, default 0.01

    Examples
    --------
    >>> from attnkit.layers import Projection
    >>> proj = Projection(2, 1, bias=False, rng=0)
    >>> proj.W = np.ones((2, 1))
    >>> opt = AdamW(proj, lr=0.1, weight_decay=0.5)
    >>> opt.step()  # zero gradient: only the decay acts
    >>> proj.W.ravel()
    array([0.95, 0.95])
    """

    decoupled_weight_decay = True

    def __init__(self, module: Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        super().__init__(module, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

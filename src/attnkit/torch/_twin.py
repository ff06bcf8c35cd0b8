"""The machinery every twin shares: build a ``torch.nn.Module`` from an attnkit module, and back.

A twin is made FROM an attnkit module: its parameters are copied (same names, same dtype, same ``x @ W``
layout) in the order attnkit registers them, its children are twinned one by one, and a parameter-free
skeleton of the source is kept so :func:`to_numpy` can rebuild the attnkit module with the trained weights.
Building a twin with attnkit's constructor arguments therefore builds the attnkit module first, which gives
the twin attnkit's initial weights for the same ``rng``.

Dimension letters: B batch, H heads, Lq/Lk query/key length, Dh head features.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch.nn.functional as F

import torch
from torch import nn

from ..core.module import Module, ModuleList

__all__ = ["TwinModule", "TwinModuleList", "twin_of", "from_numpy", "to_numpy", "attend", "as_tensor", "TWINS"]

# attnkit class -> its twin class, filled by every twin class as it is defined.
TWINS: dict[type, type] = {}


def _fresh_like(template: Module) -> Module:
    """An instance of ``template``'s class that starts from :meth:`Module.__init__`'s own state, as every module
    does (an empty parameter table with its gradient buffers, no children, no fused groups, nothing saved for
    backward), plus the template's other attributes (hyperparameters, buffers). The subclass's ``__init__`` is
    not run: it would draw weights and needs its constructor arguments."""
    module = object.__new__(type(template))
    Module.__init__(module)
    owned = set(module.__dict__)
    module.__dict__.update({k: v for k, v in template.__dict__.items() if k not in owned})
    return module


def _skeleton(module: Module) -> Module:
    """A parameter-free copy of ``module`` (hyperparameters and buffers kept, parameters and saved tensors dropped).

    Its parameter table holds the names only (values None), and its fused groups the names of their parameters
    only (no buffer: the source's would stay alive with the twin), for :func:`_rebuild` to fuse them again.
    """
    copy = _fresh_like(module)
    copy._parameters.update({name: None for name in module._parameters})
    copy._fused.update({group: (None, names, ()) for group, (_, names, _) in module._fused.items()
                        if module.fused_parameter(group) is not None})
    children = {name: _skeleton(child) for name, child in module._modules.items()}
    copy._modules.update(children)
    for name, child in children.items():
        object.__setattr__(copy, name, child)
    return copy


class TwinModule(nn.Module):
    """Base of the twins: ``Twin(*args, **kwargs)`` builds attnkit's module with the same arguments and copies it.

    Subclasses set ``numpy_class`` and read their hyperparameters from the source in :meth:`setup`.
    """

    numpy_class: type = Module

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.numpy_class is not Module:
            TWINS[cls.numpy_class] = cls

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self._build(self.numpy_class(*args, **kwargs))

    @classmethod
    def wrap(cls, source: Module) -> TwinModule:
        """The twin of ``source`` (an instance of ``numpy_class``), its parameters copied."""
        twin = cls.__new__(cls)
        nn.Module.__init__(twin)
        twin._build(source)
        return twin

    def _build(self, source: Module) -> None:
        self.setup(source)
        for name, array in source._parameters.items():
            self.register_parameter(name, nn.Parameter(torch.from_numpy(np.array(array, copy=True))))
        for name, child in source._modules.items():
            setattr(self, name, twin_of(child))
        self._numpy_template = _skeleton(source)
        self.train(source.training)

    def setup(self, source: Module) -> None:
        """Copy the hyperparameters the forward needs from ``source`` (subclasses)."""

    def extra_repr(self) -> str:
        return self._numpy_template.extra_repr()


class TwinModuleList(nn.ModuleList):
    """The twin of :class:`attnkit.core.module.ModuleList` (children named ``0``, ``1``, ...)."""

    @classmethod
    def wrap(cls, source: ModuleList) -> TwinModuleList:
        twin = cls([twin_of(child) for child in source])
        twin._numpy_template = _skeleton(source)
        return twin


TWINS[ModuleList] = TwinModuleList


def twin_of(module: Module) -> nn.Module:
    """The twin of one attnkit module (its exact class must have one)."""
    twin_class = TWINS.get(type(module))
    if twin_class is None:
        raise ValueError(f"attnkit.torch has no twin of {type(module).__name__}; twinned classes: "
                         f"{', '.join(sorted(c.__name__ for c in TWINS))}")
    return twin_class.wrap(module)


def from_numpy(module: Module) -> nn.Module:
    """The ``torch.nn.Module`` twin of an attnkit module: same parameter names, values and dtype.

    Parameters
    ----------
    module : attnkit.core.Module
        A module whose class (and every child's class) has a twin.

    Returns
    -------
    torch.nn.Module
        ``dict(twin.named_parameters())`` has the keys of ``dict(module.named_parameters())``; each tensor is
        a copy of the array (CPU, same dtype), in the same training mode.

    Raises
    ------
    TypeError
        ``module`` is not an attnkit module.
    ValueError
        A class without a twin (naming it), e.g. an additive attention head.

    Shapes
    ------
    As the source module's forward, on tensors.

    Examples
    --------
    >>> from attnkit.layers import FeedForward
    >>> ffn = FeedForward(4, 8, rng=0)
    >>> twin = from_numpy(ffn)
    >>> [name for name, _ in twin.named_parameters()], twin.W1.dtype
    (['W1', 'b1', 'W2', 'b2'], torch.float64)
    >>> bool(np.array_equal(to_numpy(twin).W1, ffn.W1))
    True
    """
    if not isinstance(module, Module):
        raise TypeError(f"module must be an attnkit Module, got {type(module).__name__}")
    return twin_of(module)


def _to_array(tensor: torch.Tensor, name: str) -> np.ndarray:
    if tensor.dtype not in (torch.float16, torch.float32, torch.float64):
        raise TypeError(f"parameter {name!r} has dtype {tensor.dtype}, which NumPy cannot hold; convert the "
                        f"module first (e.g. twin.float())")
    return tensor.detach().cpu().numpy().copy()


def _rebuild(twin: nn.Module, prefix: str) -> Module:
    template = twin._numpy_template
    module = _fresh_like(template)
    # Filled into the table Module.__init__ made, which its gradient buffers read: the rebuilt module gets the
    # same (unallocated) buffers as a module built by its constructor.
    module._parameters.update({name: _to_array(getattr(twin, name), prefix + name) for name in template._parameters})
    for group, (_, names, _) in template._fused.items():
        try:
            module.fuse_parameters(group, names)
        except ValueError:  # the twin's parameters no longer share a dtype: used one by one, as after a rebinding
            pass
    children = {name: _rebuild(getattr(twin, name), f"{prefix}{name}.") for name in template._modules}
    module._modules.update(children)
    for name, child in children.items():
        object.__setattr__(module, name, child)
    object.__setattr__(module, "training", twin.training)
    # A twin class may finish what a constructor would (links between the rebuilt children)
    after = getattr(type(twin), "after_rebuild", None)
    if after is not None:
        after(module)
    return module


def to_numpy(module: nn.Module) -> Module:
    """The attnkit module of a twin, with the twin's current parameters (copied to NumPy, dtype kept).

    Raises
    ------
    TypeError
        ``module`` is not a twin, or holds parameters NumPy has no dtype for (bfloat16).

    Shapes
    ------
    The returned module's forward takes NumPy arrays of the shapes the twin takes as tensors.

    Examples
    --------
    >>> from attnkit.layers import LayerNorm
    >>> twin = from_numpy(LayerNorm(3))
    >>> with torch.no_grad():
    ...     _ = twin.gamma.mul_(2.0)
    >>> to_numpy(twin).gamma
    array([2., 2., 2.])
    """
    if not isinstance(module, nn.Module) or not hasattr(module, "_numpy_template"):
        raise TypeError(f"module must be an attnkit.torch twin (from from_numpy), got {type(module).__name__}")
    return _rebuild(module, "")


def as_tensor(x: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as a tensor on ``device`` (NumPy arrays are converted, tensors moved only when needed)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype) if (x.device != device or (dtype and x.dtype != dtype)) else x
    return torch.as_tensor(np.asarray(x), device=device, dtype=dtype)


def causal_band(seq_q: int, seq_k: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask, optionally a band of ``window`` keys: (Lq, Lk) bool, True = may attend."""
    i = torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q)  # (Lq, 1) absolute query positions
    j = torch.arange(seq_k, device=device)[None, :]  # (1, Lk)
    allowed = j <= i  # (Lq, Lk)
    if window is not None:
        allowed = allowed & (j > i - window)  # (Lq, Lk)
    return allowed


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
           causal: bool = False, window: int | None = None, scale: float | None = None,
           dropout_p: float = 0.0) -> torch.Tensor:
    """attnkit's attention on ``F.scaled_dot_product_attention``: bool masks (True = may attend), bottom-right
    causal, optional sliding window, grouped-query k/v, and zeros for a query that may attend to nothing.

    Shapes
    ------
    q (B, Hq, Lq, Dh), k/v (B, Hkv, Lk, Dh) with Hkv dividing Hq, mask broadcastable to (B, Hq, Lq, Lk)
    -> (B, Hq, Lq, Dh).
    """
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    gqa = q.shape[-3] != k.shape[-3]
    if mask is None and window is None and (not causal or seq_q == seq_k):
        # The fused kernels' own causal flag is top-left aligned, which equals bottom-right when Lq == Lk.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=gqa)  # (B, Hq, Lq, Dh)
    allowed = mask if mask is None or mask.ndim >= 2 else mask[None, :]  # (Lk,) -> (1, Lk): SDPA wants 2-D+
    if causal:
        band = causal_band(seq_q, seq_k, window, q.device)  # (Lq, Lk)
        allowed = band if allowed is None else allowed & band
    alive = allowed.any(dim=-1, keepdim=True)  # (..., Lq, 1)
    # A query with no key gets a full row for the kernel (finite everywhere, also in backward) and its output
    # is replaced by zeros, so its gradient is zero too.
    safe = allowed | ~alive  # (..., Lq, Lk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, scale=scale, dropout_p=dropout_p,
                                         enable_gqa=gqa)  # (B, Hq, Lq, Dh)
    return torch.where(alive, out, torch.zeros((), dtype=out.dtype, device=out.device))  # (B, Hq, Lq, Dh)

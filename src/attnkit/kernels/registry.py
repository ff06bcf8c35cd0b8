"""The attention kernels by name: one table, one signature, and the one place a kernel is chosen.

Every entry computes ``dropout(softmax(scale * q k^T + bias, masked)) v`` and its exact gradients:

``forward(q, k, v, *, mask, causal, scale, bias, dropout_p, dropout_seed, window) -> (out, weights, ctx)``
    ``weights`` is the (..., Lq, Lk) softmax before dropout, or ``None`` for a kernel that never forms it.
``backward(grad_out, ctx) -> (dq, dk, dv, dbias)``
    ``ctx`` is what that kernel's forward returned (an instance of its ``context_type``).

===============  ==========================================================================================
name             kernel
===============  ==========================================================================================
``"reference"``  :mod:`~attnkit.kernels.reference`: materialises the scores; returns the weights; the yardstick
``"tiled"``      :mod:`~attnkit.kernels.tiled`: online softmax over tiles, threads, nothing of size Lq x Lk
``"one_query"``  :mod:`~attnkit.kernels.decode_step`: a decoding step's query rows after every cached key, two
                 products, with a score modifier and sinks; inference only (its backward refuses)
===============  ==========================================================================================

Which kernel runs
-----------------
Every attention in attnkit (the heads and ``MultiHeadAttention``, ``GroupedQueryAttention``, multi-head latent
attention, :func:`attnkit.flex.flex_attention`, :func:`attnkit.kernels.attention_forward`) takes ``kernel`` and
asks :func:`resolve_kernel`; none decides by itself. ``kernel="auto"`` (the default everywhere) means:

1. ``"reference"`` when the weights are needed (``need_weights``, ``output_attentions``, a hook on the pattern):
   only it forms them;
2. ``"reference"`` for a single query row (``Lq == 1``, one decoding step): one row of scores per head is
   cheapest formed whole, and the tiled kernel's tile bookkeeping would cost more than it saves;
3. ``"tiled"`` otherwise: nothing of size ``Lq x Lk`` is allocated.

``"one_query"`` is never ``"auto"``'s choice: it keeps nothing for a backward. The layers' one-token ``step``
methods (a decoding step with a cache, which no backward follows) name it.

A named kernel runs as named (``"tiled"`` with weights needed is a ``ValueError``). Flex attention runs a
``"reference"`` choice on the reference attention kernel when its mask is one the kernels take as arguments
(causal, window, key padding, a dense boolean mask) and on its own reference kernel otherwise (a mask
function, sinks, the log-sum-exp); that is the same choice on another description, not a second rule. A
new kernel joins with :func:`register_attention_kernel`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from . import decode_step, reference, tiled

__all__ = ["AttentionKernel", "ATTENTION_KERNELS", "register_attention_kernel", "resolve_kernel",
           "kernel_for_context"]


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """One attention implementation: its forward, its backward, and the context type its forward returns."""

    name: str
    forward: Callable
    backward: Callable
    context_type: type
    returns_weights: bool


def _tiled_forward(q, k, v, **kwargs):
    out, _, ctx = tiled.flash_attention_forward(q, k, v, **kwargs)
    return out, None, ctx


ATTENTION_KERNELS: dict[str, AttentionKernel] = {}


def register_attention_kernel(kernel: AttentionKernel) -> None:
    """Add ``kernel`` to :data:`ATTENTION_KERNELS` under its name (a name may be registered once)."""
    if kernel.name == "auto" or kernel.name in ATTENTION_KERNELS:
        raise ValueError(f"an attention kernel named {kernel.name!r} is already registered")
    ATTENTION_KERNELS[kernel.name] = kernel


register_attention_kernel(AttentionKernel("reference", reference.attention_forward, reference.attention_backward,
                                          reference.AttentionContext, returns_weights=True))
register_attention_kernel(AttentionKernel("tiled", _tiled_forward, tiled.flash_attention_backward,
                                          tiled.FlashContext, returns_weights=False))
register_attention_kernel(AttentionKernel("one_query", decode_step.one_query_forward, decode_step.one_query_backward,
                                          decode_step.OneQueryContext, returns_weights=False))


def resolve_kernel(kernel: str, *, need_weights: bool, seq_q: int | None = None) -> AttentionKernel:
    """The kernel that runs for ``kernel`` ("auto" or a registered name): the rule in this module's docstring.

    Parameters
    ----------
    kernel : str
        ``"auto"`` or a name in :data:`ATTENTION_KERNELS`.
    need_weights : bool
        The caller needs the (..., Lq, Lk) softmax weights.
    seq_q : int, optional
        Lq, the number of query rows (None: not known, taken as more than one).

    >>> resolve_kernel("auto", need_weights=True).name, resolve_kernel("auto", need_weights=False, seq_q=9).name
    ('reference', 'tiled')
    >>> resolve_kernel("auto", need_weights=False, seq_q=1).name
    'reference'
    """
    if kernel == "auto":
        return ATTENTION_KERNELS["reference" if need_weights or seq_q == 1 else "tiled"]
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"kernel must be 'auto' or one of {sorted(ATTENTION_KERNELS)}, got {kernel!r}")
    chosen = ATTENTION_KERNELS[kernel]
    if need_weights and not chosen.returns_weights:
        raise ValueError(f"kernel {kernel!r} does not form the attention weights; pass need_weights=False "
                         "or kernel='reference'")
    return chosen


def kernel_for_context(ctx) -> AttentionKernel:
    """The registered kernel whose forward returned ``ctx``."""
    for entry in ATTENTION_KERNELS.values():
        if isinstance(ctx, entry.context_type):
            return entry
    raise TypeError(f"ctx must come from a registered attention kernel's forward, got {type(ctx).__name__}")

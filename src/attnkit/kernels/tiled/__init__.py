"""Tiled (FlashAttention-style) attention: online softmax forward, recomputing backward, threads.

Same semantics as :mod:`attnkit.kernels.reference` (boolean masks with ``True`` = may attend,
bottom-right-aligned causal masking and sliding windows, fully masked rows give zero output and zero
gradients, keys no query may attend to are zeroed so NaN/Inf padding cannot leak, inverted dropout after
the softmax from the counter-based :func:`~attnkit.kernels.dropout.keep_mask`), but nothing of size
``Lq x Lk`` is ever allocated: forward keeps the output and the per-row log-sum-exp, backward recomputes
the probabilities tile by tile (FlashAttention-2), so memory is linear in the sequence length. Tiles
entirely outside the causal band or the sliding window are skipped: with a window W the work is ~L W.

Dimension letters: ``...`` the broadcast leading batch/head dims of q, k, v, mask and bias (all heads of
a tile go to BLAS in one batched matmul); k and v keep their own leading shape, so grouped-query keys
``(B, Hkv, 1, Lk, D)`` are never repeated per query head ``(B, Hkv, G, Lq, D)``. Lq/Lk query/key length,
D query/key features, Dv value features, Tq/Tk tile lengths.

The code is a sequence of tile steps, each a function of what it reads: ``_Pass`` (geometry and settings
of one call), the operand dataclasses, and a per-worker :class:`_Scratch`. How the time is spent, the
tricks that remove overhead, and why the tiles have their sizes: ``docs/kernels.md``.
"""
from __future__ import annotations

from .backward import flash_attention_backward
from .forward import flash_attention_forward
from .plan import FlashContext, default_blocks

__all__ = ["FlashContext", "flash_attention_forward", "flash_attention_backward", "default_blocks"]

"""Attention compute kernels (no parameters, no input checking).

``reference`` materialises the ``Lq x Lk`` scores; the tiled kernel (FlashAttention-style) never does.
"""
from .bias import ScoreBias
from .reference import attention_backward, attention_forward, causal_mask, masked_softmax

__all__ = ["ScoreBias", "attention_forward", "attention_backward", "causal_mask", "masked_softmax"]

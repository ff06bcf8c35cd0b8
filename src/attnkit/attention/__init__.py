"""Attention modules: every head implements :class:`attnkit.core.BaseAttention`."""
from .multi_head_attention import MultiHeadAttention
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["MultiHeadAttention", "ScaledDotProductAttention"]

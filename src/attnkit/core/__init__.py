"""Building blocks shared by every layer: the ``Module`` base and the ``BaseAttention`` interface."""
from .base_attention import BaseAttention
from .module import Module, ModuleList

__all__ = ["Module", "ModuleList", "BaseAttention"]

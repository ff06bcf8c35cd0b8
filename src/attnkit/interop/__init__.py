"""Bridges to other libraries' modules (torch is imported lazily: attnkit itself needs numpy only).

- :func:`from_torch` / :func:`to_torch`: ``torch.nn.MultiheadAttention`` and the ``torch.nn`` Transformer
  modules to attnkit and back, with their weights; the attnkit classes also have ``from_torch`` and
  ``to_torch_state_dict`` (the converters are registered by class in :mod:`attnkit.core.converters`).
- :mod:`attnkit.interop.torch_nn`: the converters themselves.
"""
from .torch_nn import from_torch, to_torch

__all__ = ["from_torch", "to_torch"]

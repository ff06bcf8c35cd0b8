"""Bridges to other libraries' modules (imported lazily: attnkit itself needs numpy only).

- :mod:`attnkit.interop.torch_nn`: ``torch.nn.MultiheadAttention`` and the ``torch.nn`` Transformer modules
  to attnkit and back (also reachable as ``from_torch`` / ``to_torch_state_dict`` on the attnkit classes).
"""

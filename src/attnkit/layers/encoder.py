"""Stacks of encoder blocks: the one loop over blocks (:func:`stack_encoder_blocks`) and the
:class:`TransformerEncoder` module built on it.

Dimension letters: B batch, L sequence length, D ``d_model``, H heads.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._validation import check_positive_int
from ..core.converters import torch_converter
from ..core.module import Module, ModuleList
from ..init import as_generator
from .encoder_block import TransformerEncoderBlock
from .layer_norm import LayerNorm

__all__ = ["TransformerEncoder", "stack_encoder_blocks"]


def _forward_blocks(blocks: Iterable[TransformerEncoderBlock], x: Any, mask: Any = None,
                    key_padding_mask: Any = None, is_causal: bool = False,
                    need_weights: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """Run ``x`` through ``blocks`` in order with the same masks; returns ``(output, [weights per block])``."""
    all_weights = []
    for block in blocks:
        x = block.forward(x, mask, key_padding_mask, is_causal, need_weights=need_weights)  # (B, L, D)
        if need_weights:
            x, weights = x
            all_weights.append(weights)  # (B, H, L, L)
    return x, all_weights


def _backward_blocks(blocks: Sequence[TransformerEncoderBlock], grad_output: Any) -> np.ndarray:
    """Backpropagate through ``blocks`` in reverse order; returns the gradient of the first block's input."""
    g = grad_output
    for block in reversed(list(blocks)):
        g = block.backward(g)  # (B, L, D)
    return g


def stack_encoder_blocks(x: np.ndarray, blocks: list[TransformerEncoderBlock],
                         mask: np.ndarray | None = None) -> np.ndarray:
    """Pass ``x`` through a stack of encoder blocks in order.

    Parameters
    ----------
    x : ndarray, shape (batch, seq, d_model)
    blocks : list of TransformerEncoderBlock
    mask : ndarray of bool, optional
        ``True`` = may attend; the same mask for every block.

    Returns
    -------
    output : ndarray, shape (batch, seq, d_model)

    Shapes
    ------
    x : (B, L, D) -> (B, L, D) in ``x``'s float dtype; mask bool (L, L), (L,) or 4-D broadcastable to
    (B, H, L, L), ``True`` = may attend. :class:`TransformerEncoder` runs the same loop.

    Examples
    --------
    >>> blocks = [TransformerEncoderBlock(8, 2, rng=i) for i in range(3)]
    >>> stack_encoder_blocks(np.zeros((1, 4, 8)), blocks).shape
    (1, 4, 8)
    """
    if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, TransformerEncoderBlock) for b in blocks):
        raise TypeError("blocks must be a list of TransformerEncoderBlock instances")
    return _forward_blocks(blocks, x, mask)[0]


class TransformerEncoder(Module):
    """``num_layers`` encoder blocks applied in turn, then (optionally) a final :class:`LayerNorm`.

    A pre-norm stack leaves its residual stream un-normalised, so it usually ends with a norm (as
    ``torch.nn.TransformerEncoder(..., norm=LayerNorm)`` and GPT-2 do); a post-norm stack already ends on one.

    Parameters
    ----------
    num_layers : int
    d_model : int
    num_heads : int
        Must divide ``d_model``.
    d_ff : int, optional
        Feed-forward hidden size (default ``4 * d_model``).
    norm_first : bool, default True
        Pre-norm blocks (True) or post-norm blocks (False); see ``TransformerEncoderBlock``.
    activation : {"relu", "gelu", "gelu_tanh"}, default "relu"
    final_norm : bool, optional
        Add the final LayerNorm ``norm``; default: ``norm_first``.
    eps : float, default 1e-6
        Epsilon of every layer norm.
    attention_bias : bool, default False
        Biases in the attention projections.
    rng : numpy.random.Generator or int, optional
        Source of every initial weight.

    Attributes
    ----------
    layers : ModuleList of TransformerEncoderBlock (parameters ``"layers.0.ffn.W1"``, ``"layers.0.attention.W_Q"``, ...)
    norm : LayerNorm or None (parameters ``"norm.gamma"``, ``"norm.beta"``)

    Shapes
    ------
    x : (B, L, D) -> (B, L, D), in ``x``'s float dtype. ``mask``: bool, ``True`` = may attend, (L, L), (L,) or
    4-D broadcastable to (B, H, L, L); ``key_padding_mask``: bool (B, L), ``True`` = real token (both the
    opposite of torch's boolean masks). With ``need_weights=True`` the forward also returns a list with one
    (B, H, L, L) array of attention weights per layer.

    Examples
    --------
    >>> enc = TransformerEncoder(2, d_model=8, num_heads=2, rng=0)
    >>> x = np.random.default_rng(1).normal(size=(3, 5, 8))
    >>> y, weights = enc(x, key_padding_mask=np.arange(5) < np.array([[5], [4], [2]]), need_weights=True)
    >>> y.shape, len(weights), weights[0].shape
    ((3, 5, 8), 2, (3, 2, 5, 5))
    >>> float(weights[1][2, :, :, 2:].max())  # padded keys get no weight
    0.0
    >>> enc.backward(np.ones_like(y)).shape
    (3, 5, 8)
    >>> [name for name, _ in enc.named_parameters()][:3]
    ['layers.0.norm1.gamma', 'layers.0.norm1.beta', 'layers.0.attention.W_Q']
    """

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int | None = None, *,
                 norm_first: bool = True, activation: str = "relu", final_norm: bool | None = None,
                 eps: float = 1e-6, attention_bias: bool = False,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.num_layers = check_positive_int(num_layers, "num_layers")
        gen = as_generator(rng)
        self.layers = ModuleList([
            TransformerEncoderBlock(d_model, num_heads, d_ff, norm_first=norm_first, activation=activation,
                                    eps=eps, attention_bias=attention_bias, rng=gen)
            for _ in range(self.num_layers)])
        self.d_model = self.layers[0].d_model
        self.num_heads = self.layers[0].num_heads
        self.norm_first = bool(norm_first)
        self.final_norm = self.norm_first if final_norm is None else bool(final_norm)
        self.norm = LayerNorm(self.d_model, eps=eps) if self.final_norm else None

    def extra_repr(self) -> str:
        return f"num_layers={self.num_layers}, norm_first={self.norm_first}, final_norm={self.final_norm}"

    def forward(self, x: Any, mask: Any = None, key_padding_mask: Any = None, is_causal: bool = False,
                need_weights: bool = False):
        """Encode ``x`` (B, L, D) with every layer (same masks for each); returns (B, L, D).

        With ``need_weights=True`` returns ``(output, [weights of layer 0, layer 1, ...])``, each (B, H, L, L).
        """
        x, all_weights = _forward_blocks(self.layers, x, mask, key_padding_mask, is_causal, need_weights)
        if self.norm is not None:
            x = self.norm.forward(x)  # (B, L, D)
        return (x, all_weights) if need_weights else x

    def backward(self, grad_output: Any) -> np.ndarray:
        """Backpropagate (B, L, D) ``grad_output`` through the last forward; returns ``grad_x`` (B, L, D)."""
        g = grad_output
        if self.norm is not None:
            g = self.norm.backward(g)  # (B, L, D)
        return _backward_blocks(self.layers, g)  # (B, L, D)

    @classmethod
    def from_torch(cls, module: Any) -> TransformerEncoder:
        """The same computation as a ``torch.nn.TransformerEncoder`` (see :mod:`attnkit.interop.torch_nn`)."""
        return torch_converter(cls).from_torch(module)

    def to_torch_state_dict(self) -> dict[str, Any]:
        """These weights as a ``torch.nn.TransformerEncoder`` state dict (torch tensors)."""
        return torch_converter(type(self)).state_dict(self)

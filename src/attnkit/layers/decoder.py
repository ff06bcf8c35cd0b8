"""The Transformer decoder: blocks with masked self-attention, cross-attention over memory and a feed-forward
network, and the stack of them.

Dimension letters: B batch, Lt target length, Ls memory (source) length, D ``d_model``, H heads,
Dh = D // H head features, F ``d_ff``.

Besides ``forward``/``backward`` (training), a block can decode incrementally for generation:
:meth:`TransformerDecoderBlock.project_memory` computes the cross-attention keys and values of the memory
once, and :meth:`TransformerDecoderBlock.decode` runs new target positions against a
:class:`attnkit.decoding.cache.KVCache` holding the self-attention keys and values of the earlier ones. That path
keeps no backward cache worth using and is checked against the full forward by the tests.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_float_array, check_grad_output, check_ndim, check_positive_int
from ..attention.additive import AdditiveAttention
from ..attention.multi_head_attention import MultiHeadAttention
from ..core.converters import torch_converter
from ..core.module import Module, ModuleList
from ..init import as_generator
from ..kernels.activations import ACTIVATIONS
from .dropout import Dropout
from .feed_forward import FeedForward
from .layer_norm import LayerNorm

__all__ = ["TransformerDecoderBlock", "TransformerDecoder", "CROSS_ATTENTION_KINDS"]

CROSS_ATTENTION_KINDS = ("dot", "additive")


def _check_sequence(x: Any, name: str, d_model: int) -> np.ndarray:
    x = as_float_array(x, name)
    check_ndim(x, name, ndim=3, expected=f"3-D (batch, seq, d_model={d_model})")
    if x.shape[-1] != d_model:
        raise ValueError(f"{name} has {x.shape[-1]} features, expected d_model = {d_model} (got shape {x.shape})")
    return x


class TransformerDecoderBlock(Module):
    """One Transformer decoder block: masked self-attention, cross-attention over ``memory``, feed-forward.

    Pre-norm (``norm_first=True``, default)::

        h1  = x  + drop1(self_attention(norm1(x)))
        h2  = h1 + drop2(cross_attention(norm2(h1), memory))
        out = h2 + drop3(ffn(norm3(h2)))

    Post-norm (``norm_first=False``, the original Transformer and ``torch.nn.TransformerDecoderLayer``'s
    default): ``h1 = norm1(x + drop1(SA(x)))``, ``h2 = norm2(h1 + drop2(CA(h1, memory)))``,
    ``out = norm3(h2 + drop3(ffn(h2)))``.

    Parameters
    ----------
    d_model : int
    num_heads : int
        Must divide ``d_model``.
    d_ff : int, optional
        Feed-forward hidden size (default ``4 * d_model``).
    dropout : float, default 0.0
        Dropout on the attention weights and on each residual branch (training mode only). Unlike torch,
        there is no dropout inside the feed-forward network.
    activation : {"relu", "gelu", "gelu_tanh"}, default "relu"
    norm_first : bool, default True
    eps : float, default 1e-6
        Layer-norm epsilon (``torch.nn`` uses 1e-5; :meth:`from_torch` copies it).
    attention_bias : bool, default False
        Biases in the attention projections (``torch.nn`` has them).
    cross_attention : {"dot", "additive"}, default "dot"
        The head of the cross-attention: scaled dot-product, or Bahdanau's additive score
        ``v . tanh(q W_q + k W_k)`` (:class:`~attnkit.attention.AdditiveAttention`, hidden size Dh).
    rng : numpy.random.Generator or int, optional
        Source of the initial weights and dropout seeds.

    Attributes
    ----------
    norm1, norm2, norm3 : LayerNorm; self_attention, cross_attention : MultiHeadAttention;
    ffn : FeedForward; dropout1, dropout2, dropout3 : Dropout.

    Shapes
    ------
    x : (B, Lt, D), memory : (B, Ls, D) -> (B, Lt, D) in the inputs' float dtype.
    tgt_mask : bool (Lt, Lt) or 4-D broadcastable to (B, H, Lt, Lt); memory_mask : bool (Lt, Ls) or 4-D;
    ``True`` = may attend. tgt_key_padding_mask (B, Lt), memory_key_padding_mask (B, Ls): bool, ``True`` =
    real token. All are the OPPOSITE of torch.nn's boolean masks. ``tgt_is_causal=True`` ANDs the causal
    mask into the self-attention.

    Examples
    --------
    >>> block = TransformerDecoderBlock(8, 2, rng=0)
    >>> rng = np.random.default_rng(1)
    >>> x, memory = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 5, 8))
    >>> y = block(x, memory, tgt_is_causal=True)
    >>> grad_x, grad_memory = block.backward(np.ones_like(y))
    >>> y.shape, grad_x.shape, grad_memory.shape
    ((2, 3, 8), (2, 3, 8), (2, 5, 8))
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *, dropout: float = 0.0,
                 activation: str = "relu", norm_first: bool = True, eps: float = 1e-6,
                 attention_bias: bool = False, cross_attention: str = "dot",
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.d_model = check_positive_int(d_model, "d_model")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if cross_attention not in CROSS_ATTENTION_KINDS:
            raise ValueError(f"cross_attention must be one of {CROSS_ATTENTION_KINDS}, got {cross_attention!r}")
        gen = as_generator(rng)
        self.norm_first = bool(norm_first)
        self.cross_attention_kind = cross_attention
        self.self_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=attention_bias, rng=gen)
        self.num_heads, head_dim = self.self_attention.num_heads, self.self_attention.head_dim
        if cross_attention == "additive":
            head = AdditiveAttention(head_dim, head_dim, head_dim, rng=gen)
            self.cross_attention = MultiHeadAttention(d_model, num_heads, attention=head, bias=attention_bias, rng=gen)
        else:
            self.cross_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=attention_bias,
                                                      rng=gen)
        self.ffn = FeedForward(d_model, d_ff, activation, rng=gen)
        self.d_ff, self.activation = self.ffn.d_ff, activation
        self.norm1, self.norm2, self.norm3 = (LayerNorm(d_model, eps) for _ in range(3))
        self.eps = self.norm1.eps
        self.dropout1, self.dropout2, self.dropout3 = (Dropout(dropout, seed=int(gen.integers(2**63)))
                                                       for _ in range(3))
        self._memory_shape: tuple[int, ...] | None = None
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, d_ff={self.d_ff}, norm_first={self.norm_first}, "
                f"activation={self.activation!r}, eps={self.eps}, cross_attention={self.cross_attention_kind!r}")

    # -- training path -----------------------------------------------------------------------------
    def forward(self, x: Any, memory: Any, tgt_mask: Any = None, memory_mask: Any = None,
                tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
                tgt_is_causal: bool = False, need_weights: bool = False):
        """Decode ``x`` (B, Lt, D) against ``memory`` (B, Ls, D); returns (B, Lt, D).

        With ``need_weights=True`` returns ``(output, self_weights (B, H, Lt, Lt), cross_weights (B, H, Lt, Ls))``.
        """
        x = _check_sequence(x, "x", self.d_model)
        memory = _check_sequence(memory, "memory", self.d_model)
        if memory.shape[0] != x.shape[0]:
            raise ValueError(f"memory has batch size {memory.shape[0]} but x has {x.shape[0]} "
                             f"(x: {x.shape}, memory: {memory.shape})")
        self._memory_shape, self._shape, self._dtype = memory.shape, x.shape, x.dtype

        def self_block(h):
            out, w = self.self_attention(h, h, h, tgt_mask, tgt_key_padding_mask, need_weights, tgt_is_causal)
            return self.dropout1(out), w  # (B, Lt, D)

        def cross_block(h):
            out, w = self.cross_attention(h, memory, memory, memory_mask, memory_key_padding_mask, need_weights)
            return self.dropout2(out), w  # (B, Lt, D)

        if self.norm_first:
            sa, self_w = self_block(self.norm1(x))
            h1 = x + sa  # (B, Lt, D)
            ca, cross_w = cross_block(self.norm2(h1))
            h2 = h1 + ca  # (B, Lt, D)
            out = h2 + self.dropout3(self.ffn(self.norm3(h2)))  # (B, Lt, D)
        else:
            sa, self_w = self_block(x)
            h1 = self.norm1(x + sa)  # (B, Lt, D)
            ca, cross_w = cross_block(h1)
            h2 = self.norm2(h1 + ca)  # (B, Lt, D)
            out = self.norm3(h2 + self.dropout3(self.ffn(h2)))  # (B, Lt, D)
        return (out, self_w, cross_w) if need_weights else out

    def backward(self, grad_output: Any) -> tuple[np.ndarray, np.ndarray]:
        """Backpropagate (B, Lt, D) ``grad_output``; returns ``(grad_x (B, Lt, D), grad_memory (B, Ls, D))``."""
        if self._memory_shape is None:
            raise RuntimeError("TransformerDecoderBlock.backward called before forward")
        g = check_grad_output(grad_output, self._shape, self._dtype, "TransformerDecoderBlock")  # (B, Lt, D)
        if self.norm_first:
            g_h2 = g + self.norm3.backward(self.ffn.backward(self.dropout3.backward(g)))
            dq, dk, dv = self.cross_attention.backward(self.dropout2.backward(g_h2))
            g_h1 = g_h2 + self.norm2.backward(dq)
            sq, sk, sv = self.self_attention.backward(self.dropout1.backward(g_h1))
            grad_x = g_h1 + self.norm1.backward(sq + sk + sv)
        else:
            g_s3 = self.norm3.backward(g)  # gradient of h2 + FFN(h2)
            g_h2 = g_s3 + self.ffn.backward(self.dropout3.backward(g_s3))
            g_s2 = self.norm2.backward(g_h2)  # gradient of h1 + CA(h1)
            dq, dk, dv = self.cross_attention.backward(self.dropout2.backward(g_s2))
            g_h1 = g_s2 + dq
            g_s1 = self.norm1.backward(g_h1)  # gradient of x + SA(x)
            sq, sk, sv = self.self_attention.backward(self.dropout1.backward(g_s1))
            grad_x = g_s1 + sq + sk + sv
        return grad_x, dk + dv

    # -- generation path ---------------------------------------------------------------------------
    def project_memory(self, memory: Any) -> tuple[np.ndarray, np.ndarray]:
        """Cross-attention keys and values of ``memory`` (B, Ls, D), each (B, H, Ls, Dh), for :meth:`decode`."""
        memory = _check_sequence(memory, "memory", self.d_model)
        return self.cross_attention.project_kv(memory)

    def decode(self, x: Any, cache: Any, layer: int, memory_kv: tuple[np.ndarray, np.ndarray],
               memory_mask: np.ndarray | None = None, need_weights: bool = False):
        """Run new target positions ``x`` (B, Ln, D) after the ones already in ``cache`` (inference only).

        Parameters
        ----------
        x : ndarray (B, Ln, D)
            The block's input at the next Ln positions.
        cache : attnkit.decoding.cache.KVCache
            Its ``layer`` slot receives this block's self-attention keys/values of the new positions.
        layer : int
        memory_kv : tuple of ndarray
            ``project_memory(memory)``.
        memory_mask : bool, broadcastable to (B, H, Ln, Ls), optional
            ``True`` = may attend (e.g. ``memory_key_padding_mask[:, None, None, :]``).
        need_weights : bool
            Also return the cross-attention weights (B, H, Ln, Ls).

        Returns
        -------
        out : (B, Ln, D), and with ``need_weights`` the cross-attention weights.
        """
        x = _check_sequence(x, "x", self.d_model)
        sa_mha, ca_mha = self.self_attention, self.cross_attention
        h = self.norm1(x) if self.norm_first else x  # (B, Ln, D)
        keys, values, slots = cache.update(layer, *sa_mha.project_kv(h))
        causal = slots[None, :] <= slots[-x.shape[1]:, None]  # (Ln, Lpast + Ln): the new keys are the last slots
        sa, _ = sa_mha.attend_kv(h, keys, values, causal)  # (B, Ln, D)
        h1 = x + sa if self.norm_first else self.norm1(x + sa)  # (B, Ln, D)
        ca, weights = ca_mha.attend_kv(self.norm2(h1) if self.norm_first else h1, *memory_kv, memory_mask,
                                       need_weights=need_weights)  # (B, Ln, D)
        if self.norm_first:
            h2 = h1 + ca  # (B, Ln, D)
            out = h2 + self.ffn(self.norm3(h2))  # (B, Ln, D)
        else:
            h2 = self.norm2(h1 + ca)  # (B, Ln, D)
            out = self.norm3(h2 + self.ffn(h2))  # (B, Ln, D)
        return (out, weights) if need_weights else out

    # -- torch.nn bridge ---------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, module: Any) -> TransformerDecoderBlock:
        """A block with the weights of a ``torch.nn.TransformerDecoderLayer`` (see :mod:`attnkit.interop.torch_nn`)."""
        return torch_converter(cls).from_torch(module)

    def to_torch_state_dict(self) -> dict[str, Any]:
        """This block's weights as a ``torch.nn.TransformerDecoderLayer`` state dict (torch tensors)."""
        return torch_converter(type(self)).state_dict(self)


class TransformerDecoder(Module):
    """``num_layers`` decoder blocks applied in turn, then (optionally) a final :class:`LayerNorm`.

    Parameters
    ----------
    num_layers : int
    d_model, num_heads, d_ff, dropout, activation, norm_first, eps, attention_bias, cross_attention
        As :class:`TransformerDecoderBlock`.
    final_norm : bool, optional
        Add the final LayerNorm ``norm`` (default: ``norm_first``; ``torch.nn.Transformer`` always has one).
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    layers : ModuleList of TransformerDecoderBlock; norm : LayerNorm or None.

    Shapes
    ------
    As :class:`TransformerDecoderBlock`: x (B, Lt, D), memory (B, Ls, D) -> (B, Lt, D); every block sees the
    same memory and masks. ``backward`` returns ``(grad_x, grad_memory)``, the memory's gradient summed over
    the blocks.

    Examples
    --------
    >>> dec = TransformerDecoder(2, 8, 2, rng=0)
    >>> rng = np.random.default_rng(1)
    >>> x, memory = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 5, 8))
    >>> y = dec(x, memory, tgt_is_causal=True, memory_key_padding_mask=np.arange(5) < np.array([[5], [2]]))
    >>> [g.shape for g in dec.backward(np.ones_like(y))]
    [(2, 3, 8), (2, 5, 8)]
    """

    def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int | None = None, *,
                 dropout: float = 0.0, activation: str = "relu", norm_first: bool = True,
                 final_norm: bool | None = None, eps: float = 1e-6, attention_bias: bool = False,
                 cross_attention: str = "dot", rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.num_layers = check_positive_int(num_layers, "num_layers")
        gen = as_generator(rng)
        self.layers = ModuleList([
            TransformerDecoderBlock(d_model, num_heads, d_ff, dropout=dropout, activation=activation,
                                    norm_first=norm_first, eps=eps, attention_bias=attention_bias,
                                    cross_attention=cross_attention, rng=gen)
            for _ in range(self.num_layers)])
        first = self.layers[0]
        self.d_model, self.num_heads, self.norm_first = first.d_model, first.num_heads, first.norm_first
        self.final_norm = self.norm_first if final_norm is None else bool(final_norm)
        self.norm = LayerNorm(d_model, eps) if self.final_norm else None

    def extra_repr(self) -> str:
        return f"num_layers={self.num_layers}, norm_first={self.norm_first}, final_norm={self.final_norm}"

    def forward(self, x: Any, memory: Any, tgt_mask: Any = None, memory_mask: Any = None,
                tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
                tgt_is_causal: bool = False, need_weights: bool = False):
        """Decode ``x`` with every block; with ``need_weights`` also return the per-block cross-attention weights."""
        cross = []
        for block in self.layers:
            x = block(x, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                      tgt_is_causal, need_weights)  # (B, Lt, D)
            if need_weights:
                x, _, cross_w = x
                cross.append(cross_w)
        if self.norm is not None:
            x = self.norm(x)  # (B, Lt, D)
        return (x, cross) if need_weights else x

    def backward(self, grad_output: Any) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(grad_x (B, Lt, D), grad_memory (B, Ls, D))`` and adds every parameter's gradient."""
        g = grad_output if self.norm is None else self.norm.backward(grad_output)
        grad_memory = None
        for block in reversed(list(self.layers)):
            g, gm = block.backward(g)  # (B, Lt, D), (B, Ls, D)
            grad_memory = gm if grad_memory is None else grad_memory + gm
        return g, grad_memory

    def decode(self, x: Any, cache: Any, memory_kv: list[tuple[np.ndarray, np.ndarray]],
               memory_mask: np.ndarray | None = None, need_weights: bool = False):
        """Incremental :meth:`TransformerDecoderBlock.decode` through every block and the final norm.

        ``memory_kv`` is :meth:`project_memory`'s list. With ``need_weights`` also returns the list of
        per-block cross-attention weights (B, H, Ln, Ls).
        """
        weights = []
        for i, block in enumerate(self.layers):
            x = block.decode(x, cache, i, memory_kv[i], memory_mask, need_weights)  # (B, Ln, D)
            if need_weights:
                x, w = x
                weights.append(w)
        if self.norm is not None:
            x = self.norm(x)  # (B, Ln, D)
        return (x, weights) if need_weights else x

    def project_memory(self, memory: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every block's cross-attention keys and values of ``memory``, computed once per generation."""
        return [block.project_memory(memory) for block in self.layers]

    @classmethod
    def from_torch(cls, module: Any) -> TransformerDecoder:
        """A decoder with the weights of a ``torch.nn.TransformerDecoder`` (see :mod:`attnkit.interop.torch_nn`)."""
        return torch_converter(cls).from_torch(module)

    def to_torch_state_dict(self) -> dict[str, Any]:
        """This decoder's weights as a ``torch.nn.TransformerDecoder`` state dict (torch tensors)."""
        return torch_converter(type(self)).state_dict(self)

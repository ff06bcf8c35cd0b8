"""The Transformer decoder: blocks with masked self-attention, cross-attention over memory and a feed-forward
network, and the stack of them.

Dimension letters: B batch, Lt target length, Ls memory (source) length, D ``d_model``, H heads,
Dh = D // H head features, F ``d_ff``.

Besides ``forward``/``backward`` (training), ``forward(..., cache=...)`` decodes incrementally for generation,
the way the decoder-only LM blocks do: with an :class:`attnkit.decoding.cache.EncoderDecoderCache`, each
attention module keeps its own keys and values under its ``layer_index`` (the self-attention appends the new
target positions, the cross-attention projects the memory on the first step only). That path is inference
(no backward) and is checked against the full forward by the tests.
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
    layer_index : int, default 0
        The block's entry in a decoding cache (:class:`TransformerDecoder` numbers its blocks).

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
                 rng: np.random.Generator | int | None = None, layer_index: int = 0) -> None:
        super().__init__()
        self.d_model = check_positive_int(d_model, "d_model")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if cross_attention not in CROSS_ATTENTION_KINDS:
            raise ValueError(f"cross_attention must be one of {CROSS_ATTENTION_KINDS}, got {cross_attention!r}")
        gen = as_generator(rng)
        self.norm_first = bool(norm_first)
        self.cross_attention_kind = cross_attention
        self.self_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=attention_bias, rng=gen,
                                                 layer_index=layer_index)
        self.num_heads, head_dim = self.self_attention.num_heads, self.self_attention.head_dim
        self.layer_index = self.self_attention.layer_index
        if cross_attention == "additive":
            head = AdditiveAttention(head_dim, head_dim, head_dim, rng=gen)
            self.cross_attention = MultiHeadAttention(d_model, num_heads, attention=head, bias=attention_bias, rng=gen,
                                                      layer_index=layer_index)
        else:
            self.cross_attention = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=attention_bias,
                                                      rng=gen, layer_index=layer_index)
        self.ffn = FeedForward(d_model, d_ff, activation, rng=gen)
        self.d_ff, self.activation = self.ffn.d_ff, activation
        self.norm1, self.norm2, self.norm3 = (LayerNorm(d_model, eps) for _ in range(3))
        self.eps = self.norm1.eps
        self.dropout1, self.dropout2, self.dropout3 = (Dropout(dropout, seed=int(gen.integers(2**63)))
                                                       for _ in range(3))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, d_ff={self.d_ff}, norm_first={self.norm_first}, "
                f"activation={self.activation!r}, eps={self.eps}, cross_attention={self.cross_attention_kind!r}")

    # -- training path -----------------------------------------------------------------------------
    def forward(self, x: Any, memory: Any, tgt_mask: Any = None, memory_mask: Any = None,
                tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
                tgt_is_causal: bool = False, need_weights: bool = False, *, cache: Any = None):
        """Decode ``x`` (B, Lt, D) against ``memory`` (B, Ls, D); returns (B, Lt, D).

        With ``need_weights=True`` returns ``(output, self_weights (B, H, Lt, Lt), cross_weights (B, H, Lt, Ls))``.
        With an :class:`~attnkit.decoding.cache.EncoderDecoderCache` (inference: no :meth:`backward`), ``x`` holds
        the next positions after those in the cache; target masks then cover the cached slots (see
        :meth:`MultiHeadAttention.forward`), and the self-attention weights are (B, H, Lt, S).
        """
        x = _check_sequence(x, "x", self.d_model)
        memory = _check_sequence(memory, "memory", self.d_model)
        if memory.shape[0] != x.shape[0]:
            raise ValueError(f"memory has batch size {memory.shape[0]} but x has {x.shape[0]} "
                             f"(x: {x.shape}, memory: {memory.shape})")
        if cache is None:
            self.save_for_backward(x.shape, x.dtype)
        else:
            self.save_for_backward()  # the cached path is inference
        self_cache = None if cache is None else cache.self_attention
        cross_cache = None if cache is None else cache.cross_attention

        def self_block(h):
            out, w = self.self_attention(h, h, h, tgt_mask, tgt_key_padding_mask, need_weights, tgt_is_causal,
                                         cache=self_cache)
            return self.dropout1(out), w  # (B, Lt, D)

        def cross_block(h):
            out, w = self.cross_attention(h, memory, memory, memory_mask, memory_key_padding_mask, need_weights,
                                          cache=cross_cache)
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
        if self.saved_tensors is None:
            raise RuntimeError("TransformerDecoderBlock.backward called before forward (a cached forward keeps nothing "
                               "for it)")
        shape, dtype = self.saved_tensors
        g = check_grad_output(grad_output, shape, dtype, "TransformerDecoderBlock")  # (B, Lt, D)
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
                                    cross_attention=cross_attention, rng=gen, layer_index=i)
            for i in range(self.num_layers)])
        first = self.layers[0]
        self.d_model, self.num_heads, self.norm_first = first.d_model, first.num_heads, first.norm_first
        self.final_norm = self.norm_first if final_norm is None else bool(final_norm)
        self.norm = LayerNorm(d_model, eps) if self.final_norm else None

    def extra_repr(self) -> str:
        return f"num_layers={self.num_layers}, norm_first={self.norm_first}, final_norm={self.final_norm}"

    def forward(self, x: Any, memory: Any, tgt_mask: Any = None, memory_mask: Any = None,
                tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
                tgt_is_causal: bool = False, need_weights: bool = False, *, cache: Any = None):
        """Decode ``x`` with every block; with ``need_weights`` also return the per-block cross-attention weights.

        ``cache``: an :class:`~attnkit.decoding.cache.EncoderDecoderCache` with a layer per block, for
        incremental decoding (see :meth:`TransformerDecoderBlock.forward`).
        """
        cross = []
        for block in self.layers:
            x = block(x, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                      tgt_is_causal, need_weights, cache=cache)  # (B, Lt, D)
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

    @classmethod
    def from_torch(cls, module: Any) -> TransformerDecoder:
        """A decoder with the weights of a ``torch.nn.TransformerDecoder`` (see :mod:`attnkit.interop.torch_nn`)."""
        return torch_converter(cls).from_torch(module)

    def to_torch_state_dict(self) -> dict[str, Any]:
        """This decoder's weights as a ``torch.nn.TransformerDecoder`` state dict (torch tensors)."""
        return torch_converter(type(self)).state_dict(self)

"""``Transformer``: the encoder-decoder of "Attention Is All You Need", an encoder stack and a decoder stack.

Dimension letters: B batch, Ls source length, Lt target length, D ``d_model``, H heads.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.converters import torch_converter
from ..core.module import Module
from ..init import as_generator
from .decoder import TransformerDecoder
from .encoder import TransformerEncoder

__all__ = ["Transformer"]


class Transformer(Module):
    """Encoder-decoder Transformer: ``decoder(tgt, encoder(src))``, batch first, attnkit's mask polarity.

    Both stacks end with a LayerNorm (as ``torch.nn.Transformer``), pre-norm or post-norm blocks alike.

    Parameters
    ----------
    d_model : int
    num_heads : int
    num_encoder_layers, num_decoder_layers : int, default 6
    d_ff : int, optional
        Feed-forward hidden size (default ``4 * d_model``).
    dropout : float, default 0.0
        Dropout of the decoder blocks (see :class:`TransformerDecoderBlock`).
    activation : {"relu", "gelu", "gelu_tanh"}, default "relu"
    norm_first : bool, default True
    eps : float, default 1e-6
    attention_bias : bool, default False
    cross_attention : {"dot", "additive"}, default "dot"
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    encoder : TransformerEncoder, decoder : TransformerDecoder.

    Shapes
    ------
    src (B, Ls, D), tgt (B, Lt, D) -> (B, Lt, D). ``src_mask`` (Ls, Ls), ``tgt_mask`` (Lt, Lt),
    ``memory_mask`` (Lt, Ls) (or 4-D): bool, ``True`` = may attend. ``*_key_padding_mask`` (B, L): bool,
    ``True`` = real token. Both are the OPPOSITE of ``torch.nn.Transformer``'s boolean masks.
    ``tgt_is_causal=True`` applies the causal mask to the decoder's self-attention (torch only takes it
    as a hint about ``tgt_mask``). ``memory_key_padding_mask`` is not taken from ``src_key_padding_mask``
    (as in torch): pass both to hide padded source tokens from the decoder.

    Examples
    --------
    >>> model = Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=2, rng=0)
    >>> rng = np.random.default_rng(1)
    >>> src, tgt = rng.normal(size=(2, 5, 8)), rng.normal(size=(2, 3, 8))
    >>> y = model(src, tgt, tgt_is_causal=True)
    >>> grad_src, grad_tgt = model.backward(np.ones_like(y))
    >>> y.shape, grad_src.shape, grad_tgt.shape
    ((2, 3, 8), (2, 5, 8), (2, 3, 8))
    """

    def __init__(self, d_model: int, num_heads: int, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 d_ff: int | None = None, *, dropout: float = 0.0, activation: str = "relu",
                 norm_first: bool = True, eps: float = 1e-6, attention_bias: bool = False,
                 cross_attention: str = "dot", rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        self.encoder = TransformerEncoder(num_encoder_layers, d_model, num_heads, d_ff, norm_first=norm_first,
                                          activation=activation, final_norm=True, eps=eps,
                                          attention_bias=attention_bias, rng=gen)
        self.decoder = TransformerDecoder(num_decoder_layers, d_model, num_heads, d_ff, dropout=dropout,
                                          activation=activation, norm_first=norm_first, final_norm=True, eps=eps,
                                          attention_bias=attention_bias, cross_attention=cross_attention, rng=gen)
        self.d_model, self.num_heads = self.decoder.d_model, self.decoder.num_heads

    def forward(self, src: Any, tgt: Any, src_mask: Any = None, tgt_mask: Any = None, memory_mask: Any = None,
                src_key_padding_mask: Any = None, tgt_key_padding_mask: Any = None,
                memory_key_padding_mask: Any = None, tgt_is_causal: bool = False) -> np.ndarray:
        """Encode ``src`` and decode ``tgt`` against it; returns (B, Lt, D)."""
        memory = self.encoder(src, src_mask, src_key_padding_mask)  # (B, Ls, D)
        return self.decoder(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                            tgt_is_causal)  # (B, Lt, D)

    def backward(self, grad_output: Any) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(grad_src (B, Ls, D), grad_tgt (B, Lt, D))`` and adds every parameter's gradient."""
        grad_tgt, grad_memory = self.decoder.backward(grad_output)
        return self.encoder.backward(grad_memory), grad_tgt

    @classmethod
    def from_torch(cls, module: Any) -> Transformer:
        """A Transformer with the weights of a ``torch.nn.Transformer`` (see :mod:`attnkit.interop.torch_nn`)."""
        return torch_converter(cls).from_torch(module)

    def to_torch_state_dict(self) -> dict[str, Any]:
        """This model's weights as a ``torch.nn.Transformer`` state dict (torch tensors)."""
        return torch_converter(type(self)).state_dict(self)

"""``TransformerEncoderBlock``: LayerNorm, MultiHeadAttention, LayerNorm and FeedForward with two residuals.

The block owns no parameter itself: its four sublayers do, and its forward and backward are the list of
sublayers read forwards and backwards. The flat names ``W1``, ``b1``, ``W2``, ``b2``, ``gamma1``, ``beta1``,
``gamma2``, ``beta2`` are live, writable views of the sublayers' parameters (``block.W1`` is
``block.ffn.W1``), and :attr:`TransformerEncoderBlock.STATE_DICT_RENAMES` maps those flat names to the
parameter names of checkpoints (``ffn.W1``, ``norm1.gamma``, ...).

Dimension letters: B batch, L sequence length, D ``d_model``, F ``d_ff``, H heads.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_float_array, check_features, check_grad_output, check_ndim, check_positive_int
from ..attention.multi_head_attention import MultiHeadAttention
from ..core.converters import torch_converter
from ..core.module import Module
from ..init import as_generator
from .feed_forward import FeedForward
from .layer_norm import LayerNorm

__all__ = ["TransformerEncoderBlock"]

# Flat attribute -> (sublayer, parameter of that sublayer).
_FLAT_NAMES = {"W1": ("ffn", "W1"), "b1": ("ffn", "b1"), "W2": ("ffn", "W2"), "b2": ("ffn", "b2"),
               "gamma1": ("norm1", "gamma"), "beta1": ("norm1", "beta"),
               "gamma2": ("norm2", "gamma"), "beta2": ("norm2", "beta")}


def _sublayer_parameter(flat: str) -> property:
    """Property ``flat`` reading and writing parameter ``_FLAT_NAMES[flat]`` of a sublayer.

    Reading gives the sublayer's own array (in-place edits change the sublayer); assigning copies into it
    with the sublayer's shape check.
    """
    layer, name = _FLAT_NAMES[flat]

    def get(self: TransformerEncoderBlock) -> np.ndarray:
        return getattr(getattr(self, layer), name)

    def set_(self: TransformerEncoderBlock, value: Any) -> None:
        setattr(getattr(self, layer), name, value)

    return property(get, set_, doc=f"``{layer}.{name}`` under its flat name (a live view).")


class TransformerEncoderBlock(Module):
    """One Transformer encoder block made of its layers.

    Pre-norm (default)::

        x -> LayerNorm -> MultiHeadAttention -> + -> LayerNorm -> FFN -> +
        |__________________________|           |___________________|

    ``h = x + attention(norm1(x))``, ``out = h + ffn(norm2(h))``. Post-norm (``norm_first=False``, the
    original Transformer and BERT): ``h = norm1(x + attention(x))``, ``out = norm2(h + ffn(h))``.

    Parameters
    ----------
    d_model : int
        Model dimension D.
    num_heads : int
        Attention heads H (a positive divisor of D).
    d_ff : int, optional
        Feed-forward hidden dimension F (default ``4 * d_model``).
    norm_first : bool, default True
        Pre-norm (True) or post-norm (False).
    activation : {"relu", "gelu", "gelu_tanh"}, default "relu"
    eps : float, default 1e-6
        Layer-norm epsilon (finite, > 0).
    attention_bias : bool, default False
        Biases in the attention projections.
    rng : numpy.random.Generator or int, optional
        Source of the initial weights.

    Attributes
    ----------
    norm1 : LayerNorm (next to attention), attention : MultiHeadAttention, norm2 : LayerNorm (next to the
    FFN), ffn : FeedForward. Parameters are named ``norm1.gamma``, ``attention.W_Q``, ``ffn.W1``, ...
    W1 (D, F), b1 (F,), W2 (F, D), b2 (D,), gamma1, beta1, gamma2, beta2 (D,) : live views of
    ``ffn.W1``, ..., ``norm1.gamma``, ..., ``norm2.beta``; assigning to them writes the sublayer's array.
    d_model, num_heads, d_ff, norm_first, activation, eps.
    STATE_DICT_RENAMES : dict
        Flat parameter name -> name in this block's state dict, so ``load_state_dict`` can read state
        dicts keyed by the flat names.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D), in ``x``'s float dtype. mask : bool, ``True`` = may attend, (L, L), (L,) or
    4-D broadcastable to (B, H, L, L); key_padding_mask : bool (B, L), ``True`` = real token (both the
    opposite of torch's boolean masks). Positions marked as padding never influence real positions nor
    any gradient, even when they hold NaN or inf.

    Examples
    --------
    >>> from attnkit.positional import create_causal_mask
    >>> block = TransformerEncoderBlock(16, 4, rng=0)
    >>> x = np.random.default_rng(1).normal(size=(2, 6, 16))
    >>> y = block.forward(x, mask=create_causal_mask(6))
    >>> grad_x = block.backward(np.ones_like(y))
    >>> y.shape, grad_x.shape, block.d_ff
    ((2, 6, 16), (2, 6, 16), 64)
    >>> block.W1 is block.ffn.W1, sorted(block.ffn.grads)
    (True, ['W1', 'W2', 'b1', 'b2'])
    """

    STATE_DICT_RENAMES = {flat: f"{layer}.{name}" for flat, (layer, name) in _FLAT_NAMES.items()}

    W1 = _sublayer_parameter("W1")
    b1 = _sublayer_parameter("b1")
    W2 = _sublayer_parameter("W2")
    b2 = _sublayer_parameter("b2")
    gamma1 = _sublayer_parameter("gamma1")
    beta1 = _sublayer_parameter("beta1")
    gamma2 = _sublayer_parameter("gamma2")
    beta2 = _sublayer_parameter("beta2")

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *, norm_first: bool = True,
                 activation: str = "relu", eps: float = 1e-6, attention_bias: bool = False,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        d_model = check_positive_int(d_model, "d_model")
        gen = as_generator(rng)
        self.norm_first = bool(norm_first)
        # Draw the attention's weights before the FFN's (a seed gives the weights it always gave), then
        # register the sublayers in the order forward runs them.
        attention = MultiHeadAttention(d_model, num_heads, bias=attention_bias, rng=gen)
        ffn = FeedForward(d_model, d_ff, activation, rng=gen)
        self.norm1 = LayerNorm(d_model, eps=eps)
        self.attention = attention
        self.norm2 = LayerNorm(d_model, eps=eps)
        self.ffn = ffn
        self.d_model, self.num_heads, self.d_ff = d_model, self.attention.num_heads, self.ffn.d_ff
        self.activation, self.eps = self.ffn.activation, self.norm1.eps
        self._shape: tuple[int, ...] | None = None
        self._dtype: np.dtype | None = None

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, d_ff={self.d_ff}, "
                f"norm_first={self.norm_first}, activation={self.activation!r}, eps={self.eps}")

    def hook_points(self) -> tuple[str, ...]:
        """``hook_resid_pre`` (the input), ``hook_attn_out`` and ``hook_mlp_out`` (each branch's output),
        ``hook_resid_mid`` (input plus attention, before ``norm1`` in a post-norm block), ``hook_resid_post``
        (the output, after ``norm2`` in a post-norm block: what the next block reads); all (B, L, D)."""
        return ("hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")

    def forward(self, x: Any, mask: Any = None, key_padding_mask: Any = None, is_causal: bool = False,
                need_weights: bool = False):
        """Encode ``x`` (B, L, D); returns (B, L, D), or ``(output, weights (B, H, L, L))`` with ``need_weights``.

        ``mask`` and ``key_padding_mask`` go to :meth:`MultiHeadAttention.forward`; ``is_causal`` adds the
        causal mask.
        """
        x = as_float_array(x, "x")
        check_ndim(x, "x", ndim=3, expected=f"3-D (batch, seq, d_model={self.d_model})")
        x = check_features(x, "x", self.d_model, "TransformerEncoderBlock", "d_model")
        x = self.hook_point("hook_resid_pre", self._isolate_padding(x, key_padding_mask))  # (B, L, D)
        self._shape, self._dtype = x.shape, x.dtype
        masks = dict(attn_mask=mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
                     need_weights=need_weights)
        if self.norm_first:
            a = self.norm1(x)  # (B, L, D)
            att, weights = self.attention(a, a, a, **masks)  # (B, L, D), (B, H, L, L) or None
            h = self.hook_point("hook_resid_mid", x + self.hook_point("hook_attn_out", att))  # (B, L, D)
            out = h + self.hook_point("hook_mlp_out", self.ffn(self.norm2(h)))  # (B, L, D)
        else:
            att, weights = self.attention(x, x, x, **masks)  # (B, L, D), (B, H, L, L) or None
            h = self.norm1(self.hook_point("hook_resid_mid", x + self.hook_point("hook_attn_out", att)))  # (B, L, D)
            out = self.norm2(h + self.hook_point("hook_mlp_out", self.ffn(h)))  # (B, L, D)
        out = self.hook_point("hook_resid_post", out)
        return (out, weights) if need_weights else out

    def backward(self, grad_output: Any) -> np.ndarray:
        """Backpropagate (B, L, D) ``grad_output``; returns the gradient of ``x``.

        Each sublayer adds its parameters' gradients into its own ``grads`` (``named_gradients()`` lists
        them as ``"ffn.W1"``, ``"attention.W_Q"``, ...).
        """
        if self._shape is None:
            raise RuntimeError("TransformerEncoderBlock.backward called before forward")
        g = check_grad_output(grad_output, self._shape, self._dtype, "TransformerEncoderBlock")  # (B, L, D)
        g = self.hook_backward("hook_resid_post", g)
        if self.norm_first:
            g_mlp = self.hook_backward("hook_mlp_out", g)
            g_h = self.hook_backward("hook_resid_mid", g + self.norm2.backward(self.ffn.backward(g_mlp)))  # (B, L, D)
            g_att = self.hook_backward("hook_attn_out", g_h)
            grad_x = g_h + self.norm1.backward(self._attention_backward(g_att))  # (B, L, D)
        else:
            g_s2 = self.norm2.backward(g)  # gradient of h + ffn(h)
            g_h = g_s2 + self.ffn.backward(self.hook_backward("hook_mlp_out", g_s2))  # (B, L, D)
            g_s1 = self.hook_backward("hook_resid_mid", self.norm1.backward(g_h))  # gradient of x + attention(x)
            grad_x = g_s1 + self._attention_backward(self.hook_backward("hook_attn_out", g_s1))  # (B, L, D)
        grad_x = self.hook_backward("hook_resid_pre", grad_x)
        if self.saved_tensors is not None:  # the padded entries that held NaN or inf
            grad_x = np.where(self.saved_tensors[0], 0, grad_x).astype(grad_x.dtype, copy=False)  # (B, L, D)
        return grad_x

    def _attention_backward(self, g: np.ndarray) -> np.ndarray:
        dq, dk, dv = self.attention.backward(g)  # (B, L, D) each
        return dq + dk + dv  # self-attention: query, key and value are one tensor

    def _isolate_padding(self, x: np.ndarray, key_padding_mask: Any) -> np.ndarray:
        """``x`` with the non-finite entries of padded positions replaced by 0 (a copy only if there are any).

        Attention already ignores padded keys; a padded *query* still runs through the norms, the FFN and
        the projections, where one NaN would spread into every parameter gradient. Finite padding is kept
        as it is, so padded positions compute what other libraries compute for them.
        """
        self.save_for_backward()
        kpm = None if key_padding_mask is None else np.asarray(key_padding_mask)
        if kpm is None or kpm.dtype != np.bool_ or kpm.shape != x.shape[:2]:
            return x  # no padding, or a mask the attention refuses with a message naming it
        pad = ~kpm[..., None]  # (B, L, 1), True = padding
        bad = pad & ~np.isfinite(x)  # (B, L, D)
        if not bad.any():
            return x
        self.save_for_backward(bad)
        return np.where(bad, 0, x).astype(x.dtype, copy=False)  # (B, L, D)

    @classmethod
    def from_torch(cls, module: Any) -> TransformerEncoderBlock:
        """The same computation as a ``torch.nn.TransformerEncoderLayer`` (see :mod:`attnkit.interop.torch_nn`)."""
        return torch_converter(cls).from_torch(module)

    def to_torch_state_dict(self) -> dict[str, Any]:
        """These weights as a ``torch.nn.TransformerEncoderLayer`` state dict (torch tensors)."""
        return torch_converter(type(self)).state_dict(self)

"""``ShortConv``: LFM2's gated short convolution, the token mixer of its ``"conv"`` layers, with its cache.

Dimension letters: B batch, L length, D ``hidden_size`` (the convolved channels too), K the kernel size
(``conv_L_cache``, 3 in LFM2).

The layer, in order (Hugging Face's ``Lfm2ShortConv``)::

    b, c, v = split(x W_in + b_in, 3)        # (B, L, D) each: an input gate, an output gate, the values
    h = b * v                                # the convolution's input
    u = causal_conv(h) + conv_bias           # each channel its own last K inputs, no activation
    y = (c * u) W_out + b_out

Only the convolution mixes positions, over K tokens: what decoding keeps is the last K - 1 inputs ``h``
(:class:`ShortConvCache`), a fixed size whatever the length. A padded position's input ``x`` is zeroed first, as
Hugging Face does (with biases its ``h`` is then ``b_in``'s product, not zero: that too is Hugging Face's).

Parameter names and a Hugging Face checkpoint (``conv.`` of an LFM2 layer; linear weights are stored ``(In, Out)``,
the transpose of ``nn.Linear.weight``):

================  =============================  =====================================================
attnkit           Hugging Face                   shape
================  =============================  =====================================================
``W_in``          ``in_proj.weight.T``           (D, 3 D): b, c, v columns in that order
``b_in``          ``in_proj.bias``               (3 D,), only with ``conv_bias``
``conv_weight``   ``conv.weight[:, 0, :]``       (D, K)
``conv_bias``     ``conv.bias``                  (D,), only with ``conv_bias``
``W_out``         ``out_proj.weight.T``          (D, D)
``b_out``         ``out_proj.bias``              (D,), only with ``conv_bias``
================  =============================  =====================================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import as_bool_mask, check_features, check_grad_output, check_ndim, check_positive_int
from ..attention.cache_entry import check_max_length
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import causal_conv as _conv
from ..kernels.linear import linear, linear_backward
from .recurrent_state import RecurrentState, StateMixer, step_padding

__all__ = ["ShortConv", "ShortConvCache", "ShortConvConfig", "ShortConvMixer"]


@dataclass
class ShortConvCache(RecurrentState):
    """What decoding keeps for one :class:`ShortConv` layer: the convolution's last K - 1 inputs.

    Attributes
    ----------
    conv_state : (B, K - 1, D), zeros before the first token
    length : int, the number of positions seen
    """

    conv_state: np.ndarray
    length: int = 0


@dataclass(frozen=True)
class ShortConvConfig:
    """The shape of a decoder's short-convolution layers (a part in ``DecoderConfig.mixer_parts``), with the names of
    ``transformers``' LFM2 config in parentheses.

    Attributes
    ----------
    kernel_size : int
        K (``conv_L_cache``).
    bias : bool
        Biases on the input and output projections and the convolution (``conv_bias``).
    """

    kernel_size: int = 3
    bias: bool = False

    def __post_init__(self) -> None:
        check_positive_int(self.kernel_size, "kernel_size")
        if not isinstance(self.bias, bool):
            raise TypeError(f"bias must be True or False, got {self.bias!r}")


class ShortConv(Module):
    """LFM2's gated short convolution: ``((c * conv(b * v)) W_out`` with ``b, c, v`` from one input projection.

    Parameters
    ----------
    hidden_size : int
        D (``hidden_size``).
    kernel_size : int, default 3
        K (``conv_L_cache``).
    bias : bool, default False
        ``b_in``, ``conv_bias`` and ``b_out`` (``conv_bias``).
    rng : numpy.random.Generator or int, optional
        Source of the initial weights: ``N(0, 0.02^2)`` projections, ``U(-1/sqrt(K), 1/sqrt(K))`` convolution,
        zero biases.

    Attributes
    ----------
    W_in (D, 3 D), conv_weight (D, K), W_out (D, D), with ``bias``: b_in (3 D,), conv_bias (D,), b_out (D,);
    ``grads`` with the same names. The module docstring maps them to Hugging Face's names.

    Shapes
    ------
    x : (B, L, D) -> y : (B, L, D), in ``x``'s float dtype (float32 in, float32 out).

    Examples
    --------
    >>> layer = ShortConv(6, kernel_size=3, rng=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 6))
    >>> y = layer(x)
    >>> y.shape, layer.backward(np.ones_like(y)).shape
    ((2, 5, 6), (2, 5, 6))
    >>> cache = layer.new_cache(2)
    >>> steps = np.stack([layer.step(x[:, t], cache=cache) for t in range(5)], axis=1)
    >>> bool(np.allclose(steps, y)), cache.length
    (True, 5)
    """

    def __init__(self, hidden_size: int, *, kernel_size: int = 3, bias: bool = False,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        d = self.hidden_size = check_positive_int(hidden_size, "hidden_size")
        taps = self.kernel_size = check_positive_int(kernel_size, "kernel_size")
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}")
        self.bias = bias
        gen = as_generator(rng)
        self.register_parameter("W_in", normal(gen, (d, 3 * d), std=0.02))
        self.register_parameter("conv_weight", gen.uniform(-1.0, 1.0, (d, taps)) / np.sqrt(taps))
        self.register_parameter("W_out", normal(gen, (d, d), std=0.02))
        if bias:
            self.register_parameter("b_in", np.zeros(3 * d))
            self.register_parameter("conv_bias", np.zeros(d))
            self.register_parameter("b_out", np.zeros(d))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, kernel_size={self.kernel_size}, bias={self.bias}"

    def hook_points(self) -> tuple[str, ...]:
        """``hook_conv_in`` (B, L, D): the gated input ``b * v`` the convolution reads (what the cache keeps);
        ``hook_conv_out`` (B, L, D): the convolution's output before the output gate ``c``."""
        return ("hook_conv_in", "hook_conv_out")

    def new_cache(self, batch_size: int, max_length: int | None = None, *, dtype: Any = None,
                  rollback: int = 0) -> ShortConvCache:
        """An empty cache for ``batch_size`` sequences: zero convolution inputs, in ``dtype`` (default: the
        parameters' dtype); ``max_length`` and ``rollback`` change nothing (a state has one size at every length)."""
        b = check_positive_int(batch_size, "batch_size")
        check_max_length(max_length)
        dtype = self._parameters["W_out"].dtype if dtype is None else dtype
        return ShortConvCache(np.zeros((b, self.kernel_size - 1, self.hidden_size), dtype))

    def _check_padding(self, attention_mask: Any, x: np.ndarray) -> np.ndarray | None:
        """``attention_mask`` as x's dtype (B, L, 1): 1 for a real token, 0 for padding; None without padding."""
        mask = as_bool_mask(attention_mask, "attention_mask", allow_int=True)
        if mask is None or mask.all():
            return None
        if mask.shape != x.shape[:2]:
            raise ValueError(f"ShortConv: attention_mask must have shape (B, L) = {x.shape[:2]}, got {mask.shape}")
        return mask[..., None].astype(x.dtype)  # (B, L, 1)

    def _gates(self, x: np.ndarray):
        """``x W_in + b_in`` split into the input gate, the output gate and the values: (B, L, D) each."""
        p = self._parameters
        return np.split(linear(x, p["W_in"], p.get("b_in")), 3, axis=-1)  # (B, L, D) x 3

    def forward(self, x: Any, cache: ShortConvCache | None = None, *, attention_mask: Any = None) -> np.ndarray:
        """Run the layer over ``x`` (B, L, D).

        Without a cache the sequence starts from zero inputs and the forward keeps what :meth:`backward` needs.
        With a ``cache`` (from :meth:`new_cache`) it continues from the cache's last inputs and writes the new
        ones back; a cached forward is inference and keeps nothing for backward.

        ``attention_mask`` (B, L) bool or 0/1, ``True`` = real token: a padded position's input is zeroed first
        (as Hugging Face does). None: all real.
        """
        x = check_features(x, "x", self.hidden_size, "ShortConv", "hidden_size")
        check_ndim(x, "x", 3, expected="(B, L, hidden_size)")
        if cache is not None and cache.conv_state.shape[0] != x.shape[0]:
            raise ValueError(f"ShortConv: the cache holds {cache.conv_state.shape[0]} sequences but x has "
                             f"{x.shape[0]} (x: {x.shape})")
        p = self._parameters
        padding = self._check_padding(attention_mask, x)
        inputs = x if padding is None else x * padding  # (B, L, D)
        gate_in, gate_out, values = self._gates(inputs)  # (B, L, D) each
        h = self.hook_point("hook_conv_in", gate_in * values)  # (B, L, D)
        state = None if cache is None else cache.conv_state
        u, new_state, conv_saved = _conv.causal_conv_forward(h, p["conv_weight"], state, bias=p.get("conv_bias"),
                                                             activation=None)  # (B, L, D)
        u = self.hook_point("hook_conv_out", u)
        gated = gate_out * u  # (B, L, D)
        y = linear(gated, p["W_out"], p.get("b_out")).astype(x.dtype, copy=False)  # (B, L, D)
        if cache is None:
            self.save_for_backward(inputs, padding, gate_in, gate_out, values, u, conv_saved, gated)
        else:
            cache.conv_state = new_state.astype(cache.conv_state.dtype, copy=False)
            cache.length += x.shape[1]
            self.save_for_backward()
        return y

    def step(self, x: np.ndarray, *, cache: ShortConvCache, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """One decoding step (B, D) -> (B, D) continuing ``cache``: :meth:`forward`'s numbers on one position, bit
        for bit (the convolution's taps over the K - 1 kept inputs and the new one, in the forward's order), nothing
        saved. ``attention_mask`` (B,) or the model's (B, P + 1) (its last column is this position's), None: a real
        token."""
        p = self._parameters
        real = step_padding(attention_mask, x.dtype)  # (B, 1) or None
        if real is not None:
            x = x * real  # (B, D): a padded input is zero
        gate_in, gate_out, values = self._gates(x)  # (B, D) each
        u, new_state = _conv.causal_conv_step(gate_in * values, p["conv_weight"], cache.conv_state,
                                              bias=p.get("conv_bias"), activation=None)  # (B, D), (B, K - 1, D)
        cache.conv_state = new_state.astype(cache.conv_state.dtype, copy=False)  # a fresh array
        cache.length += 1
        return linear(gate_out * u, p["W_out"], p.get("b_out")).astype(x.dtype, copy=False)  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add every parameter's gradient into ``self.grads``; return ``grad_x`` (B, L, D)."""
        if self.saved_tensors is None:
            raise RuntimeError("ShortConv.backward called before a forward without a cache")
        x, padding, gate_in, gate_out, values, u, conv_saved, gated = self.saved_tensors
        dy = check_grad_output(grad_output, x.shape, x.dtype, "ShortConv")
        p = self._parameters
        d_gated, grad_w_out, grad_b_out = linear_backward(dy, gated, p["W_out"].astype(x.dtype, copy=False),
                                                          need_bias=self.bias)  # (B, L, D)
        d_gate_out = d_gated * u  # (B, L, D)
        d_u = self.hook_backward("hook_conv_out", d_gated * gate_out)  # (B, L, D)
        d_h, grad_conv, _, grad_conv_bias = _conv.causal_conv_backward(d_u, p["conv_weight"], conv_saved)
        d_h = self.hook_backward("hook_conv_in", d_h)  # (B, L, D)
        d_in = np.concatenate([d_h * values, d_gate_out, d_h * gate_in], axis=-1)  # (B, L, 3 D)
        grad_x, grad_w_in, grad_b_in = linear_backward(d_in, x, p["W_in"].astype(x.dtype, copy=False),
                                                       need_bias=self.bias)  # (B, L, D)
        grads = dict(W_in=grad_w_in, conv_weight=grad_conv, W_out=grad_w_out, b_in=grad_b_in,
                     conv_bias=grad_conv_bias, b_out=grad_b_out)
        for name in self._parameters:  # the biases' only where the layer has them
            self.grads[name] += grads[name]
        return grad_x if padding is None else grad_x * padding  # a zeroed input has no gradient


class ShortConvMixer(StateMixer, ShortConv):
    """A :class:`ShortConv` as the token mixer of a decoder block (a ``"short_conv"`` layer).

    It speaks the mixers' protocol: ``forward(x, *, rotary, attention_mask, cache, output_attentions)`` and
    ``step``, where ``rotary`` is ignored (the convolution orders the tokens), ``attention_mask`` is the model's
    (B, P + L) mask over every column (the layer reads the new L), and ``cache`` the model's
    :class:`~attnkit.decoding.cache.ModelCache`, whose :meth:`~attnkit.decoding.cache.ModelCache.state` for this
    layer is its :class:`ShortConvCache`. It has no attention weights: ``output_attentions=True`` is refused.

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size`` and the layer's part (``config.layers[layer_index].part``, a :class:`ShortConvConfig`).
    layer_index : int
    rng : numpy.random.Generator or int, optional
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        shape = config.layers[layer_index].part
        super().__init__(config.hidden_size, kernel_size=shape.kernel_size, bias=shape.bias, rng=rng)
        self.layer_index = layer_index

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False) -> np.ndarray:
        """The layer's output (B, L, D)."""
        if output_attentions:
            raise ValueError(f"layer {self.layer_index} is a short convolution: it has no attention weights (its "
                             "hook points hook_conv_in and hook_conv_out show what it mixes)")
        mask, state = self._model_inputs(x, attention_mask, cache)  # (B, L) or None, the layer's state or None
        return super().forward(x, state, attention_mask=mask)  # (B, L, D)

"""Layer norm, the feed-forward network and the Transformer encoder block (seed 003).

Dimension letters: B batch, L sequence length, D model dim (d_model), F feed-forward hidden dim (d_ff).
"""
from __future__ import annotations

import numpy as np

from ._validation import as_float_array, check_ndim, check_positive_int, common_float_dtype
from .attention.multi_head_attention import MultiHeadAttention, xavier_uniform
from .core.module import Module
from .kernels import ffn as _ffn
from .kernels import norm as _norm
from .kernels.activations import ACTIVATIONS
from .positional import create_causal_mask  # noqa: F401  (used in the docstring example)

__all__ = ["layer_norm", "layer_norm_backward", "feed_forward", "feed_forward_backward",
           "TransformerEncoderBlock", "stack_encoder_blocks"]


def _check_norm_args(x, gamma, name_x="x"):
    x = as_float_array(x, name_x)
    gamma = as_float_array(gamma, "gamma")
    check_ndim(x, name_x, min_ndim=1, expected="at least 1-D (..., d_model)")
    if gamma.shape != x.shape[-1:]:
        raise ValueError(f"gamma has shape {gamma.shape}, expected (d_model,) = {x.shape[-1:]} for {name_x} of shape {x.shape}")
    return x, gamma


def _check_eps(eps) -> float:
    if not isinstance(eps, (int, float, np.floating)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    return float(eps)


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Layer normalisation over the last axis: ``gamma * (x - mean) / sqrt(var + eps) + beta``.

    The variance is the biased one (divided by d_model), as in ``torch.nn.LayerNorm``.

    Parameters
    ----------
    x : ndarray, shape (..., d_model)
    gamma : ndarray, shape (d_model,)
        Scale.
    beta : ndarray, shape (d_model,)
        Shift.
    eps : float, default 1e-6

    Returns
    -------
    normalized : ndarray, same shape as ``x``

    Examples
    --------
    >>> layer_norm(np.array([[1.0, 2.0, 3.0]]), np.ones(3), np.zeros(3)).round(4)
    array([[-1.2247,  0.    ,  1.2247]])
    """
    x, gamma = _check_norm_args(x, gamma)
    beta = as_float_array(beta, "beta")
    if beta.shape != gamma.shape:
        raise ValueError(f"beta has shape {beta.shape}, expected (d_model,) = {gamma.shape}")
    dtype = common_float_dtype(x, gamma, beta)
    y, _, _ = _norm.layer_norm_forward(x.astype(dtype, copy=False), gamma, beta, _check_eps(eps))
    return y


def layer_norm_backward(grad_output: np.ndarray, x: np.ndarray, gamma: np.ndarray,
                        eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Backward of :func:`layer_norm`.

    Parameters
    ----------
    grad_output : ndarray, shape (..., d_model)
        Gradient of the loss with respect to the output.
    x : ndarray, shape (..., d_model)
        The forward's input.
    gamma : ndarray, shape (d_model,)
    eps : float, default 1e-6
        The epsilon of the forward.

    Returns
    -------
    grad_x : ndarray, shape of ``x``
    grad_gamma : ndarray, shape (d_model,)
    grad_beta : ndarray, shape (d_model,)
    """
    x, gamma = _check_norm_args(x, gamma)
    grad_output = as_float_array(grad_output, "grad_output")
    if grad_output.shape != x.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, expected the shape of x {x.shape}")
    dtype = common_float_dtype(x, gamma, grad_output)
    x = x.astype(dtype, copy=False)
    _, x_hat, rstd = _norm.layer_norm_forward(x, gamma, np.zeros_like(gamma), _check_eps(eps))
    return _norm.layer_norm_backward(grad_output.astype(dtype, copy=False), x_hat, rstd, gamma.astype(dtype))


def _check_ffn_args(x, W1, b1, W2, b2=None):
    x = as_float_array(x, "x")
    check_ndim(x, "x", min_ndim=1, expected="at least 1-D (..., d_model)")
    W1, b1, W2 = as_float_array(W1, "W1"), as_float_array(b1, "b1"), as_float_array(W2, "W2")
    d = x.shape[-1]
    check_ndim(W1, "W1", ndim=2, expected=f"2-D (d_model={d}, d_ff)")
    if W1.shape[0] != d:
        raise ValueError(f"W1 has shape {W1.shape}, expected (d_model={d}, d_ff) for x of shape {x.shape}")
    f = W1.shape[1]
    if b1.shape != (f,):
        raise ValueError(f"b1 has shape {b1.shape}, expected (d_ff,) = {(f,)}")
    if W2.shape != (f, d):
        raise ValueError(f"W2 has shape {W2.shape}, expected (d_ff, d_model) = {(f, d)}")
    arrays = [x, W1, b1, W2]
    if b2 is not None:
        b2 = as_float_array(b2, "b2")
        if b2.shape != (d,):
            raise ValueError(f"b2 has shape {b2.shape}, expected (d_model,) = {(d,)}")
        arrays.append(b2)
    dtype = common_float_dtype(*arrays)
    return tuple(a.astype(dtype, copy=False) for a in arrays)


def feed_forward(x: np.ndarray, W1: np.ndarray, b1: np.ndarray, W2: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """Position-wise feed-forward network: ``ReLU(x @ W1 + b1) @ W2 + b2``.

    Parameters
    ----------
    x : ndarray, shape (batch, seq, d_model) (any leading dims)
    W1 : ndarray, shape (d_model, d_ff)
    b1 : ndarray, shape (d_ff,)
    W2 : ndarray, shape (d_ff, d_model)
    b2 : ndarray, shape (d_model,)

    Returns
    -------
    output : ndarray, shape of ``x``

    Examples
    --------
    >>> feed_forward(np.array([[[1.0, -1.0]]]), np.eye(2), np.zeros(2), np.eye(2), np.ones(2))
    array([[[2., 1.]]])
    """
    x, W1, b1, W2, b2 = _check_ffn_args(x, W1, b1, W2, b2)
    y, _, _ = _ffn.feed_forward_forward(x, W1, b1, W2, b2)
    return y


def feed_forward_backward(grad_output: np.ndarray, x: np.ndarray, W1: np.ndarray, b1: np.ndarray,
                          W2: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Backward of :func:`feed_forward` (recomputes the hidden layer from ``x``; ``b2`` is not needed).

    Parameters
    ----------
    grad_output : ndarray, shape (..., d_model)
    x, W1, b1, W2 : ndarrays
        The forward's inputs.

    Returns
    -------
    grad_x : ndarray, shape of ``x``
    grad_params : dict
        ``{'W1': (d_model, d_ff), 'b1': (d_ff,), 'W2': (d_ff, d_model), 'b2': (d_model,)}``.
    """
    x, W1, b1, W2 = _check_ffn_args(x, W1, b1, W2)
    grad_output = as_float_array(grad_output, "grad_output")
    if grad_output.shape != x.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, expected the shape of x {x.shape}")
    pre = x @ W1 + b1  # (..., F)
    hidden = np.maximum(pre, 0)  # (..., F)
    return _ffn.feed_forward_backward(grad_output.astype(x.dtype, copy=False), x, W1, W2, pre, hidden)


class TransformerEncoderBlock(Module):
    """One Transformer encoder block.

    Pre-norm (default, seed 003)::

        x -> LayerNorm -> MultiHeadAttention -> + -> LayerNorm -> FFN -> +
        |__________________________|           |___________________|

    i.e. ``h = x + MHA(LN1(x))``, ``out = h + FFN(LN2(h))``. With ``norm_first=False`` (post-norm, the
    original Transformer and BERT): ``h = LN1(x + MHA(x))``, ``out = LN2(h + FFN(h))``.

    Parameters
    ----------
    d_model : int
        Model dimension D.
    num_heads : int
        Attention heads (must divide D).
    d_ff : int, optional
        Feed-forward hidden dimension F (default ``4 * d_model``).
    norm_first : bool, default True
        Pre-norm (True) or post-norm (False).
    activation : {"relu", "gelu", "gelu_tanh"}, default "relu"
    eps : float, default 1e-6
        Layer-norm epsilon.
    attention_bias : bool, default False
        Biases in the attention projections.
    rng : numpy.random.Generator or int, optional
        Source of the initial weights.

    Attributes
    ----------
    d_model, num_heads, d_ff, attention (MultiHeadAttention),
    W1 (D, F), b1 (F,), W2 (F, D), b2 (D,): FFN parameters,
    gamma1, beta1 (the norm next to attention), gamma2, beta2 (the norm next to the FFN): (D,) each.
    grads : gradients of the block's own parameters; the attention's are in ``attention.grads``
    (``named_gradients()`` lists all, e.g. ``"attention.W_Q"``).

    Shapes
    ------
    x : (B, L, D); mask : bool, ``True`` = may attend, (L, L), (L,) or 4-D broadcastable to (B, H, L, L).

    Examples
    --------
    >>> block = TransformerEncoderBlock(16, 4, rng=0)
    >>> x = np.random.default_rng(1).normal(size=(2, 6, 16))
    >>> y = block.forward(x, mask=create_causal_mask(6))
    >>> grad_x = block.backward(np.ones_like(y))
    >>> y.shape, grad_x.shape, block.d_ff
    ((2, 6, 16), (2, 6, 16), 64)
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *, norm_first: bool = True,
                 activation: str = "relu", eps: float = 1e-6, attention_bias: bool = False,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        d_model = check_positive_int(d_model, "d_model")
        d_ff = 4 * d_model if d_ff is None else check_positive_int(d_ff, "d_ff")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        self.d_model, self.num_heads, self.d_ff = d_model, num_heads, d_ff
        self.norm_first, self.activation, self.eps = bool(norm_first), activation, _check_eps(eps)
        self.attention = MultiHeadAttention(d_model, num_heads, bias=attention_bias, rng=gen)
        self.register_parameter("W1", xavier_uniform(gen, d_model, d_ff))
        self.register_parameter("b1", np.zeros(d_ff))
        self.register_parameter("W2", xavier_uniform(gen, d_ff, d_model))
        self.register_parameter("b2", np.zeros(d_model))
        for i in ("1", "2"):
            self.register_parameter("gamma" + i, np.ones(d_model))
            self.register_parameter("beta" + i, np.zeros(d_model))
        self._cache = None

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, num_heads={self.num_heads}, d_ff={self.d_ff}, "
                f"norm_first={self.norm_first}, activation={self.activation!r}, eps={self.eps}")

    def _norm(self, i: str, x: np.ndarray):
        return _norm.layer_norm_forward(x, self._parameters["gamma" + i], self._parameters["beta" + i], self.eps)

    def _ffn(self, x: np.ndarray):
        p = self._parameters
        return _ffn.feed_forward_forward(x, p["W1"], p["b1"], p["W2"], p["b2"], self.activation)

    def forward(self, x: np.ndarray, mask: np.ndarray | None = None, key_padding_mask: np.ndarray | None = None,
                is_causal: bool = False, need_weights: bool = False):
        """Encode ``x`` (B, L, D); returns (B, L, D), or ``(output, weights)`` with ``need_weights=True``.

        ``mask`` (``True`` = may attend) and ``key_padding_mask`` ((B, L), ``True`` = real token) are passed to
        :meth:`MultiHeadAttention.forward`; ``is_causal`` adds the causal mask. With ``need_weights`` the
        attention's per-head weights (B, H, L, L) are returned too (e.g. for plotting).
        """
        x = as_float_array(x, "x")
        check_ndim(x, "x", ndim=3, expected=f"3-D (batch, seq, d_model={self.d_model})")
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x has {x.shape[-1]} features, expected d_model = {self.d_model} (got shape {x.shape})")
        if self.norm_first:
            a, *ln1 = self._norm("1", x)  # (B, L, D)
            att, weights = self._attend(a, mask, key_padding_mask, is_causal, need_weights)  # (B, L, D)
            h = x + att  # (B, L, D)
            f, *ln2 = self._norm("2", h)  # (B, L, D)
            y, *ff = self._ffn(f)  # (B, L, D)
            out = h + y
            self._cache = (ln1, ln2, (f, *ff))
        else:
            att, weights = self._attend(x, mask, key_padding_mask, is_causal, need_weights)  # (B, L, D)
            s = x + att  # (B, L, D)
            h, *ln1 = self._norm("1", s)  # (B, L, D)
            y, *ff = self._ffn(h)  # (B, L, D)
            out, *ln2 = self._norm("2", h + y)  # (B, L, D)
            self._cache = (ln1, ln2, (h, *ff))
        return (out, weights) if need_weights else out

    def backward(self, grad_output: np.ndarray) -> np.ndarray:
        """Backpropagate (B, L, D) ``grad_output``; returns the gradient of ``x`` and adds every parameter's
        gradient into ``self.grads`` and ``self.attention.grads``."""
        if self._cache is None:
            raise RuntimeError("TransformerEncoderBlock.backward called before forward")
        ln1, ln2, (ffn_in, pre, hidden) = self._cache
        g = as_float_array(grad_output, "grad_output")
        if g.shape != ffn_in.shape:
            raise ValueError(f"grad_output has shape {g.shape}, expected the output shape {ffn_in.shape}")
        g = g.astype(ffn_in.dtype, copy=False)
        if self.norm_first:
            g_h = g + self._norm_backward("2", self._ffn_backward(g, ffn_in, pre, hidden), ln2)
            return g_h + self._norm_backward("1", self._attention_backward(g_h), ln1)
        g_s2 = self._norm_backward("2", g, ln2)  # gradient of h + FFN(h)
        g_h = g_s2 + self._ffn_backward(g_s2, ffn_in, pre, hidden)
        g_s1 = self._norm_backward("1", g_h, ln1)  # gradient of x + MHA(x)
        return g_s1 + self._attention_backward(g_s1)

    def _attend(self, a: np.ndarray, mask, key_padding_mask, is_causal: bool, need_weights: bool = False):
        """Self-attention of ``a``: returns ``(output (B, L, D), weights (B, H, L, L) or None)``."""
        return self.attention.forward(a, a, a, attn_mask=mask, key_padding_mask=key_padding_mask,
                                      need_weights=need_weights, is_causal=is_causal)

    def _attention_backward(self, g: np.ndarray) -> np.ndarray:
        dq, dk, dv = self.attention.backward(g)
        return dq + dk + dv  # self-attention: query, key and value are the same tensor

    def _norm_backward(self, i: str, g: np.ndarray, cache) -> np.ndarray:
        x_hat, rstd = cache
        grad_x, grad_gamma, grad_beta = _norm.layer_norm_backward(g, x_hat, rstd, self._parameters["gamma" + i])
        self.grads["gamma" + i] += grad_gamma
        self.grads["beta" + i] += grad_beta
        return grad_x

    def _ffn_backward(self, g: np.ndarray, x: np.ndarray, pre: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        p = self._parameters
        grad_x, grads = _ffn.feed_forward_backward(g, x, p["W1"], p["W2"], pre, hidden, self.activation)
        for name, value in grads.items():
            self.grads[name] += value
        return grad_x


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

    Examples
    --------
    >>> blocks = [TransformerEncoderBlock(8, 2, rng=i) for i in range(3)]
    >>> stack_encoder_blocks(np.zeros((1, 4, 8)), blocks).shape
    (1, 4, 8)
    """
    if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, TransformerEncoderBlock) for b in blocks):
        raise TypeError("blocks must be a list of TransformerEncoderBlock instances")
    for block in blocks:
        x = block.forward(x, mask=mask)
    return x

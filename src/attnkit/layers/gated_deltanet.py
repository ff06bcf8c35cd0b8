"""``GatedDeltaNet``: the linear-attention layer of Qwen3-Next and Qwen3.5 (Gated DeltaNet), with its cache.

Dimension letters: B batch, L length, D ``hidden_size``, Hk / Hv key / value heads (Hv a multiple of Hk;
value head h reads key head ``h // (Hv / Hk)``), Dk / Dv key / value head dims, Kd = Hk Dk, Vd = Hv Dv,
Cc = 2 Kd + Vd the convolved channels (q, k, v side by side), K the convolution's kernel size.

The layer, in order (Hugging Face's ``Qwen3_5GatedDeltaNet``):

1. ``x W_qkv`` (B, L, Cc), ``z = x W_z`` (B, L, Vd), ``b = x W_b``, ``a = x W_a`` (B, L, Hv);
2. the short causal convolution with SiLU over ``x W_qkv`` (:mod:`attnkit.kernels.causal_conv`), split
   into q, k (B, L, Hk, Dk) and v (B, L, Hv, Dv); q and k L2-normalised per head;
3. ``beta = sigmoid(b)``, the log-decay ``g = -exp(A_log) softplus(a + dt_bias)`` (B, L, Hv);
4. the gated delta rule (:mod:`attnkit.kernels.delta_rule`, q scaled by ``Dk ** -0.5``), per value head;
5. the gated RMSNorm ``norm_gamma * rms_norm(o) * silu(z)`` per head, then ``W_out``.

Parameter names and a Hugging Face checkpoint (linear weights are stored ``(In, Out)``, the transpose of
``nn.Linear.weight``):

================  ============================  ========================================
attnkit           Qwen3.5 (``linear_attn.``)    Qwen3-Next (``linear_attn.``)
================  ============================  ========================================
``W_qkv``         ``in_proj_qkv.weight.T``      q, k, v rows of ``in_proj_qkvz.weight``
``W_z``           ``in_proj_z.weight.T``        z rows of ``in_proj_qkvz.weight``
``W_b``           ``in_proj_b.weight.T``        b rows of ``in_proj_ba.weight``
``W_a``           ``in_proj_a.weight.T``        a rows of ``in_proj_ba.weight``
``conv_weight``   ``conv1d.weight[:, 0, :]``    ``conv1d.weight[:, 0, :]``
``dt_bias``       ``dt_bias``                   ``dt_bias``
``A_log``         ``A_log``                     ``A_log``
``norm_gamma``    ``norm.weight``               ``norm.weight``
``W_out``         ``out_proj.weight.T``         ``out_proj.weight.T``
================  ============================  ========================================

Qwen3.5's split projections map one to one, which is why the layer keeps them apart. Qwen3-Next fuses the
same rows grouped per key head: ``in_proj_qkvz.weight`` viewed as (Hk, 2 Dk + 2 (Hv / Hk) Dv, D) holds each
key head's q, k, v and z rows in that order, ``in_proj_ba.weight`` viewed as (Hk, 2 Hv / Hk, D) its b and a
rows; ``W_qkv`` is all q rows, then all k, then all v, transposed (``tests/layers/test_gated_deltanet.py``
regroups them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import as_bool_mask, check_eps, check_features, check_grad_output, check_ndim, check_positive_int
from ..attention.cache_entry import check_max_length
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import causal_conv as _conv
from ..kernels import delta_rule as _delta
from ..kernels.linear import linear, linear_backward
from ..kernels.rms_norm import gated_rms_norm_backward, gated_rms_norm_forward
from .recurrent_state import RecurrentState, StateMixer, step_padding

__all__ = ["DeltaRuleMixer", "GatedDeltaNet", "GatedDeltaNetCache", "GatedDeltaNetConfig",
           "GatedDeltaNetMixer"]

_INPUTS = ("W_qkv", "W_z", "W_b", "W_a")


@dataclass
class GatedDeltaNetCache(RecurrentState):
    """What decoding keeps for one :class:`GatedDeltaNet` layer: a fixed size, whatever the length so far.

    Attributes
    ----------
    conv_state : (B, K - 1, Cc), the last K - 1 inputs of the convolution (zeros before the first token)
    recurrent_state : (B, Hv, Dk, Dv), the delta rule's state
    length : int, the number of positions seen
    """

    conv_state: np.ndarray
    recurrent_state: np.ndarray
    length: int = 0


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The shape of a decoder's Gated DeltaNet layers (a part in ``DecoderConfig.mixer_parts``), with the names of
    ``transformers``' Qwen3-Next / Qwen3.5 configs in parentheses.

    Attributes
    ----------
    num_key_heads, num_value_heads : int
        Hk, Hv (``linear_num_key_heads``, ``linear_num_value_heads``); Hv a multiple of Hk.
    key_head_dim, value_head_dim : int
        Dk, Dv (``linear_key_head_dim``, ``linear_value_head_dim``).
    conv_kernel_size : int
        K (``linear_conv_kernel_dim``).
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int = 4

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_size"):
            check_positive_int(getattr(self, name), name)
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                             f"({self.num_key_heads})")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # never overflows, unlike 1 / (1 + exp(-x))


class GatedDeltaNet(Module):
    """Gated DeltaNet: projections, short convolution, gated delta rule, gated RMSNorm, output projection.

    Parameters
    ----------
    hidden_size : int
        D (``hidden_size``).
    num_key_heads, num_value_heads : int
        Hk and Hv (``linear_num_key_heads``, ``linear_num_value_heads``); Hv must be a multiple of Hk.
    key_head_dim, value_head_dim : int
        Dk and Dv (``linear_key_head_dim``, ``linear_value_head_dim``).
    conv_kernel_size : int, default 4
        K (``linear_conv_kernel_dim``).
    eps : float, default 1e-6
        The gated RMSNorm's epsilon (``rms_norm_eps``).
    chunk_size : int, default 64
        C of the chunked delta rule (a whole-sequence forward); any C gives the same result up to rounding.
    rng : numpy.random.Generator or int, optional
        Source of the initial weights: ``N(0, 0.02^2)`` linear weights, ``U(-1/sqrt(K), 1/sqrt(K))``
        convolution, ``dt_bias`` ones and ``A_log = log(U(1, 16))``, ``norm_gamma`` ones.

    Attributes
    ----------
    W_qkv (D, Cc), W_z (D, Vd), W_b (D, Hv), W_a (D, Hv), conv_weight (Cc, K), dt_bias (Hv,), A_log (Hv,),
    norm_gamma (Dv,), W_out (Vd, D); ``grads`` with the same names. The module docstring maps them to
    Hugging Face's names.

    Shapes
    ------
    x : (B, L, D) -> y : (B, L, D), in ``x``'s float dtype (float32 in, float32 out).

    Examples
    --------
    >>> layer = GatedDeltaNet(8, num_key_heads=1, num_value_heads=2, key_head_dim=4, value_head_dim=3, rng=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 8))
    >>> y = layer(x)
    >>> y.shape, layer.backward(np.ones_like(y)).shape
    ((2, 5, 8), (2, 5, 8))
    >>> cache = layer.new_cache(2)
    >>> steps = np.stack([layer.step(x[:, t], cache=cache) for t in range(5)], axis=1)
    >>> bool(np.allclose(steps, y)), cache.length
    (True, 5)
    """

    input_names: tuple[str, ...] = _INPUTS
    """The maps of x, in the order of :meth:`_project`'s parts (fused into one ``W_in``); the convolution's
    input comes first."""
    gate_activation = "silu"
    """The output norm's gate (:func:`attnkit.kernels.rms_norm.gated_rms_norm_forward`)."""

    def __init__(self, hidden_size: int, num_key_heads: int, num_value_heads: int, key_head_dim: int,
                 value_head_dim: int, *, conv_kernel_size: int = 4, eps: float = 1e-6, chunk_size: int = 64,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        d = self.hidden_size = check_positive_int(hidden_size, "hidden_size")
        hk = self.num_key_heads = check_positive_int(num_key_heads, "num_key_heads")
        hv = self.num_value_heads = check_positive_int(num_value_heads, "num_value_heads")
        if hv % hk:
            raise ValueError(f"num_value_heads ({hv}) must be a multiple of num_key_heads ({hk}): each key head "
                             "serves the same number of value heads")
        dk = self.key_head_dim = check_positive_int(key_head_dim, "key_head_dim")
        dv = self.value_head_dim = check_positive_int(value_head_dim, "value_head_dim")
        taps = self.conv_kernel_size = check_positive_int(conv_kernel_size, "conv_kernel_size")
        self.eps = check_eps(eps)
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        gen = as_generator(rng)
        widths = (self.conv_dim, self.value_dim, hv, hv)
        for name, width in zip(_INPUTS, widths):
            self.register_parameter(name, normal(gen, (d, width), std=0.02))
        self.register_parameter("conv_weight", gen.uniform(-1.0, 1.0, (self.conv_dim, taps)) / np.sqrt(taps))
        self.register_parameter("dt_bias", np.ones(hv))
        self.register_parameter("A_log", np.log(gen.uniform(1.0, 16.0, hv)))
        self.register_parameter("norm_gamma", np.ones(dv))
        self.register_parameter("W_out", normal(gen, (self.value_dim, d), std=0.02))
        # the four input maps read the same x: one product computes them all (one read in a decoding step)
        self.fuse_parameters("W_in", self.input_names)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_key_heads={self.num_key_heads}, "
                f"num_value_heads={self.num_value_heads}, key_head_dim={self.key_head_dim}, "
                f"value_head_dim={self.value_head_dim}, conv_kernel_size={self.conv_kernel_size}")

    def new_cache(self, batch_size: int, max_length: int | None = None, *, dtype: Any = None,
                  rollback: int = 0) -> GatedDeltaNetCache:
        """An empty cache for ``batch_size`` sequences: zero convolution inputs and a zero state, in ``dtype``
        (default: the parameters' dtype);
        ``max_length`` and ``rollback`` change nothing (a state has one size at every length)."""
        b = check_positive_int(batch_size, "batch_size")
        check_max_length(max_length)
        dtype = self._parameters["W_out"].dtype if dtype is None else dtype
        return GatedDeltaNetCache(
            np.zeros((b, self.conv_kernel_size - 1, self.conv_dim), dtype),
            np.zeros((b, self.num_value_heads, self.key_head_dim, self.value_head_dim), dtype))

    # -- forward ----------------------------------------------------------------------------------------
    def _project(self, x: np.ndarray):
        """``x W_in`` split into the parts of :attr:`input_names`: here the convolution's input (B, L, Cc), z
        (B, L, Vd), b and a (B, L, Hv)."""
        p, names = self._parameters, self.input_names
        fused = self.fused_parameter("W_in")
        if fused is None:
            return [linear(x, p[name]) for name in names]  # (B, L, Cc), (B, L, Vd), (B, L, Hv), (B, L, Hv)
        both, parts, start = linear(x, fused), [], 0  # both: (B, L, Cc + Vd + 2 Hv)
        for name in names:  # slices, as np.split makes them, without its Python cost (a decoding step's)
            width = p[name].shape[1]
            parts.append(both[..., start:start + width])
            start += width
        return parts  # (B, L, Cc), (B, L, Vd), (B, L, Hv), (B, L, Hv)

    def _input_backward(self, d_in: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Gradients of :meth:`_project` from ``d_in`` (B, L, total width of the parts): ``grad_x`` (B, L, D), the
        input projections' gradients added into ``grads``. One product with the fused ``W_in``, else one per input
        (their own storage, or packed weights), as :meth:`_project` took them."""
        p, names = self._parameters, self.input_names
        cuts = np.cumsum([p[n].shape[1] for n in names])[:-1]
        fused = self.fused_parameter("W_in")
        if fused is not None:
            grad_x, grad_w_in, _ = linear_backward(d_in, x, fused)  # (B, L, D), (D, Cc + Vd + 2 Hv)
            for name, grad in zip(names, np.split(grad_w_in, cuts, axis=-1)):
                self.grads[name] += grad
            return grad_x
        grad_x = np.zeros_like(x)  # (B, L, D)
        for name, part in zip(names, np.split(d_in, cuts, axis=-1)):
            grad_part, grad_w, _ = linear_backward(part, x, p[name], need_weight=self.grads.wanted)  # (B, L, D)
            grad_x += grad_part
            self.grads.add(name, grad_w)
        return grad_x

    def _heads(self, mixed: np.ndarray):
        """The convolved channels as q, k (B, Hk, L, Dk) and v (B, Hv, L, Dv), heads first for the kernels."""
        b, length = mixed.shape[:2]
        kd = self.key_dim
        q = mixed[..., :kd].reshape(b, length, self.num_key_heads, self.key_head_dim)  # (B, L, Hk, Dk)
        k = mixed[..., kd:2 * kd].reshape(b, length, self.num_key_heads, self.key_head_dim)  # (B, L, Hk, Dk)
        v = mixed[..., 2 * kd:].reshape(b, length, self.num_value_heads, self.value_head_dim)  # (B, L, Hv, Dv)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # heads first

    def _gates(self, b: np.ndarray, a: np.ndarray):
        """``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)``: (B, L, Hv) each, and softplus's input."""
        dtype = a.dtype
        pre = a + self._parameters["dt_bias"].astype(dtype, copy=False)  # (B, L, Hv)
        rate = np.exp(self._parameters["A_log"].astype(dtype, copy=False))  # (Hv,)
        return _sigmoid(b), -rate * np.logaddexp(dtype.type(0), pre), pre, rate

    def _delta_inputs(self, x: np.ndarray, conv_state: np.ndarray | None):
        """Steps 1-3 of the layer: the delta rule's arguments ``(q, k, v, g, beta)`` per value head ((B, Hv, L,
        D*) and (B, Hv, L)), z (B, L, Vd), the convolution's new state and what backward needs of them."""
        mixed, z, b, a = self._project(x)
        conv_out, conv_state, conv_saved = _conv.causal_conv_forward(mixed, self._parameters["conv_weight"],
                                                                     conv_state)  # (B, L, Cc)
        q, k, v = self._heads(conv_out)
        qn, q_rstd = _delta.l2_normalize_forward(q)  # (B, Hk, L, Dk)
        kn, k_rstd = _delta.l2_normalize_forward(k)  # (B, Hk, L, Dk)
        group = self.num_value_heads // self.num_key_heads
        beta, g, pre, rate = self._gates(b, a)  # (B, L, Hv) each
        delta_args = (np.repeat(qn, group, axis=1), np.repeat(kn, group, axis=1), v,  # (B, Hv, L, D*)
                      g.transpose(0, 2, 1), beta.transpose(0, 2, 1))  # (B, Hv, L)
        return delta_args, z, conv_state, (conv_saved, (qn, q_rstd, kn, k_rstd), (beta, g, pre, rate))

    def token_weights(self, x: Any, *, attention_mask: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """What the layer has in place of attention weights: each value head's effective token-to-token weights.

        A Gated DeltaNet layer computes no softmax pattern, but over a whole sequence (zero states) its core
        output, before the gated norm and ``W_out``, is linear in its values: ``o = weights @ values`` per value
        head (:func:`attnkit.kernels.delta_rule.token_weights`). Row t of a head's weights says how much of each
        earlier token's value reaches token t; entries may be negative and rows need not sum to one. Nothing is
        saved for backward.

        Shapes
        ------
        x (B, L, D); attention_mask (B, L) or None -> weights (B, Hv, L, L), lower-triangular, and values
        (B, Hv, L, Dv), in the layer's compute dtype.
        """
        x = check_features(x, "x", self.hidden_size, "GatedDeltaNet", "hidden_size")
        check_ndim(x, "x", 3, expected="(B, L, hidden_size)")
        padding = self._check_padding(attention_mask, x)
        (q, k, v, g, beta), _, _, _ = self._delta_inputs(x if padding is None else x * padding, None)
        return _delta.token_weights(q, k, g, beta), v  # (B, Hv, L, L), (B, Hv, L, Dv)

    def _check_padding(self, attention_mask: Any, x: np.ndarray) -> np.ndarray | None:
        """``attention_mask`` as x's dtype (B, L, 1): 1 for a real token, 0 for padding; None without padding."""
        mask = as_bool_mask(attention_mask, "attention_mask", allow_int=True)
        if mask is None or mask.all():
            return None
        if mask.shape != x.shape[:2]:
            raise ValueError(f"GatedDeltaNet: attention_mask must have shape (B, L) = {x.shape[:2]}, got {mask.shape}")
        return mask[..., None].astype(x.dtype)  # (B, L, 1)

    def forward(self, x: Any, cache: GatedDeltaNetCache | None = None, *, attention_mask: Any = None) -> np.ndarray:
        """Run the layer over ``x`` (B, L, D).

        Without a cache the sequence starts from zero states and the forward keeps what :meth:`backward`
        needs. With a ``cache`` (from :meth:`new_cache`) it continues from the cache's states and writes the
        new ones back: a decoding step (L = 1) runs the recurrent form, a longer prefill the chunked one;
        a cached forward is inference and keeps nothing for backward.

        ``attention_mask`` (B, L) bool or 0/1, ``True`` = real token: a padded position's input is zeroed
        first (as Hugging Face does), so its keys, values and convolution inputs are zero and it leaves the
        state as it found it, whatever its token (from the zero state of a left-padded row: zero). None: all real.
        """
        x = check_features(x, "x", self.hidden_size, "GatedDeltaNet", "hidden_size")
        check_ndim(x, "x", 3, expected="(B, L, hidden_size)")
        if cache is not None and cache.conv_state.shape[0] != x.shape[0]:
            raise ValueError(f"GatedDeltaNet: the cache holds {cache.conv_state.shape[0]} sequences but x has "
                             f"{x.shape[0]} (x: {x.shape})")
        p = self._parameters
        padding = self._check_padding(attention_mask, x)
        inputs = x if padding is None else x * padding  # (B, L, D)
        delta_args, z, conv_state, saved = self._delta_inputs(inputs, None if cache is None else cache.conv_state)
        conv_saved, normalised, gates = saved
        if cache is None:
            o, _, delta_ctx = _delta.chunked_forward(*delta_args, chunk_size=self.chunk_size)  # (B, Hv, L, Dv)
        elif x.shape[1] == 1:
            o, state, _ = _delta.recurrent_forward(*delta_args, initial_state=cache.recurrent_state)
        else:
            o, state, _ = _delta.chunked_forward(*delta_args, initial_state=cache.recurrent_state,
                                                 chunk_size=self.chunk_size)
        o = o.transpose(0, 2, 1, 3)  # (B, L, Hv, Dv)
        zh = z.reshape(o.shape)  # (B, L, Hv, Dv)
        normed, norm_saved = gated_rms_norm_forward(o, zh, p["norm_gamma"].astype(o.dtype, copy=False), self.eps,
                                                    self.gate_activation)
        flat = normed.reshape(x.shape[0], x.shape[1], self.value_dim)  # (B, L, Vd)
        y = linear(flat, p["W_out"]).astype(x.dtype, copy=False)  # (B, L, D)
        if cache is None:
            self.save_for_backward(inputs, padding, conv_saved, normalised, gates, delta_ctx, norm_saved, flat)
        else:
            cache.conv_state = conv_state.astype(cache.conv_state.dtype, copy=False)
            cache.recurrent_state = state.astype(cache.recurrent_state.dtype, copy=False)
            cache.length += x.shape[1]
            self.save_for_backward()
        return y

    def _step_inputs(self, x: np.ndarray, conv_state: np.ndarray):
        """:meth:`_delta_inputs` of one position per row: the delta rule's ``(q, k, v, g, beta)`` per value head
        ((B, Hv, D*) and (B, Hv)), z (B, Vd) and the convolution's new state (B, K - 1, Cc)."""
        mixed, z, b, a = self._project(x)  # (B, Cc), (B, Vd), (B, Hv), (B, Hv)
        conv_out, conv_state = _conv.causal_conv_step(mixed, self._parameters["conv_weight"], conv_state)  # (B, Cc)
        bsz, kd, hk, dk = x.shape[0], self.key_dim, self.num_key_heads, self.key_head_dim
        qn, _ = _delta.l2_normalize_forward(conv_out[:, :kd].reshape(bsz, hk, dk))  # (B, Hk, Dk)
        kn, _ = _delta.l2_normalize_forward(conv_out[:, kd:2 * kd].reshape(bsz, hk, dk))  # (B, Hk, Dk)
        v = conv_out[:, 2 * kd:].reshape(bsz, self.num_value_heads, self.value_head_dim)  # (B, Hv, Dv)
        group = self.num_value_heads // hk
        beta, g, _, _ = self._gates(b, a)  # (B, Hv) each
        return (np.repeat(qn, group, axis=1), np.repeat(kn, group, axis=1), v, g, beta), z, conv_state  # (B, Hv, *)

    def step(self, x: np.ndarray, *, cache: GatedDeltaNetCache, attention_mask: np.ndarray | None = None
             ) -> np.ndarray:
        """One decoding step (B, D) -> (B, D) continuing ``cache``: :meth:`forward`'s numbers on one position, nothing
        saved.

        The cached forward's parts in its order on (B, *) rows: the fused input projection, the convolution's
        K taps on the kept window (:func:`attnkit.kernels.causal_conv.causal_conv_step`), the L2 norms and gates,
        one update of the delta rule's state (:func:`attnkit.kernels.delta_rule.recurrent_step`), the gated
        RMSNorm and ``W_out``; no length axis to add, transpose and take away. ``attention_mask`` (B,) or the
        model's (B, P + 1) (its last column is this position's), None: a real token.
        """
        real = step_padding(attention_mask, x.dtype)  # (B, 1) or None
        if real is not None:
            x = x * real  # (B, D): a padded input is zero
        delta_args, z, conv_state = self._step_inputs(x, cache.conv_state)  # (B, Hv, *) each, (B, Vd), (B, K - 1, Cc)
        o, state = _delta.recurrent_step(*delta_args, cache.recurrent_state)  # (B, Hv, Dv), (B, Hv, Dk, Dv)
        gamma = self._parameters["norm_gamma"].astype(o.dtype, copy=False)
        normed, _ = gated_rms_norm_forward(o, z.reshape(o.shape), gamma, self.eps, self.gate_activation)  # (B, Hv, Dv)
        y = linear(normed.reshape(x.shape[0], self.value_dim), self._parameters["W_out"])  # (B, D)
        cache.conv_state = conv_state.astype(cache.conv_state.dtype, copy=False)
        cache.recurrent_state = state.astype(cache.recurrent_state.dtype, copy=False)
        cache.length += 1
        return y.astype(x.dtype, copy=False)

    # -- backward ---------------------------------------------------------------------------------------
    def backward(self, grad_output: Any) -> np.ndarray:
        """Add every parameter's gradient into ``self.grads``; return ``grad_x`` (B, L, D)."""
        if self.saved_tensors is None:
            raise RuntimeError("GatedDeltaNet.backward called before a forward without a cache")
        x, padding, conv_saved, normalised, gates, delta_ctx, norm_saved, flat = self.saved_tensors
        qn, q_rstd, kn, k_rstd = normalised
        dy = check_grad_output(grad_output, x.shape, x.dtype, "GatedDeltaNet")
        p = self._parameters
        d_flat, grad_w_out, _ = linear_backward(dy, flat, p["W_out"].astype(x.dtype, copy=False))  # (B, L, Vd)
        bsz, length = x.shape[:2]
        shape = (bsz, length, self.num_value_heads, self.value_head_dim)
        do, dz, grad_gamma = gated_rms_norm_backward(d_flat.reshape(shape), norm_saved,
                                                     p["norm_gamma"].astype(x.dtype, copy=False))  # (B, L, Hv, Dv)
        dq, dk, dv, dg, dbeta, _ = _delta.chunked_backward(do.transpose(0, 2, 1, 3), delta_ctx)  # (B, Hv, L, D*)
        group = self.num_value_heads // self.num_key_heads
        heads = (bsz, self.num_key_heads, group, length, self.key_head_dim)
        dq = _delta.l2_normalize_backward(dq.reshape(heads).sum(axis=2), qn, q_rstd)  # (B, Hk, L, Dk)
        dk = _delta.l2_normalize_backward(dk.reshape(heads).sum(axis=2), kn, k_rstd)  # (B, Hk, L, Dk)
        d_mixed = np.concatenate([t.transpose(0, 2, 1, 3).reshape(bsz, length, -1) for t in (dq, dk, dv)],
                                 axis=-1)  # (B, L, Cc)
        conv_weight = p["conv_weight"].reshape(self.conv_dim, -1)  # (Cc, K), whatever the layer's storage shape
        d_conv_in, grad_conv, _, _ = _conv.causal_conv_backward(d_mixed, conv_weight, conv_saved)  # (B, L, Cc)
        d_parts = self._gates_backward(dg, dbeta, dz.reshape(bsz, length, self.value_dim), gates)
        grad_x = self._input_backward(np.concatenate([d_conv_in, *d_parts], axis=-1), x)  # (B, L, D)
        self.grads["conv_weight"] += grad_conv.reshape(p["conv_weight"].shape)
        self.grads["norm_gamma"] += grad_gamma
        self.grads["W_out"] += grad_w_out
        return grad_x if padding is None else grad_x * padding  # a zeroed input has no gradient

    def _gates_backward(self, dg: np.ndarray, dbeta: np.ndarray, dz: np.ndarray, gates) -> list[np.ndarray]:
        """The gradients of :meth:`_project`'s parts after the convolution's (here z, b and a, (B, L, *)) from
        those of the log-decay ``dg``, ``beta`` (B, Hv, L) and the output gate ``dz`` (B, L, Vd); ``dt_bias``'s
        and ``A_log``'s added into ``grads``."""
        beta, g, pre, rate = gates
        dg = dg.transpose(0, 2, 1)  # (B, L, Hv)
        db = dbeta.transpose(0, 2, 1) * beta * (1.0 - beta)  # (B, L, Hv)
        d_pre = -rate * dg * _sigmoid(pre)  # (B, L, Hv): softplus' = sigmoid
        self.grads["dt_bias"] += d_pre.sum(axis=(0, 1))
        self.grads["A_log"] += np.einsum("blh,blh->h", dg, g)  # g = -exp(A_log) softplus: dg/dA_log = g
        return [dz, db, d_pre]


class DeltaRuleMixer(StateMixer):
    """The mixers' protocol for a delta-rule layer (:class:`GatedDeltaNetMixer`, Kimi Delta Attention's mixer):
    put before the layer's class in the bases, its ``forward`` reads the model's mask and cache and calls the
    layer's."""

    def hook_points(self) -> tuple[str, ...]:
        """None: the layer has no softmax pattern (see :meth:`~GatedDeltaNet.token_weights` for what it has)."""
        return ()

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """The layer's output (B, L, D), or ``(output, token weights (B, Hv, L, L))`` with ``output_attentions``."""
        mask, state = self._model_inputs(x, attention_mask, cache)  # (B, L) or None, the layer's state or None
        if output_attentions and cache is not None:
            raise ValueError(f"a {type(self).__name__} layer's token weights exist for a whole sequence only (no "
                             "cache): its past is a state, not tokens")
        y = super().forward(x, state, attention_mask=mask)  # (B, L, D)
        if not output_attentions:
            return y
        return y, self.token_weights(x, attention_mask=mask)[0]


class GatedDeltaNetMixer(DeltaRuleMixer, GatedDeltaNet):
    """A :class:`GatedDeltaNet` as the token mixer of a decoder block (a ``"linear_attention"`` layer).

    It speaks the mixers' protocol: ``forward(x, *, rotary, attention_mask, cache, output_attentions)``, where
    ``rotary`` is ignored (the convolution and the recurrence order the tokens), ``attention_mask`` is the
    model's (B, P + L) mask over every column (the layer reads the new L), and ``cache`` the model's
    :class:`~attnkit.decoding.cache.ModelCache`, whose :meth:`~attnkit.decoding.cache.ModelCache.state` for this
    layer is its :class:`GatedDeltaNetCache`. ``output_attentions=True`` returns the layer's
    :meth:`~GatedDeltaNet.token_weights` (B, Hv, L, L) beside its output: it has no softmax pattern.

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size``, ``norm.eps`` and the layer's part (``config.layers[layer_index].part``, a
        :class:`GatedDeltaNetConfig`).
    layer_index : int
    rng : numpy.random.Generator or int, optional
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        shape = config.layers[layer_index].part
        super().__init__(config.hidden_size, shape.num_key_heads, shape.num_value_heads, shape.key_head_dim,
                         shape.value_head_dim, conv_kernel_size=shape.conv_kernel_size, eps=config.norm.eps, rng=rng)
        self.layer_index = layer_index

"""``Mamba2``: the Mamba-2 mixer of the state-space hybrids (Bamba, Granite 4 hybrid, Nemotron-H, Falcon-H1), with
its cache.

Dimension letters: B batch, L length, D ``hidden_size``, H heads, P head dim, I = H P the inner width, G groups
(of heads sharing their B and C projections), N state size, K the convolution's kernel size,
Cc = I + 2 G N the convolved channels (x, B, C side by side).

The layer, in order (Hugging Face's ``BambaMixer`` / ``GraniteMoeHybridMambaLayer`` on its PyTorch path)::

    z, xBC, dt = split(x W_in + b_in)                    # (B, L, I), (B, L, Cc), (B, L, H)
    xBC = silu(causal_conv(xBC) + conv_bias)             # :mod:`attnkit.kernels.causal_conv`
    xs, Bm, Cm = split(xBC)                              # (B, L, H, P), (B, L, G, N) twice
    dt = max(softplus(dt + dt_bias), dt_min);  A = -exp(A_log)   # (B, L, H), (H,)
    y = ssd(q=Cm, k=Bm, v=dt xs, g=dt A) + D_skip xs     # :mod:`attnkit.kernels.ssd`, per head
    out = (gamma * group_rms_norm(y * silu(z))) W_out + b_out

The gate multiplies before the norm (``norm_before_gate=False``), and the norm is over each of the G groups of
I / G features; :attr:`Mamba2Config.norm` chooses instead the norm before the gate, ``silu(z) * gamma *
group_rms_norm(y)`` (Falcon-H1's ``mamba_norm_before_gate``), or no norm, ``y * silu(z)`` (Falcon-H1 without
``mamba_rms_norm``). With :attr:`Mamba2Config.projection_multipliers` (Falcon-H1's ``ssm_multipliers``) the
projection's z, x, B, C and dt columns are each multiplied by a fixed factor before the split.

A padded position's input, and its convolution's output, are zeroed (as Hugging Face does), so it leaves the
state as it found it. What decoding keeps is fixed-size: the convolution's last K - 1 inputs and the
scan's state (:class:`Mamba2Cache`).

Parameter names and a Hugging Face checkpoint (``mamba.`` of a layer; linear weights stored ``(In, Out)``, the
transpose of ``nn.Linear.weight``):

================  ================================  ==========================================
attnkit           Hugging Face                      shape
================  ================================  ==========================================
``W_in``          ``in_proj.weight.T``              (D, I + Cc + H): z, x, B, C, dt columns
``b_in``          ``in_proj.bias``                  (I + Cc + H,), with ``proj_bias``
``conv_weight``   ``conv1d.weight[:, 0, :]``        (Cc, K)
``conv_bias``     ``conv1d.bias``                   (Cc,), with ``conv_bias``
``dt_bias``       ``dt_bias``                       (H,)
``A_log``         ``A_log``                         (H,)
``D_skip``        ``D``                             (H,)
``norm_gamma``    ``norm.weight``                   (I,), unless ``norm`` is None
``W_out``         ``out_proj.weight.T``             (I, D)
``b_out``         ``out_proj.bias``                 (D,), with ``out_bias``
================  ================================  ==========================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import (
    as_bool_mask,
    check_eps,
    check_factor,
    check_features,
    check_grad_output,
    check_ndim,
    check_positive_int,
)
from ..attention.cache_entry import check_max_length
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import causal_conv as _conv
from ..kernels import ssd as _ssd
from ..kernels.activations import activation_backward, activation_forward
from ..kernels.linear import linear, linear_backward
from ..kernels.rms_norm import rms_norm_backward, rms_norm_forward
from .recurrent_state import RecurrentState, StateMixer, step_padding

__all__ = ["Mamba2", "Mamba2Cache", "Mamba2Config", "Mamba2Mixer", "MAMBA2_NORMS"]

MAMBA2_NORMS = ("after_gate", "before_gate", None)
# Mamba2Config.norm -> the Mamba2 method (and its "_backward") that applies the gate and the norm
_GATE_AND_NORM = {"after_gate": "_norm_after_gate", "before_gate": "_norm_before_gate", None: "_gate_only"}


@dataclass
class Mamba2Cache(RecurrentState):
    """What decoding keeps for one :class:`Mamba2` layer: a fixed size, whatever the length so far.

    Attributes
    ----------
    conv_state : (B, K - 1, Cc), the last K - 1 inputs of the convolution (zeros before the first token)
    ssm_state : (B, H, N, P), the scan's state
    length : int, the number of positions seen
    """

    conv_state: np.ndarray
    ssm_state: np.ndarray
    length: int = 0


@dataclass(frozen=True)
class Mamba2Config:
    """The shape of a decoder's Mamba-2 layers, with the names of ``transformers``' Bamba / Granite 4 hybrid
    configs in parentheses.

    Attributes
    ----------
    num_heads, head_dim : int
        H (``mamba_n_heads``) and P (``mamba_d_head``).
    state_size : int
        N (``mamba_d_state``).
    n_groups : int, default 1
        G (``mamba_n_groups``), dividing H.
    conv_kernel_size : int, default 4
        K (``mamba_d_conv``).
    conv_bias, proj_bias : bool
        The convolution's bias (``mamba_conv_bias``, default True) and the projections' (``mamba_proj_bias``).
    chunk_size : int, default 64
        C of the chunked scan; any C gives the same result up to rounding.
    time_step_min : float, default 0.0
        The floor of the step sizes: ``dt = max(softplus(...), time_step_min)`` (Nemotron-H's ``time_step_min``;
        0: no floor, Bamba's); the gradient passes where ``dt`` is at or above it, as ``torch.clamp``'s does.
    norm : {"after_gate", "before_gate", None}, default "after_gate"
        Where the group RMSNorm sits: on ``y * silu(z)`` (Bamba), on ``y`` before the gate multiplies
        (``mamba_norm_before_gate``), or nowhere (no ``norm_gamma``).
    out_bias : bool, optional
        The output projection's bias (Falcon-H1's ``projectors_bias``); None: as ``proj_bias``.
    projection_multipliers : tuple of 5 floats, optional
        Fixed factors of the input projection's z, x, B, C and dt columns (Falcon-H1's ``ssm_multipliers``).
    """

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel_size: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 64
    time_step_min: float = 0.0
    norm: str | None = "after_gate"
    out_bias: bool | None = None
    projection_multipliers: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel_size", "chunk_size"):
            check_positive_int(getattr(self, name), name)
        for name in ("conv_bias", "proj_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        floor = self.time_step_min
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor < float("inf"):
            raise ValueError(f"time_step_min must be a finite number >= 0, got {floor!r}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"n_groups ({self.n_groups}) must divide num_heads ({self.num_heads})")
        if self.norm not in MAMBA2_NORMS:
            raise ValueError(f"norm must be one of {MAMBA2_NORMS}, got {self.norm!r}")
        if self.out_bias is not None and not isinstance(self.out_bias, bool):
            raise TypeError(f"out_bias must be True, False or None, got {self.out_bias!r}")
        factors = self.projection_multipliers
        if factors is not None:
            if not isinstance(factors, (tuple, list)) or len(factors) != 5:
                raise ValueError(f"projection_multipliers must be 5 factors (z, x, B, C, dt), got {factors!r}")
            object.__setattr__(self, "projection_multipliers",
                               tuple(check_factor(f, "projection_multipliers") for f in factors))

    @property
    def output_bias(self) -> bool:
        """Whether the output projection has a bias (``out_bias``, else ``proj_bias``)."""
        return self.proj_bias if self.out_bias is None else self.out_bias


class Mamba2(Module):
    """The Mamba-2 mixer: projections, short convolution with SiLU, the SSD scan, gated group RMSNorm, output.

    Parameters
    ----------
    hidden_size : int
        D.
    shape : Mamba2Config
    eps : float, default 1e-6
        The gated norm's epsilon (``rms_norm_eps``).
    rng : numpy.random.Generator or int, optional
        Source of the initial weights: ``N(0, 0.02^2)`` projections, ``U(-1/sqrt(K), 1/sqrt(K))`` convolution,
        zero biases, ``dt_bias`` and ``D_skip`` ones, ``A_log = log(1..H)``, ``norm_gamma`` ones.

    Attributes
    ----------
    The module docstring's table; ``grads`` with the same names.

    Shapes
    ------
    x : (B, L, D) -> y : (B, L, D), in ``x``'s float dtype.

    Examples
    --------
    >>> layer = Mamba2(8, Mamba2Config(num_heads=2, head_dim=3, state_size=4, chunk_size=2), rng=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 8))
    >>> y = layer(x)
    >>> y.shape, layer.backward(np.ones_like(y)).shape
    ((2, 5, 8), (2, 5, 8))
    >>> cache = layer.new_cache(2)
    >>> steps = np.stack([layer.step(x[:, t], cache=cache) for t in range(5)], axis=1)
    >>> bool(np.allclose(steps, y)), cache.length
    (True, 5)
    """

    def __init__(self, hidden_size: int, shape: Mamba2Config, *, eps: float = 1e-6,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        if not isinstance(shape, Mamba2Config):
            raise TypeError(f"shape must be a Mamba2Config, got {type(shape).__name__}")
        d = self.hidden_size = check_positive_int(hidden_size, "hidden_size")
        self.shape, self.eps = shape, check_eps(eps)
        h, n, g = shape.num_heads, shape.state_size, shape.n_groups
        inner = self.inner_size = h * shape.head_dim
        self.conv_dim = inner + 2 * g * n
        self.widths = (inner, self.conv_dim, h)  # z, xBC, dt
        gen = as_generator(rng)
        self.register_parameter("W_in", normal(gen, (d, sum(self.widths)), std=0.02))
        taps = shape.conv_kernel_size
        self.register_parameter("conv_weight", gen.uniform(-1.0, 1.0, (self.conv_dim, taps)) / np.sqrt(taps))
        self.register_parameter("dt_bias", np.ones(h))
        self.register_parameter("A_log", np.log(np.arange(1.0, h + 1.0)))
        self.register_parameter("D_skip", np.ones(h))
        if shape.norm is not None:
            self.register_parameter("norm_gamma", np.ones(inner))
        self.register_parameter("W_out", normal(gen, (inner, d), std=0.02))
        if shape.conv_bias:
            self.register_parameter("conv_bias", np.zeros(self.conv_dim))
        if shape.proj_bias:
            self.register_parameter("b_in", np.zeros(sum(self.widths)))
        if shape.output_bias:
            self.register_parameter("b_out", np.zeros(d))
        # the projection's per-column factors (W,): z x B C dt each its own (ones without multipliers: x * 1.0 is
        # x, bit for bit)
        gn = g * n
        factors = shape.projection_multipliers or (1.0,) * 5
        self.projection_scale = np.repeat(np.asarray(factors, np.float64), (inner, inner, gn, gn, h))
        # the gate and the norm as shape.norm places them (method names: a copy of the module keeps its own)
        self.gate_and_norm = _GATE_AND_NORM[shape.norm]

    def extra_repr(self) -> str:
        s = self.shape
        return (f"hidden_size={self.hidden_size}, num_heads={s.num_heads}, head_dim={s.head_dim}, "
                f"state_size={s.state_size}, n_groups={s.n_groups}")

    def hook_points(self) -> tuple[str, ...]:
        """``hook_conv_out`` (B, L, Cc): the convolved x, B and C channels the scan reads; ``hook_ssm_out``
        (B, L, H, P): the scan's output with the skip ``D x``, before the gate and the norm."""
        return ("hook_conv_out", "hook_ssm_out")

    def new_cache(self, batch_size: int, max_length: int | None = None, *, dtype: Any = None,
                  rollback: int = 0) -> Mamba2Cache:
        """An empty cache for ``batch_size`` sequences, in ``dtype`` (default: the parameters' dtype);
        ``max_length`` and ``rollback`` change nothing (a state has one size at every length)."""
        b, s = check_positive_int(batch_size, "batch_size"), self.shape
        check_max_length(max_length)
        dtype = self._parameters["W_out"].dtype if dtype is None else dtype
        return Mamba2Cache(np.zeros((b, s.conv_kernel_size - 1, self.conv_dim), dtype),
                           np.zeros((b, s.num_heads, s.state_size, s.head_dim), dtype))

    def _check_padding(self, attention_mask: Any, x: np.ndarray) -> np.ndarray | None:
        """``attention_mask`` as x's dtype (B, L, 1): 1 for a real token, 0 for padding; None without padding."""
        mask = as_bool_mask(attention_mask, "attention_mask", allow_int=True)
        if mask is None or mask.all():
            return None
        if mask.shape != x.shape[:2]:
            raise ValueError(f"Mamba2: attention_mask must have shape (B, L) = {x.shape[:2]}, got {mask.shape}")
        return mask[..., None].astype(x.dtype)  # (B, L, 1)

    def _scan_inputs(self, xbc: np.ndarray, dt_raw: np.ndarray):
        """The convolved channels and the raw step sizes as the scan's q, k (B, H, L, N), v (B, H, L, P), g
        (B, H, L), with xs (B, L, H, P), dt and softplus's input (B, L, H)."""
        s, p = self.shape, self._parameters
        b, length = xbc.shape[:2]
        gn = s.n_groups * s.state_size
        xs = xbc[..., :self.inner_size].reshape(b, length, s.num_heads, s.head_dim)  # (B, L, H, P)
        per_group = s.num_heads // s.n_groups
        heads = [np.repeat(part.reshape(b, length, s.n_groups, s.state_size), per_group, axis=2).transpose(0, 2, 1, 3)
                 for part in (xbc[..., self.inner_size + gn:], xbc[..., self.inner_size:self.inner_size + gn])]
        pre = dt_raw + p["dt_bias"].astype(dt_raw.dtype, copy=False)  # (B, L, H)
        dt = np.logaddexp(dt_raw.dtype.type(0), pre)  # (B, L, H): softplus
        if s.time_step_min:
            dt = np.maximum(dt, dt.dtype.type(s.time_step_min))  # (B, L, H): the floor
        rate = -np.exp(p["A_log"].astype(dt.dtype, copy=False))  # (H,): A
        v = (xs * dt[..., None]).transpose(0, 2, 1, 3)  # (B, H, L, P)
        return heads[0], heads[1], v, (dt * rate).transpose(0, 2, 1), xs, dt, pre, rate

    def _group_norm(self, h: np.ndarray):
        """``gamma * group_rms_norm(h)`` (B, L, I), or (B, I) for a step's rows, and the unit-gain norm's output,
        x_hat and rstd."""
        groups = h.reshape(h.shape[:-1] + (self.shape.n_groups, -1))  # (B, L, G, I / G)
        unit, x_hat, rstd = rms_norm_forward(groups, np.ones(groups.shape[-1], h.dtype), self.eps)
        unit = unit.reshape(h.shape)  # (B, L, I)
        return unit * self._parameters["norm_gamma"].astype(unit.dtype, copy=False), (unit, x_hat, rstd)

    def _group_norm_backward(self, d_out: np.ndarray, saved, grads: dict) -> np.ndarray:
        """The gradient of :meth:`_group_norm`'s input (B, L, I); ``norm_gamma``'s into ``grads``."""
        unit, x_hat, rstd = saved
        grads["norm_gamma"] = np.einsum("bli,bli->i", d_out, unit)
        d_unit = (d_out * self._parameters["norm_gamma"].astype(d_out.dtype, copy=False)).reshape(x_hat.shape)
        d_in, _ = rms_norm_backward(d_unit, x_hat, rstd, np.ones(x_hat.shape[-1], x_hat.dtype))
        return d_in.reshape(d_out.shape)  # (B, L, I)

    def _norm_after_gate(self, y: np.ndarray, z: np.ndarray):
        """``gamma * group_rms_norm(y * silu(z))`` (B, L, I) and what its backward needs."""
        act = activation_forward(z, "silu")  # (B, L, I)
        out, norm_saved = self._group_norm(y * act)  # (B, L, I)
        return out, (y, z, act, norm_saved)

    def _norm_after_gate_backward(self, d_out: np.ndarray, saved, grads: dict):
        """The gradients of ``y`` and ``z`` (B, L, I) each."""
        y, z, act, norm_saved = saved
        d_gated = self._group_norm_backward(d_out, norm_saved, grads)  # (B, L, I)
        return d_gated * act, activation_backward(d_gated * y, z, act, "silu")

    def _norm_before_gate(self, y: np.ndarray, z: np.ndarray):
        """``silu(z) * gamma * group_rms_norm(y)`` (B, L, I) and what its backward needs."""
        act = activation_forward(z, "silu")  # (B, L, I)
        normed, norm_saved = self._group_norm(y)  # (B, L, I)
        return normed * act, (z, act, normed, norm_saved)

    def _norm_before_gate_backward(self, d_out: np.ndarray, saved, grads: dict):
        z, act, normed, norm_saved = saved
        d_y = self._group_norm_backward(d_out * act, norm_saved, grads)  # (B, L, I)
        return d_y, activation_backward(d_out * normed, z, act, "silu")

    def _gate_only(self, y: np.ndarray, z: np.ndarray):
        """``y * silu(z)`` (B, L, I), no norm, and what its backward needs."""
        act = activation_forward(z, "silu")  # (B, L, I)
        return y * act, (y, z, act)

    def _gate_only_backward(self, d_out: np.ndarray, saved, grads: dict):
        y, z, act = saved
        return d_out * act, activation_backward(d_out * y, z, act, "silu")

    def forward(self, x: Any, cache: Mamba2Cache | None = None, *, attention_mask: Any = None) -> np.ndarray:
        """Run the layer over ``x`` (B, L, D).

        Without a cache the sequence starts from zero states and the forward keeps what :meth:`backward` needs.
        With a ``cache`` it continues from the cache's states and writes the new ones back: one position runs the
        recurrent scan, more the chunked one; a cached forward is inference and keeps nothing for backward.
        ``attention_mask`` (B, L) bool or 0/1, ``True`` = real token; None: all real.
        """
        x = check_features(x, "x", self.hidden_size, "Mamba2", "hidden_size")
        check_ndim(x, "x", 3, expected="(B, L, hidden_size)")
        if cache is not None and cache.conv_state.shape[0] != x.shape[0]:
            raise ValueError(f"Mamba2: the cache holds {cache.conv_state.shape[0]} sequences but x has "
                             f"{x.shape[0]} (x: {x.shape})")
        p = self._parameters
        padding = self._check_padding(attention_mask, x)
        inputs = x if padding is None else x * padding  # (B, L, D)
        projected = linear(inputs, p["W_in"], p.get("b_in"))  # (B, L, I + Cc + H)
        projected = projected * self.projection_scale.astype(projected.dtype)  # (B, L, I + Cc + H)
        z, xbc, dt_raw = np.split(projected, np.cumsum(self.widths)[:-1], axis=-1)
        conv_out, conv_state, conv_saved = _conv.causal_conv_forward(
            xbc, p["conv_weight"], None if cache is None else cache.conv_state, bias=p.get("conv_bias"),
            activation="silu")  # (B, L, Cc)
        if padding is not None:
            conv_out = conv_out * padding  # a padded position's channels stay zero after the convolution too
        conv_out = self.hook_point("hook_conv_out", conv_out)
        q, k, v, g, xs, dt, pre, rate = self._scan_inputs(conv_out, dt_raw)
        state = None if cache is None else cache.ssm_state
        if cache is not None and x.shape[1] == 1:
            o, state = _ssd.recurrent_forward(q, k, v, g, state)  # (B, H, 1, P)
        else:
            o, state, scan_ctx = _ssd.chunked_forward(q, k, v, g, state, chunk_size=self.shape.chunk_size)
        skip = p["D_skip"].astype(xs.dtype, copy=False)[:, None]  # (H, 1)
        y = self.hook_point("hook_ssm_out", o.transpose(0, 2, 1, 3) + skip * xs).reshape(z.shape)  # (B, L, I)
        normed, norm_saved = getattr(self, self.gate_and_norm)(y, z)  # (B, L, I)
        out = linear(normed, p["W_out"], p.get("b_out")).astype(x.dtype, copy=False)  # (B, L, D)
        if cache is None:
            self.save_for_backward(inputs, padding, conv_saved, (q, k, xs, dt, pre, rate), scan_ctx, norm_saved,
                                   normed)
        else:
            cache.conv_state = conv_state.astype(cache.conv_state.dtype, copy=False)
            cache.ssm_state = state.astype(cache.ssm_state.dtype, copy=False)
            cache.length += x.shape[1]
            self.save_for_backward()
        return out

    def _scan_step_inputs(self, xbc: np.ndarray, dt_raw: np.ndarray):
        """:meth:`_scan_inputs` of one position per row: the scan's q, k (B, H, N), v (B, H, P), g (B, H), and xs
        (B, H, P), from the convolved channels (B, Cc) and the raw step sizes (B, H)."""
        s, p = self.shape, self._parameters
        b, gn, inner = xbc.shape[0], s.n_groups * s.state_size, self.inner_size
        xs = xbc[:, :inner].reshape(b, s.num_heads, s.head_dim)  # (B, H, P)
        per_group = s.num_heads // s.n_groups
        q, k = (np.repeat(part.reshape(b, s.n_groups, s.state_size), per_group, axis=1)  # (B, H, N) each
                for part in (xbc[:, inner + gn:], xbc[:, inner:inner + gn]))
        pre = dt_raw + p["dt_bias"].astype(dt_raw.dtype, copy=False)  # (B, H)
        dt = np.logaddexp(dt_raw.dtype.type(0), pre)  # (B, H): softplus
        if s.time_step_min:
            dt = np.maximum(dt, dt.dtype.type(s.time_step_min))  # (B, H): the floor
        rate = -np.exp(p["A_log"].astype(dt.dtype, copy=False))  # (H,): A
        return q, k, xs * dt[..., None], dt * rate, xs  # (B, H, N) x2, (B, H, P), (B, H), (B, H, P)

    def step(self, x: np.ndarray, *, cache: Mamba2Cache, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """One decoding step (B, D) -> (B, D) continuing ``cache``: :meth:`forward`'s numbers on one position,
        nothing saved.

        The cached forward's parts in its order on (B, *) rows: the input projection and its factors, the
        convolution's K taps on the kept window (:func:`attnkit.kernels.causal_conv.causal_conv_step`), one update
        of the scan's state (:func:`attnkit.kernels.ssd.recurrent_step`) with the skip, the gate and norm, ``W_out``;
        no length axis to add, transpose and take away. ``attention_mask`` (B,) or the model's (B, P + 1) (its last
        column is this position's), None: a real token.
        """
        p = self._parameters
        real = step_padding(attention_mask, x.dtype)  # (B, 1) or None
        if real is not None:
            x = x * real  # (B, D): a padded input is zero
        projected = linear(x, p["W_in"], p.get("b_in"))  # (B, I + Cc + H)
        projected = projected * self.projection_scale.astype(projected.dtype)  # (B, I + Cc + H)
        inner, conv_dim = self.widths[:2]
        z, xbc, dt_raw = (projected[:, :inner], projected[:, inner:inner + conv_dim],
                          projected[:, inner + conv_dim:])  # (B, I), (B, Cc), (B, H)
        conv_out, conv_state = _conv.causal_conv_step(xbc, p["conv_weight"], cache.conv_state,
                                                      bias=p.get("conv_bias"), activation="silu")  # (B, Cc)
        if real is not None:
            conv_out = conv_out * real  # a padded position's channels stay zero after the convolution too
        q, k, v, g, xs = self._scan_step_inputs(conv_out, dt_raw)  # (B, H, N) x2, (B, H, P), (B, H), (B, H, P)
        o, state = _ssd.recurrent_step(q, k, v, g, cache.ssm_state)  # (B, H, P), (B, H, N, P)
        y = (o + p["D_skip"].astype(xs.dtype, copy=False)[:, None] * xs).reshape(z.shape)  # (B, I)
        normed, _ = getattr(self, self.gate_and_norm)(y, z)  # (B, I)
        cache.conv_state = conv_state.astype(cache.conv_state.dtype, copy=False)
        cache.ssm_state = state.astype(cache.ssm_state.dtype, copy=False)
        cache.length += 1
        return linear(normed, p["W_out"], p.get("b_out")).astype(x.dtype, copy=False)  # (B, D)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add every parameter's gradient into ``self.grads``; return ``grad_x`` (B, L, D)."""
        if self.saved_tensors is None:
            raise RuntimeError("Mamba2.backward called before a forward without a cache")
        x, padding, conv_saved, scan_inputs, scan_ctx, norm_saved, normed = self.saved_tensors
        q, k, xs, dt, pre, rate = scan_inputs
        s, p = self.shape, self._parameters
        dy = check_grad_output(grad_output, x.shape, x.dtype, "Mamba2")
        grads: dict[str, np.ndarray | None] = {}
        d_normed, grads["W_out"], grads["b_out"] = linear_backward(dy, normed, p["W_out"].astype(x.dtype, copy=False),
                                                                   need_bias=s.output_bias)  # (B, L, I)
        d_y, dz = getattr(self, self.gate_and_norm + "_backward")(d_normed, norm_saved, grads)  # (B, L, I) each
        d_y = self.hook_backward("hook_ssm_out", d_y.reshape(xs.shape))  # (B, L, H, P)
        grads["D_skip"] = np.einsum("blhp,blhp->h", d_y, xs)
        dq, dk, dv, dg, _ = _ssd.chunked_backward(d_y.transpose(0, 2, 1, 3), scan_ctx)  # (B, H, L, *)
        dv = dv.transpose(0, 2, 1, 3)  # (B, L, H, P)
        d_xs = d_y * p["D_skip"].astype(d_y.dtype, copy=False)[:, None] + dv * dt[..., None]  # (B, L, H, P)
        dg = dg.transpose(0, 2, 1)  # (B, L, H)
        d_dt = np.einsum("blhp,blhp->blh", dv, xs) + dg * rate  # (B, L, H)
        grads["A_log"] = np.einsum("blh,blh->h", dg, dt) * rate  # dA / dA_log = A
        d_pre = d_dt * (0.5 * (1.0 + np.tanh(0.5 * pre)))  # (B, L, H): softplus' = sigmoid
        if s.time_step_min:  # the floor passes no gradient where it holds dt up
            d_pre = d_pre * (np.logaddexp(pre.dtype.type(0), pre) >= pre.dtype.type(s.time_step_min))
        grads["dt_bias"] = d_pre.sum(axis=(0, 1))
        b, length = xs.shape[:2]
        group_shape = (b, s.n_groups, s.num_heads // s.n_groups, length, s.state_size)
        d_b, d_c = (t.reshape(group_shape).sum(axis=2).transpose(0, 2, 1, 3).reshape(b, length, -1)
                    for t in (dk, dq))  # (B, L, G N) each
        d_conv_out = self.hook_backward("hook_conv_out", np.concatenate([d_xs.reshape(b, length, -1), d_b, d_c],
                                                                        axis=-1))  # (B, L, Cc)
        if padding is not None:
            d_conv_out = d_conv_out * padding
        d_xbc, grads["conv_weight"], _, grads["conv_bias"] = _conv.causal_conv_backward(d_conv_out, p["conv_weight"],
                                                                                       conv_saved)  # (B, L, Cc)
        d_proj = np.concatenate([dz, d_xbc, d_pre], axis=-1)  # (B, L, I + Cc + H)
        d_proj = d_proj * self.projection_scale.astype(d_proj.dtype)
        grad_x, grads["W_in"], grads["b_in"] = linear_backward(d_proj, x, p["W_in"].astype(x.dtype, copy=False),
                                                               need_bias=s.proj_bias)  # (B, L, D)
        for name in self._parameters:  # the biases' only where the layer has them
            self.grads[name] += grads[name]
        return grad_x if padding is None else grad_x * padding  # a zeroed input has no gradient


class Mamba2Mixer(StateMixer, Mamba2):
    """A :class:`Mamba2` as the token mixer of a decoder block (a ``"mamba2"`` layer).

    It speaks the mixers' protocol: ``forward(x, *, rotary, attention_mask, cache, output_attentions)``, where
    ``rotary`` is ignored, ``attention_mask`` is the model's (B, P + L) mask over every column (the layer reads the
    new L) and ``cache`` the model's :class:`~attnkit.decoding.cache.ModelCache`, whose
    :meth:`~attnkit.decoding.cache.ModelCache.state` for this layer is its :class:`Mamba2Cache`. It has no attention
    weights: ``output_attentions=True`` is refused.

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size``, ``norm.eps`` and the layer's part (``config.layers[layer_index].part``, a
        :class:`Mamba2Config`).
    layer_index : int
    shape : Mamba2Config, optional
        The shape in place of the layer's part (the Mamba-2 half of an ``"attention_mamba2"`` layer, whose part is
        an :class:`~attnkit.layers.attention_mamba2.AttentionMamba2Config` holding it).
    rng : numpy.random.Generator or int, optional
    """

    def __init__(self, config, layer_index: int, *, shape: Mamba2Config | None = None,
                 rng: np.random.Generator | int | None = None) -> None:
        shape = config.layers[layer_index].part if shape is None else shape
        super().__init__(config.hidden_size, shape, eps=config.norm.eps, rng=rng)
        self.layer_index = layer_index

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False) -> np.ndarray:
        """The layer's output (B, L, D)."""
        if output_attentions:
            raise ValueError(f"layer {self.layer_index} is a Mamba-2 layer: it has no attention weights")
        mask, state = self._model_inputs(x, attention_mask, cache)  # (B, L) or None, the layer's state or None
        return super().forward(x, state, attention_mask=mask)  # (B, L, D)

"""``KimiDeltaAttention``: the linear-attention layer of Kimi Linear (Kimi Delta Attention, KDA), with its cache.

Dimension letters: B batch, L length, D ``hidden_size``, H heads, Dh head dim (keys and values alike),
E = H Dh, K the convolution's kernel size.

Gated DeltaNet (:class:`~attnkit.layers.gated_deltanet.GatedDeltaNet`, whose cache, padding rule and token
weights it keeps) except that the decay is one per key channel, not one per head, and that both gates go through
a rank-Dh bottleneck. The layer, in order (Hugging Face's ``KimiLinearDeltaAttention``):

1. ``x W_q``, ``x W_k``, ``x W_v`` (B, L, E) side by side, the short causal convolution with SiLU over them
   (:mod:`attnkit.kernels.causal_conv`), split into q, k, v (B, L, H, Dh); q and k L2-normalised per head;
2. ``beta = sigmoid(x W_b)`` (B, L, H); the channel-wise log-decay
   ``g = -exp(A_log[h]) softplus((x W_fa) W_fb + dt_bias)`` (B, L, H, Dh);
3. the gated delta rule with that vector gate (:mod:`attnkit.kernels.delta_rule`, q scaled by ``Dh ** -0.5``);
4. the gated RMSNorm ``norm_gamma * rms_norm(o) * sigmoid((x W_ga) W_gb)`` per head (a sigmoid where Gated
   DeltaNet has a SiLU), then ``W_out``.

Parameter names and a Hugging Face checkpoint (``self_attn.``; linear weights stored ``(In, Out)``, the
transpose of ``nn.Linear.weight``):

===============  ========================================
attnkit          Kimi Linear
===============  ========================================
``W_q``          ``q_proj.weight.T``
``W_k``          ``k_proj.weight.T``
``W_v``          ``v_proj.weight.T``
``W_fa``         ``forget_gate.f_a_proj.weight.T`` (D, Dh)
``W_b``          ``b_proj.weight.T``
``W_ga``         ``g_a_proj.weight.T`` (D, Dh)
``conv_weight``  ``conv1d.weight`` (3 E, 1, K) as (3, E, K): on disk ``{q,k,v}_conv1d.weight``
``W_fb``         ``forget_gate.f_b_proj.weight.T`` (Dh, E)
``dt_bias``      ``forget_gate.dt_bias`` (E,)
``A_log``        ``forget_gate.A_log`` (1, 1, H, 1) flattened
``W_gb``         ``g_b_proj.weight.T`` (Dh, E)
``norm_gamma``   ``o_norm.weight`` (Dh,)
``W_out``        ``o_proj.weight.T``
===============  ========================================
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._validation import check_eps, check_positive_int
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import causal_conv as _conv
from ..kernels import delta_rule as _delta
from ..kernels.linear import linear
from .gated_deltanet import DeltaRuleMixer, GatedDeltaNet, _sigmoid

__all__ = ["KimiDeltaAttention", "KimiDeltaAttentionConfig", "KimiDeltaAttentionMixer"]


@dataclass(frozen=True)
class KimiDeltaAttentionConfig:
    """The shape of a decoder's Kimi Delta Attention layers (a part in ``DecoderConfig.mixer_parts``), with the names of
    ``transformers``' ``KimiLinearConfig`` in parentheses.

    Attributes
    ----------
    num_heads : int
        H (``linear_num_heads``, ``linear_attn_config["num_heads"]``).
    head_dim : int
        Dh (``linear_head_dim``, ``linear_attn_config["head_dim"]``).
    conv_kernel_size : int
        K (``linear_conv_kernel_dim``, ``linear_attn_config["short_conv_kernel_size"]``).
    """

    num_heads: int
    head_dim: int
    conv_kernel_size: int = 4

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "conv_kernel_size"):
            check_positive_int(getattr(self, name), name)


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Delta Attention: projections, short convolution, channel-wise gated delta rule, sigmoid-gated
    RMSNorm, output projection (module docstring).

    Parameters
    ----------
    hidden_size : int
        D.
    num_heads, head_dim : int
        H and Dh (``linear_num_heads``, ``linear_head_dim``).
    conv_kernel_size : int, default 4
        K (``linear_conv_kernel_dim``).
    eps : float, default 1e-5
        The gated RMSNorm's epsilon (``rms_norm_eps``, whose default in ``KimiLinearConfig`` this is).
    chunk_size : int, default 16
        C of the chunked delta rule (a whole-sequence forward); any C gives the same result up to rounding. A
        channel-wise gate costs C^2 Dk per chunk for its decayed products (a scalar gate C^2): 16 ran a (1, 8,
        512, 64) forward and backward in a tenth of 64's time (measured on a busy 2-core machine).
    rng : numpy.random.Generator or int, optional
        Source of the initial weights: ``N(0, 0.02^2)`` linear weights, ``U(-1/sqrt(K), 1/sqrt(K))``
        convolution, ``dt_bias`` ones and ``A_log = log(U(1, 16))``, ``norm_gamma`` ones.

    Attributes
    ----------
    W_q, W_k, W_v (D, E), W_fa (D, Dh), W_b (D, H), W_ga (D, Dh), conv_weight (3, E, K), W_fb (Dh, E),
    dt_bias (E,), A_log (H,), W_gb (Dh, E), norm_gamma (Dh,), W_out (E, D); ``grads`` with the same names.

    Shapes
    ------
    x : (B, L, D) -> y : (B, L, D), in ``x``'s float dtype (float32 in, float32 out).

    Examples
    --------
    >>> layer = KimiDeltaAttention(8, num_heads=2, head_dim=4, rng=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 5, 8))
    >>> y = layer(x)
    >>> y.shape, layer.backward(np.ones_like(y)).shape
    ((2, 5, 8), (2, 5, 8))
    >>> cache = layer.new_cache(2)
    >>> steps = np.concatenate([layer(x[:, t:t + 1], cache=cache) for t in range(5)], axis=1)
    >>> bool(np.allclose(steps, y)), cache.length
    (True, 5)
    """

    input_names = ("W_q", "W_k", "W_v", "W_fa", "W_b", "W_ga")
    gate_activation = "sigmoid"

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, conv_kernel_size: int = 4,
                 eps: float = 1e-5, chunk_size: int = 16, rng: np.random.Generator | int | None = None) -> None:
        Module.__init__(self)
        d = self.hidden_size = check_positive_int(hidden_size, "hidden_size")
        h = self.num_heads = check_positive_int(num_heads, "num_heads")
        dh = self.head_dim = check_positive_int(head_dim, "head_dim")
        # Gated DeltaNet's names for the shapes its cache, heads and token weights read: one key head per value head
        self.num_key_heads = self.num_value_heads = h
        self.key_head_dim = self.value_head_dim = dh
        taps = self.conv_kernel_size = check_positive_int(conv_kernel_size, "conv_kernel_size")
        self.eps = check_eps(eps)
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        e = self.key_dim = self.value_dim = h * dh
        self.conv_dim = 3 * e
        gen = as_generator(rng)
        for name, width in zip(self.input_names, (e, e, e, dh, h, dh)):
            self.register_parameter(name, normal(gen, (d, width), std=0.02))
        self.register_parameter("conv_weight", gen.uniform(-1.0, 1.0, (3, e, taps)) / np.sqrt(taps))
        self.register_parameter("W_fb", normal(gen, (dh, e), std=0.02))
        self.register_parameter("dt_bias", np.ones(e))
        self.register_parameter("A_log", np.log(gen.uniform(1.0, 16.0, h)))
        self.register_parameter("W_gb", normal(gen, (dh, e), std=0.02))
        self.register_parameter("norm_gamma", np.ones(dh))
        self.register_parameter("W_out", normal(gen, (e, d), std=0.02))
        self.fuse_parameters("W_in", self.input_names)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"conv_kernel_size={self.conv_kernel_size}")

    def _delta_inputs(self, x: np.ndarray, conv_state: np.ndarray | None):
        """Steps 1-2 of the layer: the delta rule's arguments ``(q, k, v, g, beta)`` ((B, H, L, Dh) each, beta
        (B, H, L)), the output gate's input (B, L, E), the convolution's new state and what backward needs."""
        p = self._parameters
        q_in, k_in, v_in, fa, b, ga = self._project(x)
        mixed = np.concatenate([q_in, k_in, v_in], axis=-1)  # (B, L, 3 E)
        conv_weight = p["conv_weight"].reshape(self.conv_dim, -1)  # (3 E, K): q's channels, then k's, then v's
        conv_out, conv_state, conv_saved = _conv.causal_conv_forward(mixed, conv_weight, conv_state)  # (B, L, 3 E)
        q, k, v = self._heads(conv_out)  # (B, H, L, Dh) each
        qn, q_rstd = _delta.l2_normalize_forward(q)  # (B, H, L, Dh)
        kn, k_rstd = _delta.l2_normalize_forward(k)  # (B, H, L, Dh)
        beta, g, pre, rate, z = self._channel_gates(fa, b, ga)  # (B, L, H), (B, L, H, Dh) x2, (H, 1), (B, L, E)
        delta_args = (qn, kn, v, g.transpose(0, 2, 1, 3), beta.transpose(0, 2, 1))
        return delta_args, z, conv_state, (conv_saved, (qn, q_rstd, kn, k_rstd), (beta, g, pre, rate, fa, ga))

    def _channel_gates(self, fa: np.ndarray, b: np.ndarray, ga: np.ndarray):
        """From ``x W_fa`` (..., Dh), ``x W_b`` (..., H) and ``x W_ga`` (..., Dh): ``beta = sigmoid(x W_b)``
        (..., H), the channel-wise log-decay g and softplus's input (..., H, Dh), ``exp(A_log)`` (H, 1) and the
        output gate's input (..., E)."""
        p, dtype = self._parameters, fa.dtype
        pre = linear(fa, p["W_fb"], p["dt_bias"])  # (..., E)
        pre = pre.reshape(pre.shape[:-1] + (self.num_heads, self.head_dim))  # (..., H, Dh)
        rate = np.exp(p["A_log"].astype(dtype, copy=False))[:, None]  # (H, 1)
        g = -rate * np.logaddexp(dtype.type(0), pre)  # (..., H, Dh)
        return _sigmoid(b), g, pre, rate, linear(ga, p["W_gb"])  # (..., H), (..., H, Dh) x2, (H, 1), (..., E)

    def _step_inputs(self, x: np.ndarray, conv_state: np.ndarray):
        """:meth:`_delta_inputs` of one position per row: ``(q, k, v, g, beta)`` ((B, H, Dh) each, beta (B, H)),
        the output gate's input (B, E) and the convolution's new state (B, K - 1, 3 E)."""
        q_in, k_in, v_in, fa, b, ga = self._project(x)  # (B, E) x3, (B, Dh), (B, H), (B, Dh)
        mixed = np.concatenate([q_in, k_in, v_in], axis=-1)  # (B, 3 E)
        conv_weight = self._parameters["conv_weight"].reshape(self.conv_dim, -1)  # (3 E, K)
        conv_out, conv_state = _conv.causal_conv_step(mixed, conv_weight, conv_state)  # (B, 3 E)
        bsz, h, dh, e = x.shape[0], self.num_heads, self.head_dim, self.key_dim
        qn, _ = _delta.l2_normalize_forward(conv_out[:, :e].reshape(bsz, h, dh))  # (B, H, Dh)
        kn, _ = _delta.l2_normalize_forward(conv_out[:, e:2 * e].reshape(bsz, h, dh))  # (B, H, Dh)
        v = conv_out[:, 2 * e:].reshape(bsz, h, dh)  # (B, H, Dh)
        beta, g, _, _, z = self._channel_gates(fa, b, ga)  # (B, H), (B, H, Dh), _, _, (B, E)
        return (qn, kn, v, g, beta), z, conv_state

    def _gates_backward(self, dg: np.ndarray, dbeta: np.ndarray, dz: np.ndarray, gates) -> list[np.ndarray]:
        """The gradients of ``x W_fa``, ``x W_b`` and ``x W_ga`` (B, L, *) from those of the log-decay ``dg``
        (B, H, L, Dh), ``beta`` (B, H, L) and the output gate ``dz`` (B, L, E); ``W_fb``'s, ``W_gb``'s,
        ``dt_bias``'s and ``A_log``'s added into ``grads``."""
        beta, g, pre, rate, fa, ga = gates
        p = self._parameters
        dg = dg.transpose(0, 2, 1, 3)  # (B, L, H, Dh)
        db = dbeta.transpose(0, 2, 1) * beta * (1.0 - beta)  # (B, L, H)
        d_pre = (-rate * dg * _sigmoid(pre)).reshape(dz.shape)  # (B, L, E): softplus' = sigmoid
        self.grads["dt_bias"] += d_pre.sum(axis=(0, 1))
        self.grads["A_log"] += np.einsum("blhd,blhd->h", dg, g)  # g = -exp(A_log) softplus: dg/dA_log = g
        self.grads["W_fb"] += np.einsum("blr,ble->re", fa, d_pre)
        self.grads["W_gb"] += np.einsum("blr,ble->re", ga, dz)
        d_fa = d_pre @ p["W_fb"].astype(d_pre.dtype, copy=False).T  # (B, L, Dh)
        d_ga = dz @ p["W_gb"].astype(dz.dtype, copy=False).T  # (B, L, Dh)
        return [d_fa, db, d_ga]


class KimiDeltaAttentionMixer(DeltaRuleMixer, KimiDeltaAttention):
    """A :class:`KimiDeltaAttention` as the token mixer of a decoder block (a ``"kimi_delta_attention"`` layer):
    the mixers' protocol exactly as :class:`~attnkit.layers.gated_deltanet.GatedDeltaNetMixer` speaks it
    (``rotary`` ignored, the model's mask over every column, the cache's state for this layer, token weights
    (B, H, L, L) with ``output_attentions``).

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size``, ``norm.eps`` and the layer's part (``config.layers[layer_index].part``, a
        :class:`KimiDeltaAttentionConfig`).
    layer_index : int
    rng : numpy.random.Generator or int, optional
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        shape = config.layers[layer_index].part
        super().__init__(config.hidden_size, shape.num_heads, shape.head_dim, conv_kernel_size=shape.conv_kernel_size,
                         eps=config.norm.eps, rng=rng)
        self.layer_index = layer_index

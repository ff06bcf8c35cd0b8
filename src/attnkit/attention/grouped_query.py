"""``GroupedQueryAttention``: causal self-attention of a decoder-only LM (multi-head, grouped-query, multi-query).

Dimension letters: B batch, L new tokens, S keys (past + new), D ``hidden_size``, Hq query heads, Hkv key/value
heads, G = Hq / Hkv queries per key/value head, Dh ``head_dim``, R rotated features.

Grouped-query attention shares each key/value head among G query heads. The layer's attention is one
:func:`attnkit.flex.flex_attention` call: its causal (sliding-window or chunked: the layer's span) and padding
mask, its score modifier (Gemma 2's soft-cap) and its sinks (gpt-oss) describe the variant, and flex attention
picks the kernel (the tiled FlashAttention kernel for a plain causal layer). Either kernel reads each key/value
head for its G query heads and sums their gradients over the group, so repeated K/V are never materialised.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_bool_mask, check_features, check_grad_output
from ..core.hooks import hook_heads, hook_heads_backward
from ..core.module import Module
from ..flex import (
    and_masks,
    causal_lower_right,
    chunked_mask,
    create_block_mask,
    flex_attention,
    flex_attention_backward,
    padding_mask,
    sliding_window_mask,
)
from ..init import as_generator, normal
from ..kernels import rotary as _rotary
from ..kernels.decode_step import head_norms_into, rms_norm_into
from ..kernels.fixed_weights import FixedWeights, fixed_weights_backward, fixed_weights_forward
from ..kernels.linear import linear, linear_backward
from ..kernels.registry import ATTENTION_KERNELS
from ..kernels.rms_norm import rms_norm_backward, rms_norm_forward
from .cache_entry import KeysValues

__all__ = ["GroupedQueryAttention", "QK_NORMS", "NoQueryTemperature", "QueryTemperature", "slot_positions"]

ONE_QUERY = ATTENTION_KERNELS["one_query"]  # a decoding step's kernel (see kernels.registry)


class NoQKNorm:
    """Queries and keys as projected: the q/k normalisation of a layer without one."""

    scope: str | None = None

    def __init__(self, eps: float, offset: float) -> None:
        self.eps, self.offset = eps, offset

    def on_projection(self, attention, q: np.ndarray, k: np.ndarray):
        """(q, k, saved) after the step on the whole projections (B, L, H*Dh)."""
        return q, k, None

    def on_heads(self, attention, q: np.ndarray, k: np.ndarray, saved):
        """(q, k, saved) after the step on the heads (B, H, L, Dh)."""
        return q, k, saved

    def on_heads_backward(self, attention, dq: np.ndarray, dk: np.ndarray, saved):
        """The input gradients of :meth:`on_heads` (the norm weights' go into ``attention.grads``)."""
        return dq, dk

    def on_heads_in_place(self, attention, qk: np.ndarray, num_q: int) -> None:
        """:meth:`on_heads` of a decoding step, written over the query and key heads side by side (B, Hq + Hkv,
        1, Dh), the first ``num_q`` the queries (nothing here)."""

    def on_projection_in_place(self, attention, q: np.ndarray, k: np.ndarray) -> None:
        """:meth:`on_projection` of a decoding step, written over the projections (B, Hq*Dh), (B, Hkv*Dh)
        (views of the step's own fused projection; nothing here)."""

    def on_rotated(self, attention, q: np.ndarray, k: np.ndarray, saved):
        """(q, k, saved) after the step on the heads after the rotation (B, H, L, Dh)."""
        return q, k, saved

    def on_rotated_backward(self, attention, dq: np.ndarray, dk: np.ndarray, saved):
        """The input gradients of :meth:`on_rotated`."""
        return dq, dk

    def on_projection_backward(self, attention, dq: np.ndarray, dk: np.ndarray, saved):
        """The input gradients of :meth:`on_projection`."""
        return dq, dk

    def _forward(self, attention, q: np.ndarray, k: np.ndarray):
        """RMS-normalise q and k over their last axis with the weights ``q_norm``, ``k_norm`` (+ ``offset``)."""
        q, q_hat, q_rstd = rms_norm_forward(q, self._gain(attention, "q_norm"), self.eps)
        k, k_hat, k_rstd = rms_norm_forward(k, self._gain(attention, "k_norm"), self.eps)
        return q, k, (q_hat, q_rstd, k_hat, k_rstd)

    def _backward(self, attention, dq: np.ndarray, dk: np.ndarray, saved):
        q_hat, q_rstd, k_hat, k_rstd = saved
        dq, grad_q_norm = rms_norm_backward(dq, q_hat, q_rstd, self._gain(attention, "q_norm"))
        dk, grad_k_norm = rms_norm_backward(dk, k_hat, k_rstd, self._gain(attention, "k_norm"))
        attention.grads["q_norm"] += grad_q_norm
        attention.grads["k_norm"] += grad_k_norm
        return dq, dk

    def _gain(self, attention, name: str) -> np.ndarray:
        """A q/k norm's weight plus the norm offset (Gemma's ``1 + weight``)."""
        weight = attention._parameters[name]
        return weight + weight.dtype.type(self.offset)


class HeadQKNorm(NoQKNorm):
    """RMSNorm of each head's Dh features, one weight per feature shared by the heads (Qwen3, Gemma 3)."""

    scope = "head"

    def on_heads(self, attention, q, k, saved):
        return self._forward(attention, q, k)  # (B, Hq, L, Dh), (B, Hkv, L, Dh)

    def on_heads_backward(self, attention, dq, dk, saved):
        return self._backward(attention, dq, dk, saved)

    def on_heads_in_place(self, attention, qk, num_q):
        # the numbers of on_heads (rms_norm_into is rms_norm_forward bit for bit) in one pass instead of two
        head_norms_into(qk, num_q, self._gain(attention, "q_norm"), self._gain(attention, "k_norm"), self.eps)


class ProjectionQKNorm(NoQKNorm):
    """RMSNorm over the whole projections, Hq*Dh and Hkv*Dh weights (OLMo 2)."""

    scope = "projection"

    def on_projection(self, attention, q, k):
        return self._forward(attention, q, k)  # (B, L, Hq*Dh), (B, L, Hkv*Dh)

    def on_projection_backward(self, attention, dq, dk, saved):
        return self._backward(attention, dq, dk, saved)

    def on_projection_in_place(self, attention, q, k):
        # rms_norm_into is rms_norm_forward bit for bit, without the normalised copies a backward would read
        for x, name in ((q, "q_norm"), (k, "k_norm")):
            rms_norm_into(x, self._gain(attention, name), self.eps, x, np.empty(x.shape, x.dtype))


class RotatedHeadQKNorm(NoQKNorm):
    """RMSNorm of each head's Dh features after the rotation, one weight per feature shared by the heads
    (HunYuan)."""

    scope = "head_after_rotary"

    def on_rotated(self, attention, q, k, saved):
        return self._forward(attention, q, k)  # (B, Hq, L, Dh), (B, Hkv, L, Dh)

    def on_rotated_backward(self, attention, dq, dk, saved):
        return self._backward(attention, dq, dk, saved)


class UnitRotatedQKNorm(NoQKNorm):
    """RMSNorm of each head's Dh features after the rotation, without weights (Llama 4's ``use_qk_norm``, its
    "L2 norm": ``x / sqrt(mean(x^2) + eps)``)."""

    scope = "unit_after_rotary"

    def on_rotated(self, attention, q, k, saved):
        unit = np.ones(q.shape[-1], q.dtype)  # (Dh,): the norm's gain is one
        q, q_hat, q_rstd = rms_norm_forward(q, unit, self.eps)  # (B, Hq, L, Dh)
        k, k_hat, k_rstd = rms_norm_forward(k, unit, self.eps)  # (B, Hkv, L, Dh)
        return q, k, (q_hat, q_rstd, k_hat, k_rstd)

    def on_rotated_backward(self, attention, dq, dk, saved):
        q_hat, q_rstd, k_hat, k_rstd = saved
        unit = np.ones(dq.shape[-1], q_hat.dtype)  # (Dh,)
        dq, _ = rms_norm_backward(dq, q_hat, q_rstd, unit)  # (B, Hq, L, Dh)
        dk, _ = rms_norm_backward(dk, k_hat, k_rstd, unit)  # (B, Hkv, L, Dh)
        return dq, dk


QK_NORMS = {None: NoQKNorm, "head": HeadQKNorm, "projection": ProjectionQKNorm,
            "head_after_rotary": RotatedHeadQKNorm, "unit_after_rotary": UnitRotatedQKNorm}
"""The q/k normalisation of each ``AttentionConfig.qk_norm``: where in the projection it acts, chosen when the
layer is built."""


def causal_span(length: int, seq_k: int, positions: np.ndarray | None):
    """The mask of a full layer: each of the last ``length`` of ``seq_k`` positions sees itself and every earlier
    one."""
    return causal_lower_right(length, seq_k)


class WindowSpan:
    """The mask of a sliding-window layer: the last W keys, the query's own included."""

    def __init__(self, window: int) -> None:
        self.window = window

    def __call__(self, length: int, seq_k: int, positions: np.ndarray | None):
        return sliding_window_mask(self.window, offset=seq_k - length)


class ChunkSpan:
    """The mask of a chunked layer: the keys of the query's own chunk of C positions, up to itself."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def __call__(self, length: int, seq_k: int, positions: np.ndarray):
        return chunked_mask(self.chunk, offset=seq_k - length, positions=positions)


def slot_positions(attention_mask: np.ndarray | None, slots: np.ndarray) -> np.ndarray:
    """The position of the token in each of ``slots``: its row's count of real tokens before it (``cumsum(mask) -
    1``, clipped at 0 for the pads before the first), as the model's positions are made from the mask; the slot
    itself without a mask. (B, S) bool or None, (S',) int -> (B or 1, S') int64."""
    if attention_mask is None:
        return np.asarray(slots, dtype=np.int64)[None]  # (1, S')
    counts = np.cumsum(attention_mask, axis=1, dtype=np.int64) - 1  # (B, S)
    return np.maximum(counts[:, slots], 0)  # (B, S')


def no_positions(attention_mask: np.ndarray | None, slots: np.ndarray) -> None:
    """The positions of a layer that needs none (neither chunks nor a temperature): None."""
    return None


class NoQueryTemperature:
    """The queries as they are: the temperature of a layer without one."""

    def forward(self, q: np.ndarray, positions: np.ndarray | None):
        """(q, None)."""
        return q, None

    @staticmethod
    def backward(dq: np.ndarray, scales: None) -> np.ndarray:
        return dq


class QueryTemperature:
    """Llama 4's attention temperature on its layers without rotary: the query at position p is multiplied by
    ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``, which grows with the distance the layer must see
    across (https://arxiv.org/abs/2501.19399). A constant per position, so its backward scales the query's
    gradient alike.

    Parameters
    ----------
    floor_scale, attn_scale : float

    Examples
    --------
    >>> QueryTemperature(2.0, 0.5).scales(np.array([[0, 1, 5]]), np.float64).round(4).tolist()
    [[1.0, 1.3466, 1.6931]]
    """

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def scales(self, positions: np.ndarray, dtype) -> np.ndarray:
        """The factor of each query (B, L) from its position (B, L), computed in float64 and given in ``dtype``."""
        steps = np.floor((positions + 1.0) / self.floor_scale)  # (B, L)
        return (1.0 + self.attn_scale * np.log1p(steps)).astype(dtype)  # (B, L)

    def forward(self, q: np.ndarray, positions: np.ndarray):
        """(q (B, H, L, Dh) scaled per position, the scales (B, 1, L, 1) its backward multiplies by); ``positions``
        (B, S) end with the L queries'."""
        scales = self.scales(positions[:, positions.shape[1] - q.shape[2]:], q.dtype)[:, None, :, None]  # (B, 1, L, 1)
        return q * scales, scales

    @staticmethod
    def backward(dq: np.ndarray, scales: np.ndarray) -> np.ndarray:
        return dq * scales  # (B, H, L, Dh)


class GroupedQueryAttention(Module):
    """Causal self-attention with rotary queries/keys, Hkv <= Hq key/value heads and an optional window or chunk.

    Parameters
    ----------
    config : DecoderConfig
        Reads ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``attention`` (biases, scale,
        soft-cap, sinks), ``norm`` (the q/k norms' epsilon and offset) and this layer's window, chunk, q/k norm,
        query temperature and rotary (its :class:`~attnkit.models.layer_spec.LayerSpec`,
        ``config.layers[layer_index]``). A chunked layer's chunks and the temperature follow the tokens'
        positions, made from ``attention_mask`` as the model's are (``cumsum(mask) - 1``).
    layer_index : int
        Which layer this is (its window, and its entry in a :class:`~attnkit.decoding.cache.ModelCache`).
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (biases start at zero).

    Attributes
    ----------
    W_Q : (D, Hq*Dh), W_K : (D, Hkv*Dh), W_V : (D, Hkv*Dh), W_O : (Hq*Dh, D), stored for ``x @ W``;
    b_Q, b_K, b_V with ``attention_bias``; b_O with ``output_bias``; sinks (Hq,) with ``attention_sinks``.
    ``grads`` with the same names.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D) in ``x``'s float dtype.
    rotary : ``(cos, sin)`` each (B, L, R) from :class:`~attnkit.layers.rotary.RotaryEmbedding`, or None
    (no rotary, e.g. GPT-2's learned positions).
    attention_mask : (B, S) bool/0-1, ``True`` = real token, over the cache slots (past + new); None = all real.
    cache : :class:`~attnkit.decoding.cache.ModelCache`, optional. With a cache the new keys/values are appended and the
    queries attend to every kept slot; the cached path is for inference (no :meth:`backward`).

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=8, hidden_size=8, num_layers=1, num_heads=4,
    ...                     num_kv_heads=2, head_dim=2, mlp=MLPConfig(8))
    >>> attn = GroupedQueryAttention(cfg, 0, rng=0)
    >>> y = attn(np.ones((2, 3, 8)))
    >>> y.shape, attn.backward(np.ones_like(y)).shape, attn.W_K.shape
    ((2, 3, 8), (2, 3, 8), (8, 4))
    """

    def __init__(self, config, layer_index: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        if (isinstance(layer_index, bool) or not isinstance(layer_index, int)
                or not 0 <= layer_index < config.num_layers):
            raise ValueError(f"layer_index must be an integer in [0, {config.num_layers}), got {layer_index!r}")
        self.layer_index = layer_index
        spec = config.layers[layer_index]
        self.hidden_size, self.head_dim = config.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads = config.num_heads, spec.num_kv_heads
        self.num_groups = self.num_heads // self.num_kv_heads
        self.window = spec.window
        # a chunked layer's query sees its own chunk of positions (chunked_mask)
        self.chunk = spec.chunk
        # how far back a query sees for certain: a decoding step within it needs no mask (a chunk may start at the
        # query itself)
        self.reach = self.window or (1 if self.chunk else np.inf)
        # which keys a query may see, as a flex mask: the layer's one choice of mask
        self.span = ChunkSpan(self.chunk) if self.chunk else WindowSpan(self.window) if self.window else causal_span
        temperature = spec.query_temperature
        self.temperature = NoQueryTemperature() if temperature is None else QueryTemperature(*temperature)
        # chunks and the temperature follow the tokens' positions, made from the mask as the model's are
        self.positions = slot_positions if self.chunk is not None or temperature is not None else no_positions
        rotary = spec.rotary
        self.uses_rotary = rotary is not None
        self.interleaved = rotary is not None and rotary.interleaved
        gen = as_generator(rng)
        d, q_width, kv_width = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for name, shape in (("W_Q", (d, q_width)), ("W_K", (d, kv_width)), ("W_V", (d, kv_width)),
                            ("W_O", (q_width, d))):
            self.register_parameter(name, normal(gen, shape, std=0.02))
        if config.attention.bias:
            for name, size in (("b_Q", q_width), ("b_K", kv_width), ("b_V", kv_width)):
                self.register_parameter(name, np.zeros(size))
        if config.attention.output_bias:
            self.register_parameter("b_O", np.zeros(d))
        # the three projections side by side: one product makes q, k and v (one read per decoding step)
        self.fuse_parameters("W_QKV", ("W_Q", "W_K", "W_V"))
        if config.attention.bias:
            self.fuse_parameters("b_QKV", ("b_Q", "b_K", "b_V"))
        attention = config.attention
        self.scale = attention.scale  # None: head_dim ** -0.5
        # The layer's score modifier (Gemma 2's soft-cap) and sinks go through flex attention (exact gradients).
        self.score_mod = spec.score_mod
        self.has_sinks = attention.sinks
        self._sink_names = ("sinks",) if self.has_sinks else ()
        if self.has_sinks:
            self.register_parameter("sinks", normal(gen, (self.num_heads,), std=0.02))
        qk_norm = spec.qk_norm
        self.qk_norm = QK_NORMS[qk_norm](config.norm.eps, config.norm.offset)
        if qk_norm not in (None, "unit_after_rotary"):  # the unit norm has no weights
            whole = qk_norm == "projection"
            self.register_parameter("q_norm", np.ones(q_width if whole else self.head_dim))
            self.register_parameter("k_norm", np.ones(kv_width if whole else self.head_dim))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, window={self.window}, layer_index={self.layer_index}")

    FORWARD_ONLY_HOOKS = ("hook_pattern",)

    def hook_points(self) -> tuple[str, ...]:
        """``hook_q``, ``hook_k``, ``hook_v`` (B, L, H, Dh) after the projections and q/k norms (K and V: the
        Hkv key/value heads); ``hook_rot_q``, ``hook_rot_k`` after the rotation and a q/k norm that follows it
        (rotary layers only);
        ``hook_pattern`` (B, Hq, L, S) the attention weights (forward hooks only; asking for it runs the
        reference kernel); ``hook_z`` (B, L, Hq, Dh) each head's output as the output projection reads it
        (after the gate of a gated layer)."""
        rotated = ("hook_rot_q", "hook_rot_k") if self.uses_rotary else ()
        return ("hook_q", "hook_k", "hook_v", *rotated, "hook_pattern", "hook_z")

    # ------------------------------------------------------------------------------------------------
    def _heads(self, flat: np.ndarray, heads: int) -> np.ndarray:
        b, length = flat.shape[:2]
        return flat.reshape(b, length, heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, H, L, Dh)

    def _project(self, x: np.ndarray):
        """Query, key and value heads of ``x``, queries and keys normalised when ``qk_norm``; and what the
        norms' backward needs (None without them)."""
        p = self._parameters
        fused = self.fused_weight_and_bias("W_QKV", "b_QKV")
        if fused is not None:
            qkv = linear(x, *fused)  # (B, L, (Hq + 2 Hkv)*Dh)
            q_width, kv_width = p["W_Q"].shape[1], p["W_K"].shape[1]
            q, k = qkv[..., :q_width], qkv[..., q_width:q_width + kv_width]  # (B, L, Hq*Dh), (B, L, Hkv*Dh)
            v = self._heads(qkv[..., q_width + kv_width:], self.num_kv_heads)  # (B, Hkv, L, Dh)
        else:
            q = linear(x, p["W_Q"], p.get("b_Q"))  # (B, L, Hq*Dh)
            k = linear(x, p["W_K"], p.get("b_K"))  # (B, L, Hkv*Dh)
            v = self._heads(linear(x, p["W_V"], p.get("b_V")), self.num_kv_heads)  # (B, Hkv, L, Dh)
        q, k, normed = self.qk_norm.on_projection(self, q, k)  # (B, L, Hq*Dh), (B, L, Hkv*Dh)
        q, k = self._heads(q, self.num_heads), self._heads(k, self.num_kv_heads)  # (B, H, L, Dh)
        q, k, normed = self.qk_norm.on_heads(self, q, k, normed)  # (B, Hq, L, Dh), (B, Hkv, L, Dh)
        return q, k, v, normed

    def _check_mask(self, attention_mask, batch: int, seq_k: int) -> np.ndarray | None:
        mask = as_bool_mask(attention_mask, "attention_mask", allow_int=True)
        if mask is not None and mask.shape != (batch, seq_k):
            raise ValueError(f"GroupedQueryAttention: attention_mask must have shape (B, S) = ({batch}, {seq_k}) "
                             f"(past + new tokens), got {mask.shape}")
        return mask

    def forward(self, x: Any, *, rotary=None, attention_mask: Any = None, cache=None,
                output_attentions: bool = False):
        """Attend every new token to itself and the tokens before it; saves what :meth:`backward` needs.

        With ``output_attentions=True`` the reference kernel computes the scores and the result is
        ``(y, weights)``: weights (B, Hq, L, S), query head ``h * G + g`` (member g of key/value head h's
        group) in row ``h * G + g``, an array the caller owns (backward reads the kernel's own copy).
        """
        x = check_features(x, "x", self.hidden_size, "GroupedQueryAttention", "hidden_size")
        if x.ndim != 3:
            raise ValueError(f"GroupedQueryAttention: x must be (B, L, D), got shape {x.shape}")
        b, length, _ = x.shape
        q, k, v, normed = self._project(x)  # (B, Hq, L, Dh), (B, Hkv, L, Dh), (B, Hkv, L, Dh)
        hooked = self._hook_table is not None
        if hooked:
            q, k, v = (hook_heads(self, name, t) for name, t in (("hook_q", q), ("hook_k", k), ("hook_v", v)))
        if rotary is not None:
            cos, sin = rotary
            q = _rotary.rotary_apply(q, cos, sin, self.interleaved)  # (B, Hq, L, Dh)
            k = _rotary.rotary_apply(k, cos, sin, self.interleaved)  # (B, Hkv, L, Dh)
        q, k, normed = self.qk_norm.on_rotated(self, q, k, normed)  # (B, Hq, L, Dh), (B, Hkv, L, Dh)
        if rotary is not None and hooked:
            q, k = hook_heads(self, "hook_rot_q", q), hook_heads(self, "hook_rot_k", k)
        if cache is not None:
            kept = cache.update(self.layer_index, k, v)
            k, v = kept.keys, kept.values  # (B, Hkv, S, Dh)
            past = int(kept.slots[-1]) + 1  # slots filled after this update
            full_mask, slots = self._check_mask(attention_mask, b, past), kept.slots
            key_mask = None if full_mask is None else full_mask[:, slots]  # (B, S)
        else:
            full_mask = key_mask = self._check_mask(attention_mask, b, length)
            slots = np.arange(length)
        positions = self.positions(full_mask, slots)  # (B|1, S) or None
        q, scales = self.temperature.forward(q, positions)  # (B, Hq, L, Dh)
        out, weights, ctx = self._attend(q, k, v, key_mask, output_attentions, positions)  # (B, Hq, L, Dh)
        merged = out.reshape(b, self.num_heads, length, self.head_dim).transpose(0, 2, 1, 3)  # (B, L, Hq, Dh)
        merged, gate_saved = self._gate(x, merged)  # (B, L, Hq, Dh)
        if hooked:
            merged = self.hook_point("hook_z", merged)
        merged = merged.reshape(b, length, self.num_heads * self.head_dim)  # (B, L, Hq*Dh)
        y = linear(merged, self._parameters["W_O"], self._parameters.get("b_O"))  # (B, L, D)
        if cache is None:  # the cached path is inference: it keeps nothing
            self.save_for_backward(x, merged, gate_saved, ctx, rotary, normed, scales)
        else:
            self.save_for_backward()
        if not output_attentions:
            return y
        # The reference kernel returns its own copy of the weights (backward reads ctx's), so this is the caller's.
        return y, weights.reshape(b, self.num_heads, length, weights.shape[-1])  # (B, Hq, L, S)

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray | None,
                need_weights: bool, positions: np.ndarray | None = None):
        """Causal (windowed, padded) attention with the layer's score modifier and sinks, through
        :func:`attnkit.flex.flex_attention`: ``(out (B, Hq, L, Dh), weights (B, Hq, L, S) or None, ctx)``.

        The cache returns consecutive slots ending at the new tokens, so the mask's bottom-right causal
        alignment holds for cached steps too. ``positions`` (B|1, S): the keys' positions (a chunked layer's).
        The kernel is flex's ``"auto"`` (the reference kernel when the weights
        are needed or for one decoding step, the tiled FlashAttention kernel otherwise).
        """
        b, _, length, _ = q.shape
        seq_k = k.shape[2]
        if length == 1 and key_mask is None and self.reach >= seq_k:
            block_mask = None  # one query after every key it may see (a decoding step): nothing to hide
        else:
            mask = self.span(length, seq_k, positions)
            if key_mask is not None:
                mask = and_masks(mask, padding_mask(key_mask))
            block_mask = create_block_mask(mask, None if key_mask is None else b, None, length, seq_k)
        table = self._hook_table
        pattern_hooked = table is not None and "hook_pattern" in table.forward
        out, ctx = flex_attention(q, k, v, self.score_mod, block_mask, scale=self.scale, enable_gqa=True,
                                  sinks=self._parameters.get("sinks"),
                                  need_weights=need_weights or pattern_hooked)  # (B, Hq, L, Dh)
        if pattern_hooked:
            pattern = ctx.weights.reshape(b, self.num_heads, length, seq_k)  # (B, Hq, L, S)
            hooked = self.hook_point("hook_pattern", pattern)
            if "hook_pattern" in table.replaced:
                out, ctx = fixed_weights_forward(hooked, v, q.shape)  # (B, Hq, L, Dh)
                return out, (hooked.copy() if need_weights else None), ctx
        weights = None if ctx.weights is None or not need_weights else ctx.weights.copy()  # (B, Hq, L, S)
        return out, weights, ctx

    def new_cache(self, batch_size: int, max_length: int | None = None, *, dtype: Any = None,
                  rollback: int = 0) -> KeysValues:
        """This layer's entry of a model's cache: its keys and values, a ring of its window (or chunk) plus
        ``rollback`` slots when it has one (:class:`~attnkit.decoding.cache.KeysValues`), in ``dtype`` (default:
        the parameters')."""
        dtype = self._parameters["W_O"].dtype if dtype is None else dtype
        return KeysValues(batch_size, self.num_kv_heads, self.head_dim, dtype, max_length=max_length,
                          window=self.window or self.chunk, rollback=rollback, layer=self.layer_index)

    def step(self, x: np.ndarray, *, rotary=None, attention_mask: np.ndarray | None = None, cache=None) -> np.ndarray:
        """One decoding step: :meth:`forward` of one new token per row with a cache, (B, D) -> (B, D).

        The same parts in the same order (one q/k/v product, the q/k norms, the rotation, the cache, the
        attention with the layer's window, score modifier and sinks, the gate of a gated layer, W_O), on
        (B, D) rows, with the registry's ``"one_query"`` kernel; nothing is saved (a step is inference).
        ``rotary`` is (cos, sin) each (B, 1, R); ``attention_mask`` (B, S) over every slot, or None.
        """
        b = x.shape[0]
        q, k, v, qk = self._project_step(x)  # (B, Hq, 1, Dh), (B, Hkv, 1, Dh), (B, Hkv, 1, Dh)
        if rotary is not None:  # q and k are the step's own arrays: rotated where they are
            if qk is not None:  # side by side in the projection: one rotation turns both
                _rotary.rotary_apply_in_place(qk, *rotary, self.interleaved)  # (B, Hq + Hkv, 1, Dh)
            else:
                _rotary.rotary_apply_in_place(q, *rotary, self.interleaved)  # (B, Hq, 1, Dh)
                _rotary.rotary_apply_in_place(k, *rotary, self.interleaved)  # (B, Hkv, 1, Dh)
        q, k, _ = self.qk_norm.on_rotated(self, q, k, None)  # (B, Hq, 1, Dh), (B, Hkv, 1, Dh)
        kept = cache.update(self.layer_index, k, v)  # keys, values (B, Hkv, S, Dh)
        if attention_mask is None and self.positions is no_positions:  # a plain layer: nothing hides a key
            heads = self._attend_step(q, kept.keys, kept.values, None)  # (B, Hq, Dh)
        else:
            key_mask = None if attention_mask is None else attention_mask[:, kept.slots]  # (B, S)
            positions = self.positions(attention_mask, kept.slots)  # (B|1, S) or None
            q, _ = self.temperature.forward(q, positions)  # (B, Hq, 1, Dh)
            if self.chunk:  # the keys of the query's own chunk
                same = positions // self.chunk == positions[:, -1:] // self.chunk  # (B|1, S)
                key_mask = same if key_mask is None else key_mask & same  # (B, S)
            heads = self._attend_step(q, kept.keys, kept.values, key_mask)  # (B, Hq, Dh)
        heads = self._gate(x[:, None], heads[:, None])[0][:, 0]  # (B, Hq, Dh)
        p = self._parameters
        return linear(heads.reshape(b, -1), p["W_O"], p.get("b_O"))  # (B, D)

    def _project_step(self, x: np.ndarray):
        """:meth:`_project` of one position per row: query, key and value heads (B, H, 1, Dh), q/k normalised,
        each an array of the step's own (views of its fresh projection or the norm's output); and the query and
        key heads side by side as one view (B, Hq + Hkv, 1, Dh) where they are (the fused projection), else
        None: one rotation then turns both."""
        p = self._parameters
        fused = self.fused_weight_and_bias("W_QKV", "b_QKV")
        b, hq, hkv, dh = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if fused is not None:
            qkv = linear(x, *fused)  # (B, (Hq + 2 Hkv)*Dh)
            self.qk_norm.on_projection_in_place(self, qkv[:, :hq * dh], qkv[:, hq * dh:(hq + hkv) * dh])
            qk = qkv[:, :(hq + hkv) * dh].reshape(b, hq + hkv, 1, dh)  # (B, Hq + Hkv, 1, Dh), a view
            self.qk_norm.on_heads_in_place(self, qk, hq)
            v = qkv[:, (hq + hkv) * dh:].reshape(b, hkv, 1, dh)  # (B, Hkv, 1, Dh)
            return qk[:, :hq], qk[:, hq:], v, qk
        q, k, v = (linear(x, p[f"W_{n}"], p.get(f"b_{n}")) for n in "QKV")  # (B, H*Dh) each
        q, k, _ = self.qk_norm.on_projection(self, q, k)  # (B, Hq*Dh), (B, Hkv*Dh)
        q = q.reshape(b, hq, 1, dh)  # (B, Hq, 1, Dh)
        k = k.reshape(b, hkv, 1, dh)  # (B, Hkv, 1, Dh)
        q, k, _ = self.qk_norm.on_heads(self, q, k, None)  # (B, Hq, 1, Dh), (B, Hkv, 1, Dh)
        return q, k, v.reshape(b, hkv, 1, dh), None

    def _attend_step(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                     key_mask: np.ndarray | None) -> np.ndarray:
        """One query per row and head (B, Hq, 1, Dh) over the keys and values (B, Hkv, S, Dh) with the layer's
        window, score modifier and sinks: the heads' outputs (B, Hq, Dh)."""
        b, hkv = keys.shape[:2]
        grouped = q.reshape(b, hkv, self.num_heads // hkv, q.shape[-1])  # (B, Hkv, G, Dh)
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S)
        out, _, _ = ONE_QUERY.forward(grouped, keys, values, mask=mask, scale=self.scale, window=self.window,
                                      score_mod=self.score_mod, sinks=self._parameters.get("sinks"))  # (B, Hkv, G, Dh)
        return out.reshape(b, self.num_heads, -1)  # (B, Hq, Dh)

    def backward(self, grad_output: Any) -> np.ndarray:
        """Add the parameter gradients into ``self.grads``; return ``grad_x`` (B, L, D) (uncached path only)."""
        if self.saved_tensors is None:
            raise RuntimeError("GroupedQueryAttention.backward needs a forward without a cache just before it")
        x, merged, gate_saved, ctx, rotary, normed, scales = self.saved_tensors
        b, length, _ = x.shape
        g = check_grad_output(grad_output, x.shape, x.dtype, "GroupedQueryAttention")
        p = self._parameters
        wanted = self.grads.wanted
        grad_merged, grad_w, grad_b = linear_backward(g, merged, p["W_O"], "b_O" in p, wanted)  # (B, L, Hq*Dh)
        self._accumulate("O", grad_w, grad_b)
        grad_out = grad_merged.reshape(b, length, self.num_heads, self.head_dim)  # (B, L, Hq, Dh)
        hooked = self._hook_table is not None
        if hooked:
            grad_out = self.hook_backward("hook_z", grad_out)
        grad_out, grad_x = self._gate_backward(grad_out, x, gate_saved)  # (B, L, Hq, Dh), (B, L, D)
        grad_out = grad_out.transpose(0, 2, 1, 3)  # (B, Hq, L, Dh)
        if isinstance(ctx, FixedWeights):
            dq, dk, dv = fixed_weights_backward(grad_out, ctx)  # (B, H, L, Dh)
        else:
            dq, dk, dv, *dsinks = flex_attention_backward(np.ascontiguousarray(grad_out), ctx)  # (B, H, L, Dh)
            for name, grad in zip(self._sink_names, dsinks):
                self.grads[name] += grad
        dq = self.temperature.backward(dq, scales)  # (B, Hq, L, Dh)
        if rotary is not None and hooked:
            dq, dk = hook_heads_backward(self, "hook_rot_q", dq), hook_heads_backward(self, "hook_rot_k", dk)
        dq, dk = self.qk_norm.on_rotated_backward(self, dq, dk, normed)  # (B, Hq, L, Dh), (B, Hkv, L, Dh)
        if rotary is not None:
            cos, sin = rotary
            dq = _rotary.rotary_backward(dq, cos, sin, self.interleaved)  # (B, Hq, L, Dh)
            dk = _rotary.rotary_backward(dk, cos, sin, self.interleaved)  # (B, Hkv, L, Dh)
        if hooked:
            dq, dk, dv = (hook_heads_backward(self, name, d) for name, d in (("hook_q", dq), ("hook_k", dk),
                                                                             ("hook_v", dv)))
        dq, dk = self.qk_norm.on_heads_backward(self, dq, dk, normed)  # (B, Hq, L, Dh), (B, Hkv, L, Dh)
        dq, dk, dv = (d.transpose(0, 2, 1, 3).reshape(b, length, -1) for d in (dq, dk, dv))  # (B, L, H*Dh)
        dq, dk = self.qk_norm.on_projection_backward(self, dq, dk, normed)  # (B, L, Hq*Dh), (B, L, Hkv*Dh)
        for name, flat in (("Q", dq), ("K", dk), ("V", dv)):
            gx, grad_w, grad_b = linear_backward(flat, x, p[f"W_{name}"], f"b_{name}" in p, wanted)  # (B, L, D)
            self._accumulate(name, grad_w, grad_b)
            grad_x += gx
        return grad_x

    def _gate(self, x: np.ndarray, heads: np.ndarray):
        """What each head's output (B, L, Hq, Dh) becomes before ``W_O``: itself here (a gated layer scales it);
        returns it and what :meth:`_gate_backward` needs."""
        return heads, None

    def _gate_backward(self, grad: np.ndarray, x: np.ndarray, saved):
        """Gradients of :meth:`_gate`: the heads' outputs' (B, L, Hq, Dh) and a fresh ``grad_x`` (B, L, D) the
        projections' gradients are added to (zeros here: x reaches the output only through the heads)."""
        return grad, np.zeros_like(x)

    def _accumulate(self, name: str, grad_w: np.ndarray | None, grad_b: np.ndarray | None) -> None:
        self.grads.add(f"W_{name}", grad_w)
        self.grads.add(f"b_{name}", grad_b)

"""``DecodeStep``: one decoding step of a :class:`~attnkit.models.causal_lm.CausalLM` in buffers kept between steps.

Dimension letters: B rows, D ``hidden_size``, Hq/Hkv query/key-value heads, G = Hq / Hkv, Dh ``head_dim``,
F ``intermediate_size``, V ``vocab_size``, S cached slots.

A step feeds one new token per row through every layer with a KV cache. At batch 1 its products (four per
layer and the head) are matrix-vector products bound by reading the weights; the rest (norms, rotary, the cache
write, the attention of one query, the activation, residual adds) is a few thousand numbers per layer, where
the general path's module calls, checks and fresh arrays cost more than the arithmetic. This path runs the same
parts of the same model, in the same order, with the in-place kernels of :mod:`attnkit.kernels.decode_step`
and products written into preallocated buffers: a handful of NumPy calls per layer beyond its products.

It serves the layers it knows, and says so (:func:`decode_step_for`): pre-norm blocks with sequential
residuals, RMSNorm, full causal grouped-query attention with rotary positions or none (biases allowed; no q/k
norm, window, score modifier or sinks), the gated MLP (SiLU in place, other activations through
:func:`~attnkit.kernels.activations.activation_forward`); rows without padding; no hooks installed. Any other
model or step takes :meth:`CausalLM.forward`'s general path, which stays the reference: the tests check that
both give the same greedy tokens and logits to float32 rounding.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..attention.grouped_query import GroupedQueryAttention
from ..kernels._threads import blas_on_free_cores, one_row_blas
from ..kernels.activations import activation_forward
from ..kernels.decode_step import one_query_attention, rms_norm_into, silu_gate_into
from ..kernels.rotary import rotary_apply
from ..layers.gated_mlp import GatedMLP
from ..layers.identity import Identity
from ..layers.lm_block import LMBlock
from ..layers.rms_norm import RMSNorm

__all__ = ["DecodeStep", "decode_step_for"]


def _layer_supported(layer: Any) -> bool:
    if type(layer) is not LMBlock:  # sequential residuals (not ParallelLMBlock, not a subclass with more parts)
        return False
    if not (isinstance(layer.attn_norm, RMSNorm) and isinstance(layer.mlp_norm, RMSNorm)):
        return False
    if not (isinstance(layer.attn_post_norm, Identity) and isinstance(layer.mlp_post_norm, Identity)):
        return False
    attention, mlp = layer.attention, layer.mlp
    return (type(attention) is GroupedQueryAttention and attention.window is None and attention.score_mod is None
            and not attention.has_sinks and attention.qk_norm.scope is None and type(mlp) is GatedMLP)


def decode_step_for(lm: Any) -> DecodeStep | None:
    """The :class:`DecodeStep` of ``lm``, or None when one of its layers is of a kind this path does not serve."""
    config = lm.config
    if lm.rotary is None or lm.sliding_rotary is not None or not isinstance(lm.norm, RMSNorm):
        return None
    if not all(_layer_supported(layer) for layer in lm.layers) or config.hidden_size != lm.head_weight.shape[1]:
        return None
    return DecodeStep(lm)


class _Buffers:
    """The arrays one step writes into, for B rows in one dtype (made once, reused by every later step)."""

    def __init__(self, lm: Any, rows: int, dtype: np.dtype) -> None:
        c = lm.config
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        f = c.intermediate_size
        self.normed, self.scratch = np.empty((rows, c.hidden_size), dtype), np.empty((rows, c.hidden_size), dtype)
        self.branch = np.empty((rows, c.hidden_size), dtype)  # (B, D): what a branch adds to the residual
        self.qkv = np.empty((rows, q_width + 2 * kv_width), dtype)  # (B, (Hq + 2 Hkv) Dh)
        self.heads = np.empty((rows, c.num_kv_heads, c.num_groups, c.head_dim), dtype)  # (B, Hkv, G, Dh)
        self.gate_up = np.empty((rows, 2 * f), dtype)  # (B, 2F)
        self.hidden = np.empty((rows, f), dtype)  # (B, F)


class DecodeStep:
    """One token per row through ``lm`` with a cache, in place (see the module docstring for what it serves).

    Parameters
    ----------
    lm : CausalLM
        Its parameters are read at every step (training or loading between steps is seen).

    Shapes
    ------
    ``step(ids, positions, cache)``: ids (B, 1) int, positions (B, 1) int -> logits (B, 1, V) in the model's dtype.
    """

    def __init__(self, lm: Any) -> None:
        self.lm = lm
        self._buffers: dict[tuple[int, np.dtype], _Buffers] = {}
        self._modules = [module for _, module in lm.named_modules()]  # the structure is fixed once built

    def hooked(self) -> bool:
        """Whether a hook is installed anywhere in the model (then the general path runs, which calls them)."""
        return any(module.__dict__.get("_hook_table") is not None for module in self._modules)

    def _buffers_for(self, rows: int, dtype: np.dtype) -> _Buffers:
        key = (rows, np.dtype(dtype))
        if key not in self._buffers:
            self._buffers = {key: _Buffers(self.lm, rows, dtype)}  # one batch size at a time: no hoard
        return self._buffers[key]

    def step(self, ids: np.ndarray, positions: np.ndarray, cache: Any) -> np.ndarray:
        """Logits (B, 1, V) of the token after ``ids`` (B, 1); appends every layer's key and value to ``cache``."""
        lm = self.lm
        h = lm.embed.weight[ids[:, 0]].astype(lm.dtype, copy=True)  # (B, D): the residual stream, updated in place
        if lm.config.embedding_scale != 1.0:
            h *= h.dtype.type(lm.config.embedding_scale)
        cos, sin = lm.rotary(positions, dtype=h.dtype)  # (B, 1, R) each
        buffers = self._buffers_for(h.shape[0], h.dtype)
        with one_row_blas() if h.shape[0] == 1 else blas_on_free_cores():
            for index, layer in enumerate(lm.layers):
                self._attention(index, layer, h, cos, sin, cache, buffers)
                self._mlp(layer, h, buffers)
        norm = lm.norm
        rms_norm_into(h, norm._gain(), norm.eps, buffers.normed, buffers.scratch)
        weight = lm.head_weight.astype(h.dtype, copy=False)
        with blas_on_free_cores():
            logits = buffers.normed @ weight.T  # (B, V)
        cap = lm.config.final_logit_softcap
        if cap is not None:
            logits /= cap
            np.tanh(logits, out=logits)
            logits *= cap
        return logits[:, None]  # (B, 1, V)

    def _attention(self, index: int, layer: Any, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache: Any,
                   buffers: _Buffers) -> None:
        """``h += W_O attention(rotary(W_QKV attn_norm(h)))``, the new key and value appended to ``cache``."""
        attention, norm = layer.attention, layer.attn_norm
        rms_norm_into(h, norm._gain(), norm.eps, buffers.normed, buffers.scratch)
        p = attention._parameters
        fused = attention.fused_weight_and_bias("W_QKV", "b_QKV")
        weight, bias = fused if fused is not None else (np.concatenate([p["W_Q"], p["W_K"], p["W_V"]], axis=1),
                                                        None if "b_Q" not in p else
                                                        np.concatenate([p["b_Q"], p["b_K"], p["b_V"]]))
        qkv = np.matmul(buffers.normed, weight, out=buffers.qkv)  # (B, (Hq + 2 Hkv) Dh)
        if bias is not None:
            qkv += bias
        rows, hkv, group, dh = buffers.heads.shape
        q_width, kv_width = hkv * group * dh, hkv * dh
        q = qkv[:, :q_width].reshape(rows, hkv * group, 1, dh)  # (B, Hq, 1, Dh)
        k = qkv[:, q_width:q_width + kv_width].reshape(rows, hkv, 1, dh)  # (B, Hkv, 1, Dh)
        v = qkv[:, q_width + kv_width:].reshape(rows, hkv, 1, dh)  # (B, Hkv, 1, Dh)
        if attention.uses_rotary:
            q = rotary_apply(q, cos, sin, attention.interleaved)  # (B, Hq, 1, Dh)
            k = rotary_apply(k, cos, sin, attention.interleaved)  # (B, Hkv, 1, Dh)
        kept = cache.update(index, k, v)  # keys, values (B, Hkv, S, Dh)
        scale = dh ** -0.5 if attention.scale is None else float(attention.scale)
        out = one_query_attention(q.reshape(rows, hkv, group, dh), kept.keys, kept.values, scale,
                                  buffers.heads)  # (B, Hkv, G, Dh)
        np.matmul(out.reshape(rows, q_width), p["W_O"], out=buffers.branch)  # (B, D)
        if "b_O" in p:
            buffers.branch += p["b_O"]
        h += buffers.branch

    def _mlp(self, layer: Any, h: np.ndarray, buffers: _Buffers) -> None:
        """``h += W_down (silu(W_gate x) * W_up x)`` with ``x = mlp_norm(h)``."""
        mlp, norm = layer.mlp, layer.mlp_norm
        rms_norm_into(h, norm._gain(), norm.eps, buffers.normed, buffers.scratch)
        p = mlp._parameters
        fused = mlp.fused_weight_and_bias("W_gate_up", "b_gate_up")
        weight, bias = fused if fused is not None else (np.concatenate([p["W_gate"], p["W_up"]], axis=1),
                                                        None if "b_gate" not in p else
                                                        np.concatenate([p["b_gate"], p["b_up"]]))
        np.matmul(buffers.normed, weight, out=buffers.gate_up)  # (B, 2F)
        if bias is not None:
            buffers.gate_up += bias
        width = buffers.hidden.shape[1]
        if mlp.activation == "silu":
            silu_gate_into(buffers.gate_up, width, buffers.hidden)  # (B, F)
        else:
            np.multiply(activation_forward(buffers.gate_up[:, :width], mlp.activation), buffers.gate_up[:, width:],
                        out=buffers.hidden)  # (B, F)
        np.matmul(buffers.hidden, p["W_down"], out=buffers.branch)  # (B, D)
        if "b_down" in p:
            buffers.branch += p["b_down"]
        h += buffers.branch

"""``MultiHeadAttention``: projections, any pluggable head, and the output projection.

Dimension letters: B batch, Lq/Lk query/key length, E embed_dim (= d_model), H heads, Dh = E // H,
Ek/Ev key/value input features (kdim/vdim, default E).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._aliases import alias_property, resolve
from .._validation import (
    as_float_array,
    check_head_size,
    check_mha_mask,
    check_ndim,
    check_positive_int,
    common_float_dtype,
    returns_input_precision,
)
from ..core.base_attention import BaseAttention
from ..core.converters import torch_converter
from ..core.hooks import hook_heads, hook_heads_backward
from ..core.module import Module
from ..init import as_generator, xavier_uniform
from ..kernels.fixed_weights import fixed_weights_backward, fixed_weights_forward
from ..kernels.heads import merge_heads, split_heads
from ..kernels.linear import linear, linear_backward
from .scaled_dot_product import ScaledDotProductAttention

__all__ = ["MultiHeadAttention"]


def _check_padding(key_padding_mask: Any, shape: tuple[int, int], expected: str) -> np.ndarray | None:
    """``key_padding_mask`` as a boolean array of ``shape`` (``True`` = real token), or None."""
    if key_padding_mask is None:
        return None
    kpm = np.asarray(key_padding_mask)
    if kpm.dtype != np.bool_:
        raise TypeError(f"key_padding_mask must be boolean (True = real token), got dtype {kpm.dtype}")
    if kpm.shape != tuple(shape):
        raise ValueError(f"key_padding_mask has shape {kpm.shape}, expected {expected} = {tuple(shape)}")
    return kpm


class MultiHeadAttention(Module):
    """Multi-head attention: ``Concat(head_1, ..., head_H) W_O`` with ``head_i = Attention(q W_Q^i, k W_K^i, v W_V^i)``.

    Weights are applied as ``x @ W`` (``W_Q`` is (Ek... , E)), unlike ``torch.nn.Linear`` which stores the
    transpose: to copy from ``torch.nn.MultiheadAttention`` use ``W_Q = in_proj_weight[:E].T``.

    Parameters
    ----------
    embed_dim : int
        Model dimension E, also accepted as ``d_model=`` (the positional form
        ``MultiHeadAttention(d_model, num_heads)`` is the same call). A positive multiple of ``num_heads``.
    num_heads : int
        Number of heads H; each has ``Dh = E // H`` features.
    attention : BaseAttention, optional
        The head computation, applied to all heads at once on (B, H, L, Dh) arrays. Default
        :class:`ScaledDotProductAttention` with the given ``dropout``.
    dropout : float, default 0.0
        Dropout on the attention weights of the default head (training mode only).
    bias : bool, default False
        Add biases ``b_Q, b_K, b_V, b_O`` to the four projections.
    kdim, vdim : int, optional
        Feature sizes of the key and value inputs (default E).
    rng : numpy.random.Generator or int, optional
        Source of the Glorot-uniform initial weights (biases start at zero) and of the default head's
        dropout seed.
    layer_index : int, default 0
        This module's entry in a decoding cache (see ``cache`` in :meth:`forward`).

    Attributes
    ----------
    W_Q : (E, E), W_K : (Ek, E), W_V : (Ev, E), W_O : (E, E), and b_Q, b_K, b_V, b_O : (E,) when ``bias``.
    grads : dict with the same names, filled by :meth:`backward`.
    embed_dim (alias d_model), num_heads, d_k (alias head_dim) = Dh, kdim, vdim, attention.
    Aliases resolve in :mod:`attnkit._aliases`; ``docs/names.md`` lists them.

    Shapes
    ------
    query (B, Lq, E), key (B, Lk, Ek), value (B, Lk, Ev) -> output (B, Lq, E) and weights (B, H, Lq, Lk),
    in the inputs' float dtype. Masks are boolean, ``True`` = may attend (see :meth:`forward`).

    Examples
    --------
    >>> mha = MultiHeadAttention(8, 2, rng=0)
    >>> x = np.random.default_rng(0).normal(size=(3, 5, 8))
    >>> out, w = mha(x, x, x, attn_mask=np.tril(np.ones((5, 5), bool)))
    >>> out.shape, w.shape
    ((3, 5, 8), (3, 2, 5, 5))
    >>> grad_q, grad_k, grad_v = mha.backward(np.ones_like(out))
    >>> sorted(mha.grads)
    ['W_K', 'W_O', 'W_Q', 'W_V']
    """

    def __init__(self, embed_dim: int | None = None, num_heads: int | None = None,
                 attention: BaseAttention | None = None, dropout: float = 0.0, bias: bool = False,
                 kdim: int | None = None, vdim: int | None = None, *, d_model: int | None = None,
                 rng: np.random.Generator | int | None = None, layer_index: int = 0) -> None:
        super().__init__()
        embed_dim = resolve("MultiHeadAttention", "embed_dim", embed_dim, "d_model", d_model)
        if embed_dim is None or num_heads is None:
            raise TypeError("MultiHeadAttention needs embed_dim (or d_model) and num_heads")
        embed_dim = check_positive_int(embed_dim, "embed_dim")
        num_heads = check_positive_int(num_heads, "num_heads")
        head_size = check_head_size(embed_dim, num_heads, "embed_dim (d_model)")
        kdim = embed_dim if kdim is None else check_positive_int(kdim, "kdim")
        vdim = embed_dim if vdim is None else check_positive_int(vdim, "vdim")
        gen = as_generator(rng)
        if attention is None:
            # The dropout stream is seeded from rng too, so a seeded layer is reproducible end to end.
            attention = ScaledDotProductAttention(dropout=dropout, seed=int(gen.integers(2**63)) if dropout else None)
        elif not isinstance(attention, BaseAttention):
            raise TypeError(f"attention must be a BaseAttention instance, got {type(attention).__name__}")
        elif dropout:
            raise ValueError("dropout applies to the default head only; configure the dropout of the given "
                             "attention head")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.d_k = head_size
        self.kdim, self.vdim = kdim, vdim
        self.bias = bool(bias)
        self.attention = attention
        self.layer_index = check_positive_int(layer_index, "layer_index", allow_zero=True)
        for name, fan_in in (("W_Q", embed_dim), ("W_K", kdim), ("W_V", vdim), ("W_O", embed_dim)):
            self.register_parameter(name, xavier_uniform(gen, fan_in, embed_dim))
        if self.bias:
            for name in ("b_Q", "b_K", "b_V", "b_O"):
                self.register_parameter(name, np.zeros(embed_dim))
        self.save_for_backward()

    d_model = alias_property("MultiHeadAttention", "d_model")
    head_dim = alias_property("MultiHeadAttention", "head_dim")

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, bias={self.bias}, kdim={self.kdim}, "
                f"vdim={self.vdim}")

    def get_params(self) -> dict[str, np.ndarray]:
        """Copies of all parameters by name (``W_Q, W_K, W_V, W_O``, biases, and the head's as ``attention.*``)."""
        return self.state_dict()

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Copy in any subset of the parameters named as in :meth:`get_params` (shapes are checked)."""
        self.load_state_dict(params, strict=False)

    FORWARD_ONLY_HOOKS = ("hook_pattern",)

    def hook_points(self) -> tuple[str, ...]:
        """``hook_q``, ``hook_k``, ``hook_v`` (B, L, H, Dh) after the projections; ``hook_pattern`` (B, H, Lq, Lk)
        the head's weights (forward hooks only; asking for it makes the head form them); ``hook_z``
        (B, Lq, H, Dh) each head's output before the output projection."""
        return ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")

    def _attend(self, q, k, v, head_mask, is_causal: bool, need_weights: bool, hook_kv: bool = True):
        """The head on (B, H, L, Dh) queries, keys and values, through the hooks when there are any:
        ``(heads (B, H, Lq, Dh), weights or None, the fixed weights' context or None)``. ``hook_kv=False``: the
        keys and values went through their hooks before they were cached."""
        table = self._hook_table
        if table is None:
            heads, weights = self.attention.forward(q, k, v, head_mask, is_causal=is_causal,
                                                    need_weights=need_weights)  # (B, H, Lq, Dh)
            return heads, weights, None
        q = hook_heads(self, "hook_q", q)
        if hook_kv:
            k, v = hook_heads(self, "hook_k", k), hook_heads(self, "hook_v", v)
        pattern_hooked = "hook_pattern" in table.forward
        heads, weights = self.attention.forward(q, k, v, head_mask, is_causal=is_causal,
                                                need_weights=need_weights or pattern_hooked)  # (B, H, Lq, Dh)
        fixed = None
        if pattern_hooked:
            pattern = self.hook_point("hook_pattern", weights)
            if "hook_pattern" in table.replaced:
                heads, fixed = fixed_weights_forward(pattern, v, q.shape)  # (B, H, Lq, Dh)
                weights = pattern.copy()
        heads = hook_heads(self, "hook_z", heads)
        return heads, (weights if need_weights else None), fixed

    def _b(self, name: str) -> np.ndarray | None:
        return self._parameters[name] if self.bias else None

    def _heads(self, which: str, x: np.ndarray) -> np.ndarray:
        """Projection ``W_<which>`` of ``x`` (B, L, E), split into heads (B, H, L, Dh)."""
        return split_heads(linear(x, self._parameters["W_" + which], self._b("b_" + which)), self.num_heads)

    @returns_input_precision
    def forward(self, query: np.ndarray, key: np.ndarray, value: np.ndarray, attn_mask: np.ndarray | None = None,
                key_padding_mask: np.ndarray | None = None, need_weights: bool = True, is_causal: bool = False,
                *, mask: np.ndarray | None = None, cache: Any = None):
        """Attend from ``query`` to ``key``/``value``.

        Parameters
        ----------
        query : ndarray, shape (B, Lq, E)
        key : ndarray, shape (B, Lk, Ek)
        value : ndarray, shape (B, Lk, Ev)
        attn_mask : ndarray of bool, optional
            ``True`` = may attend (the opposite of torch's boolean ``attn_mask``). Shape (Lq, Lk), (Lk,) or
            4-D broadcastable to (B, H, Lq, Lk); 3-D masks are refused as ambiguous. ``mask=`` is an alias.
        key_padding_mask : ndarray of bool, shape (B, Lk), optional
            ``True`` = real token, ``False`` = padding (again the opposite of torch). Padded keys and values
            are ignored entirely, even if they hold NaN or Inf.
        need_weights : bool, default True
            Return the per-head weights; with ``False`` returns ``None`` for them.
        is_causal : bool, default False
            Add the bottom-right-aligned causal mask (query i sees keys ``j <= i + Lk - Lq``).
        cache : optional
            Inference only (no :meth:`backward` after): a decoding cache that keeps keys and values between
            steps, under ``layer_index``. With a :class:`~attnkit.decoding.cache.KVCache` (self-attention),
            ``key``/``value`` are the new positions' inputs, their keys and values are appended, and the
            queries attend to every slot the cache returns (``is_causal``: to the slots up to their own). With a
            :class:`~attnkit.decoding.cache.CrossAttentionCache`, the memory given as ``key``/``value`` is
            projected on the first call only. Masks then cover the keys the cache returns (S of them):
            ``attn_mask`` broadcastable to (B, H, Lq, S), ``key_padding_mask`` (B, S).

        Returns
        -------
        output : ndarray, shape (B, Lq, E)
        weights : ndarray, shape (B, H, Lq, Lk), or None
            Queries that may attend to no key get zero weights and a zero head output.
        """
        attn_mask = resolve("MultiHeadAttention.forward", "attn_mask", attn_mask, "mask", mask)
        if cache is not None:
            return self._forward_cached(query, key, value, attn_mask, key_padding_mask, need_weights, is_causal,
                                        cache)
        query, key, value, kpm = self._check_inputs(query, key, value, key_padding_mask)
        batch, seq_q, _ = query.shape
        seq_k = key.shape[1]
        attn_mask = check_mha_mask(attn_mask, "attn_mask", batch, self.num_heads, seq_q, seq_k)
        head_mask = attn_mask
        if kpm is not None:
            pad = kpm[:, None, None, :]  # (B, 1, 1, Lk)
            head_mask = pad if head_mask is None else (head_mask & pad)
            # Padding garbage (NaN/Inf) must not reach any output or gradient: zero it before projecting.
            key = np.where(kpm[..., None], key, 0).astype(key.dtype, copy=False)  # (B, Lk, Ek)
            value = np.where(kpm[..., None], value, 0).astype(value.dtype, copy=False)  # (B, Lk, Ev)
        q, k, v = self._heads("Q", query), self._heads("K", key), self._heads("V", value)  # (B, H, L, Dh) each
        heads, weights, fixed = self._attend(q, k, v, head_mask, is_causal, need_weights)  # (B, H, Lq, Dh)
        merged = merge_heads(heads)  # (B, Lq, E)
        out = linear(merged, self.W_O, self._b("b_O"))  # (B, Lq, E)
        self.save_for_backward(query, key, value, merged, kpm, fixed)
        return out, weights

    def _forward_cached(self, query, key, value, attn_mask, key_padding_mask, need_weights, is_causal, cache):
        """:meth:`forward` through a decoding cache: project only what the cache does not hold yet."""
        query, key, value, _ = self._check_inputs(query, key, value, None)
        batch, seq_q, _ = query.shape
        kept = cache.stored(self.layer_index)
        if kept is None:
            new_k, new_v = self._heads("K", key), self._heads("V", value)  # (B, H, Lk, Dh)
            if self._hook_table is not None:  # hooked once, as they enter the cache (the new positions only)
                new_k, new_v = hook_heads(self, "hook_k", new_k), hook_heads(self, "hook_v", new_v)
            kept = cache.update(self.layer_index, new_k, new_v)
        keys, values, slots = kept  # (B, H, S, Dh), (B, H, S, Dh), (S,)
        seq_k = keys.shape[-2]
        head_mask = check_mha_mask(attn_mask, "attn_mask", batch, self.num_heads, seq_q, seq_k)
        kpm = _check_padding(key_padding_mask, (batch, seq_k), "(batch, cached keys)")
        if kpm is not None:
            pad = kpm[:, None, None, :]  # (B, 1, 1, S)
            head_mask = pad if head_mask is None else (head_mask & pad)
        if is_causal:
            causal = slots[None, :] <= slots[-seq_q:, None]  # (Lq, S): the queries are the newest slots
            head_mask = causal if head_mask is None else (head_mask & causal)
        q = self._heads("Q", query)  # (B, H, Lq, Dh)
        heads, weights, _ = self._attend(q, keys.astype(q.dtype, copy=False), values.astype(q.dtype, copy=False),
                                         head_mask, False, need_weights, hook_kv=False)  # (B, H, Lq, Dh)
        self.save_for_backward()  # the cached path is inference: nothing for backward
        return linear(merge_heads(heads), self.W_O, self._b("b_O")), weights  # (B, Lq, E)

    @returns_input_precision
    def backward(self, grad_output: np.ndarray):
        """Backpropagate ``grad_output`` (B, Lq, E) through the last forward.

        Returns ``(grad_query (B, Lq, E), grad_key (B, Lk, Ek), grad_value (B, Lk, Ev))`` and adds the
        parameter gradients into ``self.grads`` (the head adds its own into ``self.attention.grads``).
        """
        if self.saved_tensors is None:
            raise RuntimeError("MultiHeadAttention.backward called before forward")
        query, key, value, merged, kpm, fixed = self.saved_tensors
        grad_output = as_float_array(grad_output, "grad_output")
        if grad_output.shape != merged.shape:
            raise ValueError(f"grad_output has shape {grad_output.shape}, expected the output shape {merged.shape}")
        g = grad_output.astype(merged.dtype, copy=False)
        d_merged = self._accumulate("O", g, merged)  # (B, Lq, E)
        d_heads = split_heads(d_merged, self.num_heads)  # (B, H, Lq, Dh)
        hooked = self._hook_table is not None
        if hooked:
            d_heads = hook_heads_backward(self, "hook_z", d_heads)
        if fixed is not None:
            dq, dk, dv = fixed_weights_backward(d_heads, fixed)  # (B, H, L, Dh) each
        else:
            dq, dk, dv = self.attention.backward(d_heads)  # (B, H, L, Dh) each
        if hooked:
            dq, dk, dv = (hook_heads_backward(self, name, d) for name, d in (("hook_q", dq), ("hook_k", dk),
                                                                             ("hook_v", dv)))
        grad_query = self._accumulate("Q", merge_heads(dq), query)  # (B, Lq, E)
        grad_key = self._accumulate("K", merge_heads(dk), key)  # (B, Lk, Ek)
        grad_value = self._accumulate("V", merge_heads(dv), value)  # (B, Lk, Ev)
        if kpm is not None:
            grad_key = np.where(kpm[..., None], grad_key, 0).astype(g.dtype, copy=False)
            grad_value = np.where(kpm[..., None], grad_value, 0).astype(g.dtype, copy=False)
        return grad_query, grad_key, grad_value

    def _accumulate(self, which: str, grad_y: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Add the gradients of projection ``W_<which>`` (and its bias); return the gradient of its input."""
        grad_x, grad_w, grad_b = linear_backward(grad_y, x, self._parameters["W_" + which], self.bias)
        self.grads["W_" + which] += grad_w
        if self.bias:
            self.grads["b_" + which] += grad_b
        return grad_x

    def _check_inputs(self, query, key, value, key_padding_mask):
        query = as_float_array(query, "query")
        key = as_float_array(key, "key")
        value = as_float_array(value, "value")
        for name, x, feat in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            check_ndim(x, name, ndim=3, expected=f"3-D (batch, seq, {feat})")
            if x.shape[-1] != feat:
                raise ValueError(f"{name} has {x.shape[-1]} features, expected {feat} (got shape {x.shape})")
        if not (query.shape[0] == key.shape[0] == value.shape[0]):
            raise ValueError(f"query, key and value must share the batch size, got {query.shape}, {key.shape}, "
                             f"{value.shape}")
        if key.shape[1] != value.shape[1]:
            raise ValueError(f"key has length {key.shape[1]} but value has length {value.shape[1]} "
                             f"(key: {key.shape}, value: {value.shape})")
        dtype = common_float_dtype(query, key, value)
        query, key, value = (a.astype(dtype, copy=False) for a in (query, key, value))
        return query, key, value, _check_padding(key_padding_mask, key.shape[:2], "(batch, seq_k)")

    @classmethod
    def from_torch(cls, module) -> MultiHeadAttention:
        """The same attention as a ``torch.nn.MultiheadAttention`` (see :mod:`attnkit.interop.torch_nn`)."""
        return torch_converter(cls).from_torch(module)

    def to_torch_state_dict(self) -> dict:
        """These weights as a ``torch.nn.MultiheadAttention`` state dict (torch tensors)."""
        return torch_converter(type(self)).state_dict(self)

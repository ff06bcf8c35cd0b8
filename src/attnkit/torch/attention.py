"""Twins of attnkit's attention layers, on ``F.scaled_dot_product_attention``.

Masks keep attnkit's polarity (``True`` = may attend / real token, as ``F.scaled_dot_product_attention``
itself), causal masks are bottom-right aligned when Lq != Lk, and a query that may attend to nothing gets a
zero output and zero gradient.

Dimension letters: B batch, Lq/Lk query/key length, E embed dim, H heads, Dh head features, Hq/Hkv query and
key/value heads, S keys.
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F

import torch

from ..attention.gated import GatedAttention as _GatedAttention
from ..attention.grouped_query import GroupedQueryAttention as _GroupedQueryAttention
from ..attention.grouped_query import QueryTemperature
from ..attention.latent import MultiHeadLatentAttention as _MultiHeadLatentAttention
from ..attention.lightning_indexer import KEY_NORM_EPS
from ..attention.lightning_indexer import LightningIndexer as _LightningIndexer
from ..attention.multi_head_attention import MultiHeadAttention as _MultiHeadAttention
from ..attention.scaled_dot_product import ScaledDotProductAttention as _ScaledDotProductAttention
from ._twin import TwinModule, as_tensor, attend, causal_band
from .layers import _linear, _rms, rotary_apply

__all__ = ["ScaledDotProductAttention", "MultiHeadAttention", "GroupedQueryAttention", "MultiHeadLatentAttention",
           "LightningIndexer"]


def _split(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, length, width = x.shape
    return x.view(b, length, heads, width // heads).transpose(1, 2)  # (B, H, L, Dh)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, length, dh = x.shape
    return x.transpose(1, 2).reshape(b, length, h * dh)  # (B, L, H*Dh)


def _bool_mask(mask: Any, device: torch.device, name: str) -> torch.Tensor | None:
    if mask is None:
        return None
    mask = as_tensor(mask, device)
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be boolean (True = may attend / real token), got dtype {mask.dtype}")
    return mask


class ScaledDotProductAttention(TwinModule):
    """Twin of the default attention head: ``softmax(q k^T * scale) v`` with attnkit's masks, on SDPA.

    Shapes
    ------
    q (B, H, Lq, Dh), k/v (B, H, Lk, Dh), mask bool broadcastable to (B, H, Lq, Lk) -> (B, H, Lq, Dh).

    Examples
    --------
    >>> head = ScaledDotProductAttention()
    >>> q = torch.ones(1, 1, 2, 4, dtype=torch.float64)
    >>> head(q, q, q, torch.tensor([False, False])).abs().max().item()  # nothing to attend: zeros
    0.0
    """

    numpy_class = _ScaledDotProductAttention

    def setup(self, source) -> None:
        self.dropout, self.scale, self.is_causal = source.dropout, source.scale, source.is_causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, *,
                is_causal: bool = False) -> torch.Tensor:
        mask = _bool_mask(mask, q.device, "mask")
        return attend(q, k, v, mask, causal=self.is_causal or is_causal, scale=self.scale,
                      dropout_p=self.dropout if self.training else 0.0)  # (B, H, Lq, Dh)


class MultiHeadAttention(TwinModule):
    """Twin of :class:`attnkit.attention.MultiHeadAttention` (default scaled dot-product head only).

    Shapes
    ------
    query (B, Lq, E), key (B, Lk, Ek), value (B, Lk, Ev) -> ``(output (B, Lq, E), None)``: the fused kernels
    return no weights (``need_weights=True`` is refused). ``attn_mask`` bool (Lq, Lk), (Lk,) or 4-D,
    ``True`` = may attend;
    ``key_padding_mask`` bool (B, Lk), ``True`` = real token (padded keys/values are zeroed before projecting,
    so NaN padding never spreads).

    Examples
    --------
    >>> mha = MultiHeadAttention(8, 2, rng=0)
    >>> x = torch.randn(3, 5, 8, dtype=torch.float64)
    >>> out, weights = mha(x, x, x, is_causal=True)
    >>> out.shape, weights
    (torch.Size([3, 5, 8]), None)
    """

    numpy_class = _MultiHeadAttention

    def setup(self, source) -> None:
        if type(source.attention) is not _ScaledDotProductAttention:
            raise ValueError(f"attnkit.torch twins MultiHeadAttention with the default ScaledDotProductAttention "
                             f"head only, got a {type(source.attention).__name__} head")
        self.embed_dim, self.num_heads, self.bias = source.embed_dim, source.num_heads, source.bias

    def _b(self, name: str) -> torch.Tensor | None:
        return getattr(self, name) if self.bias else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                key_padding_mask: Any = None, need_weights: bool = False, is_causal: bool = False, *,
                mask: Any = None):
        if need_weights:
            raise ValueError("MultiHeadAttention (torch twin) runs fused attention kernels, which return no "
                             "weights; use attnkit's module (attnkit.torch.to_numpy) to inspect attention weights")
        if mask is not None:
            if attn_mask is not None:
                raise TypeError("pass attn_mask or its alias mask, not both")
            attn_mask = mask
        device = query.device
        head_mask = _bool_mask(attn_mask, device, "attn_mask")
        kpm = _bool_mask(key_padding_mask, device, "key_padding_mask")
        if kpm is not None:
            pad = kpm[:, None, None, :]  # (B, 1, 1, Lk)
            head_mask = pad if head_mask is None else head_mask & pad
            zero = torch.zeros((), dtype=key.dtype, device=device)
            key = torch.where(kpm[..., None], key, zero)  # (B, Lk, Ek)
            value = torch.where(kpm[..., None], value, zero)  # (B, Lk, Ev)
        q = _split(_linear(query, self.W_Q, self._b("b_Q")), self.num_heads)  # (B, H, Lq, Dh)
        k = _split(_linear(key, self.W_K, self._b("b_K")), self.num_heads)  # (B, H, Lk, Dh)
        v = _split(_linear(value, self.W_V, self._b("b_V")), self.num_heads)  # (B, H, Lk, Dh)
        heads = self.attention(q, k, v, head_mask, is_causal=is_causal)  # (B, H, Lq, Dh)
        return _linear(_merge(heads), self.W_O, self._b("b_O")), None  # (B, Lq, E)


class GroupedQueryAttention(TwinModule):
    """Twin of :class:`attnkit.attention.grouped_query.GroupedQueryAttention`: causal self-attention with
    rotary queries/keys, Hkv <= Hq key/value heads (SDPA's ``enable_gqa``: K/V never repeated), the layer's
    sliding window (a band mask) or chunk (a same-chunk mask over the positions made from the mask), and Llama 4's
    query temperature.

    Shapes
    ------
    x (B, L, D) -> (B, L, D); rotary ``(cos, sin)`` each (B, L, R) or None; attention_mask (B, L) bool,
    ``True`` = real token. No KV cache: the twin is for training (decode with attnkit or transformers).

    Examples
    --------
    >>> from attnkit.models import AttentionConfig, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="mistral", vocab_size=8, hidden_size=8, num_layers=1, num_heads=4,
    ...                     num_kv_heads=2, head_dim=2, mlp=MLPConfig(8),
    ...                     attention=AttentionConfig(sliding_window=2), layer_types=("sliding_attention",))
    >>> attn = GroupedQueryAttention(cfg, 0, rng=0)
    >>> attn(torch.ones(2, 3, 8, dtype=torch.float64)).shape, attn.window
    (torch.Size([2, 3, 8]), 2)
    """

    numpy_class = _GroupedQueryAttention

    def setup(self, source) -> None:
        for name in ("layer_index", "hidden_size", "head_dim", "num_heads", "num_kv_heads", "window", "interleaved",
                     "scale", "uses_rotary", "has_sinks", "chunk"):
            setattr(self, name, getattr(source, name))
        temperature = source.temperature
        self.temperature = ((temperature.floor_scale, temperature.attn_scale)
                            if isinstance(temperature, QueryTemperature) else None)
        self.qk_norm_scope, self.norm_eps, self.norm_offset = (source.qk_norm.scope, source.qk_norm.eps,
                                                               source.qk_norm.offset)
        self.softcap = None if source.score_mod is None else source.score_mod.cap

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = getattr(self, name)
        return _rms(x, weight + self.norm_offset if self.norm_offset else weight, self.norm_eps)

    def forward(self, x: torch.Tensor, *, rotary=None, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("GroupedQueryAttention (torch twin) has no KV cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        q = _linear(x, self.W_Q, getattr(self, "b_Q", None))  # (B, L, Hq*Dh)
        k = _linear(x, self.W_K, getattr(self, "b_K", None))  # (B, L, Hkv*Dh)
        v = _split(_linear(x, self.W_V, getattr(self, "b_V", None)), self.num_kv_heads)  # (B, Hkv, L, Dh)
        if self.qk_norm_scope == "projection":  # over the whole projection (OLMo 2)
            q, k = self._norm(q, "q_norm"), self._norm(k, "k_norm")  # as above
        q, k = _split(q, self.num_heads), _split(k, self.num_kv_heads)  # (B, H, L, Dh)
        if self.qk_norm_scope == "head":  # per head, over Dh, before the rotation (Qwen3)
            q, k = self._norm(q, "q_norm"), self._norm(k, "k_norm")  # as above
        if rotary is not None:
            cos, sin = rotary
            q = rotary_apply(q, cos, sin, self.interleaved)  # (B, Hq, L, Dh)
            k = rotary_apply(k, cos, sin, self.interleaved)  # (B, Hkv, L, Dh)
        if self.qk_norm_scope == "head_after_rotary":  # per head, after the rotation (HunYuan)
            q, k = self._norm(q, "q_norm"), self._norm(k, "k_norm")  # as above
        if self.qk_norm_scope == "unit_after_rotary":  # per head, after the rotation, no weights (Llama 4)
            q, k = _rms(q, None, self.norm_eps), _rms(k, None, self.norm_eps)  # as above
        mask = _bool_mask(attention_mask, x.device, "attention_mask")
        if mask is not None and mask.shape != (x.shape[0], x.shape[1]):
            raise ValueError(f"GroupedQueryAttention: attention_mask must have shape (B, L) = "
                             f"{tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        if self.chunk is not None or self.temperature is not None:
            real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask  # (B, L)
            positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, L), as the model's
            if self.temperature is not None:
                floor_scale, attn_scale = self.temperature
                steps = torch.floor((positions.double() + 1.0) / floor_scale)  # (B, L)
                q = q * (1.0 + attn_scale * torch.log1p(steps)).to(q.dtype)[:, None, :, None]  # (B, Hq, L, Dh)
            if self.chunk is not None:
                chunks = positions // self.chunk  # (B, L)
                same = chunks[:, :, None] == chunks[:, None, :]  # (B, L, L)
                mask = same if mask is None else same & mask[:, None, :]  # (B, L, L)
                mask = mask[:, None]  # (B, 1, L, L)
        if mask is not None and mask.ndim == 2:
            mask = mask[:, None, None, :]  # (B, 1, 1, S)
        if self.softcap is None and not self.has_sinks:
            out = attend(q, k, v, mask, causal=True, window=self.window, scale=self.scale)  # (B, Hq, L, Dh)
        else:
            out = _scored_attention(q, k, v, mask, self.window, self.scale, self.softcap,
                                    getattr(self, "sinks", None))  # (B, Hq, L, Dh)
        return self._output(x, _merge(out))  # (B, L, D)

    def _output(self, x: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        """The heads' outputs side by side (B, L, Hq*Dh) through ``W_O``."""
        return _linear(merged, self.W_O, getattr(self, "b_O", None))  # (B, L, D)


class GatedAttention(GroupedQueryAttention):
    """Twin of :class:`attnkit.attention.gated.GatedAttention`: the heads' outputs scaled by
    ``sigmoid(x W_G + b_G)`` before ``W_O`` (Qwen3-Next's gated attention).

    Shapes
    ------
    As :class:`GroupedQueryAttention`.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="qwen3_next", vocab_size=8, hidden_size=8, num_layers=1, num_heads=4,
    ...                     num_kv_heads=2, head_dim=2, mlp=MLPConfig(8), layer_types=("gated_attention",))
    >>> GatedAttention(cfg, 0, rng=0)(torch.ones(2, 3, 8, dtype=torch.float64)).shape
    torch.Size([2, 3, 8])
    """

    numpy_class = _GatedAttention

    def _output(self, x: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(_linear(x, self.W_G, getattr(self, "b_G", None)))  # (B, L, Hq*Dh)
        return super()._output(x, merged * gate)  # (B, L, D)


class MultiHeadLatentAttention(TwinModule):
    """Twin of :class:`attnkit.attention.latent.MultiHeadLatentAttention` in its explicit form: the latent and
    the shared rotary key up-projected to H key and value heads, then causal attention (SDPA).

    Shapes
    ------
    x (B, L, D) -> (B, L, D); rotary ``(cos, sin)`` each (B, L, R), or None (no rotation); attention_mask (B, L)
    bool, ``True`` = real
    token. No cache: the twin is for training (decode with attnkit, whose cached path is the absorbed form).

    Examples
    --------
    >>> from attnkit.attention import LatentAttentionConfig
    >>> cfg = LatentAttentionConfig(hidden_size=16, num_heads=2, q_lora_rank=8, kv_lora_rank=6,
    ...                             qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3)
    >>> attn = MultiHeadLatentAttention(cfg, rng=0)
    >>> rotary = (torch.ones(1, 3, 2, dtype=torch.float64), torch.zeros(1, 3, 2, dtype=torch.float64))
    >>> attn(torch.ones(1, 3, 16, dtype=torch.float64), rotary=rotary).shape
    torch.Size([1, 3, 16])
    """

    numpy_class = _MultiHeadLatentAttention

    def setup(self, source) -> None:
        self.config = source.config

    def forward(self, x: torch.Tensor, *, rotary, attention_mask: Any = None, cache=None) -> torch.Tensor:
        if cache is not None:
            raise ValueError("MultiHeadLatentAttention (torch twin) has no cache; decode with attnkit's CausalLM "
                             "(attnkit.torch.to_numpy) or transformers")
        cfg = self.config
        b, length, _ = x.shape
        h, dn, c_width = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            a = _rms(_linear(x, self.W_QA, getattr(self, "b_QA", None)), self.q_a_norm, cfg.norm_eps)  # (B, L, Cq)
            q = _linear(a, self.W_QB)  # (B, L, H*(Dn+R))
        else:
            q = _linear(x, self.W_Q)  # (B, L, H*(Dn+R))
        q = _split(q, h)  # (B, H, L, Dn+R)

        def turn(t: torch.Tensor) -> torch.Tensor:  # no tables: a NoPE layer, the features pass unturned
            return t if rotary is None else rotary_apply(t, *rotary, cfg.rope_interleaved)

        q = torch.cat([q[..., :dn], turn(q[..., dn:])], dim=-1)
        mask = _bool_mask(attention_mask, x.device, "attention_mask")
        mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, S)
        if cfg.index_topk:  # only the keys the indexer chose (it has no gradient from attention)
            cos, sin = rotary
            chosen = self.indexer.select(x, a, cos, sin, cfg.rope_interleaved, mask)  # (B, 1, L, S)
            mask = chosen if mask is None else mask & chosen  # (B, 1, L, S)
        kv_a = _linear(x, self.W_KVA, getattr(self, "b_KVA", None))  # (B, L, C+R)
        c = _rms(kv_a[..., :c_width], self.kv_a_norm, cfg.norm_eps)  # (B, L, C)
        k_rope = turn(kv_a[:, None, :, c_width:])  # (B, 1, L, R)
        kv = (c @ self.W_KVB.to(c.dtype)).view(b, length, h, -1).transpose(1, 2)  # (B, H, L, Dn+Dv)
        k = torch.cat([kv[..., :dn], k_rope.expand(b, h, length, -1)], dim=-1)  # (B, H, L, Dn+R)
        out = attend(q, k, kv[..., dn:], mask, causal=True, window=cfg.sliding_window, scale=cfg.scale)
        return _linear(_merge(out), self.W_O, getattr(self, "b_O", None))  # (B, L, D)


class LightningIndexer(TwinModule):
    """Twin of :class:`attnkit.attention.lightning_indexer.LightningIndexer`: its scores and top-k selection,
    outside autograd (the choice is discrete), as ``transformers``' indexer.

    Shapes
    ------
    x (B, L, D), a (B, L, Cq), cos/sin (B, L, R) in the attention's layout, mask (B, 1, 1, L) bool or None
    -> the chosen keys (B, 1, L, L) bool.
    """

    numpy_class = _LightningIndexer

    def setup(self, source) -> None:
        self.heads, self.head_dim, self.top_k, self.scale = source.num_heads, source.head_dim, source.top_k, \
            source.scale

    @torch.no_grad()
    def scores(self, x: torch.Tensor, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index scores (B, L, L); ``cos``/``sin`` (B, L, R) half-split."""
        b, length, _ = x.shape
        q = _linear(a, self.W_QB).view(b, length, self.heads, self.head_dim).transpose(1, 2)  # (B, Hi, L, Di)
        q = rotary_apply(q, cos, sin, False)  # (B, Hi, L, Di)
        k = F.layer_norm(_linear(x, self.W_K), (self.head_dim,), self.k_norm, self.k_norm_bias, KEY_NORM_EPS)
        k = rotary_apply(k[:, None], cos, sin, False)  # (B, 1, L, Di)
        s = torch.relu(q @ k.transpose(-1, -2) * self.scale)  # (B, Hi, L, L)
        w = _linear(x, self.W_weights) * self.heads ** -0.5  # (B, L, Hi)
        return torch.einsum("blh,bhls->bls", w, s)  # (B, L, L)

    @torch.no_grad()
    def select(self, x: torch.Tensor, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
               mask: torch.Tensor | None) -> torch.Tensor:
        """The ``top_k`` best-scored keys of each query among those it may see: (B, 1, L, L) bool."""
        if interleaved:  # the same angles, half-split
            cos, sin = (torch.cat([t[..., 0::2], t[..., 0::2]], dim=-1) for t in (cos, sin))
        scores = self.scores(x, a, cos, sin)  # (B, L, L)
        length = scores.shape[-1]
        allowed = causal_band(length, length, None, x.device)[None]  # (1, L, L)
        if mask is not None:
            allowed = allowed & mask[:, 0]  # (B, L, L)
        allowed = allowed.expand_as(scores)  # (B, L, L)
        if self.top_k >= length:
            return allowed[:, None]
        best = scores.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1).indices  # (B, L, k)
        chosen = torch.zeros_like(allowed).scatter(-1, best, True)  # (B, L, L)
        return (chosen & allowed)[:, None]  # (B, 1, L, L)


def _scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      window: int | None, scale: float | None, softcap: float | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal attention with explicit scores, for what SDPA cannot express: soft-capped scores
    ``C tanh(s / C)`` (before the mask) and per-head sink logits joining each row's softmax.

    Shapes
    ------
    q (B, Hq, L, Dh), k/v (B, Hkv, L, Dh), mask (B, 1, 1, L) bool or None, sinks (Hq,) -> (B, Hq, L, Dh).
    A query with nothing to attend (and no sink) gets zeros, as in attnkit.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, Hq, L, Dh)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, Hq, L, L)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = causal_band(q.shape[-2], k.shape[-2], window, q.device)  # (L, L)
    if mask is not None:
        allowed = allowed & mask  # (B, 1, L, L)
    allowed = allowed.expand_as(scores)  # (B, Hq, L, L)
    alive = allowed.any(dim=-1, keepdim=True)  # (B, Hq, L, 1)
    # dead rows get finite scores (their output is replaced by zeros below), so nothing turns into NaN
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0)  # (B, Hq, L, L)
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, Hq, L, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # (B, Hq, L, L)
    else:
        weights = torch.softmax(scores, dim=-1)  # (B, Hq, L, L)
    out = weights @ v  # (B, Hq, L, Dh)
    return torch.where(alive, out, torch.zeros((), dtype=out.dtype))  # (B, Hq, L, Dh)

"""``MultiHeadLatentAttention``: DeepSeek-V2/V3's multi-head latent attention (MLA), explicit and absorbed.

Dimension letters: B batch, L new tokens, S keys (past + new), D ``hidden_size``, H heads, Cq ``q_lora_rank``,
C ``kv_lora_rank``, Dn ``qk_nope_head_dim``, R ``qk_rope_head_dim``, Dv ``v_head_dim``.

Every token is compressed into one latent vector ``c`` (C features, RMS-normalised) and one rotary key ``k_r``
(R features) shared by all heads. The per-head keys and values are linear in ``c``::

    c, k_r     = rms(x W_KVA[:, :C]), rope(x W_KVA[:, C:])            (B, L, C), (B, L, R)
    k_h        = [c W_UK_h, k_r],  v_h = c W_UV_h                       W_KVB = [W_UK_h | W_UV_h] per head
    q_h        = [q_nope_h, rope(q_rope_h)]  from  rms(x W_QA) W_QB  (or x W_Q)
    y          = concat_h softmax(scale q_h k_h^T) v_h  W_O

The *explicit* form computes ``k_h`` and ``v_h`` and attends with ordinary (Dn + R)-wide heads through
:func:`attnkit.flex.flex_attention`; it is the training path, with an exact backward for every parameter and
the input. The *absorbed* form never forms them: ``q_nope_h . (c W_UK_h) = (q_nope_h W_UK_h^T) . c``, so each
query is moved into the latent space once and attends to the cached ``[c, k_r]`` directly (a single key/value
head shared by all H query heads, keys C + R wide, values the C-wide ``c``); and ``sum_j p_j (c_j W_UV_h) =
(sum_j p_j c_j) W_UV_h``, so the value up-projection is applied once per query after the average instead of
once per cached token. Both are the same sums regrouped, equal to round-off; the softmax scale is the
explicit form's ``(Dn + R) ** -0.5`` (times DeepSeek's YaRN ``mscale**2``) in both.

DeepSeek Sparse Attention (DeepSeek-V3.2, ``index_topk``) adds a
:class:`~attnkit.attention.lightning_indexer.LightningIndexer`: each query attends to the ``index_topk`` keys it
scores best only. The explicit form passes the choice to the tiled kernel as a boolean mask (exact gradients
given the choice; the indexer gets none, as the choice is discrete); the absorbed form gathers each query's
chosen latents and scores only those. The indexer's key (Di features) is cached after the latent.

A cache therefore holds C + R numbers per token and layer (DeepSeek-V3: 512 + 64 = 576), against
``2 * Hkv * Dh`` for Llama-style grouped-query attention (8 key/value heads of 128 at DeepSeek-V3's width
7168: 2048, 3.6x more) and ``H * (Dn + R + Dv)`` for the keys and values MLA's explicit form attends to
(128 * 320 = 40960, 71x more). In bfloat16 that is 1152 bytes per token and layer against 4096 and 81920.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validation import as_bool_mask, check_factor, check_features, check_grad_output, check_positive_int, check_real
from ..core.hooks import hook_heads, hook_heads_backward
from ..core.module import Module
from ..flex import (
    and_masks,
    boolean_mask,
    causal_lower_right,
    create_block_mask,
    flex_attention,
    flex_attention_backward,
    padding_mask,
    sliding_window_mask,
)
from ..init import as_generator, normal
from ..kernels import indexer as _indexer
from ..kernels import latent as _latent
from ..kernels import rotary as _rotary
from ..kernels.decode_step import rms_norm_into
from ..kernels.fixed_weights import FixedWeights, fixed_weights_backward, fixed_weights_forward
from ..kernels.linear import linear, linear_backward
from ..kernels.registry import ATTENTION_KERNELS
from ..kernels.rms_norm import rms_norm_backward, rms_norm_forward
from .cache_entry import Latents
from .lightning_indexer import LightningIndexer, half_split_rotary

__all__ = ["LatentAttentionConfig", "MultiHeadLatentAttention", "yarn_softmax_scale"]

FORMS = ("auto", "explicit", "absorbed")
ONE_QUERY = ATTENTION_KERNELS["one_query"]  # a decoding step's kernel (see kernels.registry)


def yarn_softmax_scale(qk_head_dim: int, rope_scaling: dict | None = None) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times ``mscale ** 2`` under a YaRN-type scaling.

    ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` (1 when ``factor <= 1`` or ``mscale_all_dim`` is 0 or
    missing), as ``transformers``' ``yarn_apply_mscale``: the longer context's logits are sharpened in the
    scale, on top of the rotary tables' own attention factor.

    Examples
    --------
    >>> round(yarn_softmax_scale(192), 6), round(yarn_softmax_scale(192, {"rope_type": "yarn", "factor": 40,
    ...                                                                    "mscale_all_dim": 1.0}), 6)
    (0.072169, 0.135234)
    """
    scale = qk_head_dim ** -0.5
    if rope_scaling is None or rope_scaling.get("rope_type", "default") == "default":
        return scale
    m_all, factor = rope_scaling.get("mscale_all_dim") or 0, rope_scaling.get("factor", 1.0)
    if m_all and factor > 1:
        mscale = 0.1 * m_all * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass(frozen=True)
class LatentAttentionConfig:
    """The shape of one multi-head latent attention layer (field names as ``transformers``' DeepseekV3Config).

    Attributes
    ----------
    hidden_size : int
        D.
    num_heads : int
        H (``num_attention_heads``).
    kv_lora_rank : int
        C, the latent's width.
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim : int
        Dn, R (even) and Dv.
    q_lora_rank : int, optional
        Cq: queries through a rank-Cq bottleneck with its RMSNorm (``W_QA``, ``q_a_norm``, ``W_QB``); None: one
        projection ``W_Q`` (DeepSeek-V2-Lite).
    attention_bias : bool
        Biases on ``W_QA``, ``W_KVA`` and ``W_O`` (``q_b_proj``, ``kv_b_proj`` and ``q_proj`` never have one).
    norm_eps : float
        Of the two latent RMSNorms; ``transformers`` builds them with its default 1e-6 whatever
        ``rms_norm_eps`` says.
    rope_interleaved : bool
        Rotary pairs ``(x[2i], x[2i+1])`` (DeepSeek's checkpoints, ``rope_interleave=True``) or half-split.
    attention_scale : float, optional
        The softmax scale; None: ``(Dn + R) ** -0.5`` (see :func:`yarn_softmax_scale` for DeepSeek's YaRN one).
    sliding_window : int, optional
        W: each query sees itself and the W - 1 tokens before it.
    index_topk, index_n_heads, index_head_dim : int, optional
        DeepSeek Sparse Attention: a :class:`~attnkit.attention.lightning_indexer.LightningIndexer` of
        ``index_n_heads`` heads ``index_head_dim`` wide (at least R) picks the ``index_topk`` keys each query
        attends to (all three or none; needs ``q_lora_rank``, excludes ``sliding_window``).
    """

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    attention_bias: bool = False
    norm_eps: float = 1e-6
    rope_interleaved: bool = True
    attention_scale: float | None = None
    sliding_window: int | None = None
    index_topk: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            check_positive_int(getattr(self, name), name)
        for name in ("q_lora_rank", "sliding_window", "index_topk", "index_n_heads", "index_head_dim"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary turns feature pairs), got {self.qk_rope_head_dim}")
        if not check_real(self.norm_eps, "norm_eps") >= 0:
            raise ValueError(f"norm_eps must be non-negative, got {self.norm_eps}")
        if self.attention_scale is not None:
            check_factor(self.attention_scale, "attention_scale")
        indexer = (self.index_topk, self.index_n_heads, self.index_head_dim)
        if any(v is not None for v in indexer):
            if None in indexer:
                raise ValueError(f"index_topk, index_n_heads and index_head_dim go together (the sparse attention "
                                 f"indexer), got {indexer}")
            if not self.q_lora_rank or self.sliding_window:
                raise ValueError("the sparse attention indexer reads the normalised query latent: it needs "
                                 "q_lora_rank, and no sliding_window")
            if self.index_head_dim < self.qk_rope_head_dim:
                raise ValueError(f"index_head_dim ({self.index_head_dim}) must be at least qk_rope_head_dim "
                                 f"({self.qk_rope_head_dim}): the indexer turns that many of its features")

    @property
    def qk_head_dim(self) -> int:
        """Dn + R, the width of an explicit query or key head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """C + R, what a cache keeps per token: the normalised latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """What a cache keeps per token: the latent (C + R), then the indexer's key (Di) with one."""
        return self.latent_dim + (self.index_head_dim or 0)

    @property
    def scale(self) -> float:
        """The softmax scale of both forms."""
        return self.qk_head_dim ** -0.5 if self.attention_scale is None else float(self.attention_scale)


def _turn(x: np.ndarray, cos, sin, interleaved: bool, *, backward: bool = False) -> np.ndarray:
    """The rotation of the R rotary features (or its gradient's, ``backward``); none without tables (NoPE)."""
    if cos is None:
        return x
    return (_rotary.rotary_backward if backward else _rotary.rotary_apply)(x, cos, sin, interleaved)


class MultiHeadLatentAttention(Module):
    """Causal self-attention through a compressed key/value latent (DeepSeek-V2/V3, Kimi K2, GLM-5).

    The parameters are named after ``transformers``' ``DeepseekV3Attention`` (``self_attn.<name>``, see the
    Attributes): every weight is stored for ``x @ W`` (that ``nn.Linear``'s weight transposed), every other
    tensor as in the checkpoint; ``grads`` has the same names. Interleaved checkpoints need no permutation: the
    rotary kernel turns the pairs ``(x[2i], x[2i+1])`` in place, where ``transformers`` de-interleaves q and k
    after turning them (the same permutation on both sides of every dot product, so the scores are equal).

    Parameters
    ----------
    config : LatentAttentionConfig
    layer_index : int, default 0
        Which layer this is (its entry in a model's :class:`~attnkit.decoding.cache.ModelCache`).
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (norm gains start at one, biases at zero).

    Attributes
    ----------
    W_QA : (D, Cq)
        With ``q_lora_rank``: transformers' ``self_attn.q_a_proj.weight`` transposed; ``b_QA`` (Cq,) its bias
        (with ``attention_bias``).
    q_a_norm : (Cq,)
        ``q_a_layernorm.weight``.
    W_QB : (Cq, H*(Dn+R))
        ``q_b_proj.weight`` transposed; per head the Dn plain columns, then the R rotary ones.
    W_Q : (D, H*(Dn+R))
        Without ``q_lora_rank``: ``q_proj.weight`` transposed.
    W_KVA : (D, C+R)
        ``kv_a_proj_with_mqa.weight`` transposed: the latent's C columns, then the shared rotary key's R;
        ``b_KVA`` (C+R,) its bias.
    kv_a_norm : (C,)
        ``kv_a_layernorm.weight``.
    W_KVB : (C, H*(Dn+Dv))
        ``kv_b_proj.weight`` transposed; per head W_UK_h (Dn columns), then W_UV_h (Dv).
    W_O : (H*Dv, D)
        ``o_proj.weight`` transposed; ``b_O`` (D,) its bias.

    Shapes
    ------
    x : (B, L, D) -> (B, L, D) in ``x``'s float dtype.
    rotary : ``(cos, sin)`` each (B, L, R), from :func:`attnkit.kernels.rotary.rotary_cos_sin` with
    ``interleaved=config.rope_interleaved``; None: the R "rotary" features are not turned (a NoPE layer: Kimi
    Linear's latent attention keeps DeepSeek-V3's shapes but rotates nothing).
    attention_mask : (B, S) bool/0-1, ``True`` = real token, over the cache slots (past + new); None = all real.
    cache : :class:`~attnkit.decoding.cache.ModelCache`, optional: appends the new tokens' ``[c, k_r]`` (C + R
    each) and attends to every kept slot; inference only (no :meth:`backward`).
    output_attentions : bool, default False
        Also return the weights (B, H, L, S), an array the caller owns (the reference kernel computes them).
    form : {"auto", "explicit", "absorbed"}
        Which computation runs: ``"auto"`` is the absorbed form with a cache (decoding) and the explicit form
        without one (prefill, training), or with hooks installed (so ``hook_k`` and ``hook_v`` fire in every
        decoding step, and a replacement there is used). Only an explicit forward without a cache keeps what
        backward needs.

    Hook points: see :meth:`hook_points`.

    Examples
    --------
    >>> from attnkit.kernels.rotary import rotary_cos_sin, rotary_frequencies
    >>> cfg = LatentAttentionConfig(hidden_size=16, num_heads=2, q_lora_rank=8, kv_lora_rank=6,
    ...                             qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3)
    >>> attn = MultiHeadLatentAttention(cfg, rng=0)
    >>> rotary = rotary_cos_sin(np.arange(3)[None], rotary_frequencies(2, 10000.0)[0], interleaved=True)
    >>> y = attn(np.ones((1, 3, 16), np.float32), rotary=rotary)
    >>> y.shape, y.dtype, attn.backward(np.ones_like(y)).shape, attn.W_KVB.shape
    ((1, 3, 16), dtype('float32'), (1, 3, 16), (6, 14))
    """

    def __init__(self, config: LatentAttentionConfig, layer_index: int = 0, *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.layer_index = check_positive_int(layer_index, "layer_index", allow_zero=True)
        self.config = config
        cfg, gen = config, as_generator(rng)
        d, h, c = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        shapes = [("W_QA", (d, cfg.q_lora_rank)), ("W_QB", (cfg.q_lora_rank, h * cfg.qk_head_dim))] \
            if cfg.q_lora_rank else [("W_Q", (d, h * cfg.qk_head_dim))]
        shapes += [("W_KVA", (d, cfg.latent_dim)), ("W_KVB", (c, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))),
                   ("W_O", (h * cfg.v_head_dim, d))]
        for name, shape in shapes:
            self.register_parameter(name, normal(gen, shape, std=0.02))
        if cfg.q_lora_rank:
            self.register_parameter("q_a_norm", np.ones(cfg.q_lora_rank))
        self.register_parameter("kv_a_norm", np.ones(c))
        if cfg.attention_bias:
            biases = (["b_QA"] if cfg.q_lora_rank else []) + ["b_KVA", "b_O"]
            for name in biases:
                self.register_parameter(name, np.zeros(self._parameters["W_" + name[2:]].shape[1]))
        if cfg.index_topk:
            self.indexer = LightningIndexer(d, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                                            cfg.qk_rope_head_dim, cfg.index_topk, rng=gen)

    @property
    def cache_dim(self) -> int:
        """What its cache entry keeps per token (the config's ``cache_dim``)."""
        return self.config.cache_dim

    def new_cache(self, batch_size: int, max_length: int | None = None, *, dtype: Any = None,
                  rollback: int = 0) -> Latents:
        """This layer's entry of a model's cache: its tokens' latents (:class:`~attnkit.attention.cache_entry.Latents`,
        ``cache_dim`` numbers per token) in ``dtype`` (default: the parameters'); ``rollback`` needs nothing (the
        slots stay until cropped)."""
        dtype = self._parameters["W_O"].dtype if dtype is None else dtype
        return Latents(batch_size, self.cache_dim, dtype, max_length=max_length, layer=self.layer_index)

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"hidden_size={cfg.hidden_size}, num_heads={cfg.num_heads}, q_lora_rank={cfg.q_lora_rank}, "
                f"kv_lora_rank={cfg.kv_lora_rank}, qk_nope_head_dim={cfg.qk_nope_head_dim}, "
                f"qk_rope_head_dim={cfg.qk_rope_head_dim}, v_head_dim={cfg.v_head_dim}, "
                f"layer_index={self.layer_index}")

    FORWARD_ONLY_HOOKS = ("hook_pattern",)

    def hook_points(self) -> tuple[str, ...]:
        """``hook_q`` (B, L, H, Dn+R) the query heads, their rotary part turned; ``hook_k`` (B, S, H, Dn+R) and
        ``hook_v`` (B, S, H, Dv) the key and value heads the explicit form expands from the latent (the
        absorbed form never forms them and passes neither point: ``form="auto"`` runs the explicit form whenever
        hooks are installed); ``hook_pattern``
        (B, H, L, S) the attention weights, an ordinary softmax pattern in both forms (forward hooks only;
        asking for it runs the reference kernel); ``hook_z`` (B, L, H, Dv) each head's output before ``W_O``."""
        return ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")

    # ------------------------------------------------------------------------------------------------
    def _queries(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        """Query heads (B, H, L, Dn + R), their last R features rotated; and what their backward needs."""
        cfg, p = self.config, self._parameters
        b, length, _ = x.shape
        if cfg.q_lora_rank:
            a = linear(x, p["W_QA"], p.get("b_QA"))  # (B, L, Cq)
            a, a_hat, a_rstd = rms_norm_forward(a, p["q_a_norm"], cfg.norm_eps)  # (B, L, Cq)
            q = linear(a, p["W_QB"])  # (B, L, H*(Dn+R))
            saved = (a, a_hat, a_rstd)
        else:
            q = linear(x, p["W_Q"])  # (B, L, H*(Dn+R))
            saved = None
        q = q.reshape(b, length, cfg.num_heads, cfg.qk_head_dim).transpose(0, 2, 1, 3)  # (B, H, L, Dn+R)
        dn = cfg.qk_nope_head_dim
        q_rope = _turn(q[..., dn:], cos, sin, cfg.rope_interleaved)  # (B, H, L, R)
        return np.concatenate([q[..., :dn], q_rope], axis=-1), saved  # (B, H, L, Dn+R)

    def _latent(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        """The normalised latent (B, L, C), the rotated shared key (B, L, R) and the norm's ``(x_hat, rstd)``."""
        cfg, p = self.config, self._parameters
        kv_a = linear(x, p["W_KVA"], p.get("b_KVA"))  # (B, L, C+R)
        c, c_hat, c_rstd = rms_norm_forward(kv_a[..., :cfg.kv_lora_rank], p["kv_a_norm"], cfg.norm_eps)  # (B, L, C)
        k_rope = _turn(kv_a[:, None, :, cfg.kv_lora_rank:], cos, sin, cfg.rope_interleaved)[:, 0]  # (B, L, R)
        return c, k_rope, (c_hat, c_rstd)

    def _check_inputs(self, x, rotary, attention_mask, form: str):
        cfg = self.config
        x = check_features(x, "x", cfg.hidden_size, "MultiHeadLatentAttention", "hidden_size")
        if x.ndim != 3:
            raise ValueError(f"MultiHeadLatentAttention: x must be (B, L, D), got shape {x.shape}")
        if form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
        mask = as_bool_mask(attention_mask, "attention_mask", allow_int=True)
        if rotary is None:  # a NoPE layer (Kimi Linear): the "rotary" features pass unturned
            return x, None, None, mask
        if len(rotary) != 2:
            raise ValueError("MultiHeadLatentAttention: rotary must be the (cos, sin) pair of the new tokens "
                             "(the decoupled rotary key is part of the layer), or None for no rotation")
        expected = (x.shape[0], x.shape[1], cfg.qk_rope_head_dim)
        cos, sin = (np.asarray(t) for t in rotary)
        if cos.shape != expected or sin.shape != expected:
            raise ValueError(f"MultiHeadLatentAttention: rotary cos and sin must have shape (B, L, R) = {expected}, "
                             f"got {cos.shape} and {sin.shape}")
        return x, cos, sin, mask

    def forward(self, x: Any, *, rotary, attention_mask: Any = None, cache=None, output_attentions: bool = False,
                form: str = "auto"):
        """Attend every new token to itself and the tokens before it (``form`` picks explicit or absorbed);
        ``(y, weights)`` with ``output_attentions``."""
        x, cos, sin, mask = self._check_inputs(x, rotary, attention_mask, form)
        b, length, _ = x.shape
        q, q_saved = self._queries(x, cos, sin)  # (B, H, L, Dn+R)
        hooked = self._hook_table is not None
        if hooked:
            q = hook_heads(self, "hook_q", q)
        c, k_rope, c_norm = self._latent(x, cos, sin)  # (B, L, C), (B, L, R)
        sparse = "indexer" in self._modules
        index_rotary = self._index_rotary(cos, sin)  # (B, L, R) each, or None
        if cache is not None:
            new = [c, k_rope] + ([self.indexer.keys(x, index_rotary)] if sparse else [])
            kept = cache.update(self.layer_index, np.concatenate(new, axis=-1))  # (B, S, C+R[+Di])
            latent, slots = kept.latent[..., :self.config.latent_dim], kept.slots  # (B, S, C+R)
            index_keys = kept.latent[..., self.config.latent_dim:] if sparse else None  # (B, S, Di)
            key_mask = self._key_mask(mask, b, int(slots[-1]) + 1)
            key_mask = None if key_mask is None else key_mask[:, slots]  # (B, S)
        else:
            latent = index_keys = None
            key_mask = self._key_mask(mask, b, length)
        selection = self._select(x, q_saved, index_rotary, index_keys, key_mask) if sparse else None
        if form == "absorbed" or (form == "auto" and cache is not None and not hooked):
            if latent is None:
                latent = np.concatenate([c, k_rope], axis=-1)  # (B, L, C+R)
            out, weights, ctx = self._absorbed(q, latent, key_mask, selection, output_attentions)  # (B, H, L, Dv)
        else:
            if latent is not None:  # the cache's (B, S, C) and (B, S, R), in x's dtype
                latent = latent.astype(x.dtype, copy=False)
                c, k_rope = latent[..., :self.config.kv_lora_rank], latent[..., self.config.kv_lora_rank:]
            out, weights, ctx = self._explicit(q, c, k_rope, key_mask, selection,
                                               output_attentions)  # (B, H, L, Dv)
        merged = out.transpose(0, 2, 1, 3)  # (B, L, H, Dv)
        if hooked:
            merged = self.hook_point("hook_z", merged)
        merged = merged.reshape(b, length, -1)  # (B, L, H*Dv)
        y = linear(merged, self._parameters["W_O"], self._parameters.get("b_O"))  # (B, L, D)
        if cache is None and form != "absorbed":
            self.save_for_backward(x, (cos, sin), q_saved, c, c_norm, merged, ctx)
        else:  # inference: keep nothing
            self.save_for_backward()
        return (y, weights) if output_attentions else y

    def step(self, x: np.ndarray, *, rotary=None, attention_mask: np.ndarray | None = None, cache=None) -> np.ndarray:
        """One decoding step (B, D) -> (B, D): the cached forward (the absorbed form) of one new token per row.

        The same parts in the same order on (B, *) rows: the query and latent projections and norms, the
        rotations (in place on the step's own projections), the cache's update with ``[c, k_r]``, each query moved
        into the latent space (``q_nope_h W_UK_h^T``), attention of the H queries over the one cached latent head
        with the registry's ``"one_query"`` kernel (or over the indexer's chosen latents in a sparse layer), then
        ``W_UV_h`` once per head and ``W_O``. No key or value head is ever expanded, no mask is built and nothing
        is saved (a step is inference). ``rotary`` is (cos, sin) each (B, 1, R), or None (NoPE);
        ``attention_mask`` (B, S) over every slot, or None.
        """
        if cache is None:
            raise ValueError("MultiHeadLatentAttention.step needs a cache (the model's, holding this layer's latents)")
        cfg, p = self.config, self._parameters
        b, h, dn, rank = x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        cos, sin = (None, None) if rotary is None else rotary  # (B, 1, R) each
        # the norms are written over the step's own projections (rms_norm_into: the forward's numbers bit for bit)
        if cfg.q_lora_rank:
            a = linear(x, p["W_QA"], p.get("b_QA"))  # (B, Cq)
            rms_norm_into(a, p["q_a_norm"], cfg.norm_eps, a, np.empty(a.shape, a.dtype))
            q = linear(a, p["W_QB"])  # (B, H*(Dn+R))
        else:
            a, q = None, linear(x, p["W_Q"])  # (B, H*(Dn+R))
        q = q.reshape(b, h, 1, cfg.qk_head_dim)  # (B, H, 1, Dn+R), the step's own array
        kv_a = linear(x, p["W_KVA"], p.get("b_KVA"))  # (B, C+R), the step's own array
        c = rms_norm_into(kv_a[:, :rank], p["kv_a_norm"], cfg.norm_eps, kv_a[:, :rank],
                          np.empty((b, rank), kv_a.dtype))  # (B, C), a view of kv_a
        if cos is not None:
            _rotary.rotary_apply_in_place(q[..., dn:], cos, sin, cfg.rope_interleaved)  # (B, H, 1, R)
            _rotary.rotary_apply_in_place(kv_a[:, None, None, rank:], cos, sin, cfg.rope_interleaved)  # (B, 1, 1, R)
        new = [c, kv_a[:, rank:]]  # (B, C), (B, R)
        sparse = "indexer" in self._modules
        index_rotary = self._index_rotary(cos, sin)  # (B, 1, R) each, or None
        if sparse:
            new.append(self.indexer.keys(x[:, None], index_rotary)[:, 0])  # (B, Di)
        kept = cache.update(self.layer_index, np.concatenate(new, axis=-1)[:, None])  # (B, S, C+R[+Di])
        latent = kept.latent[..., :cfg.latent_dim].astype(q.dtype, copy=False)  # (B, S, C+R)
        key_mask = None if attention_mask is None else np.asarray(attention_mask)[:, kept.slots]  # (B, S)
        w_uk, w_uv = _latent.split_up_projection(p["W_KVB"], h, dn, q.dtype)  # (H, Dn, C), (H, C, Dv)
        q_abs = _latent.absorb_queries(q, w_uk, dn)  # (B, H, 1, C+R)
        if sparse:
            index_keys = kept.latent[..., cfg.latent_dim:]  # (B, S, Di)
            _, indices, valid = self._select(x[:, None], (a[:, None],), index_rotary, index_keys,
                                             key_mask)  # (B, 1, K) each
            out_latent = _indexer.gathered_attention(q_abs, latent, indices, valid, cfg.scale, rank)  # (B, H, 1, C)
        else:
            keys = latent[:, None]  # (B, 1, S, C+R): one key head shared by the H queries
            mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S)
            out_latent, _, _ = ONE_QUERY.forward(q_abs.reshape(b, 1, h, -1), keys, keys[..., :rank], mask=mask,
                                                 scale=cfg.scale, window=cfg.sliding_window)  # (B, 1, H, C)
            out_latent = out_latent.reshape(b, h, 1, rank)  # (B, H, 1, C)
        heads = _latent.absorbed_values(out_latent, w_uv)  # (B, H, 1, Dv)
        return linear(heads.reshape(b, -1), p["W_O"], p.get("b_O"))  # (B, D)

    def _index_rotary(self, cos: np.ndarray | None, sin: np.ndarray | None):
        """The sparse indexer's rotary tables in its half-split layout ((B, L, R) each); None for a dense layer or
        one without positions (NoPE), whose indexer turns nothing."""
        if "indexer" not in self._modules or cos is None:
            return None
        return half_split_rotary(cos, sin, self.config.rope_interleaved)

    def _key_mask(self, mask: np.ndarray | None, batch: int, seq_k: int) -> np.ndarray | None:
        if mask is not None and mask.shape != (batch, seq_k):
            raise ValueError(f"MultiHeadLatentAttention: attention_mask must have shape (B, S) = ({batch}, {seq_k}) "
                             f"(past + new tokens), got {mask.shape}")
        return mask

    def _select(self, x, q_saved, rotary, index_keys, key_mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The keys each new token attends to: the indexer's ``index_topk`` best among the keys it may see (causal,
        not padding), as a mask (B, L, S) bool and as ``(indices, valid)`` (B, L, K). Without a cache the indexer
        keeps what its own backward needs."""
        scores = self.indexer(x, q_saved[0], rotary=rotary, keys=index_keys)  # (B, L, S)
        length, seq_k = scores.shape[1:]
        allowed = np.arange(seq_k)[None, :] <= np.arange(length)[:, None] + (seq_k - length)  # (L, S)
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, :]  # (B, L, S)
        indices, valid = self.indexer.choose(scores, allowed)  # (B, L, K) each
        chosen = np.zeros(scores.shape, dtype=bool)  # (B, L, S)
        np.put_along_axis(chosen, indices, valid, axis=-1)
        return chosen, indices, valid

    def _explicit(self, q: np.ndarray, c: np.ndarray, k_rope: np.ndarray, key_mask, selection,
                  need_weights: bool):
        """Up-project the latent to H key heads ``[c W_UK_h, k_r]`` and value heads ``c W_UV_h``, and attend."""
        cfg = self.config
        k, v = _latent.expand_latent(c, k_rope, self._parameters["W_KVB"], cfg.num_heads,
                                     cfg.qk_nope_head_dim)  # (B, H, S, Dn+R), (B, H, S, Dv)
        if self._hook_table is not None:
            k, v = hook_heads(self, "hook_k", k), hook_heads(self, "hook_v", v)
        return self._attend(q, k, v, key_mask, selection, need_weights)

    def _absorbed(self, q: np.ndarray, latent: np.ndarray, key_mask, selection, need_weights: bool):
        """Attend in the latent space: queries ``[q_nope_h W_UK_h^T, q_rope_h]`` against the one key/value head
        ``[c, k_r]`` / ``c``, then ``W_UV_h`` on each head's averaged latent."""
        cfg = self.config
        w_uk, w_uv = _latent.split_up_projection(self._parameters["W_KVB"], cfg.num_heads, cfg.qk_nope_head_dim,
                                                 q.dtype)  # (H, Dn, C), (H, C, Dv)
        q_abs = _latent.absorb_queries(q, w_uk, cfg.qk_nope_head_dim)  # (B, H, L, C+R)
        k = latent.astype(q.dtype, copy=False)[:, None]  # (B, 1, S, C+R): one head shared by all H queries
        table = self._hook_table
        if selection is not None and not need_weights and (table is None or "hook_pattern" not in table.forward):
            # only each query's K chosen latents are gathered and scored (L*K products, not L*S)
            out_latent = _indexer.gathered_attention(q_abs, k[:, 0], *selection[1:], self.config.scale,
                                                     cfg.kv_lora_rank)  # (B, H, L, C)
            return _latent.absorbed_values(out_latent, w_uv), None, None  # (B, H, L, Dv)
        out_latent, weights, ctx = self._attend(q_abs, k, k[..., :cfg.kv_lora_rank], key_mask, selection,
                                                need_weights)  # (B, H, L, C)
        return _latent.absorbed_values(out_latent, w_uv), weights, ctx  # (B, H, L, Dv)

    def _attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray | None,
                selection: tuple | None, need_weights: bool):
        """Causal (windowed, padded) attention through :func:`attnkit.flex.flex_attention`: ``(out, weights or
        None, ctx)``; with a ``selection`` (its mask (B, L, S), indices, valid) only over the keys chosen (the mask,
        which the tiled kernel reads tile by tile, skipping the tiles where no query chose a key).

        One query after every key it may see (a decoding step) needs no mask; the kernel is flex's ``"auto"``
        (:func:`attnkit.kernels.registry.resolve_kernel`: the reference kernel for that one row of scores or when
        the weights are asked for (or hooked), the tiled FlashAttention kernel for longer runs).
        """
        b, _, length, _ = q.shape
        seq_k, window = k.shape[2], self.config.sliding_window
        if length == 1 and key_mask is None and selection is None and (not window or window >= seq_k):
            block_mask = None
        elif selection is not None:  # within the causal band and the key mask already; the band skips tiles
            mask = and_masks(causal_lower_right(length, seq_k), boolean_mask(selection[0][:, None]))
            block_mask = create_block_mask(mask, b, None, length, seq_k)
        else:
            mask = sliding_window_mask(window, offset=seq_k - length) if window else causal_lower_right(length, seq_k)
            if key_mask is not None:
                mask = and_masks(mask, padding_mask(key_mask))
            block_mask = create_block_mask(mask, None if key_mask is None else b, None, length, seq_k)
        table = self._hook_table
        pattern_hooked = table is not None and "hook_pattern" in table.forward
        out, ctx = flex_attention(q, k, v, None, block_mask, scale=self.config.scale, enable_gqa=True,
                                  need_weights=need_weights or pattern_hooked)  # (B, H, L, Dv or C)
        heads = q.shape[1]
        if pattern_hooked:
            hooked = self.hook_point("hook_pattern", ctx.weights.reshape(b, heads, length, seq_k))  # (B, H, L, S)
            if "hook_pattern" in table.replaced:
                out, ctx = fixed_weights_forward(hooked, v, q.shape)  # (B, H, L, Dv or C)
                return out, (hooked.copy() if need_weights else None), ctx
        weights = None if ctx.weights is None or not need_weights else \
            ctx.weights.reshape(b, heads, length, seq_k).copy()  # (B, H, L, S)
        return out, weights, ctx

    # ------------------------------------------------------------------------------------------------
    def backward(self, grad_output: Any) -> np.ndarray:
        """Add every parameter's gradient into ``self.grads``; return ``grad_x`` (B, L, D).

        Only after an explicit forward without a cache (the absorbed and cached forms are inference).
        """
        if self.saved_tensors is None:
            raise RuntimeError("MultiHeadLatentAttention.backward needs an explicit forward without a cache "
                               "just before it")
        x, (cos, sin), q_saved, c, c_norm, merged, ctx = self.saved_tensors
        cfg, p = self.config, self._parameters
        b, length, _ = x.shape
        h, dn = cfg.num_heads, cfg.qk_nope_head_dim
        g = check_grad_output(grad_output, x.shape, x.dtype, "MultiHeadLatentAttention")
        grad_merged, grad_w, grad_b = linear_backward(g, merged, p["W_O"], "b_O" in p)  # (B, L, H*Dv)
        self._accumulate("O", grad_w, grad_b)
        grad_out = grad_merged.reshape(b, length, h, cfg.v_head_dim)  # (B, L, H, Dv)
        hooked = self._hook_table is not None
        if hooked:
            grad_out = self.hook_backward("hook_z", grad_out)
        grad_out = grad_out.transpose(0, 2, 1, 3)  # (B, H, L, Dv)
        if isinstance(ctx, FixedWeights):  # a replaced pattern: the scores, so q and k, no longer matter
            dq, dk, dv = fixed_weights_backward(grad_out, ctx)  # (B, H, L, *)
        else:
            dq, dk, dv = flex_attention_backward(np.ascontiguousarray(grad_out), ctx)[:3]  # (B, H, L, *)
        if hooked:
            dq, dk, dv = (hook_heads_backward(self, name, d) for name, d in (("hook_q", dq), ("hook_k", dk),
                                                                             ("hook_v", dv)))
        grad_x = self._latent_backward(x, cos, sin, c, c_norm, dk, dv)  # (B, L, D)
        dq_rope = _turn(dq[..., dn:], cos, sin, cfg.rope_interleaved, backward=True)  # (B, H, L, R)
        dq = np.concatenate([dq[..., :dn], dq_rope], axis=-1)  # (B, H, L, Dn+R)
        dq = dq.transpose(0, 2, 1, 3).reshape(b, length, -1)  # (B, L, H*(Dn+R))
        grad_x += self._queries_backward(x, q_saved, dq)  # (B, L, D)
        return grad_x

    def _latent_backward(self, x, cos, sin, c, c_norm, dk, dv) -> np.ndarray:
        """From the key and value heads' gradients back through ``W_KVB``, the latent norm, the shared key's
        rotation and ``W_KVA``: that path's share of ``grad_x`` (B, L, D)."""
        cfg, p = self.config, self._parameters
        dc, dk_rope, grad_w = _latent.expand_latent_backward(dk, dv, c, p["W_KVB"],
                                                             cfg.qk_nope_head_dim)  # (B, L, C), (B, L, R)
        self.grads["W_KVB"] += grad_w
        dk_rope = _turn(dk_rope[:, None], cos, sin, cfg.rope_interleaved, backward=True)[:, 0]  # (B, L, R)
        dc, grad_gain = rms_norm_backward(dc, *c_norm, p["kv_a_norm"])  # (B, L, C)
        self.grads["kv_a_norm"] += grad_gain
        d_kv_a = np.concatenate([dc, dk_rope], axis=-1)  # (B, L, C+R)
        grad_x, grad_w, grad_b = linear_backward(d_kv_a, x, p["W_KVA"], "b_KVA" in p)  # (B, L, D)
        self._accumulate("KVA", grad_w, grad_b)
        return grad_x

    def _queries_backward(self, x, q_saved, dq: np.ndarray) -> np.ndarray:
        """From the (unrotated) query projection's gradient (B, L, H*(Dn+R)) to its share of ``grad_x``."""
        p = self._parameters
        if q_saved is None:
            grad_x, grad_w, _ = linear_backward(dq, x, p["W_Q"])  # (B, L, D)
            self.grads["W_Q"] += grad_w
            return grad_x
        a, a_hat, a_rstd = q_saved
        da, grad_w, _ = linear_backward(dq, a, p["W_QB"])  # (B, L, Cq)
        self.grads["W_QB"] += grad_w
        da, grad_gain = rms_norm_backward(da, a_hat, a_rstd, p["q_a_norm"])  # (B, L, Cq)
        self.grads["q_a_norm"] += grad_gain
        grad_x, grad_w, grad_b = linear_backward(da, x, p["W_QA"], "b_QA" in p)  # (B, L, D)
        self._accumulate("QA", grad_w, grad_b)
        return grad_x

    def _accumulate(self, name: str, grad_w: np.ndarray, grad_b: np.ndarray | None) -> None:
        self.grads[f"W_{name}"] += grad_w
        if grad_b is not None:
            self.grads[f"b_{name}"] += grad_b

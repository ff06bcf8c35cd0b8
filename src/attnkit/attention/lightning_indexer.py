"""``LightningIndexer``: DeepSeek Sparse Attention's (DSA) scorer of which keys each query attends to.

Dimension letters: B batch, L new tokens, S keys (past + new), D ``hidden_size``, Cq ``q_lora_rank``, Hi the
indexer's heads (``index_n_heads``), Di their width (``index_head_dim``), R ``qk_rope_head_dim``.

DeepSeek-V3.2 adds to each multi-head latent attention layer a small scorer with its own projections::

    q_h  = rope(a W_QB)_h                 a = the attention's normalised query latent (B, L, Cq)
    k    = rope(layer_norm(x W_K))        one key per token, shared by the Hi heads
    w_h  = (x W_weights)_h / sqrt(Hi)
    I[t, s] = sum_h w_h[t] relu(q_h[t] . k[s] / sqrt(Di))

rope turns the first R features as half-split pairs (the attention's own rotary pairs are interleaved) with
the attention's angles. Each query keeps the ``index_topk`` keys of highest ``I`` among the keys it may see,
and latent attention runs over those only (:class:`~attnkit.attention.latent.MultiHeadLatentAttention`).
The choice is discrete, so the language-model loss gives the indexer no gradient (``transformers`` runs it
under ``no_grad``); it is trained by :func:`indexer_kl_loss`, the KL divergence from the attention's
distribution to the softmax of its scores, whose gradient :meth:`LightningIndexer.backward` carries to its
parameters.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import check_grad_output
from ..core.module import Module
from ..init import as_generator, normal
from ..kernels import indexer as _indexer
from ..kernels import rotary as _rotary
from ..kernels.linear import linear, linear_backward
from ..kernels.norm import layer_norm_backward, layer_norm_forward

__all__ = ["LightningIndexer", "indexer_kl_loss", "half_split_rotary"]

# transformers builds the indexer's key norm with nn.LayerNorm(index_head_dim, eps=1e-6) whatever the config says
KEY_NORM_EPS = 1e-6


def half_split_rotary(cos: np.ndarray, sin: np.ndarray, interleaved: bool):
    """The same angles in the half-split layout the indexer turns its pairs in: ``(cos, sin)`` (B, L, R)."""
    if not interleaved:
        return cos, sin
    return tuple(np.concatenate([t[..., 0::2], t[..., 0::2]], axis=-1) for t in (cos, sin))  # (B, L, R) each


class LightningIndexer(Module):
    """DSA's lightning indexer: per-query scores of every key, and the top-k keys chosen from them.

    Parameters
    ----------
    hidden_size, q_lora_rank : int
        D and Cq: the indexer reads the layer input ``x`` and the attention's normalised query latent ``a``.
    num_heads, head_dim : int
        Hi (``index_n_heads``) and Di (``index_head_dim``).
    rope_dim : int
        R, the features of each query and key turned by rotary (the first R of Di).
    top_k : int
        ``index_topk``, the keys each query keeps.
    rng : numpy.random.Generator or int, optional
        Source of the ``N(0, 0.02^2)`` initial weights (the key norm starts at gain one, bias zero).

    Attributes
    ----------
    W_QB : (Cq, Hi*Di)
        ``indexer.wq_b.weight`` transposed.
    W_K : (D, Di)
        ``indexer.wk.weight`` transposed.
    k_norm, k_norm_bias : (Di,)
        ``indexer.k_norm.weight`` and ``.bias`` (a LayerNorm, eps 1e-6).
    W_weights : (D, Hi)
        ``indexer.weights_proj.weight`` transposed.

    Shapes
    ------
    x : (B, L, D), a : (B, L, Cq), rotary ``(cos, sin)`` each (B, L, R) in the half-split layout
    (:func:`half_split_rotary`); ``keys`` (B, S, Di) from :meth:`keys` (the cached and new tokens'), None: the
    new tokens' own. Returns the scores (B, L, S) in at least float32.

    Examples
    --------
    >>> idx = LightningIndexer(hidden_size=8, q_lora_rank=6, num_heads=2, head_dim=4, rope_dim=2, top_k=2, rng=0)
    >>> cos, sin = np.ones((1, 3, 2), np.float32), np.zeros((1, 3, 2), np.float32)
    >>> scores = idx(np.ones((1, 3, 8), np.float32), np.ones((1, 3, 6), np.float32), rotary=(cos, sin))
    >>> scores.shape, idx.select(scores, np.tril(np.ones((3, 3), bool))).sum(axis=-1).tolist()
    ((1, 3, 3), [[1, 2, 2]])
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int,
                 top_k: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        if rope_dim > head_dim:
            raise ValueError(f"LightningIndexer: head_dim ({head_dim}) must be at least rope_dim ({rope_dim}): the "
                             f"first rope_dim features of each head are turned")
        self.num_heads, self.head_dim, self.rope_dim, self.top_k = num_heads, head_dim, rope_dim, top_k
        self.scale = head_dim ** -0.5
        gen = as_generator(rng)
        for name, shape in (("W_QB", (q_lora_rank, num_heads * head_dim)), ("W_K", (hidden_size, head_dim)),
                            ("W_weights", (hidden_size, num_heads))):
            self.register_parameter(name, normal(gen, shape, std=0.02))
        self.register_parameter("k_norm", np.ones(head_dim))
        self.register_parameter("k_norm_bias", np.zeros(head_dim))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, rope_dim={self.rope_dim}, "
                f"top_k={self.top_k}")

    def keys(self, x: np.ndarray, rotary) -> np.ndarray:
        """The new tokens' index keys ``rope(layer_norm(x W_K))`` (B, L, Di), what a cache keeps."""
        return self._keys(x, rotary)[0]

    def _keys(self, x: np.ndarray, rotary):
        p = self._parameters
        k = linear(x, p["W_K"])  # (B, L, Di)
        k, k_hat, k_rstd = _layer_norm(k, p["k_norm"], p["k_norm_bias"])  # (B, L, Di)
        if rotary is not None:  # a layer without positions (NoPE) turns nothing
            k = _rotary.rotary_apply(k[:, None], *rotary)[:, 0]  # (B, L, Di)
        return k, (k_hat, k_rstd)

    def forward(self, x: Any, a: Any, *, rotary, keys: np.ndarray | None = None) -> np.ndarray:
        """Index scores (B, L, S) of the new tokens against ``keys`` (None: their own keys, S = L, and what
        :meth:`backward` needs is kept)."""
        p = self._parameters
        b, length, _ = x.shape
        q = linear(a, p["W_QB"]).reshape(b, length, self.num_heads, self.head_dim)  # (B, L, Hi, Di)
        if rotary is not None:
            q = _rotary.rotary_apply(q.transpose(0, 2, 1, 3), *rotary).transpose(0, 2, 1, 3)  # (B, L, Hi, Di)
        w = linear(x, p["W_weights"]) * x.dtype.type(self.num_heads ** -0.5)  # (B, L, Hi)
        if keys is None:
            keys, k_norm = self._keys(x, rotary)  # (B, L, Di)
            self.save_for_backward(x, a, rotary, q, keys, k_norm, w)
        else:
            self.save_for_backward()
        return _indexer.index_scores(q, keys, w, self.scale)  # (B, L, S)

    def select(self, scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """The ``top_k`` best-scored keys of each query among ``allowed`` (bool, broadcastable to (B, L, S));
        (B, L, S) bool, ``True`` = attended."""
        return _indexer.top_k_selection(scores, allowed, self.top_k)

    def choose(self, scores: np.ndarray, allowed: np.ndarray):
        """The same choice as indices: ``(indices, valid)`` (B, L, K), K = min(``top_k``, S), ``valid`` False where a
        query has fewer allowed keys (:func:`attnkit.kernels.indexer.top_k_indices`)."""
        return _indexer.top_k_indices(scores, allowed, self.top_k)

    def backward(self, grad_scores: Any):
        """Add every parameter's gradient into ``self.grads`` from ``grad_scores`` (B, L, L); return
        ``(grad_x, grad_a)``. Only after a forward without ``keys``."""
        if self.saved_tensors is None:
            raise RuntimeError("LightningIndexer.backward needs a forward without keys just before it")
        x, a, rotary, q, keys, (k_hat, k_rstd), w = self.saved_tensors
        p = self._parameters
        b, length, _ = x.shape
        g = check_grad_output(grad_scores, (b, length, length), np.promote_types(x.dtype, np.float32),
                              "LightningIndexer")
        dq, dk, dw = _indexer.index_scores_backward(g, q, keys, w, self.scale)  # (B,L,Hi,Di), (B,L,Di), (B,L,Hi)
        dq, dk, dw = (t.astype(x.dtype, copy=False) for t in (dq, dk, dw))
        dw = dw * x.dtype.type(self.num_heads ** -0.5)  # (B, L, Hi)
        grad_x, grad_w, _ = linear_backward(dw, x, p["W_weights"])  # (B, L, D)
        self.grads["W_weights"] += grad_w
        if rotary is not None:
            dk = _rotary.rotary_backward(dk[:, None], *rotary)[:, 0]  # (B, L, Di)
        dk, grad_gain, grad_bias = layer_norm_backward(dk, k_hat, k_rstd, p["k_norm"])  # (B, L, Di)
        self.grads["k_norm"] += grad_gain
        self.grads["k_norm_bias"] += grad_bias
        gx, grad_w, _ = linear_backward(dk, x, p["W_K"])  # (B, L, D)
        self.grads["W_K"] += grad_w
        grad_x += gx
        if rotary is not None:
            dq = _rotary.rotary_backward(dq.transpose(0, 2, 1, 3), *rotary).transpose(0, 2, 1, 3)  # (B, L, Hi, Di)
        grad_a, grad_w, _ = linear_backward(dq.reshape(b, length, -1), a, p["W_QB"])  # (B, L, Cq)
        self.grads["W_QB"] += grad_w
        return grad_x, grad_a


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray):
    return layer_norm_forward(x, gamma, beta, KEY_NORM_EPS)


def indexer_kl_loss(scores: Any, attention_weights: Any, support: Any):
    """DSA's indexer loss and its gradient: ``sum_t KL(p_t || softmax(I_t))`` over each query's ``support``.

    ``p_t`` is the main attention's weights summed over its heads, kept on the support and renormalised
    (DeepSeek-V3.2: the dense warm-up takes every key a query sees as its support, the sparse stage the
    selected keys). The target carries no gradient; feed the returned ``grad_scores`` to
    :meth:`LightningIndexer.backward`. ``transformers`` implements no indexer loss (its indexer is inference
    only).

    Parameters
    ----------
    scores : (B, L, S) the indexer's scores
    attention_weights : (B, H, L, S) non-negative, the attention pattern (``output_attentions``)
    support : (B, L, S) bool, ``True`` = the key takes part in the row's distributions

    Returns
    -------
    loss : float
    grad_scores : (B, L, S), ``softmax(I_t) - p_t`` on the support, in ``scores``' dtype

    Examples
    --------
    >>> s = np.array([[[0.0, 0.0]]])
    >>> loss, g = indexer_kl_loss(s, np.array([[[[0.5, 0.5]]]]), np.ones((1, 1, 2), bool))
    >>> round(loss, 12), g.tolist()
    (0.0, [[[0.0, 0.0]]])
    """
    scores, weights, support = (np.asarray(t) for t in (scores, attention_weights, support))
    if scores.ndim != 3 or weights.ndim != 4 or weights.shape[:1] + weights.shape[2:] != scores.shape:
        raise ValueError(f"indexer_kl_loss: scores must be (B, L, S) and attention_weights (B, H, L, S) with the "
                         f"same B, L, S; got {scores.shape} and {weights.shape}")
    if support.shape != scores.shape or support.dtype != np.bool_:
        raise ValueError(f"indexer_kl_loss: support must be a boolean array of shape {scores.shape}, got "
                         f"{support.shape} {support.dtype}")
    if (weights < 0).any():
        raise ValueError("indexer_kl_loss: attention_weights must be non-negative (a softmax pattern)")
    target = weights.sum(axis=1)  # (B, L, S)
    loss = _indexer.indexer_kl(scores, target, support)
    grad = _indexer.indexer_kl_backward(scores, target, support).astype(scores.dtype, copy=False)  # (B, L, S)
    return loss, grad

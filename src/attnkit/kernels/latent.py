"""Multi-head latent attention's up-projections, explicit and absorbed, and their gradient (unchecked kernels).

Dimension letters: B batch, H heads, L queries, S keys, C latent width (``kv_lora_rank``), Dn the heads' features
without position (``qk_nope_head_dim``), R the shared rotary key's (``qk_rope_head_dim``), Dv value features.

``w_kvb`` (C, H*(Dn+Dv)) holds, per head h, ``W_UK_h`` (C, Dn) then ``W_UV_h`` (C, Dv). The explicit form builds
key head ``[c W_UK_h, k_r]`` and value head ``c W_UV_h`` from the latent ``c`` and the rotary key ``k_r``; the
absorbed form regroups the same products, ``q_nope_h . (c W_UK_h) = (q_nope_h W_UK_h^T) . c`` and
``sum_j p_j (c_j W_UV_h) = (sum_j p_j c_j) W_UV_h``, so attention runs on ``[c, k_r]`` itself.
"""
from __future__ import annotations

import numpy as np

from .linear import linear, linear_backward

__all__ = ["absorb_queries", "absorbed_values", "expand_latent", "expand_latent_backward", "split_up_projection"]


def split_up_projection(w_kvb: np.ndarray, num_heads: int, nope_dim: int, dtype=None):
    """``W_UK`` (H, Dn, C) transposed for ``q_nope @ W_UK`` and ``W_UV`` (H, C, Dv), views of ``w_kvb``."""
    w = w_kvb if dtype is None else w_kvb.astype(dtype, copy=False)
    w = w.reshape(w.shape[0], num_heads, -1)  # (C, H, Dn+Dv)
    return w[..., :nope_dim].transpose(1, 2, 0), w[..., nope_dim:].transpose(1, 0, 2)  # (H, Dn, C), (H, C, Dv)


def expand_latent(c: np.ndarray, k_rope: np.ndarray, w_kvb: np.ndarray, num_heads: int, nope_dim: int):
    """The explicit form's heads: keys ``[c W_UK_h, k_r]`` (B, H, S, Dn+R) and values ``c W_UV_h`` (B, H, S, Dv).

    c (B, S, C), k_rope (B, S, R), both in the compute dtype.
    """
    b, s, _ = c.shape
    kv = linear(c, w_kvb).reshape(b, s, num_heads, -1).transpose(0, 2, 1, 3)  # (B, H, S, Dn+Dv)
    shared = np.broadcast_to(k_rope[:, None], (b, num_heads, s, k_rope.shape[-1]))  # (B, H, S, R), a view
    k = np.concatenate([kv[..., :nope_dim], shared], axis=-1)  # (B, H, S, Dn+R)
    return k, np.ascontiguousarray(kv[..., nope_dim:])  # (B, H, S, Dv)


def expand_latent_backward(dk: np.ndarray, dv: np.ndarray, c: np.ndarray, w_kvb: np.ndarray, nope_dim: int):
    """Gradients of :func:`expand_latent`: ``dc`` (B, S, C), ``dk_rope`` (B, S, R) and ``grad_w_kvb``.

    The rotary key is one per token, read by every head: its gradient is the sum over the heads.
    """
    b, _, s, _ = dk.shape
    dk_rope = dk[..., nope_dim:].sum(axis=1)  # (B, S, R)
    dkv = np.concatenate([dk[..., :nope_dim], dv], axis=-1)  # (B, H, S, Dn+Dv)
    dkv = dkv.transpose(0, 2, 1, 3).reshape(b, s, -1)  # (B, S, H*(Dn+Dv))
    dc, grad_w, _ = linear_backward(dkv, c, w_kvb)  # (B, S, C)
    return dc, dk_rope, grad_w


def absorb_queries(q: np.ndarray, w_uk: np.ndarray, nope_dim: int) -> np.ndarray:
    """Queries in the latent space: ``[q_nope_h W_UK_h^T, q_rope_h]`` (B, H, L, C+R) from q (B, H, L, Dn+R)."""
    q_latent = q[..., :nope_dim] @ w_uk  # (B, H, L, C)
    return np.concatenate([q_latent, q[..., nope_dim:]], axis=-1)  # (B, H, L, C+R)


def absorbed_values(out_latent: np.ndarray, w_uv: np.ndarray) -> np.ndarray:
    """Each head's average of the latents leaves the latent space once: (B, H, L, C) -> (B, H, L, Dv)."""
    return out_latent @ w_uv  # (B, H, L, Dv)

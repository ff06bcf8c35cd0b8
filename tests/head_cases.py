"""The catalogue of attention heads the head tests run over, and an independent T5 bucket reference.

Dimension letters: B batch, H heads, Lq/Lk query/key length, D query/key features.
"""
from __future__ import annotations

import numpy as np

from attnkit.attention import (
    AdditiveAttention,
    Attention,
    CausalAttention,
    LearnedBiasAttention,
    PhysicsGuidedAttention,
)
from attnkit.core import BaseAttention

from helpers import make_rng

B, H, LQ, LK, D, DV = 2, 2, 3, 5, 3, 2


# --------------------------------------------------------------------------------------------------------
# Head factories: name -> (factory(seed) -> head, per_head_inputs). per_head_inputs: inputs are (B, H, L, D).
# Every factory gives random (non-initial) parameter values so that the checks are not degenerate.
# --------------------------------------------------------------------------------------------------------
def randomise(head: BaseAttention, seed: int = 5) -> BaseAttention:
    rng = make_rng(seed)
    for name, p in head.named_parameters():
        if name == "log_length_scale":
            p[...] = np.log(1.7)
        elif name != "slopes":
            p[...] = rng.normal(size=p.shape)
    return head


def prior_fn(xq, xk):
    return np.cos(0.7 * (xq[:, None] - xk[None, :]))  # (Tq, Tk)


HEADS = {
    "attention": (lambda s: Attention(), False),
    "attention_future": (lambda s: Attention(future_mask=True), False),
    "attention_dropout": (lambda s: Attention(dropout=0.3, seed=s), False),
    "causal": (lambda s: CausalAttention(scale=0.7), False),
    "causal_dropout": (lambda s: CausalAttention(dropout=0.25, seed=s), False),
    "additive": (lambda s: randomise(AdditiveAttention(D, D, 4, rng=0)), False),
    "t5": (lambda s: randomise(LearnedBiasAttention(H, max_distance=6, num_buckets=8)), True),
    "t5_causal": (lambda s: randomise(LearnedBiasAttention(H, max_distance=5, num_buckets=6,
                                                            bidirectional=False)), True),
    "t5_dropout": (lambda s: randomise(LearnedBiasAttention(H, max_distance=6, num_buckets=8, dropout=0.3,
                                                             seed=s)), True),
    "alibi": (lambda s: randomise(LearnedBiasAttention(H, mode="alibi")), True),
    "alibi_causal": (lambda s: randomise(LearnedBiasAttention(H, mode="alibi", bidirectional=False)), True),
    "physics_decay": (lambda s: randomise(PhysicsGuidedAttention(length_scale=2.0)), False),
    "physics_gauss_heads": (lambda s: randomise(PhysicsGuidedAttention(
        "gaussian", num_heads=H, learn_length_scale=True)), True),
    "physics_points": (lambda s: randomise(PhysicsGuidedAttention(
        coordinates=make_rng(9).uniform(size=(LK + 2, 2)), num_heads=H, learn_length_scale=True)), True),
    "physics_pair": (lambda s: randomise(PhysicsGuidedAttention(
        "gaussian", coordinates=(make_rng(10).normal(size=LQ), make_rng(11).normal(size=LK)),
        learn_length_scale=True)), False),
    "physics_callable": (lambda s: randomise(PhysicsGuidedAttention(prior_fn, num_heads=H, dropout=0.2,
                                                                     seed=s)), True),
}



def t5_bucket_reference(rel, bidirectional, num_buckets, max_distance):
    """Direct transcription of HuggingFace T5Attention._relative_position_bucket (torch, float32 log)."""
    import math

    import torch
    relative_position = torch.from_numpy(np.asarray(rel, dtype=np.int64))
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets.numpy()


def modifier_values(mod, heads: int, seq_q: int, seq_k: int, q_rows=slice(None), k_cols=slice(None)):
    """What score modifier ``mod`` adds to zero scores of ``heads`` heads, (H, Tq, Tk) for the tile
    ``[q_rows, k_cols]`` of an (Lq, Lk) score matrix (indices as the kernels pass them)."""
    from attnkit.kernels.flex import score_index

    q_idx, k_idx = np.arange(seq_q)[q_rows], np.arange(seq_k)[k_cols]
    b, h, _, _ = score_index(1, heads, 0, 1, 0, 1)
    return mod.forward(np.zeros((1, heads, q_idx.size, k_idx.size)), b, h, q_idx.reshape(1, 1, -1, 1),
                       k_idx.reshape(1, 1, 1, -1))[0]  # (H, Tq, Tk)

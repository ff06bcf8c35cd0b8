"""The logit lens: what each block of a causal LM would predict if it were the last.

Each block's output hidden state goes through the model's final norm and output head; the top-k tokens of
the resulting distribution show how the prediction forms layer by layer.

Shapes: N layers, B batch, L tokens, D model width, V vocabulary, K top_k.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._validation import check_positive_int
from ..kernels.linear import linear
from ._inputs import as_id_batch


class LogitLens(NamedTuple):
    """Top-k predictions of every layer: ``token_ids`` int64 and ``probs`` (the model's dtype), each
    (N, L, K) for one sequence or (B, N, L, K) for a batch, best first."""

    token_ids: np.ndarray
    probs: np.ndarray


def logit_lens(lm, ids: Any, top_k: int = 5) -> LogitLens:
    """Every block's output through the final norm and the head: top-k next-token ids and probabilities.

    Parameters
    ----------
    lm : CausalLM
    ids : array_like of int, (L,) or (B, L)
    top_k : int, default 5
        How many tokens per layer and position (at most the vocabulary size).

    Returns
    -------
    LogitLens
        ``(token_ids, probs)``, each (num_layers, L, top_k) for one sequence or (B, num_layers, L, top_k)
        for a batch, sorted by probability. The last layer's row is the model's own output distribution.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=3, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> lens = logit_lens(lm, [1, 2, 3, 4], top_k=2)
    >>> lens.token_ids.shape, lens.probs.shape
    ((3, 4, 2), (3, 4, 2))
    >>> bool((lens.token_ids[-1, :, 0] == lm(np.array([[1, 2, 3, 4]]))[0].argmax(-1)).all())
    True
    """
    vocab = lm.config.vocab_size
    top_k = check_positive_int(top_k, "top_k", maximum=vocab)
    batch, single = as_id_batch(ids, vocab)
    states = lm.layer_outputs(batch)  # N x (B, L, D)
    weight = lm.head_weight
    top_ids, top_probs = [], []
    for state in states:  # one (B, L, V) at a time: N x L x V at once can be gigabytes
        h = lm.norm(state)  # (B, L, D)
        logits = linear(h, weight.astype(h.dtype, copy=False).T)  # (B, L, V)
        logits *= logits.dtype.type(lm.config.scales.logit)  # Granite's 1 / logits_scaling; 1 elsewhere
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))  # (B, L, V)
        probs /= probs.sum(axis=-1, keepdims=True)
        best = np.argpartition(-probs, top_k - 1, axis=-1)[..., :top_k]  # (B, L, K) unordered
        best_probs = np.take_along_axis(probs, best, axis=-1)  # (B, L, K)
        order = np.argsort(-best_probs, axis=-1, kind="stable")  # (B, L, K)
        top_ids.append(np.take_along_axis(best, order, axis=-1))
        top_probs.append(np.take_along_axis(best_probs, order, axis=-1))
    token_ids = np.stack(top_ids, axis=1).astype(np.int64)  # (B, N, L, K)
    probs_out = np.stack(top_probs, axis=1)  # (B, N, L, K)
    if single:
        return LogitLens(token_ids[0], probs_out[0])
    return LogitLens(token_ids, probs_out)

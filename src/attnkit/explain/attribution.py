"""Input attributions of a causal LM's prediction, from attnkit's exact backward.

Both functions differentiate the log-probability of one output token at one position with respect to the
input (token) embeddings, with :meth:`attnkit.models.CausalLM.backward`: no framework, no approximation.

Shapes: B batch, L tokens, D model width, V vocabulary.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_array
from ._inputs import as_id_batch, check_position


def embedding_gradient(lm, ids: Any, target_position: int = -1,
                       target_token: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradient of ``log p(target_token | ids[..., :target_position + 1])`` w.r.t. the token embeddings.

    Parameters
    ----------
    lm : CausalLM
        The model. Its backward forms the inputs' gradient alone (``Module.input_gradients_only``); its
        gradient buffers are left freed (zeros when read).
    ids : array_like of int, (L,) or (B, L)
        The input tokens.
    target_position : int
        The position whose next-token distribution is explained (negative counts from the end).
    target_token : int or array_like of int (B,), optional
        The output token explained; default the model's top token at ``target_position``.

    Returns
    -------
    grad : ndarray (B, L, D)
        The gradient, in the model's dtype.
    embeddings : ndarray (B, L, D)
        The token embeddings it is taken with respect to.
    target : ndarray (B,) int64
        The explained output token of each row.
    """
    batch, _ = as_id_batch(ids, lm.config.vocab_size)
    b, length = batch.shape
    position = check_position(target_position, length)
    logits = lm(batch)  # (B, L, V)
    row = logits[:, position].astype(np.float64)  # (B, V)
    probs = np.exp(row - row.max(axis=-1, keepdims=True))  # (B, V)
    probs /= probs.sum(axis=-1, keepdims=True)
    if target_token is None:
        target = row.argmax(axis=-1)  # (B,)
    else:
        given = as_array(target_token, "target_token")
        if given.dtype.kind not in "iu" or given.shape not in ((), (b,)) or (given < 0).any() or \
                (given >= lm.config.vocab_size).any():
            raise ValueError(f"target_token must be None or token ids in [0, {lm.config.vocab_size}) (an int or "
                             f"one per row), got {target_token!r}")
        target = np.broadcast_to(given, (b,)).astype(np.int64)  # (B,)
    # d log softmax(z)[t] / dz = onehot(t) - softmax(z), at the explained position only.
    grad_logits = np.zeros(logits.shape, dtype=logits.dtype)  # (B, L, V)
    grad_row = -probs  # (B, V)
    grad_row[np.arange(b), target] += 1.0
    grad_logits[:, position] = grad_row
    with lm.input_gradients_only():
        grad = lm.backward(grad_logits)  # (B, L, D)
    embeddings = lm.embed.weight[batch]  # (B, L, D)
    return grad, embeddings, target


def gradient_x_input(lm, ids: Any, target_position: int = -1, target_token: Any = None) -> np.ndarray:
    """Gradient x input: per input token, ``sum_d grad[l, d] * embedding[l, d]``.

    The gradient is that of the target token's log-probability at ``target_position`` with respect to the
    input token embeddings (see :func:`saliency` for its norm). Positive values pushed the model towards the
    target token, negative ones away from it.

    Parameters
    ----------
    lm : CausalLM
        A decoder LM (``attnkit.models.CausalLM``, e.g. from ``load_causal_lm``). Its gradient buffers
        are left freed (zeros when read).
    ids : array_like of int, (L,) or (B, L)
    target_position : int, default -1
        Which position's next-token prediction to explain.
    target_token : int or array_like (B,), optional
        The output token to explain; default the model's top token at ``target_position``.

    Returns
    -------
    ndarray (L,) for one sequence, (B, L) for a batch, in the model's dtype. Positions after
    ``target_position`` are exactly zero (the model is causal).

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> scores = gradient_x_input(lm, [1, 2, 3, 4], target_position=2)
    >>> scores.shape, float(scores[3])
    ((4,), 0.0)
    """
    batch, single = as_id_batch(ids, lm.config.vocab_size)
    grad, embeddings, _ = embedding_gradient(lm, batch, target_position, target_token)
    scores = (grad * embeddings).sum(axis=-1)  # (B, L)
    return scores[0] if single else scores


def saliency(lm, ids: Any, target_position: int = -1, target_token: Any = None) -> np.ndarray:
    """Saliency: per input token, the L2 norm over the embedding of the target log-probability's gradient.

    Same arguments as :func:`gradient_x_input`; non-negative scores of shape (L,) for one sequence,
    (B, L) for a batch.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="gpt2", vocab_size=11, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
    ...                     head_dim=4, mlp=MLPConfig(12), max_position_embeddings=8)
    >>> s = saliency(CausalLM(cfg, rng=0), [1, 2, 3])
    >>> s.shape, bool((s > 0).all())
    ((3,), True)
    """
    batch, single = as_id_batch(ids, lm.config.vocab_size)
    grad, _, _ = embedding_gradient(lm, batch, target_position, target_token)
    scores = np.sqrt((grad * grad).sum(axis=-1))  # (B, L)
    return scores[0] if single else scores

"""Greedy and beam-search decoding for any model that scores the next token from a per-row decoding state.

The model side is a :class:`DecodingState`-like object with two methods:

- ``step(tokens (R,), t) -> log_probs (R, V)``: feed the token at target position ``t`` of every row and get
  the log-probabilities of the next token (rows keep their own cache);
- ``reorder(index (R',))``: row ``r`` of the state becomes a copy of row ``index[r]`` (rows may repeat).

Beam search scores every finished hypothesis as ``(sum of the log-probabilities of its generated tokens, eos
included) / (number of generated tokens) ** length_penalty``; hypotheses still open after
``max_new_tokens`` are scored the same way, and the best score wins. Open hypotheses are pruned to the
``num_beams`` best by their summed log-probability; with ``num_beams`` at least the number of open prefixes
(``(V - 1) ** (max_new_tokens - 1)``) nothing is pruned and the search is exact. A row stops early only when
no open hypothesis can still beat its best finished one (their sums can only fall as tokens are added).

Dimension letters: B batch, K ``num_beams``, V vocabulary, N ``max_new_tokens``.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from .._validation import check_positive_int, check_real

__all__ = ["DecodingState", "greedy_search", "beam_search", "MAX_NUM_BEAMS", "check_num_beams", "useful_beams"]

MAX_NUM_BEAMS = 1024  # every beam is a decoder row with its own cache: B * K rows are decoded each step


def check_num_beams(num_beams: Any) -> int:
    """``num_beams`` as an int in ``[1, MAX_NUM_BEAMS]``; ``TypeError``/``ValueError`` naming it otherwise."""
    value = check_positive_int(num_beams, "num_beams")
    if value > MAX_NUM_BEAMS:
        raise ValueError(f"num_beams must be at most {MAX_NUM_BEAMS} (each beam decodes a row of its own), "
                         f"got {value}")
    return value


def useful_beams(num_beams: int, vocab_size: int, max_new_tokens: int) -> int:
    """The beams that can change the result: at most ``(V - 1) ** (N - 1)`` prefixes are ever open, and with
    that many beams nothing is pruned (the search is exact), so more beams only cost memory.

    >>> useful_beams(1024, 12, 2), useful_beams(4, 12, 5), useful_beams(5, 2, 9)
    (11, 4, 1)
    """
    open_prefixes, base = 1, max(1, vocab_size - 1)
    for _ in range(max_new_tokens - 1):
        if open_prefixes >= num_beams or base == 1:
            break
        open_prefixes *= base
    return min(num_beams, open_prefixes)


class DecodingState(Protocol):
    """What the search functions drive (see the module docstring)."""

    def step(self, tokens: np.ndarray, t: int) -> np.ndarray: ...

    def reorder(self, index: np.ndarray) -> None: ...


def _finish(sequences: np.ndarray, lengths: np.ndarray, bos_token_id: int, pad_token_id: int) -> np.ndarray:
    """``(B, 1 + n)`` ids: bos, then each row's tokens, then pad; n the longest row's length."""
    width = int(lengths.max()) if lengths.size else 0
    out = np.full((sequences.shape[0], 1 + width), pad_token_id, dtype=np.int64)  # (B, 1 + n)
    out[:, 0] = bos_token_id
    keep = np.arange(width)[None, :] < lengths[:, None]  # (B, n)
    out[:, 1:][keep] = sequences[:, :width][keep]
    return out


def greedy_search(state: Any, batch_size: int, *, bos_token_id: int, eos_token_id: int, max_new_tokens: int,
                  pad_token_id: int = 0) -> np.ndarray:
    """The most likely next token at every step, until every row has emitted eos or N tokens.

    Returns
    -------
    ids : int64 (B, 1 + n), starting with bos, pad after each row's eos; n <= N is the longest row.
    """
    tokens = np.full(batch_size, bos_token_id, dtype=np.int64)  # (B,)
    generated = np.full((batch_size, max_new_tokens), pad_token_id, dtype=np.int64)  # (B, N)
    lengths = np.zeros(batch_size, dtype=np.int64)  # (B,)
    finished = np.zeros(batch_size, dtype=bool)  # (B,)
    for t in range(max_new_tokens):
        log_probs = state.step(tokens, t)  # (B, V)
        tokens = np.where(finished, pad_token_id, log_probs.argmax(axis=-1))  # (B,)
        generated[:, t] = tokens
        lengths += ~finished
        finished |= tokens == eos_token_id
        if finished.all():
            break
    return _finish(generated, lengths, bos_token_id, pad_token_id)


def _normalised(sums: np.ndarray, length: int, length_penalty: float) -> np.ndarray:
    """``sums / length ** length_penalty`` in float64 for any finite penalty: an overflowing or vanishing
    ``length ** length_penalty`` ranks hypotheses by the sign of their sums, never raises, and keeps ``-inf``
    (an impossible hypothesis) at ``-inf``."""
    with np.errstate(over="ignore", under="ignore"):
        scale = np.power(np.float64(length), -length_penalty)  # 0 when length ** lp overflows
        if scale == 0.0:
            scale = np.float64(np.finfo(np.float64).tiny)  # keeps the sign order of the sums
        if np.isinf(scale):
            scale = np.float64(np.finfo(np.float64).max)
        return np.where(np.isneginf(sums), -np.inf, sums * scale)


def beam_search(state: Any, batch_size: int, *, num_beams: int, bos_token_id: int, eos_token_id: int,
                max_new_tokens: int, length_penalty: float = 1.0, pad_token_id: int = 0) -> np.ndarray:
    """Beam search with length-normalised scores (see the module docstring); ``state`` has B rows on entry.

    ``num_beams`` K must be in ``[1, MAX_NUM_BEAMS]`` (``ValueError`` naming it).

    Returns
    -------
    ids : int64 (B, 1 + n), starting with bos, the best hypothesis of each row, pad after its eos.
    """
    length_penalty = check_real(length_penalty, "length_penalty")
    b, k, n_max = batch_size, check_num_beams(num_beams), max_new_tokens
    state.reorder(np.repeat(np.arange(b), k))  # K copies of each row
    scores = np.full((b, k), -np.inf)  # (B, K): summed log-probs of the open hypotheses
    scores[:, 0] = 0.0  # the K copies start identical: open only one of them
    prefixes = np.zeros((b, k, 0), dtype=np.int64)  # (B, K, t)
    best_score = np.full(b, -np.inf)  # (B,)
    best = np.full((b, n_max), pad_token_id, dtype=np.int64)  # (B, N)
    best_length = np.zeros(b, dtype=np.int64)  # (B,)
    rows = np.arange(b)
    tokens = np.full(b * k, bos_token_id, dtype=np.int64)  # (B*K,)

    def offer(candidate_scores, beam, token, length):
        """Keep, per row, the finished hypothesis ``prefixes[beam] + token`` if it beats the best so far."""
        better = candidate_scores > best_score  # (B,)
        if better.any():
            best_score[better] = candidate_scores[better]
            best[better, :length - 1] = prefixes[rows[better], beam[better]]
            best[better, length - 1] = token[better]
            best[better, length:] = pad_token_id
            best_length[better] = length

    for t in range(n_max):
        length = t + 1  # generated tokens of every hypothesis extended at this step
        log_probs = state.step(tokens, t).astype(np.float64).reshape(b, k, -1)  # (B, K, V)
        vocab = log_probs.shape[-1]
        candidates = scores[..., None] + log_probs  # (B, K, V)
        ended = _normalised(candidates[..., eos_token_id], length, length_penalty)  # (B, K)
        beam = ended.argmax(axis=1)  # (B,)
        offer(ended[rows, beam], beam, np.full(b, eos_token_id), length)
        candidates[..., eos_token_id] = -np.inf
        flat = candidates.reshape(b, k * vocab)  # (B, K*V)
        if length == n_max:  # open hypotheses end here, scored like finished ones
            pick = flat.argmax(axis=1)  # (B,)
            offer(_normalised(flat[rows, pick], length, length_penalty), pick // vocab, pick % vocab, length)
            break
        top = np.argsort(-flat, axis=1, kind="stable")[:, :k]  # (B, K)
        beam, token = top // vocab, top % vocab  # (B, K) each
        scores = np.take_along_axis(flat, top, axis=1)  # (B, K)
        prefixes = np.concatenate([np.take_along_axis(prefixes, beam[..., None], axis=1), token[..., None]],
                                  axis=2)  # (B, K, t + 1)
        state.reorder((rows[:, None] * k + beam).reshape(-1))
        tokens = token.reshape(-1)  # (B*K,)
        # An open sum only falls; its best final score divides it by N ** lp (lp > 0) or (length + 1) ** lp.
        final_length = n_max if length_penalty > 0 else length + 1
        if np.all(best_score >= _normalised(scores.max(axis=1), final_length, length_penalty)):
            break
    return _finish(best, best_length, bos_token_id, pad_token_id)

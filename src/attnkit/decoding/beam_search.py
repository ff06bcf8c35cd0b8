"""Greedy and beam-search decoding for any model that scores the next token from a per-row decoding state.

The model side is a :class:`DecodingState`-like object with two methods:

- ``step(tokens (R,), t) -> log_probs (R, V)``: feed the token at target position ``t`` of every row and get
  the log-probabilities of the next token (rows keep their own cache);
- ``reorder(index (R',))``: row ``r`` of the state becomes a copy of row ``index[r]`` (rows may repeat).

There is one beam search, :func:`transformers_beam_search`, step for step as ``transformers``' own: decoder-only
LMs reach it through :func:`lm_beam_search` (their KV cache), encoder-decoders through :func:`beam_search`
(their decoding state). A finished hypothesis scores ``(sum of the log-probabilities of its generated tokens,
eos included) / (number of generated tokens) ** length_penalty``. With ``early_stopping="never"`` and enough
beams that nothing is pruned (at most ``(V - 1) ** (max_new_tokens - 1)`` prefixes are ever open), the search
is exact.

Dimension letters: B batch, K ``num_beams``, V vocabulary, N ``max_new_tokens``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Protocol

import numpy as np

from .._validation import check_positive_int, check_real, shown

__all__ = ["DecodingState", "greedy_search", "beam_search", "search_state", "lm_beam_search",
           "transformers_beam_search", "MAX_NUM_BEAMS", "check_num_beams", "useful_beams", "next_token_logits"]

MAX_NUM_BEAMS = 1024  # every beam is a decoder row with its own cache: B * K rows are decoded each step


def check_num_beams(num_beams: Any) -> int:
    """``num_beams`` as an int in ``[1, MAX_NUM_BEAMS]``; ``TypeError``/``ValueError`` naming it otherwise."""
    value = check_positive_int(num_beams, "num_beams")
    if value > MAX_NUM_BEAMS:
        raise ValueError(f"num_beams must be at most {MAX_NUM_BEAMS} (each beam decodes a row of its own), "
                         f"got {shown(value)}")
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


_MIN_DIVISOR = 1e-6  # a summed log-probability (|sum| < 1e3) divided by it stays above the -1e9 sentinel


def _length_divisor(new_tokens: int, length_penalty: float) -> np.float32:
    """``new_tokens ** length_penalty`` as ``transformers`` divides by it (a float32 of the float64 power).

    Kept within ``[1e-6, float32 max]`` so that any finite penalty decodes without overflow or a warning: a
    very negative penalty would otherwise push real hypotheses below the -1e9 that marks empty slots
    (``transformers`` raises ``OverflowError`` or returns those slots); in the clamped range the ranking is by
    the sums, and below it (``length_penalty < -6 / log10(new_tokens)``) it may differ from ``transformers``.
    """
    with np.errstate(over="ignore", under="ignore"):
        power = np.power(np.float64(new_tokens), np.float64(length_penalty))
    return np.float32(np.clip(power, _MIN_DIVISOR, np.finfo(np.float32).max))


def beam_search(state: Any, batch_size: int, *, num_beams: int, bos_token_id: int, eos_token_id: int,
                max_new_tokens: int, length_penalty: float = 1.0, pad_token_id: int = 0,
                early_stopping: bool | str = "never") -> np.ndarray:
    """Beam search over a :class:`DecodingState` (an encoder-decoder's): :func:`transformers_beam_search`
    with a bos prompt; ``state`` has B rows on entry and ``batch_size * num_beams`` after.

    ``num_beams`` K must be in ``[1, MAX_NUM_BEAMS]`` (``ValueError`` naming it). ``early_stopping="never"``
    (the default here) makes the search exact when nothing is pruned (see :func:`useful_beams`).

    Returns
    -------
    ids : int64 (B, 1 + n), starting with bos, the best hypothesis of each row, pad after its eos.
    """
    length_penalty = check_real(length_penalty, "length_penalty")
    k = check_num_beams(num_beams)
    prompts = np.full((batch_size, 1), bos_token_id, dtype=np.int64)  # (B, 1)
    return transformers_beam_search(_StateBeams(state, batch_size, k), prompts, num_beams=k,
                                    max_new_tokens=max_new_tokens, eos=np.array([eos_token_id]), fill=pad_token_id,
                                    length_penalty=length_penalty, early_stopping=early_stopping)


# The options a decoding state's search reads; every other option of a GenerationConfig must keep its default.
_STATE_OPTIONS = ("max_new_tokens", "num_beams", "length_penalty", "early_stopping", "eos_token_id", "pad_token_id")


def _single_id(value: Any, name: str, vocab_size: int) -> int:
    """``value`` (an id, or a sequence of exactly one) as an id in ``[0, vocab_size)``."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not is_int or not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be an id in [0, {vocab_size}), got {value!r}")
    return int(value)


def search_state(state: Any, batch_size: int, generation_config: Any, *, bos_token_id: int,
                 vocab_size: int) -> np.ndarray:
    """Greedy search (``num_beams`` 1) or beam search of a :class:`DecodingState`, as ``generation_config`` says.

    Parameters
    ----------
    state : DecodingState
        B rows on entry (``batch_size * num_beams`` after a beam search).
    batch_size : int
        B.
    generation_config : GenerationConfig
        Reads ``max_new_tokens``, ``num_beams``, ``length_penalty``, ``early_stopping``, ``eos_token_id`` (one id)
        and ``pad_token_id`` (None: 0). Sampling, logits processors, stop strings and several sequences per row
        are not implemented for a decoding state: an option of theirs that is not the default is a ValueError.
    bos_token_id : int
        The first token of every row.
    vocab_size : int
        V, the range the ids must lie in.

    Returns
    -------
    ids : int64 (B, 1 + n), bos first, pad after each row's eos; n <= ``max_new_tokens`` the longest row.
    """
    defaults = type(generation_config)()
    unread = [f"{name}={getattr(generation_config, name)!r}" for name in (f.name for f in dataclasses.fields(defaults))
              if name not in _STATE_OPTIONS and getattr(generation_config, name) != getattr(defaults, name)]
    if unread:
        raise ValueError(f"greedy and beam search of a decoding state read only {', '.join(_STATE_OPTIONS)}; "
                         f"generation_config also sets {', '.join(unread)}")
    if generation_config.eos_token_id is None:
        raise ValueError("eos_token_id is required (as an argument or in generation_config)")
    ids = dict(bos_token_id=_single_id(bos_token_id, "bos_token_id", vocab_size),
               eos_token_id=_single_id(generation_config.eos_token_id, "eos_token_id", vocab_size),
               pad_token_id=_single_id(generation_config.pad_token_id or 0, "pad_token_id", vocab_size))
    max_new_tokens = check_positive_int(generation_config.max_new_tokens, "max_new_tokens")
    if batch_size == 0:  # no rows: nothing to decode, only the bos column
        return np.full((0, 1), ids["bos_token_id"], dtype=np.int64)
    if generation_config.num_beams == 1:
        return greedy_search(state, batch_size, max_new_tokens=max_new_tokens, **ids)
    beams = useful_beams(generation_config.num_beams, vocab_size, max_new_tokens)  # the rest change nothing
    return beam_search(state, batch_size, num_beams=beams, max_new_tokens=max_new_tokens,
                       length_penalty=generation_config.length_penalty,
                       early_stopping=generation_config.early_stopping, **ids)


_FINISHED_PENALTY = np.float32(-1.0e9)  # added to a score to rule a candidate out, as transformers does


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of each row, largest first (ties: the lower index first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]  # (B, k)


@functools.lru_cache(maxsize=64)
def _keeps_logits(model_type: type) -> bool:
    """Whether ``model_type.forward`` takes ``logits_to_keep`` (by name, or through ``**kwargs``, as a
    subclass that wraps :meth:`CausalLM.forward` does)."""
    forward = getattr(model_type, "forward", None)
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # None, a builtin or a callable without a signature
        return False
    return any(p.name == "logits_to_keep" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def next_token_logits(model: Any, ids: np.ndarray, mask: np.ndarray, cache: Any) -> np.ndarray:
    """The logits (R, V) of the token after the last position of ``ids`` (R, L), through ``cache``.

    A model whose ``forward`` takes ``logits_to_keep`` (``transformers``' name; :class:`~attnkit.models.CausalLM`
    does) computes that one row of logits only, not L of them: what a long prompt's prefill costs in the head.
    """
    if _keeps_logits(type(model)):
        return model.forward(ids, mask, cache=cache, logits_to_keep=1)[:, -1, :]  # (R, V)
    return model.forward(ids, mask, cache=cache)[:, -1, :]  # (R, V)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)  # (R, V)
    with np.errstate(divide="ignore"):  # a row whose other entries are all -inf has log(1) = 0 at its max
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class _LMBeams:
    """The decoder-only LM side of :func:`transformers_beam_search`: one KV cache of B*K rows, the prompts'
    padding mask, and the one re-prefill at the model's ``reprefill_length``."""

    def __init__(self, model: Any, mask: np.ndarray, num_beams: int, total: int) -> None:
        self.model, self.total = model, total
        self.mask = np.repeat(mask, num_beams, axis=0)  # (B*K, L)
        self.cache = model.new_cache(self.mask.shape[0], max_length=total)
        self.switch = getattr(model, "reprefill_length", None)  # the model says when its cached keys go stale

    def start(self, prompts: np.ndarray) -> np.ndarray:
        return next_token_logits(self.model, prompts, self.mask, self.cache)  # (B*K, V)

    def advance(self, index: np.ndarray, sequences: np.ndarray) -> np.ndarray:
        self.cache.reorder(index)
        rows, cur = sequences.shape
        self.mask = np.concatenate([self.mask, np.ones((rows, 1), dtype=bool)], axis=1)  # (B*K, cur)
        if self.switch is not None and cur > self.switch >= self.cache.length:
            # the rotation of every cached key changes here: run the whole sequences again, once
            self.cache = self.model.new_cache(rows, max_length=self.total)
            return next_token_logits(self.model, sequences, self.mask, self.cache)  # (B*K, V)
        return next_token_logits(self.model, sequences[:, -1:], self.mask, self.cache)  # (B*K, V)


class _StateBeams:
    """A :class:`DecodingState` (``step``/``reorder``, e.g. an encoder-decoder's) as the model side of
    :func:`transformers_beam_search`."""

    def __init__(self, state: Any, batch_size: int, num_beams: int) -> None:
        self.state = state
        state.reorder(np.repeat(np.arange(batch_size), num_beams))  # K copies of each row

    def start(self, prompts: np.ndarray) -> np.ndarray:
        return self.state.step(prompts[:, -1], prompts.shape[1] - 1)  # (B*K, V)

    def advance(self, index: np.ndarray, sequences: np.ndarray) -> np.ndarray:
        self.state.reorder(index)
        return self.state.step(sequences[:, -1], sequences.shape[1] - 1)  # (B*K, V)


def lm_beam_search(model: Any, ids: np.ndarray, mask: np.ndarray, *, num_beams: int, max_new_tokens: int,
                   eos: np.ndarray, pad_token_id: int | None, length_penalty: float = 1.0,
                   early_stopping: bool | str = False, num_return_sequences: int = 1,
                   process: Any = None) -> np.ndarray:
    """Beam search for a decoder-only LM, step for step as ``transformers``' ``generate(num_beams=K)``.

    :func:`transformers_beam_search` driving the model's KV cache.

    Parameters
    ----------
    model : CausalLM
        ``forward(ids, mask, cache=)`` and ``new_cache(rows, max_length=)``; ``reprefill_length`` honoured.
    ids, mask : (B, L) int64 and bool
        Left-padded prompts.
    num_beams, max_new_tokens, eos, length_penalty, early_stopping, num_return_sequences, process
        As :func:`transformers_beam_search`.
    pad_token_id : int or None
        Fills the columns after a hypothesis's eos (``transformers``: the pad id if nonzero, else the first
        eos id).

    Returns
    -------
    int64 array (B * num_return_sequences, L + T)
        Prompts and the chosen continuations, T the longest of them.
    """
    fill = (pad_token_id if pad_token_id else int(eos[0])) if eos.size else -1
    beams = _LMBeams(model, mask, num_beams, ids.shape[1] + max_new_tokens)
    return transformers_beam_search(beams, ids, num_beams=num_beams, max_new_tokens=max_new_tokens, eos=eos,
                                    fill=fill, length_penalty=length_penalty, early_stopping=early_stopping,
                                    num_return_sequences=num_return_sequences, process=process)


def transformers_beam_search(beams: Any, prompts: np.ndarray, *, num_beams: int, max_new_tokens: int,
                             eos: np.ndarray, fill: int, length_penalty: float = 1.0,
                             early_stopping: bool | str = False, num_return_sequences: int = 1,
                             process: Any = None) -> np.ndarray:
    """The one beam search, step for step as ``transformers``' ``generate(num_beams=K)``.

    Each step takes the ``max(2, 1 + len(eos)) * K`` best continuations of all K beams by summed float32
    log-probability; continuations that end (an eos, or the length limit) among the K best are offered to the
    finished hypotheses, scored ``sum / new_tokens ** length_penalty``, and the K best unfinished ones continue
    (the model's rows reordered to follow them). The search stops when no open beam can beat the worst
    finished one (``early_stopping=False``: at the current length; ``"never"``: at the longest length when
    ``length_penalty > 0``, which makes the search exact up to pruning), when every batch row has K finished
    hypotheses and ``early_stopping=True``, or at ``max_new_tokens``.

    Parameters
    ----------
    beams
        The model side: ``start(prompts (B*K, L)) -> logits (B*K, V)`` and ``advance(index (B*K,),
        sequences (B*K, cur)) -> logits``, which makes row r a copy of row ``index[r]`` and feeds the last
        column (a decoder-only LM's KV cache, or an encoder-decoder's decoding state).
    prompts : (B, L) int64
        What every hypothesis starts with (an LM's prompt, an encoder-decoder's bos).
    num_beams : int
        K.
    max_new_tokens : int
    eos : int array (E,)
        End-of-sequence ids (empty: only the length ends a hypothesis).
    fill : int
        Fills the columns after a hypothesis's eos.
    length_penalty : float
    early_stopping : bool or "never"
    num_return_sequences : int
        The best n <= K finished hypotheses of each row, best first.
    process : callable ``(log_probs (R, V), sequences (R, t), step) -> log_probs``, optional
        The logits processors (repetition penalty, n-gram blocking, min new tokens), applied to the
        log-probabilities as ``transformers`` does in beam search.

    Returns
    -------
    int64 array (B * num_return_sequences, L + T)
        Prompts and the chosen continuations, T the longest of them.
    """
    b, length = prompts.shape
    k, total = num_beams, length + max_new_tokens
    keep = max(2, 1 + eos.size) * k  # candidates kept per step, so that K unfinished ones always remain
    first_k = np.arange(keep) < k  # (keep,): only the K best candidates may finish
    rows = np.arange(b)[:, None]  # (B, 1)
    running = np.full((b, k, total), fill, dtype=np.int64)  # (B, K, L + N)
    running[:, :, :length] = prompts[:, None]
    sequences = running.copy()  # (B, K, L + N): the finished hypotheses
    running_scores = np.zeros((b, k), dtype=np.float32)  # (B, K)
    running_scores[:, 1:] = _FINISHED_PENALTY  # the K copies start identical: open one of them
    scores = np.full((b, k), _FINISHED_PENALTY, dtype=np.float32)  # (B, K): finished scores
    finished = np.zeros((b, k), dtype=bool)  # (B, K)
    improvable = np.ones((b, 1), dtype=bool)  # (B, 1)
    running_origin = np.full((b, k, max_new_tokens), -1, dtype=np.int64)  # (B, K, N): beam of each step
    origin = running_origin.copy()
    logits = beams.start(np.repeat(prompts, k, axis=0))  # (B*K, V)
    cur = length
    while True:
        log_probs = _log_softmax(logits.astype(np.float32))  # (B*K, V)
        if process is not None:
            log_probs = process(log_probs, running[:, :, :cur].reshape(b * k, cur), cur - length)
        vocab = log_probs.shape[-1]
        summed = (log_probs.reshape(b, k, vocab) + running_scores[:, :, None]).reshape(b, k * vocab)  # (B, K*V)
        top = _top(summed, keep)  # (B, keep)
        top_scores = np.take_along_axis(summed, top, axis=1)  # (B, keep)
        beam, token = top // vocab, top % vocab  # (B, keep) each
        top_sequences = running[rows, beam]  # (B, keep, L + N)
        top_sequences[:, :, cur] = token
        top_origin = running_origin[rows, beam]  # (B, keep, N)
        top_origin[:, :, cur - length] = beam + rows * k
        ends = np.isin(token, eos) | (cur + 1 >= total)  # (B, keep)
        # the K best unfinished continuations run on
        open_scores = top_scores + ends.astype(np.float32) * _FINISHED_PENALTY  # (B, keep)
        pick = _top(open_scores, k)  # (B, K)
        running, running_origin = top_sequences[rows, pick], top_origin[rows, pick]
        running_scores = np.take_along_axis(open_scores, pick, axis=1)  # (B, K)
        # the K best of the finished so far and those just finished among the K best candidates
        just = ends & first_k[None, :]  # (B, keep)
        with np.errstate(under="ignore"):  # a huge divisor makes a score 0: still a score
            offered = top_scores / _length_divisor(cur + 1 - length, length_penalty)  # (B, keep)
        full = finished.all(axis=-1, keepdims=True) & (early_stopping is True)  # (B, 1)
        for ruled_out in (full, ~improvable, ~just):
            offered = offered + ruled_out.astype(np.float32) * _FINISHED_PENALTY
        merged = np.concatenate([scores, offered], axis=1)  # (B, K + keep)
        best = _top(merged, k)  # (B, K)
        sequences = np.concatenate([sequences, top_sequences], axis=1)[rows, best]  # (B, K, L + N)
        origin = np.concatenate([origin, top_origin], axis=1)[rows, best]  # (B, K, N)
        finished = np.concatenate([finished, just], axis=1)[rows, best]  # (B, K)
        scores = np.take_along_axis(merged, best, axis=1)  # (B, K)
        index = running_origin[:, :, cur - length].reshape(-1)  # (B*K,): the row each open beam came from
        cur += 1
        hypothetical = total - length if early_stopping == "never" and length_penalty > 0 else cur - length
        with np.errstate(under="ignore"):
            best_open = running_scores[:, :1] / _length_divisor(hypothetical, length_penalty)  # (B, 1)
        worst_finished = np.where(finished, scores.min(axis=1, keepdims=True), np.float32(-1.0e9))  # (B, K)
        improvable &= np.any(best_open > worst_finished, axis=-1, keepdims=True)
        if not improvable.any() or (finished.all() and early_stopping is True) or ends.all():
            break
        logits = beams.advance(index, running[:, :, :cur].reshape(b * k, cur))  # (B*K, V)
    n = num_return_sequences
    chosen, chosen_origin = sequences[:, :n].reshape(b * n, total), origin[:, :n].reshape(b * n, -1)
    generated = int((chosen_origin >= 0).sum(axis=1).max())
    return chosen[:, :length + generated].copy()  # (B*n, L + T)

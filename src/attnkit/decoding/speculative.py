"""Draft tokens for speculative decoding: proposals the model then checks in one forward.

Dimension letters: B rows, T tokens so far, K drafted tokens.

Decoding one token at a time reads every weight once per token. A proposer guesses the next K tokens cheaply;
the model runs them all in one forward through its cache (a multi-token step), and
:func:`~attnkit.decoding.sampling.generate_stream` keeps the guesses the model itself would have chosen, then
the model's own next token. Greedy output is the same as without a proposer; sampled output keeps the model's
distribution (each draft token ``d`` is kept with probability ``p(d)``, else the token is drawn from ``p``
without ``d``: the accept rule of speculative sampling for a proposer that puts all its mass on ``d``).

Three proposers, with Hugging Face's option names:

- :class:`PromptLookup` (``prompt_lookup_num_tokens``): the tokens that followed the last earlier occurrence of
  the sequence's last n-gram (n from ``max_matching_ngram_size`` down to 1): free, and right whenever the output
  copies its input (editing a text, answering from a document);
- :class:`DraftModel` (``assistant_model``): a smaller model with the same tokenizer, decoding K tokens greedily
  with a cache of its own;
- the same with ``assistant_early_exit=N``: the model's first N layers, then its final norm and head
  (:meth:`~attnkit.models.CausalLM.early_exit`), so no second model is needed;
- :class:`MultiTokenDraft` (``assistant_model=`` a :class:`~attnkit.models.multi_token.MultiTokenPredictor`):
  the multi-token-prediction layers a checkpoint carries (DeepSeek-V3's), reading the model's own final hidden
  states: one token per layer, as transformers' ``use_mtp=True``.

A proposer learns from how many of its tokens were kept (``accepted``): :class:`DraftModel` drafts two tokens
more after a round that kept them all and one fewer after one that did not (Hugging Face's "heuristic"
schedule), and every proposer pauses after rounds that keep fewer than two tokens, so a conversation it cannot
predict costs little more than decoding without it.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .._validation import check_positive_int
from .config import MAX_DRAFT_TOKENS

__all__ = ["Proposer", "PromptLookup", "DraftModel", "MultiTokenDraft"]

# After this many rounds in a row that did not pay, a proposer stays quiet for as many rounds as it has failed
# (doubling up to _LONGEST_PAUSE): on text it cannot predict, decoding runs almost as without it. A round pays
# when it keeps at least _KEPT_TO_PAY tokens: on a CPU, verifying a draft costs about two decoding steps more than
# one step (a product of a few rows costs several times a one-row GEMV in OpenBLAS), so a round that keeps one
# token loses time. Measured on SmolLM2-135M (docs/benchmarks.md): with a pause of at most 16 rounds and one kept
# token counting as success, free chat ran at 0.85x plain decoding; the pause of 64 bounds that loss at about 3%.
_FAILURES_BEFORE_PAUSE = 2
_LONGEST_PAUSE = 64
_KEPT_TO_PAY = 2


class Proposer:
    """What :func:`~attnkit.decoding.sampling.generate_stream` asks of a draft source.

    ``propose(sequences, mask)`` -> (B, K) int64 drafts for every row, or None for no draft this round;
    ``accepted(count, proposed)`` after the round: how many of the K were kept (the fewest over the rows).
    This base class pauses after rounds that do not pay (that keep fewer than two tokens, or fewer than were
    proposed when that is less); subclasses implement :meth:`_draft`. A proposer can be
    passed to ``generate`` as ``assistant_model``.

    A proposer with ``reads_hidden = True`` also sees the model's final hidden states of every position it runs
    (``observe(hidden, start)``, hidden (B, F, D) of positions ``start ..``), before it is asked to propose.

    Attributes
    ----------
    proposed, kept : int
        Draft tokens proposed and kept so far (their ratio is the acceptance rate).
    """

    reads_hidden = False

    def __init__(self) -> None:
        self._failures = 0
        self._quiet = 0
        self.proposed = self.kept = 0

    def propose(self, sequences: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        """Drafts (B, K) to continue ``sequences`` (B, T) (``mask`` (B, T), ``True`` = real token), or None."""
        if self._quiet:
            self._quiet -= 1
            return None
        return self._draft(sequences, mask)

    def accepted(self, count: int, proposed: int) -> None:
        """Learn that ``count`` of the ``proposed`` draft tokens were kept."""
        self.proposed += proposed
        self.kept += count
        if count >= min(_KEPT_TO_PAY, proposed):
            self._failures = 0
            return
        self._failures += 1
        if self._failures >= _FAILURES_BEFORE_PAUSE:
            self._quiet = min(2 ** (self._failures - _FAILURES_BEFORE_PAUSE), _LONGEST_PAUSE)

    def observe(self, hidden: np.ndarray, start: int) -> None:
        """The model's final hidden states (B, F, D) of positions ``start .. start + F - 1``, just computed (only
        called when ``reads_hidden``)."""

    def _draft(self, sequences: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        raise NotImplementedError


class PromptLookup(Proposer):
    """Draft the tokens that followed the last earlier occurrence of the text's last n-gram (prompt lookup
    decoding): no model, no cost beyond a search of the ids.

    Parameters
    ----------
    num_tokens : int
        K, the tokens drafted per round at most (Hugging Face's ``prompt_lookup_num_tokens``).
    max_ngram : int, default 2
        The longest n-gram matched (``max_matching_ngram_size``); shorter ones down to two tokens are tried when
        it does not occur (one token only when ``max_ngram`` is 1). Hugging Face also drafts after a one-token
        match; on a CPU such drafts are mostly rejected and each costs about two decoding steps (free chat with
        SmolLM2-135M: 0.87x plain decoding with them, 1.01x without; docs/benchmarks.md).

    Examples
    --------
    >>> lookup = PromptLookup(3)
    >>> lookup.propose(np.array([[5, 6, 7, 8, 9, 5, 6]]), np.ones((1, 7), bool)).tolist()  # "5 6" was followed by 7 8 9
    [[7, 8, 9]]
    """

    def __init__(self, num_tokens: int, max_ngram: int = 2) -> None:
        super().__init__()
        self.num_tokens = check_positive_int(num_tokens, "prompt_lookup_num_tokens")
        self.max_ngram = check_positive_int(max_ngram, "max_matching_ngram_size")

    def _draft(self, sequences: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        rows = [self._continuation(sequences[b], int(np.argmax(mask[b]))) for b in range(sequences.shape[0])]
        longest = max(len(row) for row in rows)
        if longest == 0:
            return None
        drafts = np.zeros((len(rows), longest), np.int64)  # (B, K): a row with fewer is padded (and rejected there)
        for b, row in enumerate(rows):
            drafts[b, :len(row)] = row
            drafts[b, len(row):] = row[-1] if len(row) else sequences[b, -1]
        return drafts

    def _continuation(self, ids: np.ndarray, start: int) -> np.ndarray:
        """What followed the last earlier occurrence of the last n-gram of ``ids[start:]`` (longest n first)."""
        text = ids[start:]
        for n in range(min(self.max_ngram, len(text) - 1), min(2, self.max_ngram) - 1, -1):
            windows = sliding_window_view(text[:-1], n)  # (T - n, n): every n-gram that has a successor
            hits = np.flatnonzero((windows == text[-n:]).all(axis=1))
            if hits.size:
                begin = hits[-1] + n
                return text[begin:begin + self.num_tokens]
        return text[:0]


class DraftModel(Proposer):
    """Draft K tokens greedily with a smaller model (Hugging Face's ``assistant_model``) through its own cache.

    Parameters
    ----------
    model : CausalLM or anything with ``forward(ids, mask, cache=, logits_to_keep=)`` and ``new_cache``
        The draft; its ids must be the target's (the same tokenizer). :meth:`CausalLM.early_exit` gives the
        target's own first layers.
    num_tokens : int, default 20
        K of the first round (``num_assistant_tokens``); then two more after a round that kept them all, one
        fewer (at least 1) after one that did not.
    vocab_size : int, optional
        The target's vocabulary: a drafted id past it is refused.
    """

    def __init__(self, model: Any, num_tokens: int = 20, *, vocab_size: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.num_tokens = check_positive_int(num_tokens, "num_assistant_tokens")
        self.vocab_size = vocab_size
        self._cache = None

    def accepted(self, count: int, proposed: int) -> None:
        super().accepted(count, proposed)
        self.num_tokens = min(self.num_tokens + 2, MAX_DRAFT_TOKENS) if count == proposed else \
            max(1, self.num_tokens - 1)

    def _draft(self, sequences: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        cache = self._reusable_cache(sequences)
        pending, pending_mask = sequences[:, cache.length:], mask  # (B, P), (B, T)
        drafts = []
        for i in range(self.num_tokens):
            logits = self.model.forward(pending, pending_mask, cache=cache, logits_to_keep=1)[:, -1]  # (B, V)
            if i == 0 and getattr(cache, "needs_marks", False):
                cache.mark()  # the sequence so far: where the next round's shared prefix begins at the latest
            token = np.argmax(logits, axis=-1).astype(np.int64)  # (B,)
            if self.vocab_size is not None and token.max() >= self.vocab_size:
                raise ValueError(f"the draft model proposed token {int(token.max())}, past the model's vocabulary "
                                 f"of {self.vocab_size}: it must use the same tokenizer")
            drafts.append(token)
            pending = token[:, None]  # (B, 1)
            pending_mask = np.concatenate([pending_mask, np.ones((sequences.shape[0], 1), bool)], axis=1)
        return np.stack(drafts, axis=1)  # (B, K)

    def _reusable_cache(self, ids: np.ndarray):
        """The draft's cache cropped to the prefix it shares with ``ids`` (a fresh one if it cannot go there),
        holding at most ``T - 1`` of them, so at least one id is fed."""
        cache = self._cache
        if cache is not None and cache.batch_size == ids.shape[0]:
            held = cache.token_ids
            width = min(held.shape[1], ids.shape[1] - 1)
            differs = np.flatnonzero((held[:, :width] != ids[:, :width]).any(axis=0))
            shared = int(differs[0]) if differs.size else width
            if cache.can_crop(shared):
                cache.crop(shared)
                return cache
            back = [at for at in cache.marks if at <= shared]
            if back:
                cache.crop(back[-1])
                return cache
        self._cache = self.model.new_cache(ids.shape[0], rollback=MAX_DRAFT_TOKENS)
        return self._cache


class MultiTokenDraft(Proposer):
    """Draft with a checkpoint's multi-token-prediction layers: one token per layer, from the model's own final
    hidden states (transformers' ``generate(..., use_mtp=True)``).

    Prediction layer ``k`` at slot ``s`` reads the hidden state at position ``s`` (layer 0: the model's) and token
    ``s + k + 1``; its own cache keeps the slots every layer computed from kept tokens only, so each round feeds
    the slots of the tokens kept since, and the next layers' slots that read a draft are run again.

    Parameters
    ----------
    predictor : MultiTokenPredictor
        From :func:`attnkit.pretrained.load_multi_token_predictor` (or built on the model).

    Shapes
    ------
    As :class:`Proposer`: drafts (B, M), M the predictor's layers.
    """

    reads_hidden = True

    def __init__(self, predictor: Any) -> None:
        super().__init__()
        self.predictor = predictor
        self._cache = None
        self._hidden: np.ndarray | None = None  # (B, N, D): the model's hidden states of positions _start ..
        self._start = 0

    def observe(self, hidden: np.ndarray, start: int) -> None:
        held = self._hidden
        if held is not None and held.shape[0] == hidden.shape[0] and self._start <= start <= \
                self._start + held.shape[1]:
            self._hidden = np.concatenate([held[:, :start - self._start], hidden], axis=1)  # (B, N, D)
            return
        # a new sequence, or positions the buffer cannot reach: start again from these
        self._hidden, self._start, self._cache = hidden, start, None

    def _draft(self, sequences: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        batch, length = sequences.shape
        cache = self._cache
        if cache is None or cache.batch_size != batch:
            cache = self._cache = self.predictor.new_cache(batch)
        done = cache.length  # slots every layer computed from kept tokens
        held = self._hidden
        # the model has run positions 0 .. length - 2 (the last token is not fed yet): slot s reads position s
        if held is None or self._start > done or self._start + held.shape[1] < length - 1 or done >= length - 1:
            return None
        hidden = held[:, done - self._start:length - 1 - self._start]  # (B, L, D): slots done .. length - 2
        positions = np.maximum(np.cumsum(mask, axis=1, dtype=np.int64) - 1, 0)  # (B, T)
        _, drafts = self.predictor.draft(sequences[:, done + 1:], hidden, mask[:, :length - 1],
                                         position_ids=positions[:, done + 1:], cache=cache)  # (B, M)
        # layer k's slot s read token s + k + 1: slots past length - 1 - M read a draft in some layer
        keep = max(done, length - self.predictor.num_layers)
        cache.crop(keep)
        self._hidden, self._start = held[:, keep - self._start:], keep
        return drafts

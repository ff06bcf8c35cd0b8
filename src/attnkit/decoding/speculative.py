"""Draft tokens for speculative decoding: proposals the model then checks in one forward.

Dimension letters: B rows, T tokens so far, K drafted tokens.

Decoding one token at a time reads every weight once per token. A proposer guesses the next K tokens cheaply;
the model runs them all in one forward through its cache (a multi-token step), and
:func:`~attnkit.decoding.sampling.generate_stream` keeps the guesses the model itself would have chosen, then
the model's own next token. Greedy output is the same as without a proposer; sampled output keeps the model's
distribution (each draft token ``d`` is kept with probability ``p(d)``, else the token is drawn from ``p``
without ``d``: the accept rule of speculative sampling for a proposer that puts all its mass on ``d``).

The proposers, with Hugging Face's option names:

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

Every proposer decides each round whether to draft, and how many tokens, from a cost model in units of one
decoding step: verifying K drafts is a forward of K + 1 rows, which costs :func:`verify_cost` (K + 1) steps (on a
CPU almost three steps already for two rows: a product of a few rows costs several times a one-row GEMV), and
drafting costs ``draft_cost`` steps per token (none for prompt lookup; a draft model's share of the weights a
step reads). It estimates the chance ``a`` that a draft token is kept (the kept tokens over the tokens checked,
recent rounds weighing more, starting from one half), expects ``1 + a + ... + a**K`` tokens from a round of K,
and drafts the K that gives the most tokens per step, but only when that beats plain decoding by a tenth.
Otherwise it decodes plainly and still learns: prompt lookup, whose drafts are free, checks what it would have
drafted against the tokens that came; a draft model probes, a round of its best K, only when, should none of it
be kept, what drafting has lost in this sequence would stay within 3% of what plain decoding has cost so far
(the prompt's forward, which a first round rides on, and a step per token since), counting the draft's own
reading of the tokens it has not seen. So a free draft that is never kept is never sent, and a costly one costs
at most 3% more than plain decoding. In a batch a round keeps the fewest drafts any row keeps.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .._validation import check_positive_int
from .config import MAX_DRAFT_TOKENS

__all__ = ["Proposer", "PromptLookup", "DraftModel", "MultiTokenDraft", "VERIFY_COST", "verify_cost",
           "expected_tokens", "draft_step_cost"]

# What a forward of r rows through the cache costs, in one-row decoding steps, measured at these r: SmolLM2-135M,
# float32, OpenBLAS's sgemm, 2 threads, medians of repeated runs (docs/benchmarks.md). OpenBLAS packs the whole
# weight for a product of a few rows: two rows cost almost three one-row GEMVs.
_MEASURED_COST = {1: 1.0, 2: 2.7, 3: 2.8, 4: 2.9, 5: 3.0, 6: 3.0, 7: 3.0, 8: 3.1, 9: 3.3, 10: 3.35, 11: 3.4, 12: 3.4,
                  13: 3.5, 14: 3.6, 15: 3.7, 16: 3.7, 17: 3.8, 32: 5.0, 64: 7.2, 130: 9.5}
VERIFY_COST = tuple(float(c) for c in np.interp(np.arange(1, 131), list(_MEASURED_COST), list(_MEASURED_COST.values())))
"""What a forward of r = 1 .. 130 rows through the cache costs in one-row decoding steps on a CPU (measured at
r = 1 .. 17, 32, 64 and 130, linear between; docs/benchmarks.md). Past the table each row adds the last row's
increment."""

_MIN_GAIN = 1.1  # draft only when the expected tokens per step beat plain decoding's by this factor
_LOSS_BUDGET = 0.03  # a costly draft probes only if, were nothing kept, its losses stay this share of plain's cost
_MEMORY = 0.8  # each later round weighs a round's evidence by this (the estimate follows the text)
_PRIOR_KEPT, _PRIOR_CHECKED = 0.5, 1.0  # before any evidence, a draft token is kept one time in two


def verify_cost(rows: int, table: tuple[float, ...] = VERIFY_COST) -> float:
    """Steps (one-row forwards) a forward of ``rows`` rows through the cache costs, by ``table`` (the costs of
    1, 2, ... rows; :data:`VERIFY_COST` by default), each row past it adding the table's last increment."""
    if rows <= len(table):
        return table[rows - 1]
    step = table[-1] - table[-2] if len(table) > 1 else 0.0
    return table[-1] + (rows - len(table)) * step


def expected_tokens(rate: float, length: int) -> float:
    """Tokens a round of ``length`` drafts yields when each is kept with chance ``rate`` (after the ones before it):
    the kept drafts and the model's own next token, ``1 + rate + ... + rate**length``."""
    return float(np.sum(rate ** np.arange(length + 1)))


def draft_step_cost(draft: Any, model: Any) -> float:
    """The share of a decoding step of ``model`` that one token of ``draft`` costs: the weights each reads per
    token (its blocks and its head). ``draft`` is a causal LM, :meth:`~attnkit.models.CausalLM.early_exit`'s
    model or a multi-token predictor of ``model`` (one of its layers and the model's head per token); every
    expert of a mixture counted; 1.0 when either does not show its layers."""
    try:
        full = _weights_per_token(model.layers, model)
        if hasattr(draft, "num_layers") and getattr(draft, "model", None) is model and hasattr(draft, "draft"):
            layers = list(draft.layers)
            return (sum(_nbytes(layer) for layer in layers) / len(layers) + _head_nbytes(model)) / full
        if getattr(draft, "model", None) is model:  # the model's first layers
            return _weights_per_token(list(model.layers)[:draft.num_layers], model) / full
        return _weights_per_token(draft.layers, draft) / full
    except (AttributeError, TypeError, ZeroDivisionError):
        return 1.0


def _nbytes(module: Any) -> int:
    return sum(p.nbytes for p in module.parameters())


def _head_nbytes(lm: Any) -> int:
    return getattr(lm, lm.head_owner).weight.nbytes


def _weights_per_token(layers: Any, lm: Any) -> int:
    return sum(_nbytes(layer) for layer in layers) + _head_nbytes(lm)


class Proposer:
    """What :func:`~attnkit.decoding.sampling.generate_stream` asks of a draft source.

    ``propose(sequences, mask)`` -> (B, K) int64 drafts for every row, or None for no draft this round;
    ``accepted(count, proposed)`` after the round: how many of the K were kept (the fewest over the rows).
    This base class decides when to draft and how many tokens (see the module's docstring: the tokens per step a
    round is expected to give, by the acceptance so far and the cost model); subclasses implement
    :meth:`_draft`. A proposer can be passed to ``generate`` as ``assistant_model``.

    A proposer with ``reads_hidden = True`` also sees the model's final hidden states of every position it runs
    (``observe(hidden, start)``, hidden (B, F, D) of positions ``start ..``), before it is asked to propose.

    Parameters
    ----------
    num_tokens : int
        K at most.
    draft_cost : float, default 0.0
        What drafting one token costs, in decoding steps of the model. A proposer whose drafts are free (0.0)
        checks what it would have drafted against the tokens that came instead of probing.
    verify_costs : sequence of float, optional
        What a forward of 1, 2, ... rows costs in decoding steps (:data:`VERIFY_COST`, measured on a CPU, by
        default; on a machine where a few rows cost what one does, ones).

    Attributes
    ----------
    proposed, kept : int
        Draft tokens proposed and kept so far (their ratio is the acceptance rate).
    rounds : int
        Rounds that drafted (each a forward of K + 1 rows).
    loss : float
        Steps the drafting rounds cost beyond the tokens they gave, by the cost model (negative: they gained),
        with what a draft model spent reading the tokens it had not seen.
    """

    reads_hidden = False

    def __init__(self, num_tokens: int, draft_cost: float = 0.0,
                 verify_costs: tuple[float, ...] | list[float] = VERIFY_COST) -> None:
        self.num_tokens = num_tokens
        if isinstance(draft_cost, bool) or not isinstance(draft_cost, (int, float)) or \
                not 0.0 <= draft_cost < float("inf"):
            raise ValueError(f"draft_cost must be a number of decoding steps >= 0, got {draft_cost!r}")
        self.draft_cost = float(draft_cost)
        costs = tuple(float(c) for c in verify_costs)
        if not costs or not all(0.0 < c < float("inf") for c in costs):
            raise ValueError(f"verify_costs must be the positive costs of 1, 2, ... rows, got {verify_costs!r}")
        self.verify_costs = costs
        self.proposed = self.kept = self.rounds = 0
        self.loss = 0.0
        self._kept_weight = self._checked_weight = 0.0  # the evidence, each older round weighing _MEMORY less
        self._first_length: int | None = None  # the first sequence's length: tokens decoded count from it
        self._length = 0  # the length of the last sequence seen
        self._shadow: tuple[int, np.ndarray] | None = None  # (length, drafts (B, K)): a free draft not sent
        self._loss_here, self._rounds_here = 0.0, 0  # this sequence's: what the budget bounds
        self._overhead = 0.0  # the catch-up steps of the round sent
        self._riding = 0  # the prompt's rows when the round sent rides on the prompt's forward, else 0

    @property
    def acceptance(self) -> float:
        """The estimated chance that a draft token is kept (after the ones before it were)."""
        return (self._kept_weight + _PRIOR_KEPT) / (self._checked_weight + _PRIOR_CHECKED)

    def round_cost(self, length: int) -> float:
        """Steps a round of ``length`` drafts costs: drafting them and the forward of ``length + 1`` rows."""
        return verify_cost(length + 1, self.verify_costs) + length * self.draft_cost

    def best_length(self, rate: float | None = None) -> tuple[int, float]:
        """``(K, tokens per step)``: the draft length in 1 .. ``num_tokens`` expected to give the most tokens per
        step when each draft token is kept with chance ``rate`` (default: :attr:`acceptance`); at most
        ``MAX_DRAFT_TOKENS``."""
        rate = self.acceptance if rate is None else rate
        lengths = range(1, min(self.num_tokens, MAX_DRAFT_TOKENS) + 1)
        ratios = [expected_tokens(rate, k) / self.round_cost(k) for k in lengths]
        best = int(np.argmax(ratios))
        return best + 1, ratios[best]

    def propose(self, sequences: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
        """Drafts (B, K) to continue ``sequences`` (B, T) (``mask`` (B, T), ``True`` = real token), or None."""
        length = sequences.shape[1]
        if self._first_length is None or length < self._length:  # a new sequence: a budget of its own
            self._first_length, self._shadow, self._loss_here, self._rounds_here = length, None, 0.0, 0
        self._length = length
        kept, checked = self._check_shadow(sequences)
        rate = (self._kept_weight + kept + _PRIOR_KEPT) / (self._checked_weight + checked + _PRIOR_CHECKED)
        size, ratio = self.best_length(rate)
        overhead = self._catch_up_cost(sequences)
        riding = length if self._rounds_here == 0 and length == self._first_length else 0
        if ratio >= _MIN_GAIN or (self.draft_cost > 0 and self._may_probe(size, length, overhead, riding)):
            if self._shadow is not None:  # drafting for real from here: what the free draft showed so far counts
                self._learn(kept, checked)
                self._shadow = None
            self._overhead, self._riding = overhead, riding
            return self._draft(sequences, mask, size)
        if self.draft_cost == 0 and self._shadow is None:
            drafts = self._draft(sequences, mask, self.num_tokens)
            self._shadow = None if drafts is None else (length, drafts)
        return None

    def accepted(self, count: int, proposed: int) -> None:
        """Learn that ``count`` of the ``proposed`` draft tokens were kept."""
        self.proposed += proposed
        self.kept += count
        self.rounds += 1
        self._rounds_here += 1
        lost = self._sent_cost(proposed, self._overhead, self._riding) - (count + 1)
        self.loss += lost
        self._loss_here += lost
        self._overhead, self._riding = 0.0, 0
        self._learn(count, count + 1 if count < proposed else proposed)

    def observe(self, hidden: np.ndarray, start: int) -> None:
        """The model's final hidden states (B, F, D) of positions ``start .. start + F - 1``, just computed (only
        called when ``reads_hidden``)."""

    def _learn(self, kept: float, checked: float) -> None:
        self._kept_weight = self._kept_weight * _MEMORY + kept
        self._checked_weight = self._checked_weight * _MEMORY + checked

    def _may_probe(self, size: int, length: int, overhead: float, riding: int) -> bool:
        """Whether a round of ``size`` drafts (``overhead`` steps before them; ``riding``: the prompt's rows it
        rides on, or 0) keeps this sequence's losses within the budget should none of its drafts be kept: 3% of
        what plain decoding has cost so far (the prompt's forward and a step per token since)."""
        spent = verify_cost(self._first_length, self.verify_costs) + length - self._first_length
        return self._loss_here + self._sent_cost(size, overhead, riding) - 1 <= _LOSS_BUDGET * spent

    def _sent_cost(self, size: int, overhead: float, riding: int) -> float:
        """Steps a round of ``size`` drafts costs with ``overhead`` steps before them; one riding on a forward of
        ``riding`` prompt rows costs only the rows it adds to it, and a step."""
        if not riding:
            return self.round_cost(size) + overhead
        added = verify_cost(riding + size, self.verify_costs) - verify_cost(riding, self.verify_costs)
        return 1.0 + added + size * self.draft_cost + overhead

    def _catch_up_cost(self, sequences: np.ndarray) -> float:
        """Steps spent before the first draft token on what the draft has not read yet (none here)."""
        return 0.0

    def _check_shadow(self, sequences: np.ndarray) -> tuple[int, int]:
        """``(kept, checked)``: how the free draft not sent fared against the tokens that came (the fewest over
        the rows); it is learnt from and dropped once it is decided."""
        if self._shadow is None:
            return 0, 0
        at, drafts = self._shadow
        came = sequences[:, at:at + drafts.shape[1]]  # (B, C): the tokens decoded since
        matches = np.logical_and.accumulate(came == drafts[:, :came.shape[1]], axis=1)  # (B, C)
        kept = int(matches.sum(axis=1).min())
        if kept < came.shape[1] or kept == drafts.shape[1]:  # a mismatch, or every draft token came
            self._learn(kept, min(kept + 1, drafts.shape[1]))
            self._shadow = None
            return 0, 0
        return kept, kept

    def _draft(self, sequences: np.ndarray, mask: np.ndarray, length: int) -> np.ndarray | None:
        """At most ``length`` drafts (B, K) continuing ``sequences``, or None."""
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
        match; on a CPU such drafts are mostly rejected (free chat with SmolLM2-135M: 0.87x plain decoding with
        them, 1.01x without; docs/benchmarks.md).
    verify_costs : sequence of float, optional
        As :class:`Proposer`'s (the drafts themselves are free).

    Examples
    --------
    Where a forward of a few rows costs what one does (``verify_costs=[1.0]``), drafting pays from the start:

    >>> lookup = PromptLookup(3, verify_costs=[1.0])
    >>> lookup.propose(np.array([[5, 6, 7, 8, 9, 5, 6]]), np.ones((1, 7), bool)).tolist()  # "5 6" was followed by 7 8 9
    [[7, 8, 9]]

    With the CPU's costs, a first draft is only checked against the tokens that come:

    >>> PromptLookup(3).propose(np.array([[5, 6, 7, 8, 9, 5, 6]]), np.ones((1, 7), bool)) is None
    True
    """

    def __init__(self, num_tokens: int, max_ngram: int = 2, *,
                 verify_costs: tuple[float, ...] | list[float] = VERIFY_COST) -> None:
        super().__init__(check_positive_int(num_tokens, "prompt_lookup_num_tokens"), 0.0, verify_costs)
        self.max_ngram = check_positive_int(max_ngram, "max_matching_ngram_size")

    def _draft(self, sequences: np.ndarray, mask: np.ndarray, length: int) -> np.ndarray | None:
        rows = [self._continuation(sequences[b], int(np.argmax(mask[b])), length)
                for b in range(sequences.shape[0])]
        longest = max(len(row) for row in rows)
        if longest == 0:
            return None
        drafts = np.zeros((len(rows), longest), np.int64)  # (B, K): a row with fewer is padded (and rejected there)
        for b, row in enumerate(rows):
            drafts[b, :len(row)] = row
            drafts[b, len(row):] = row[-1] if len(row) else sequences[b, -1]
        return drafts

    def _continuation(self, ids: np.ndarray, start: int, length: int) -> np.ndarray:
        """What followed the last earlier occurrence of the last n-gram of ``ids[start:]`` (longest n first)."""
        text = ids[start:]
        for n in range(min(self.max_ngram, len(text) - 1), min(2, self.max_ngram) - 1, -1):
            windows = sliding_window_view(text[:-1], n)  # (T - n, n): every n-gram that has a successor
            hits = np.flatnonzero((windows == text[-n:]).all(axis=1))
            if hits.size:
                begin = hits[-1] + n
                return text[begin:begin + length]
        return text[:0]


class DraftModel(Proposer):
    """Draft K tokens greedily with a smaller model (Hugging Face's ``assistant_model``) through its own cache.

    Parameters
    ----------
    model : CausalLM or anything with ``forward(ids, mask, cache=, logits_to_keep=)`` and ``new_cache``
        The draft; its ids must be the target's (the same tokenizer). :meth:`CausalLM.early_exit` gives the
        target's own first layers.
    num_tokens : int, default 20
        K at most (``num_assistant_tokens``); each round drafts the K expected to give the most tokens per step
        (see :class:`Proposer`): fewer as fewer are kept, as Hugging Face's "heuristic" schedule shrinks it.
    vocab_size : int, optional
        The target's vocabulary: a drafted id past it is refused.
    draft_cost : float, default 1.0
        What one drafted token costs in decoding steps of the target: :func:`draft_step_cost` gives it
        (``generate`` does so for ``assistant_model`` and ``assistant_early_exit``).
    verify_costs : sequence of float, optional
        As :class:`Proposer`'s.
    """

    def __init__(self, model: Any, num_tokens: int = 20, *, vocab_size: int | None = None, draft_cost: float = 1.0,
                 verify_costs: tuple[float, ...] | list[float] = VERIFY_COST) -> None:
        super().__init__(check_positive_int(num_tokens, "num_assistant_tokens"),
                         draft_cost, verify_costs)
        self.model = model
        self.vocab_size = vocab_size
        self._cache = None

    def _catch_up_cost(self, sequences: np.ndarray) -> float:
        """The draft's forward of the tokens its cache lacks (the whole prompt at first), less the one step its
        first token is counted as: ``draft_cost * (verify_cost(P) - 1)``."""
        cache = self._cache
        held = cache.length if cache is not None and cache.batch_size == sequences.shape[0] else 0
        return self.draft_cost * (verify_cost(max(sequences.shape[1] - held, 1), self.verify_costs) - 1)

    def _draft(self, sequences: np.ndarray, mask: np.ndarray, length: int) -> np.ndarray | None:
        cache = self._reusable_cache(sequences)
        pending, pending_mask = sequences[:, cache.length:], mask  # (B, P), (B, T)
        drafts = []
        for i in range(length):
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
    draft_cost : float, optional
        What one drafted token costs in decoding steps of the model (default: :func:`draft_step_cost`, one
        prediction layer and the head against the model's layers and head).
    verify_costs : sequence of float, optional
        As :class:`Proposer`'s.

    Shapes
    ------
    As :class:`Proposer`: drafts (B, M), M the predictor's layers.
    """

    reads_hidden = True

    def __init__(self, predictor: Any, *, draft_cost: float | None = None,
                 verify_costs: tuple[float, ...] | list[float] = VERIFY_COST) -> None:
        super().__init__(predictor.num_layers, draft_step_cost(predictor, predictor.model) if draft_cost is None
                         else draft_cost, verify_costs)
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

    def _draft(self, sequences: np.ndarray, mask: np.ndarray, size: int) -> np.ndarray | None:
        # every layer drafts: a shorter draft is the first ``size`` tokens, not a cheaper one
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
        return drafts[:, :size]  # (B, K)

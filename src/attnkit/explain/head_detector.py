"""Which heads attend like a previous-token, duplicate-token or induction head: TransformerLens's
``transformer_lens.head_detector``, with its names and its arithmetic, on attnkit's attention patterns.

A head's score compares its attention pattern (L, L) on a prompt with a detection pattern of the same shape, which
marks the key each query should attend to (lower triangular; every query may attend to several keys or none):

- ``previous_token_head``: query i to key i - 1;
- ``duplicate_token_head``: query i to every earlier key holding the same token;
- ``induction_head``: query i to the key after every earlier occurrence of its token (``A B ... A`` -> ``B``).

``error_measure="mul"`` (the default) is the share of the head's attention that falls on the marked keys,
``sum(pattern * detection) / sum(pattern)``; ``"abs"`` is ``1 - round(sum |pattern - detection| / L, 3)``, 1 for a
perfect match, rounded to three decimals as TransformerLens rounds it. ``exclude_bos`` leaves out the attention to
the first key, ``exclude_current_token`` the attention of each query to itself (from the pattern for ``"mul"``, so
the share is of what remains; from the difference for ``"abs"``). For several prompts the scores are the mean of
each prompt's.

Where it differs from TransformerLens: prompts are token ids (attnkit's models hold no tokenizer; TransformerLens's
``to_tokens`` adds a BOS, so pass the ids with it to compare), a layer without heads (Gated DeltaNet) scores NaN, and
bad arguments raise ``ValueError`` instead of ``AssertionError``. Heads left out by ``heads`` score -1, as there.

Shapes: L prompt tokens, N layers, H query heads, B prompts of one length.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._validation import as_array
from ._inputs import as_id_batch
from .hooks import hook_names, run_with_cache

__all__ = ["HEAD_NAMES", "compute_head_attention_similarity_score", "detect_head",
           "get_duplicate_token_head_detection_pattern", "get_induction_head_detection_pattern",
           "get_previous_token_head_detection_pattern"]

HEAD_NAMES = ("previous_token_head", "duplicate_token_head", "induction_head")
ERROR_MEASURES = ("mul", "abs")


def _tokens(tokens: Any) -> np.ndarray:
    """(L,) int64 from ids (L,) or (1, L), as TransformerLens's ``[batch (1) x pos]``."""
    arr = as_array(tokens, "tokens")
    if arr.dtype.kind not in "iu" or not (arr.ndim == 1 or (arr.ndim == 2 and arr.shape[0] == 1)) or arr.size == 0:
        raise ValueError(f"tokens must be non-empty token ids (L,) or (1, L), got shape {arr.shape} and dtype "
                         f"{arr.dtype}")
    return arr.reshape(-1).astype(np.int64)


def get_previous_token_head_detection_pattern(tokens: Any) -> np.ndarray:
    """(L, L) float64: ones just below the diagonal (query i attends to key i - 1).

    Examples
    --------
    >>> get_previous_token_head_detection_pattern([7, 8, 9]).astype(int).tolist()
    [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    """
    return np.eye(len(_tokens(tokens)), k=-1)  # (L, L)


def get_duplicate_token_head_detection_pattern(tokens: Any) -> np.ndarray:
    """(L, L) float64: 1 where query i and an earlier key j hold the same token.

    Examples
    --------
    >>> get_duplicate_token_head_detection_pattern([7, 8, 7, 8]).astype(int).tolist()
    [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]
    """
    ids = _tokens(tokens)
    same = ids[:, None] == ids[None, :]  # (L, L)
    return np.tril(same, k=-1).astype(np.float64)


def get_induction_head_detection_pattern(tokens: Any) -> np.ndarray:
    """(L, L) float64: 1 where key j follows an earlier occurrence of query i's token (the duplicate pattern moved
    one key to the right; key 0 never).

    Examples
    --------
    >>> get_induction_head_detection_pattern([7, 8, 7, 8]).astype(int).tolist()
    [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]
    """
    duplicate = get_duplicate_token_head_detection_pattern(tokens)  # (L, L)
    shifted = np.zeros_like(duplicate)
    shifted[:, 1:] = duplicate[:, :-1]  # (L, L)
    return np.tril(shifted)


_PATTERNS = dict(zip(HEAD_NAMES, (get_previous_token_head_detection_pattern,
                                  get_duplicate_token_head_detection_pattern, get_induction_head_detection_pattern)))


def _check_measure(error_measure: Any) -> str:
    if error_measure not in ERROR_MEASURES:
        raise ValueError(f"error_measure must be 'mul' or 'abs', got {error_measure!r}")
    return error_measure


def _scores(patterns: np.ndarray, detection: np.ndarray, exclude_bos: bool, exclude_current_token: bool,
            error_measure: str) -> np.ndarray:
    """Scores (...) of attention patterns (..., L, L) against detection patterns broadcastable to them."""
    length = patterns.shape[-1]
    keep = np.ones((length, length), dtype=bool)  # (L, L): the query-key pairs compared
    if exclude_bos:
        keep[:, 0] = False
    if exclude_current_token:
        keep[np.diag_indices(length)] = False
    detection = detection.astype(patterns.dtype)
    if error_measure == "mul":
        kept = np.where(keep, patterns, 0)  # (..., L, L)
        return (kept * detection).sum(axis=(-2, -1)) / kept.sum(axis=(-2, -1))
    difference = np.where(keep, np.abs(patterns - detection), 0)  # (..., L, L)
    return (1 - np.round(difference.mean(axis=(-2, -1)) * length, 3)).astype(patterns.dtype)


def compute_head_attention_similarity_score(attention_pattern: Any, detection_pattern: Any, *, exclude_bos: bool,
                                            exclude_current_token: bool, error_measure: str) -> float:
    """One head's score: its attention pattern (L, L) against a detection pattern (L, L) (TransformerLens's).

    Examples
    --------
    A head that puts 0.75 of each later query's attention on the previous token: half of its attention (1.5 of 3)
    is on the marked keys; without the first key, the absolute differences left are 0.25 + 0.25 + 0.25 (0.25 per
    query on average), so "abs" gives 1 - 0.25:

    >>> pattern = np.array([[1.0, 0, 0], [0.75, 0.25, 0], [0, 0.75, 0.25]])
    >>> detection = get_previous_token_head_detection_pattern([4, 5, 6])
    >>> compute_head_attention_similarity_score(pattern, detection, exclude_bos=False,
    ...                                         exclude_current_token=False, error_measure="mul")
    0.5
    >>> compute_head_attention_similarity_score(pattern, detection, exclude_bos=True,
    ...                                         exclude_current_token=False, error_measure="abs")
    0.75
    """
    pattern = as_array(attention_pattern, "attention_pattern")
    detection = as_array(detection_pattern, "detection_pattern")
    if pattern.ndim != 2 or pattern.shape[0] != pattern.shape[1] or pattern.dtype.kind != "f":
        raise ValueError(f"attention_pattern must be a square float array (L, L), got shape {pattern.shape} and "
                         f"dtype {pattern.dtype}")
    _check_detection(detection, pattern.shape[0])
    return float(_scores(pattern, detection, bool(exclude_bos), bool(exclude_current_token),
                         _check_measure(error_measure)))


def _check_detection(detection: np.ndarray, length: int) -> None:
    if detection.shape != (length, length) or detection.dtype.kind not in "biuf" or \
            np.triu(detection, k=1).any():
        raise ValueError(f"detection_pattern must be a lower triangular matrix (L, L) for a sequence of L = {length} "
                         f"tokens, got shape {detection.shape}")


def _layer_heads(heads: Any, num_layers: int, num_heads: int) -> np.ndarray:
    """(N, H) bool: the heads to score (all for None; else a list of (layer, head) or {layer: [heads]})."""
    chosen = np.zeros((num_layers, num_heads), dtype=bool)
    if heads is None:
        chosen[:] = True
        return chosen
    pairs = [(layer, head) for layer, hs in heads.items() for head in hs] if isinstance(heads, Mapping) else heads
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in pair)
                and 0 <= pair[0] < num_layers and 0 <= pair[1] < num_heads):
            raise ValueError(f"heads must be (layer, head) pairs or {{layer: [heads]}} with layers in "
                             f"[0, {num_layers}) and heads in [0, {num_heads}), got {pair!r} in {heads!r}")
        chosen[pair[0], pair[1]] = True
    return chosen


def _prompts(model, input_ids: Any) -> list[np.ndarray]:
    """Batches (B, L) of one length each: one prompt (L,), B prompts (B, L), or a list of prompts of any lengths."""
    vocab = model.config.vocab_size
    if isinstance(input_ids, (list, tuple)) and input_ids and not np.isscalar(input_ids[0]):
        batches = [as_id_batch(ids, vocab, f"input_ids[{i}]")[0] for i, ids in enumerate(input_ids)]
    else:
        batches = [as_id_batch(input_ids, vocab, "input_ids")[0]]
    for batch in batches:
        if batch.shape[1] < 2:
            raise ValueError(f"each prompt must have at least 2 tokens, got {batch.shape[1]}")
    return batches


def detect_head(model, input_ids: Any, detection_pattern: Any, heads: Any = None, cache: Any = None, *,
                exclude_bos: bool = False, exclude_current_token: bool = False,
                error_measure: str = "mul") -> np.ndarray:
    """Every head's score for one kind of head, on one prompt or the mean over several (TransformerLens's).

    Parameters
    ----------
    model : CausalLM
    input_ids : array_like of int (L,), (B, L), or a list of prompts of any lengths
        The prompt's token ids (with its BOS, if the model expects one). Several prompts need a head name as
        ``detection_pattern`` (each gets its own pattern).
    detection_pattern : str or array_like (L, L)
        One of :data:`HEAD_NAMES` (``"previous_token_head"``, ``"duplicate_token_head"``, ``"induction_head"``), or
        a lower triangular matrix of one prompt's length.
    heads : list of (layer, head) or dict of layer to list of heads, optional
        Score only these; the others get -1.
    cache : ActivationCache, optional
        :func:`~attnkit.explain.run_with_cache`'s of this one prompt, holding every layer's ``hook_pattern``: no
        forward is run.
    exclude_bos, exclude_current_token : bool, default False
        Leave out the attention to the first key, and each query's attention to itself.
    error_measure : {"mul", "abs"}
        The share of attention on the marked keys, or ``1 - round(sum |pattern - detection| / L, 3)``.

    Returns
    -------
    ndarray (N, H), the model's dtype: NaN in layers without attention heads, -1 for heads left out.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0).astype(np.float64)
    >>> scores = detect_head(lm, [1, 5, 7, 9, 5, 7, 9], "induction_head")  # (2, 2)
    >>> scores.shape, bool(((scores >= 0) & (scores <= 1)).all())
    ((2, 2), True)
    """
    measure = _check_measure(error_measure)
    named = isinstance(detection_pattern, str)
    if named and detection_pattern not in HEAD_NAMES:
        raise ValueError(f"detection_pattern must be an (L, L) array or one of {', '.join(HEAD_NAMES)}; got "
                         f"{detection_pattern!r}")
    batches = _prompts(model, input_ids)
    if (len(batches) > 1 or batches[0].shape[0] > 1) and (cache is not None or not named):
        raise ValueError("several prompts need a head name as detection_pattern (each prompt gets its own) and no "
                         "cache (a cache holds one prompt's activations): score one prompt at a time otherwise")
    config = model.config
    names = set(hook_names(model))
    pattern_names = [f"blocks.{i}.attn.hook_pattern" for i in range(config.num_layers)]
    with_heads = [i for i, name in enumerate(pattern_names) if name in names]
    if not with_heads:
        raise ValueError(f"{type(model).__name__} has no layer with attention heads (hook_pattern) to score")
    chosen = _layer_heads(heads, config.num_layers, config.num_heads)  # (N, H)
    totals = []
    for ids in batches:
        if cache is not None:
            missing = [pattern_names[i] for i in with_heads if pattern_names[i] not in cache]
            if missing:
                raise ValueError(f"cache must hold every layer's attention pattern; it has no {missing[0]}")
            found = {pattern_names[i]: cache[pattern_names[i]] for i in with_heads}
            shape = found[pattern_names[with_heads[0]]].shape  # (B, H, L, L)
            if shape[0] != 1 or shape[-1] != ids.shape[1]:
                raise ValueError(f"cache must be of this one prompt: it holds {shape[0]} of {shape[-1]} tokens, "
                                 f"input_ids is 1 of {ids.shape[1]}")
        else:
            found = run_with_cache(model, ids, names=[pattern_names[i] for i in with_heads])[1]
        if named:
            detection = np.stack([_PATTERNS[detection_pattern](row) for row in ids])  # (B, L, L)
        else:
            detection = as_array(detection_pattern, "detection_pattern")
            _check_detection(detection, ids.shape[1])
            detection = detection[None]  # (1, L, L)
        # layer by layer: the patterns are (B, H, L, L) each, and a stack of them all would copy the cache
        layers = [_scores(found[pattern_names[i]], detection[:, None], bool(exclude_bos), bool(exclude_current_token),
                          measure) for i in with_heads]  # each (B, H)
        totals.append(np.stack(layers, axis=1))  # (B, N', H)
    per_prompt = np.concatenate(totals)  # (prompts, N', H)
    out = np.full((config.num_layers, config.num_heads), np.nan, dtype=per_prompt.dtype)  # (N, H)
    out[with_heads] = per_prompt.mean(axis=0)
    return np.where(chosen | np.isnan(out), out, -1).astype(per_prompt.dtype)

"""Activation patching and its first-order estimate, attribution patching, on clean and corrupted prompts.

The metric is any function of the patched run's logits (TransformerLens's ``patching_metric``), by default the
logit difference ``logit[correct] - logit[incorrect]`` of the next token after the last position, averaged over
the prompt pairs. Activation patching runs the corrupted prompts with one clean activation put back (one layer and
position, or one layer and head, in every pair at once) and reports the metric; attribution patching estimates the
same change of the default metric from one forward and one backward of each batch:
``(clean - corrupt) . d metric / d activation`` at the corrupted run.

A layer without the point patched (``hook="z"`` in a Gated DeltaNet layer, which has no heads) gets NaN.

Shapes: B prompt pairs, N layers, L tokens, D model width, H query heads, Dh head width, R places of one layer
(L positions, or H heads), V vocabulary, K positions whose logits the metric reads.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _progress
from .._validation import as_array, check_positive_int
from ._inputs import as_id_batch
from .hooks import hook_names, hooks, run_with_cache

__all__ = ["PATCH_POINTS", "activation_patching", "attribution_patching"]

# hook argument -> the hook name in block i (per (layer, position), or per (layer, head) for "z")
PATCH_POINTS = {"resid_pre": "blocks.{}.hook_resid_pre", "attn_out": "blocks.{}.hook_attn_out",
                "mlp_out": "blocks.{}.hook_mlp_out", "z": "blocks.{}.attn.hook_z"}


def _check(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any, hook: Any, metric: Any = None):
    """``(clean (B, L), corrupt (B, L), answers (B, 2) or None, names per layer)``; a layer without the point has
    None for its name."""
    vocab = model.config.vocab_size
    clean, _ = as_id_batch(clean_ids, vocab, "clean_ids")
    corrupt, _ = as_id_batch(corrupt_ids, vocab, "corrupt_ids")
    if clean.shape != corrupt.shape:
        raise ValueError(f"clean_ids and corrupt_ids must have the same shape (one corrupted prompt of the same "
                         f"length per clean one), got {np.shape(clean_ids)} and {np.shape(corrupt_ids)}")
    if metric is not None and not callable(metric):
        raise TypeError(f"metric must be callable as metric(logits) -> float, got {type(metric).__name__}")
    answers = None
    if answer_ids is None:
        if metric is None:
            raise ValueError("give answer_ids (correct, incorrect) for the logit-difference metric, or a metric "
                             "function")
    elif metric is not None:
        raise ValueError("give answer_ids or metric, not both (answer_ids is the default metric's)")
    else:
        arr = as_array(answer_ids, "answer_ids")
        b = clean.shape[0]
        if arr.dtype.kind not in "iu" or arr.shape not in ((2,), (b, 2)) or arr.min() < 0 or arr.max() >= vocab:
            raise ValueError(f"answer_ids must be two token ids (correct, incorrect) in [0, {vocab}), or one such "
                             f"pair per prompt ({b}, 2), got {answer_ids!r}")
        answers = np.broadcast_to(arr, (b, 2)).astype(np.int64)  # (B, 2)
    if hook not in PATCH_POINTS:
        raise ValueError(f"hook must be one of {', '.join(map(repr, PATCH_POINTS))}, got {hook!r}")
    present = set(hook_names(model))
    names = [name if name in present else None
             for name in (PATCH_POINTS[hook].format(i) for i in range(model.config.num_layers))]
    return clean, corrupt, answers, names


def logit_difference(logits: np.ndarray, answers: np.ndarray) -> float:
    """The default metric: ``logit[correct] - logit[incorrect]`` after the last position, averaged over the rows
    of ``logits`` (B, K, V) with ``answers`` (B, 2)."""
    rows = np.arange(len(answers))
    return float(np.mean(logits[rows, -1, answers[:, 0]] - logits[rows, -1, answers[:, 1]]))


def logit_difference_grad(answers: np.ndarray, vocab_size: int, dtype) -> np.ndarray:
    """The gradient (B, 1, V) of :func:`logit_difference` with respect to the last position's logits: +1/B at each
    row's correct token, -1/B at its incorrect one."""
    b = len(answers)
    grad_logits = np.zeros((b, 1, vocab_size), dtype)  # (B, 1, V)
    np.add.at(grad_logits, (np.arange(b), -1, answers[:, 0]), 1.0 / b)
    np.add.at(grad_logits, (np.arange(b), -1, answers[:, 1]), -1.0 / b)
    return grad_logits


def _metric_of(metric: Callable | None, answers: np.ndarray | None) -> Callable[[np.ndarray], float]:
    """``logits (B, K, V) -> float``: the caller's metric, its result checked, or the logit difference."""
    if metric is None:
        return lambda logits: logit_difference(logits, answers)

    def checked(logits: np.ndarray) -> float:
        value = np.asarray(metric(logits))
        if value.shape != () or value.dtype.kind not in "fiu":
            raise ValueError(f"metric must return one real number for the logits of a batch {logits.shape}, got "
                             f"{type(metric(logits)).__name__} of shape {value.shape}")
        return float(value)

    return checked


def _place_rows(corrupt: np.ndarray, rows: int) -> np.ndarray:
    """``rows`` copies of the corrupted batch, place r's in rows r * B .. r * B + B - 1: (R * B, L)."""
    return np.tile(corrupt, (rows, 1))  # (R * B, L)


def patch_places(value: np.ndarray, clean: np.ndarray, per_head: bool) -> np.ndarray:
    """``value`` (R * B, L, ...) with place r of rows r * B .. r * B + B - 1 taken from ``clean`` (B, L, ...): place
    r is position r, or head r (``per_head``: a ``hook_z`` (.., L, H, Dh), head r at every position)."""
    rows = value.shape[0] // clean.shape[0]
    patched = value.copy().reshape((rows,) + clean.shape)  # (R, B, L, ...)
    place = np.arange(rows)
    if per_head:
        patched[place, :, :, place] = clean.transpose(2, 0, 1, 3)  # head r of place r: (H, B, L, Dh)
    else:
        patched[place, :, place] = clean.transpose(1, 0, *range(2, clean.ndim))  # position r of place r: (L, B, ...)
    return patched.reshape(value.shape)


def activation_patching(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any = None, hook: str = "resid_pre",
                        *, metric: Callable[[np.ndarray], Any] | None = None, logits_to_keep: int = 1,
                        progress: bool | None = None) -> np.ndarray:
    """The metric of the corrupted runs with one clean activation patched in, for every place.

    Parameters
    ----------
    model : CausalLM
    clean_ids, corrupt_ids : array_like of int, (L,) or (B, L)
        Prompt pairs of the same length (e.g. "... John gave a drink to" and the same with the names swapped),
        row b of one the corruption of row b of the other.
    answer_ids : (int, int) or array_like (B, 2), optional
        ``(correct, incorrect)`` (one pair for every prompt or one per prompt): the metric is then
        ``logit[correct] - logit[incorrect]`` after the last token, averaged over the prompts.
    hook : {"resid_pre", "attn_out", "mlp_out", "z"}
        What is patched: the residual stream entering block i, what block i's attention or MLP adds to it (at
        one position each), or one head's output ``z`` at every position.
    metric : callable, optional
        Instead of ``answer_ids``: ``metric(logits) -> float`` of a patched run's logits (B, K, V), as
        TransformerLens's ``patching_metric`` (e.g. the logit difference normalised between the clean and
        corrupted runs).
    logits_to_keep : int, default 1
        K, the last positions whose logits the metric sees (``logits[:, -1]`` is the next token's); 0 for all.
    progress : bool or None, default None
        A line on stderr counting the forwards (:mod:`attnkit._progress`): None shows it when stderr is a
        terminal, True always, False never.

    Returns
    -------
    ndarray (N, L), or (N, H) for ``"z"``
        The metric of each patched run; NaN in the rows of layers without the point (``"z"`` in a Gated DeltaNet
        layer). Patching everything at a place that carries all the information (e.g. ``resid_pre`` of block 0
        at every position) gives the clean metric.

    Notes
    -----
    The patched runs of one layer go through the model together as a batch (R places times B prompts), each
    place's rows patched at their place: N forwards in all.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> activation_patching(lm, [1, 2, 3], [1, 5, 3], answer_ids=(4, 7)).shape
    (2, 3)
    >>> pairs = activation_patching(lm, [[1, 2, 3], [2, 2, 6]], [[1, 5, 3], [2, 9, 6]], hook="z",
    ...                             metric=lambda logits: logits[:, -1, 4].mean())
    >>> pairs.shape
    (2, 2)
    """
    clean, corrupt, answers, names = _check(model, clean_ids, corrupt_ids, answer_ids, hook, metric)
    keep = check_positive_int(logits_to_keep, "logits_to_keep", allow_zero=True)
    _progress.check_progress(progress)
    with _progress.progress(len(names) + 1, f"activation patching ({hook})", unit="forward",
                            enabled=progress) as line:
        return _patch_layers(model, clean, corrupt, _metric_of(metric, answers), names, hook, keep, line)


def _patch_layers(model, clean: np.ndarray, corrupt: np.ndarray, score: Callable, names: list, hook: str,
                  keep: int, line: _progress.Progress) -> np.ndarray:
    """:func:`activation_patching`'s forwards: the clean runs' cache, then one batch of patched runs per layer."""
    _, cache = run_with_cache(model, clean, names=[name for name in names if name is not None])
    line.update()
    b = clean.shape[0]
    rows = model.config.num_heads if hook == "z" else clean.shape[1]
    batch = _place_rows(corrupt, rows)  # (R * B, L)
    out = np.full((len(names), rows), np.nan)
    for layer, name in enumerate(names):
        if name is None:
            continue

        def patch(value: np.ndarray, _: str, clean_value=cache[name]) -> np.ndarray:
            return patch_places(value, clean_value, hook == "z")

        with hooks(model, {name: patch}):
            logits = model(batch, logits_to_keep=keep)  # (R * B, K, V)
        out[layer] = [score(logits[r * b:(r + 1) * b]) for r in range(rows)]
        line.update()
    return out


def attribution_patching(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any,
                         hook: str = "resid_pre", *, progress: bool | None = None) -> np.ndarray:
    """First-order estimate of :func:`activation_patching`'s change of the metric, from exact gradients.

    ``(clean - corrupt) . d metric / d activation``, the gradient taken at the corrupted run and the product
    summed over the features of each place (over D, or over the positions and Dh of a head for ``"z"``) and over the
    prompt pairs. Same arguments as :func:`activation_patching`, for its default metric (the logit difference,
    averaged over the pairs); one forward of the clean prompts, one forward and one backward of the corrupted ones.
    The backward forms the activations' gradients alone (``Module.input_gradients_only``); the model's gradient
    buffers are left freed (zeros when read).

    Returns
    -------
    ndarray (N, L), or (N, H) for ``"z"``
        Estimates of ``patched metric - corrupted metric``; where the metric is nearly linear in the
        activation they approach :func:`activation_patching`'s result minus the corrupted metric. NaN in the rows
        of layers without the point.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> attribution_patching(lm, [1, 2, 3], [1, 5, 3], answer_ids=(4, 7), hook="z").shape
    (2, 2)
    """
    clean, corrupt, answers, per_layer = _check(model, clean_ids, corrupt_ids, answer_ids, hook)
    _progress.check_progress(progress)
    names = [name for name in per_layer if name is not None]
    with _progress.progress(3 * len(names), f"attribution patching ({hook})", unit="layer",
                            enabled=progress) as line:
        # each hook point is reached once per layer in each pass: forward, forward, backward
        ticks = {name: _tick(line) for name in names} if line.enabled else {}
        with hooks(model, ticks, backward=ticks):
            return _attribute(model, clean, corrupt, answers, per_layer, names, hook)


def _tick(line: _progress.Progress):
    """A hook that only counts (it leaves the value as it is)."""
    def tick(value: np.ndarray, name: str) -> None:
        line.update()
    return tick


def _attribute(model, clean: np.ndarray, corrupt: np.ndarray, answers: np.ndarray, per_layer: list, names: list,
               hook: str) -> np.ndarray:
    """:func:`attribution_patching`'s three passes."""
    # only the last position's logits enter the metric: the head runs on that row alone
    _, clean_cache = run_with_cache(model, clean, names=names, logits_to_keep=1)
    grads: dict[str, np.ndarray] = {}

    def keep_grad(grad: np.ndarray, name: str) -> None:
        grads[name] = np.array(grad)

    with model.input_gradients_only(), hooks(model, backward={name: keep_grad for name in names}):
        _, corrupt_cache = run_with_cache(model, corrupt, names=names, logits_to_keep=1)
        model.backward(logit_difference_grad(answers, model.config.vocab_size, model.dtype))
    axes = (0, 1, 3) if hook == "z" else (0, 2)  # a head: its positions and features; a position: its features
    rows = model.config.num_heads if hook == "z" else clean.shape[1]
    out = np.full((len(per_layer), rows), np.nan)
    for layer, name in enumerate(per_layer):
        if name is not None:
            out[layer] = ((clean_cache[name] - corrupt_cache[name]) * grads[name]).sum(axis=axes)  # (L,) or (H,)
    return out

"""Activation patching and its first-order estimate, attribution patching, on a clean and a corrupted prompt.

The metric is the logit difference ``logit[correct] - logit[incorrect]`` of the next token after the last
position. Activation patching runs the corrupted prompt with one clean activation put back (one layer and
position, or one layer and head) and reports the metric; attribution patching estimates the same change from
one forward and one backward of each run: ``(clean - corrupt) . d metric / d activation`` at the corrupted run.

Shapes: N layers, L tokens, D model width, H query heads, Dh head width.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _progress
from ._inputs import as_id_batch
from .hooks import hooks, run_with_cache

__all__ = ["PATCH_POINTS", "activation_patching", "attribution_patching"]

# hook argument -> the hook name in block i (per (layer, position), or per (layer, head) for "z")
PATCH_POINTS = {"resid_pre": "blocks.{}.hook_resid_pre", "attn_out": "blocks.{}.hook_attn_out",
                "mlp_out": "blocks.{}.hook_mlp_out", "z": "blocks.{}.attn.hook_z"}


def _check(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any, hook: Any):
    """``(clean (1, L), corrupt (1, L), (correct, incorrect), hook names per layer)``."""
    vocab = model.config.vocab_size
    clean, _ = as_id_batch(clean_ids, vocab)
    corrupt, _ = as_id_batch(corrupt_ids, vocab)
    if clean.shape[0] != 1 or clean.shape != corrupt.shape:
        raise ValueError(f"clean_ids and corrupt_ids must be one sequence each, of the same length, got shapes "
                         f"{np.shape(clean_ids)} and {np.shape(corrupt_ids)}")
    answers = np.asarray(answer_ids)
    if answers.shape != (2,) or answers.dtype.kind not in "iu" or answers.min() < 0 or answers.max() >= vocab:
        raise ValueError(f"answer_ids must be two token ids (correct, incorrect) in [0, {vocab}), got {answer_ids!r}")
    if hook not in PATCH_POINTS:
        raise ValueError(f"hook must be one of {', '.join(map(repr, PATCH_POINTS))}, got {hook!r}")
    names = [PATCH_POINTS[hook].format(i) for i in range(model.config.num_layers)]
    return clean, corrupt, (int(answers[0]), int(answers[1])), names


def _metric(logits: np.ndarray, answers: tuple[int, int]) -> np.ndarray:
    """``logit[correct] - logit[incorrect]`` at the last position, per row: (R,)."""
    return logits[:, -1, answers[0]] - logits[:, -1, answers[1]]


def activation_patching(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any,
                        hook: str = "resid_pre", *, progress: bool | None = None) -> np.ndarray:
    """The corrupted run's logit difference with one clean activation patched in, for every place.

    Parameters
    ----------
    model : CausalLM
    clean_ids, corrupt_ids : array_like of int, (L,) or (1, L)
        Two prompts of the same length (e.g. "... John gave a drink to" and the same with the names swapped).
    answer_ids : (int, int)
        ``(correct, incorrect)``: the metric is ``logit[correct] - logit[incorrect]`` after the last token.
    hook : {"resid_pre", "attn_out", "mlp_out", "z"}
        What is patched: the residual stream entering block i, what block i's attention or MLP adds to it (at
        one position each), or one head's output ``z`` at every position.
    progress : bool or None, default None
        A line on stderr counting the forwards (:mod:`attnkit._progress`): None shows it when stderr is a
        terminal, True always, False never.

    Returns
    -------
    ndarray (N, L), or (N, H) for ``"z"``
        The metric of each patched run. Patching everything at a place that carries all the information (e.g.
        ``resid_pre`` of block 0 at every position) gives the clean metric.

    Notes
    -----
    The patched runs of one layer go through the model together as a batch (L rows, or H for ``"z"``), each row
    patched at its own place: N forwards in all.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=12)
    >>> lm = CausalLM(cfg, rng=0)
    >>> activation_patching(lm, [1, 2, 3], [1, 5, 3], answer_ids=(4, 7)).shape
    (2, 3)
    """
    clean, corrupt, answers, names = _check(model, clean_ids, corrupt_ids, answer_ids, hook)
    with _progress.progress(len(names) + 1, f"activation patching ({hook})", unit="forward",
                            enabled=progress) as line:
        return _patch_layers(model, clean, corrupt, answers, names, hook, line)


def _patch_layers(model, clean: np.ndarray, corrupt: np.ndarray, answers: tuple[int, int], names: list[str],
                  hook: str, line: _progress.Progress) -> np.ndarray:
    """:func:`activation_patching`'s forwards: the clean run's cache, then one batch of patched runs per layer."""
    _, cache = run_with_cache(model, clean, names=names)
    line.update()
    rows = model.config.num_heads if hook == "z" else clean.shape[1]
    batch = np.repeat(corrupt, rows, axis=0)  # (R, L): row r is patched at place r
    place = np.arange(rows)
    out = np.empty((len(names), rows))
    for layer, name in enumerate(names):
        clean_value = cache[name][0]  # (L, D) or (L, H, Dh)

        def patch(value: np.ndarray, _: str, clean_value=clean_value) -> np.ndarray:
            patched = value.copy()  # (R, L, D) or (R, L, H, Dh)
            if hook == "z":
                patched[place, :, place] = clean_value.transpose(1, 0, 2)  # head r of row r: (H, L, Dh)
            else:
                patched[place, place] = clean_value  # position r of row r: (L, D)
            return patched

        with hooks(model, {name: patch}):
            out[layer] = _metric(model(batch, logits_to_keep=1), answers)  # (R,)
        line.update()
    return out


def attribution_patching(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any,
                         hook: str = "resid_pre", *, progress: bool | None = None) -> np.ndarray:
    """First-order estimate of :func:`activation_patching`'s change of the metric, from exact gradients.

    ``(clean - corrupt) . d metric / d activation``, the gradient taken at the corrupted run and the product
    summed over the features of each place (over D, or over the positions and Dh of a head for ``"z"``). Same
    arguments as :func:`activation_patching`; one forward of the clean prompt, one forward and one backward of the
    corrupted one. The backward forms the activations' gradients alone (``Module.input_gradients_only``); the model's
    gradient buffers are left freed (zeros when read). ``progress`` counts the layers each of the three passes
    has gone through (as :func:`activation_patching`'s).

    Returns
    -------
    ndarray (N, L), or (N, H) for ``"z"``
        Estimates of ``patched metric - corrupted metric``; where the metric is nearly linear in the
        activation they approach :func:`activation_patching`'s result minus the corrupted metric.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=12)
    >>> lm = CausalLM(cfg, rng=0)
    >>> attribution_patching(lm, [1, 2, 3], [1, 5, 3], answer_ids=(4, 7), hook="z").shape
    (2, 2)
    """
    clean, corrupt, answers, names = _check(model, clean_ids, corrupt_ids, answer_ids, hook)
    with _progress.progress(3 * len(names), f"attribution patching ({hook})", unit="layer",
                            enabled=progress) as line:
        # each hook point is reached once per layer in each pass: forward, forward, backward
        ticks = {name: _tick(line) for name in names} if line.enabled else {}
        with hooks(model, ticks, backward=ticks):
            return _attribute(model, clean, corrupt, answers, names, hook)


def _tick(line: _progress.Progress):
    """A hook that only counts (it leaves the value as it is)."""
    def tick(value: np.ndarray, name: str) -> None:
        line.update()
    return tick


def _attribute(model, clean: np.ndarray, corrupt: np.ndarray, answers: tuple[int, int], names: list[str],
               hook: str) -> np.ndarray:
    """:func:`attribution_patching`'s three passes."""
    # only the last position's logits enter the metric: the head runs on that row alone
    _, clean_cache = run_with_cache(model, clean, names=names, logits_to_keep=1)
    grads: dict[str, np.ndarray] = {}

    def keep_grad(grad: np.ndarray, name: str) -> None:
        grads[name] = np.array(grad)

    with model.input_gradients_only(), hooks(model, backward={name: keep_grad for name in names}):
        _, corrupt_cache = run_with_cache(model, corrupt, names=names, logits_to_keep=1)
        # d metric / d logits: +1 at the correct token, -1 at the incorrect one, after the last position
        grad_logits = np.zeros((1, 1, model.config.vocab_size), model.dtype)  # (1, 1, V)
        grad_logits[0, -1, answers[0]] += 1.0
        grad_logits[0, -1, answers[1]] -= 1.0
        model.backward(grad_logits)
    axes = (1, 3) if hook == "z" else (2,)  # a head: its positions and features; a position: its features
    return np.stack([((clean_cache[name] - corrupt_cache[name]) * grads[name]).sum(axis=axes)[0]
                     for name in names])  # (N, L) or (N, H)

"""Path patching: one head's effect on the metric through later heads' queries, keys or values only.

Activation patching asks what happens when one head's output is put back; path patching (Wang et al., the
indirect-object circuit; Goldowsky-Dill et al.) asks how much of that travels along one path, from a sender
head into chosen receiver heads' inputs. On the corrupted prompt, with the sender's output taken from the clean
run, it runs twice:

1. the sender's ``z`` is the clean one and every later component is frozen at its corrupted value (the heads'
   ``z`` of the sender's layer and after, and the MLPs' outputs from the sender's layer on), so the sender's
   change reaches the residual stream of each later layer directly and nothing else changes; the receivers'
   inputs (``hook_q``, ``hook_k`` or ``hook_v``, computed from that residual stream) are kept;
2. the corrupted prompt runs again with only those receiver inputs replaced by the kept ones, everything else
   computed as usual, and the metric ``logit[correct] - logit[incorrect]`` is read.

Shapes: N layers, L tokens, H query heads, Hkv key/value heads, Dh head width, R rows of one batch (one per
sender head of a layer).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _progress
from .hooks import hooks, run_with_cache
from .patching import _check, _metric

__all__ = ["RECEIVER_INPUTS", "path_patching"]

RECEIVER_INPUTS = ("q", "k", "v")


def _check_receivers(model, receivers: Any, receiver_input: Any) -> tuple[dict[int, dict[str, list[int]]], tuple]:
    """``({layer: {input: heads}}, inputs)``: the query heads named, or for ``"k"`` / ``"v"`` their key/value heads."""
    inputs = (receiver_input,) if isinstance(receiver_input, str) else tuple(receiver_input)
    if not inputs or any(name not in RECEIVER_INPUTS for name in inputs) or len(set(inputs)) != len(inputs):
        raise ValueError(f"receiver_input must be 'q', 'k', 'v' or several of them, got {receiver_input!r}")
    cfg = model.config
    try:
        pairs = [(layer, head) for layer, head in receivers]
    except (TypeError, ValueError):
        pairs = []
    if not pairs or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for p in pairs for x in p) \
            or any(not (0 < layer < cfg.num_layers and 0 <= head < cfg.num_heads) for layer, head in pairs):
        raise ValueError(f"receivers must be (layer, head) pairs with layer in [1, {cfg.num_layers}) and query head "
                         f"in [0, {cfg.num_heads}), got {receivers!r}")
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per key/value head
    table: dict[int, dict[str, list[int]]] = {}
    for layer, head in pairs:
        for name in inputs:
            heads = table.setdefault(int(layer), {}).setdefault(name, [])
            index = int(head) if name == "q" else int(head) // group
            if index not in heads:
                heads.append(index)
    return table, inputs


def _frozen_run(model, corrupt: np.ndarray, clean_z: np.ndarray, corrupt_cache: dict, sender_layer: int,
                receivers: dict[int, list[int]], inputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Step 1 for every head of ``sender_layer`` at once (row r sends head r): the receivers' inputs (R, L, ., Dh)."""
    rows = clean_z.shape[1]  # H
    place = np.arange(rows)

    def send(z: np.ndarray, _: str) -> np.ndarray:
        patched = z.copy()  # (R, L, H, Dh)
        patched[place, :, place] = clean_z.transpose(1, 0, 2)  # head r of row r: (H, L, Dh)
        return patched

    def freeze(value: np.ndarray, name: str) -> np.ndarray:
        return np.repeat(corrupt_cache[name], rows, axis=0)  # (R, ...): the corrupted run's value

    fns = {f"blocks.{sender_layer}.attn.hook_z": send}
    for layer in range(sender_layer, model.config.num_layers):
        fns[f"blocks.{layer}.hook_mlp_out"] = freeze
        if layer > sender_layer:
            fns[f"blocks.{layer}.attn.hook_z"] = freeze
    wanted = [f"blocks.{layer}.attn.hook_{x}" for layer in receivers if layer > sender_layer for x in inputs]
    kept: dict[str, np.ndarray] = {}

    def keep(value: np.ndarray, name: str) -> None:
        kept[name] = np.array(value)

    with hooks(model, fns), hooks(model, {name: keep for name in wanted}):
        model(np.repeat(corrupt, rows, axis=0), logits_to_keep=1)
    return kept


def path_patching(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any, receivers: Any,
                  receiver_input: Any = "q", *, progress: bool | None = None) -> np.ndarray:
    """The corrupted run's logit difference when each head's clean output reaches only the receivers' inputs.

    Parameters
    ----------
    model : CausalLM
    clean_ids, corrupt_ids : array_like of int, (L,) or (1, L)
        Two prompts of the same length, as for :func:`activation_patching`.
    answer_ids : (int, int)
        ``(correct, incorrect)``: the metric is ``logit[correct] - logit[incorrect]`` after the last token.
    receivers : sequence of (int, int)
        The receiving query heads ``(layer, head)``, in layers after the first. For ``"k"`` and ``"v"`` the
        patched input is the head's key/value head, ``head // (H // Hkv)``: with grouped queries it feeds every
        query head of its group.
    receiver_input : {"q", "k", "v"} or a tuple of them, default "q"
        Which of the receivers' inputs carry the sender's change (``blocks.{i}.attn.hook_q`` / ``hook_k`` /
        ``hook_v``: after the projections and q/k norms, before the rotation).
    progress : bool or None, default None
        A line on stderr counting the forwards (:mod:`attnkit._progress`): None shows it when stderr is a
        terminal, True always, False never.

    Returns
    -------
    ndarray (N, H)
        Entry (i, h): the metric with sender head h of layer i patched along the path. NaN where layer i has no
        receiver after it. Where no path carries the difference the entry is the corrupted metric.

    Notes
    -----
    The sender heads of one layer go through the model together, one row each: two forwards of H rows per
    sender layer. Freezing (step 1) is at the corrupted run's values, so a sender's path through the MLPs
    and through heads that are not receivers is cut, as is its direct path to the logits.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=3, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, intermediate_size=12)
    >>> lm = CausalLM(cfg, rng=0)
    >>> found = path_patching(lm, [1, 2, 3], [1, 5, 3], answer_ids=(4, 7), receivers=[(2, 0)])
    >>> found.shape, bool(np.isnan(found[2]).all())
    ((3, 2), True)
    """
    clean, corrupt, answers, _ = _check(model, clean_ids, corrupt_ids, answer_ids, "z")
    table, inputs = _check_receivers(model, receivers, receiver_input)
    cfg = model.config
    names = [f"blocks.{i}.{p}" for i in range(cfg.num_layers) for p in ("attn.hook_z", "hook_mlp_out")]
    with _progress.progress(2 + 2 * max(table), "path patching", unit="forward", enabled=progress) as line:
        _, clean_cache = run_with_cache(model, clean, names=names)
        _, corrupt_cache = run_with_cache(model, corrupt, names=names)
        line.update(2)
        return _send_and_receive(model, corrupt, answers, table, inputs, clean_cache, corrupt_cache, line)


def _send_and_receive(model, corrupt: np.ndarray, answers: tuple[int, int], table: dict, inputs: tuple,
                      clean_cache: dict, corrupt_cache: dict, line: _progress.Progress) -> np.ndarray:
    """:func:`path_patching`'s two forwards per sender layer (steps 1 and 2): the metrics (N, H)."""
    cfg = model.config
    out = np.full((cfg.num_layers, cfg.num_heads), np.nan)
    batch = np.repeat(corrupt, cfg.num_heads, axis=0)  # (R, L)
    for sender in range(max(table)):
        kept = _frozen_run(model, corrupt, clean_cache[f"blocks.{sender}.attn.hook_z"][0], corrupt_cache, sender,
                           table, inputs)

        def receive(value: np.ndarray, name: str, kept=kept) -> np.ndarray:
            heads = table[int(name.split(".")[1])][name[-1]]  # "blocks.{i}.attn.hook_q" -> layer i, input "q"
            patched = value.copy()  # (R, L, H or Hkv, Dh)
            patched[:, :, heads] = kept[name][:, :, heads]
            return patched

        with hooks(model, {name: receive for name in kept}):
            out[sender] = _metric(model(batch, logits_to_keep=1), answers)  # (R,)
        line.update(2)
    return out

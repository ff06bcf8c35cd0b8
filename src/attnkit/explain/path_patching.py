"""Path patching: one head's effect on the metric through later heads' queries, keys or values only.

Activation patching asks what happens when one head's output is put back; path patching (Wang et al., the
indirect-object circuit; Goldowsky-Dill et al.) asks how much of that travels along one path, from a sender
head into chosen receiver heads' inputs. On the corrupted prompt, with the sender's output taken from the clean
run, it runs twice:

1. the sender's ``z`` is the clean one and every later component is frozen at its corrupted value (the heads'
   ``z`` of the sender's layer and after, a later Gated DeltaNet layer's whole output, and the MLPs' and
   per-layer inputs' outputs from the sender's layer on), so the sender's change reaches the residual stream of
   each later layer directly and nothing else changes; the receivers' inputs (``hook_q``, ``hook_k`` or
   ``hook_v``, computed from that residual stream) are kept;
2. the corrupted prompt runs again with only those receiver inputs replaced by the kept ones, everything else
   computed as usual, and the metric (by default ``logit[correct] - logit[incorrect]``) is read.

Senders are the heads of layers that have them (a Gated DeltaNet layer sends nothing: its row is NaN); a receiver
must have the input named (a layer that reuses an earlier layer's keys and values has no ``hook_k`` / ``hook_v``
of its own).

Shapes: B prompt pairs, N layers, L tokens, H query heads, Hkv key/value heads, Dh head width, R = H places of one
batch (one per sender head of a layer), each B rows.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _progress
from .hooks import absent_point_error, hook_names, hooks, run_with_cache
from .patching import _check, _metric_of, _place_rows, patch_places

__all__ = ["RECEIVER_INPUTS", "path_patching"]

RECEIVER_INPUTS = ("q", "k", "v")


def _check_receivers(model, receivers: Any, receiver_input: Any) -> tuple[dict[int, dict[str, list[int]]], tuple]:
    """``({layer: {input: heads}}, inputs)``: the query heads named, or for ``"k"`` / ``"v"`` their key/value heads;
    a receiver layer without the input asked for is refused saying what the layer is."""
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
    present = set(hook_names(model))
    table: dict[int, dict[str, list[int]]] = {}
    for layer, head in pairs:
        attention = model.layers[int(layer)].attention
        group = cfg.num_heads // getattr(attention, "num_kv_heads", cfg.num_heads)  # query heads per key/value head
        for name in inputs:
            point = f"blocks.{int(layer)}.attn.hook_{name}"
            if point not in present:
                raise absent_point_error(model, point, f"receivers ({int(layer)}, {int(head)})")
            heads = table.setdefault(int(layer), {}).setdefault(name, [])
            index = int(head) if name == "q" else int(head) // group
            if index not in heads:
                heads.append(index)
    return table, inputs


def _frozen_run(model, corrupt: np.ndarray, clean_z: np.ndarray, corrupt_cache: dict, sender_layer: int,
                receivers: dict[int, dict[str, list[int]]], inputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Step 1 for every head of ``sender_layer`` at once (rows r * B .. r * B + B - 1 send head r): the receivers'
    inputs (R * B, L, ., Dh)."""
    rows = clean_z.shape[2]  # H

    def send(z: np.ndarray, _: str) -> np.ndarray:
        return patch_places(z, clean_z, per_head=True)

    def freeze(value: np.ndarray, name: str) -> np.ndarray:
        return np.tile(corrupt_cache[name], (rows,) + (1,) * (value.ndim - 1))  # (R * B, ...): the corrupted run's

    fns = {f"blocks.{sender_layer}.attn.hook_z": send}
    for layer in range(sender_layer, model.config.num_layers):
        for name in _component_outputs(layer, corrupt_cache, sender_layer):
            fns[name] = freeze
    wanted = [f"blocks.{layer}.attn.hook_{x}" for layer in receivers if layer > sender_layer for x in inputs]
    kept: dict[str, np.ndarray] = {}

    def keep(value: np.ndarray, name: str) -> None:
        kept[name] = np.array(value)

    with hooks(model, fns), hooks(model, {name: keep for name in wanted}):
        model(_place_rows(corrupt, rows), logits_to_keep=1)
    return kept


def _component_outputs(layer: int, cache: dict, sender_layer: int) -> list[str]:
    """What layer ``layer`` writes into the residual stream, by the points step 1 freezes: its heads' ``z`` (or a
    Gated DeltaNet layer's whole output) after the sender's layer, its MLP's and per-layer input's outputs from the
    sender's layer on (each where the layer has it)."""
    names = []
    if layer > sender_layer:
        z, out = f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.hook_attn_out"
        names += [z] if z in cache else [out] if out in cache else []  # an MLP-only layer has neither
    names += [name for name in (f"blocks.{layer}.hook_mlp_out", f"blocks.{layer}.hook_per_layer_out") if name in cache]
    return names


def path_patching(model, clean_ids: Any, corrupt_ids: Any, answer_ids: Any, receivers: Any,
                  receiver_input: Any = "q", *, metric: Callable[[np.ndarray], Any] | None = None,
                  progress: bool | None = None) -> np.ndarray:
    """The corrupted runs' metric when each head's clean output reaches only the receivers' inputs.

    Parameters
    ----------
    model : CausalLM
    clean_ids, corrupt_ids : array_like of int, (L,) or (B, L)
        Prompt pairs of the same length, as for :func:`activation_patching`.
    answer_ids : (int, int) or array_like (B, 2), or None with ``metric``
        ``(correct, incorrect)``: the metric is ``logit[correct] - logit[incorrect]`` after the last token,
        averaged over the pairs.
    receivers : sequence of (int, int)
        The receiving query heads ``(layer, head)``, in layers after the first. For ``"k"`` and ``"v"`` the
        patched input is the head's key/value head, ``head // (H // Hkv)``: with grouped queries it feeds every
        query head of its group.
    receiver_input : {"q", "k", "v"} or a tuple of them, default "q"
        Which of the receivers' inputs carry the sender's change (``blocks.{i}.attn.hook_q`` / ``hook_k`` /
        ``hook_v``: after the projections and q/k norms, before the rotation).
    metric : callable, optional
        Instead of ``answer_ids``: ``metric(logits) -> float`` of a patched run's last-position logits (B, 1, V).
    progress : bool or None, default None
        A line on stderr counting the forwards (:mod:`attnkit._progress`): None shows it when stderr is a
        terminal, True always, False never.

    Returns
    -------
    ndarray (N, H)
        Entry (i, h): the metric with sender head h of layer i patched along the path. NaN where layer i has no
        receiver after it, or no heads (a Gated DeltaNet layer). Where no path carries the difference the entry is
        the corrupted metric.

    Notes
    -----
    The sender heads of one layer go through the model together, B rows each: two forwards of H * B rows per
    sender layer. Freezing (step 1) is at the corrupted run's values, so a sender's path through the MLPs
    and through heads that are not receivers is cut, as is its direct path to the logits.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=3, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> found = path_patching(lm, [1, 2, 3], [1, 5, 3], answer_ids=(4, 7), receivers=[(2, 0)])
    >>> found.shape, bool(np.isnan(found[2]).all())
    ((3, 2), True)
    """
    clean, corrupt, answers, senders = _check(model, clean_ids, corrupt_ids, answer_ids, "z", metric)
    score = _metric_of(metric, answers)
    table, inputs = _check_receivers(model, receivers, receiver_input)
    _progress.check_progress(progress)
    with _progress.progress(2 + 2 * max(table), "path patching", unit="forward", enabled=progress) as line:
        return _send_and_receive(model, clean, corrupt, score, senders, table, inputs, line)


def _send_and_receive(model, clean: np.ndarray, corrupt: np.ndarray, score: Callable, senders: list, table: dict,
                      inputs: tuple, line: _progress.Progress) -> np.ndarray:
    """:func:`path_patching`'s runs: the two caches, then two forwards per sender layer; the metrics (N, H)."""
    cfg = model.config
    present = set(hook_names(model))
    names = [f"blocks.{i}.{p}" for i in range(cfg.num_layers)
             for p in ("attn.hook_z", "hook_attn_out", "hook_mlp_out", "hook_per_layer_out")]
    names = [name for name in names if name in present]
    _, clean_cache = run_with_cache(model, clean, names=names)
    _, corrupt_cache = run_with_cache(model, corrupt, names=names)
    line.update(2)
    out = np.full((cfg.num_layers, cfg.num_heads), np.nan)
    b, rows = clean.shape[0], cfg.num_heads
    batch = _place_rows(corrupt, rows)  # (R * B, L)
    for sender in range(max(table)):
        if senders[sender] is None:  # no heads to send from
            line.update(2)
            continue
        kept = _frozen_run(model, corrupt, clean_cache[senders[sender]], corrupt_cache, sender, table, inputs)

        def receive(value: np.ndarray, name: str, kept=kept) -> np.ndarray:
            heads = table[int(name.split(".")[1])][name[-1]]  # "blocks.{i}.attn.hook_q" -> layer i, input "q"
            patched = value.copy()  # (R * B, L, H or Hkv, Dh)
            patched[:, :, heads] = kept[name][:, :, heads]
            return patched

        with hooks(model, {name: receive for name in kept}):
            logits = model(batch, logits_to_keep=1)  # (R * B, 1, V)
        out[sender] = [score(logits[r * b:(r + 1) * b]) for r in range(rows)]
        line.update(2)
    return out

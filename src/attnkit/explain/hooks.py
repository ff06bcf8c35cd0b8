"""Hooks and activation caches with TransformerLens's names, on attnkit's exact forward and backward.

:func:`hooks` runs a model with functions applied to named activations (steering, ablation, patching) under
forward, ``generate`` and backward; :func:`run_with_cache` keeps the activations asked for; :func:`hook_names`
lists them. A model lists its hook points with ``named_hook_points()`` (``CausalLM``: ``hook_embed``,
``blocks.{i}.hook_resid_pre``, ``blocks.{i}.attn.hook_z``, ..., ``ln_final.hook_normalized``). Layers of
different kinds have different points (a Gated DeltaNet layer has no attention points, a layer that reuses an
earlier layer's keys and values no ``hook_k`` / ``hook_v``): ``CausalLM.layer_hook_points(i)`` lists layer i's,
and a point a layer does not have is refused saying what the layer is and which points it has.

Hooks are the model's, not the thread's: inside :func:`hooks` (and so inside every explanation built on it) only
the calling thread may run the model; another thread's forward, ``generate`` or backward raises a
``RuntimeError`` (:meth:`attnkit.core.module.Module.exclusive`).

Shapes: B batch, L tokens, D model width, H query heads (K/V: the key/value heads), Dh head width, S keys.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._validation import as_array
from .cache import ActivationCache

__all__ = ["hook_names", "hooks", "run_with_cache"]


def _points(model) -> list[tuple[str, Any, str]]:
    named = getattr(model, "named_hook_points", None)
    if named is None:
        raise TypeError(f"model must have named hook points (a CausalLM), got {type(model).__name__}")
    return named()


def hook_names(model) -> list[str]:
    """Every hook name of ``model``, in the order the forward reaches them.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> names = hook_names(CausalLM(cfg, rng=0))
    >>> names[:3], names[-1], len(names)
    (['hook_embed', 'blocks.0.hook_resid_pre', 'blocks.0.attn.hook_q'], 'ln_final.hook_normalized', 26)
    """
    return [name for name, _, _ in _points(model)]


def absent_point_error(model, name: str, what: str, table: Mapping | None = None) -> ValueError:
    """The error for a hook name ``model`` does not have: what the layer is and which points it has, when another
    layer has that point (a Gated DeltaNet layer asked for ``attn.hook_pattern``), else the nearest names."""
    table = {n: None for n, _, _ in _points(model)} if table is None else table  # in forward order
    found = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    layers = {n.split(".")[1] for n in table if n.startswith("blocks.")}
    if found is not None and found.group(1) in layers:
        index, local = int(found.group(1)), found.group(2)
        elsewhere = sorted({n.split(".")[1] for n in table if n.startswith("blocks.") and n.split(".", 2)[2] == local},
                           key=int)
        if elsewhere:
            has = ", ".join(n.split(".", 2)[2] for n in table if n.startswith(f"blocks.{index}."))
            kind = f" is {model.layer_kind(index)}" if hasattr(model, "layer_kind") else ""
            return ValueError(f"{what}: {name!r}: layer {index}{kind}: it has points {has}, not {local} (the layers "
                              f"with {local}: {', '.join(elsewhere)})")
    near = difflib.get_close_matches(name, table, n=3)
    hint = f"; did you mean {', '.join(near)}?" if near else "; see attnkit.explain.hook_names(model)"
    return ValueError(f"{what}: {type(model).__name__} has no hook point {name!r}{hint}")


def _resolve(model, names: Any, what: str) -> dict[str, tuple[Any, str]]:
    """``{full name: (module, local point)}`` for the names given; unknown names are refused with the nearest, a
    point that other layers have but this one does not with what the layer is."""
    table = {name: (module, point) for name, module, point in _points(model)}
    out = {}
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{what} must name hook points by str, got {type(name).__name__} {name!r}")
        if name not in table:
            raise absent_point_error(model, name, what, table)
        out[name] = table[name]
    return out


def _check_hooks(fns: Any, what: str) -> dict[str, Callable]:
    if fns is None:
        return {}
    if not isinstance(fns, Mapping):
        raise TypeError(f"{what} must be a mapping of hook names to functions, got {type(fns).__name__}")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"{what}[{name!r}] must be callable as fn(value, name), got {type(fn).__name__}")
    return dict(fns)


@contextmanager
def hooks(model, forward: Mapping[str, Callable] | None = None, *,
          backward: Mapping[str, Callable] | None = None) -> Iterator[None]:
    """Run ``model`` with ``fn(value, name)`` applied where each named value is made, inside the block.

    A forward hook returns a replacement (same shape) or None to leave the value alone; it sees a read-only
    view (edit a copy and return it). A backward hook sees the gradient arriving at the point (same layout as
    the value) and may replace it too. Hooks apply to every forward in the block: plain calls, ``generate``
    (every decoding step, where a step's value holds only the new positions: a hook that picks positions by
    index should check the length), and the backward after an uncached forward.

    The backward is exact for the hooked model: a replaced value is a constant, so its gradient stops at the
    hook point (unless the forward hook is marked ``passes_gradient = True`` and a backward hook at the same point
    maps the gradient through it, as a spliced SAE does: :mod:`attnkit.core.hooks`). Run the backward inside the
    block; leaving a block in which a value was replaced discards the model's saved forward state, so a backward
    after it raises instead of silently ignoring the replacement.
    Blocks nest (inner hooks run after outer ones at the same point); the model is as before after the block.

    The hooks are the model's: inside the block only the calling thread may run it. Another thread's forward,
    ``generate`` or backward of the same model raises a ``RuntimeError`` naming this thread (it never sees the
    hooks), and so does another thread's ``hooks`` block on it; give each thread its own copy to run them at once.

    Parameters
    ----------
    model : CausalLM
    forward : mapping of str to callable, optional
        Hook name (:func:`hook_names`) to function.
    backward : mapping of str to callable, optional
        Hook name to function of the gradient (``blocks.{i}.attn.hook_pattern`` and
        ``blocks.{i}.mlp.hook_expert_indices`` take forward hooks only).

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> def ablate_head_1(z, name):
    ...     z = z.copy()
    ...     z[:, :, 1] = 0.0
    ...     return z
    >>> with hooks(lm, {"blocks.0.attn.hook_z": ablate_head_1}):
    ...     ablated = lm(np.array([[1, 2, 3]]))
    >>> bool(np.allclose(ablated, lm(np.array([[1, 2, 3]]))))
    False
    """
    fwd, bwd = _check_hooks(forward, "forward"), _check_hooks(backward, "backward")
    points = {**_resolve(model, fwd, "forward"), **_resolve(model, bwd, "backward")}
    added: list[tuple[Any, str, Callable, str]] = []
    with model.exclusive("attnkit.explain.hooks"):
        try:
            for direction, fns in (("forward", fwd), ("backward", bwd)):
                for name, fn in fns.items():
                    module, point = points[name]
                    module.add_hook(point, fn, full_name=name, direction=direction)
                    added.append((module, point, fn, direction))
            yield
        finally:
            replaced = any(module.hook_replaced(point) for module, point, _, direction in added
                           if direction == "forward")
            for module, point, fn, direction in reversed(added):
                module.remove_hook(point, fn, direction)
            if replaced:  # the saved forward state assumed the replacements: a backward now would not be exact
                for module in {id(module): module for _, module, _ in _points(model)}.values():
                    module.save_for_backward()


def run_with_cache(model, input_ids: Any, attention_mask: Any = None, names: Any = None, *,
                   logits_to_keep: int | None = None) -> tuple[np.ndarray, ActivationCache]:
    """The logits and the activations at the hook points asked for, from one forward.

    Parameters
    ----------
    model : CausalLM
    input_ids : array_like of int, (L,) or (B, L)
        One sequence is run as a batch of one (the cache keeps the batch axis).
    attention_mask : array_like (B, L), optional
        As the model's forward (``True`` = real token).
    names : list of str or callable, optional
        Which hook points to keep: a list of names, or ``predicate(name) -> bool``; default all of them.
        ``blocks.{i}.attn.hook_pattern`` makes that layer run the reference attention kernel (the weights are
        formed), so leave it out when it is not needed.
    logits_to_keep : int, optional
        Form the logits of the last this many positions only, as a causal LM's forward does (the head's product
        over the others is skipped; the activations are those of every position either way).

    Returns
    -------
    logits : ndarray (B, L, V), or (B, logits_to_keep, V)
    cache : ActivationCache
        A mapping of hook name to the caller's copies, in forward order (TransformerLens's short names work too:
        ``cache["resid_pre", 1]``), with ``accumulated_resid``, ``decompose_resid`` and ``logit_attrs``:
        ``hook_embed``, ``blocks.{i}.hook_resid_pre`` / ``hook_resid_mid`` / ``hook_attn_out`` / ``hook_mlp_out`` /
        ``hook_resid_post`` (B, L, D),
        ``blocks.{i}.attn.hook_q`` (B, L, H, Dh), ``hook_k`` / ``hook_v`` (B, L, Hkv, Dh), ``hook_rot_q`` /
        ``hook_rot_k`` (rotary layers), ``hook_pattern`` (B, H, L, L), ``hook_z`` (B, L, H, Dh), in a layer whose
        MLP is a mixture of experts ``blocks.{i}.mlp.hook_expert_indices`` (B, L, k) int64 and
        ``hook_router_weights`` (B, L, k), ``ln_final.hook_normalized`` (B, L, D).

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> logits, cache = run_with_cache(lm, [1, 2, 3], names=lambda name: name.endswith("hook_pattern"))
    >>> list(cache), cache["blocks.1.attn.hook_pattern"].shape
    (['blocks.0.attn.hook_pattern', 'blocks.1.attn.hook_pattern'], (1, 2, 3, 3))
    """
    everything = hook_names(model)
    if names is None:
        chosen = everything
    elif callable(names):
        chosen = [name for name in everything if names(name)]
    elif isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise TypeError(f"names must be a list of hook names or a predicate, got {type(names).__name__}")
    else:
        chosen = list(_resolve(model, list(names), "names"))
    ids = as_array(input_ids, "input_ids")
    if ids.ndim == 1:
        ids = ids[None]  # (1, L)
    found: dict[str, np.ndarray] = {}

    def keep(value: np.ndarray, name: str) -> None:
        found[name] = np.array(value)

    with hooks(model, {name: keep for name in chosen}):
        logits = model(ids, attention_mask) if logits_to_keep is None else \
            model(ids, attention_mask, logits_to_keep=logits_to_keep)
    order = {name: i for i, name in enumerate(everything)}
    cache = {name: found[name] for name in sorted(found, key=order.__getitem__)}
    return logits, ActivationCache(cache, model)

"""``ActivationCache``: what :func:`~attnkit.explain.run_with_cache` returns, with TransformerLens's helpers for
reading the residual stream.

A mapping of hook name to array (the arrays are the caller's), which also takes TransformerLens's short names
(``cache["resid_pre", 1]``, ``cache["z", 0]``, ``cache["embed"]``) and splits the residual stream:

- :meth:`~ActivationCache.accumulated_resid`: the residual stream entering each block, and the final one;
- :meth:`~ActivationCache.decompose_resid`: the stream entering a block (or the final one) as the sum of what the
  embeddings and every earlier attention and MLP wrote;
- :meth:`~ActivationCache.apply_ln_to_stack`: such a stack through a norm frozen at the run's scale;
- :meth:`~ActivationCache.logit_attrs`: each entry's share of a logit (or of a logit difference).

attnkit does not fold a norm's weight into the matrix after it (TransformerLens's ``fold_ln``), so ``apply_ln``
applies the norm's linear part at the run's scale, its weight included and its shift (LayerNorm's ``beta``) left
out: the stack's entries through it sum to the norm's output minus its shift, and their logit attributions to the
logit minus ``shift . W_U[token]`` (before Gemma 2's soft-cap). Where layers scale their output (Gemma 4's
``layer_scalar``), a component of a decomposition is what reaches the stream decomposed: times the scalars of its
layer and every later one before it.

Shapes: C components of a stack, B batch, L tokens, D model width, N layers.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ._frozen_norm import frozen_norm

__all__ = ["ActivationCache", "act_name", "output_factors"]

_ALIASES = {"attn": "pattern", "key": "k", "query": "q", "value": "v"}
_ATTENTION_POINTS = {"q", "k", "v", "z", "rot_q", "rot_k", "pattern"}


def act_name(name: Any, layer: Any = None) -> str:
    """The full hook name of TransformerLens's short name: ``("resid_pre", 1)`` -> ``blocks.1.hook_resid_pre``,
    ``("z", 0)`` or ``"z0"`` -> ``blocks.0.attn.hook_z``, ``"embed"`` -> ``hook_embed``, ``"normalized"`` ->
    ``ln_final.hook_normalized``; a full name is returned as it is.

    Examples
    --------
    >>> act_name("resid_pre", 1), act_name("k6"), act_name("embed"), act_name("blocks.0.hook_mlp_out")
    ('blocks.1.hook_resid_pre', 'blocks.6.attn.hook_k', 'hook_embed', 'blocks.0.hook_mlp_out')
    """
    if not isinstance(name, str):
        raise TypeError(f"a hook name must be a str, got {type(name).__name__} {name!r}")
    if ("." in name or name.startswith("hook_")) and layer is None:
        return name
    match = re.fullmatch(r"([a-z_]+?)(\d+)", name)
    if match is not None and layer is None:
        name, layer = match.group(1), int(match.group(2))
    name = _ALIASES.get(name, name)
    if layer is None:
        return "ln_final.hook_normalized" if name == "normalized" else f"hook_{name}"
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"a layer must be an int, got {type(layer).__name__} {layer!r}")
    part = "attn." if name in _ATTENTION_POINTS else ""
    return f"blocks.{int(layer)}.{part}hook_{name}"


def output_factors(model) -> np.ndarray:
    """(N + 1,): how much of what layer i writes reaches the final residual stream (the product of the output
    scalars of layers i..N-1; entry N is 1), for models whose layers scale their output (Gemma 4), else ones."""
    scalars = [float(getattr(layer, "layer_scalar", np.ones(1))[0]) for layer in model.layers]
    return np.append(np.cumprod(scalars[::-1])[::-1], 1.0)  # (N + 1,)


def _take(x: np.ndarray, index: Any, axis: int) -> np.ndarray:
    """``x`` indexed along ``axis`` as TransformerLens's ``Slice``: None all, an int one (the axis goes), a
    ``slice``, a ``(start, stop[, step])`` tuple, or a list or array of indices."""
    if index is None:
        return x
    if isinstance(index, tuple):
        index = slice(*index)
    elif not isinstance(index, (slice, int, np.integer)):
        index = np.asarray(index)
        if index.dtype.kind not in "iu" or index.ndim != 1:
            raise ValueError(f"a position or batch slice must be None, an int, a slice, a (start, stop[, step]) "
                             f"tuple or a 1-D list of ints, got {index!r}")
    elif isinstance(index, bool):
        raise TypeError("a position or batch slice must not be a bool")
    axis = axis % x.ndim
    return x[(slice(None),) * axis + (index,)]


class ActivationCache(Mapping):
    """The activations of one run by hook name, and TransformerLens's ways of reading the residual stream.

    Parameters
    ----------
    cache_dict : dict of str to ndarray
        Hook name to activation, each with its batch axis (B, ...).
    model : CausalLM
        The model that made them (its norms and output head are read by ``apply_ln`` and :meth:`logit_attrs`).

    Examples
    --------
    >>> from attnkit.explain import run_with_cache
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0).astype(np.float64)
    >>> logits, cache = run_with_cache(lm, [1, 2, 3])
    >>> stack, labels = cache.decompose_resid(pos_slice=-1, return_labels=True)
    >>> labels, stack.shape
    (['embed', '0_attn_out', '0_mlp_out', '1_attn_out', '1_mlp_out'], (5, 1, 8))
    >>> bool(np.allclose(stack.sum(0), cache["resid_post", 1][:, -1], rtol=0, atol=1e-15))
    True
    >>> attrs = cache.logit_attrs(stack, tokens=4, incorrect_tokens=7, pos_slice=-1)  # (5, 1)
    >>> bool(abs(attrs.sum() - (logits[0, -1, 4] - logits[0, -1, 7])) < 1e-12)
    True
    """

    def __init__(self, cache_dict: dict[str, np.ndarray], model: Any) -> None:
        self.cache_dict = cache_dict
        self.model = model

    def __repr__(self) -> str:
        return f"ActivationCache with keys {list(self.cache_dict)}"

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, str) and key in self.cache_dict:
            return self.cache_dict[key]
        name = act_name(*key) if isinstance(key, tuple) else act_name(key)
        if isinstance(key, tuple) and len(key) > 1 and isinstance(key[1], (int, np.integer)) and key[1] < 0:
            name = act_name(key[0], self._num_layers() + int(key[1]))
        if name not in self.cache_dict:
            raise KeyError(f"{key!r} ({name}) is not in this cache; it holds {len(self.cache_dict)} points "
                           f"(run_with_cache keeps every point with names=None)")
        return self.cache_dict[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.cache_dict)

    def __len__(self) -> int:
        return len(self.cache_dict)

    # -- the residual stream -----------------------------------------------------------------------------
    def _num_layers(self) -> int:
        return len(self.model.layers)

    def _layer(self, layer: Any) -> int:
        n = self._num_layers()
        if layer is None or (isinstance(layer, (int, np.integer)) and not isinstance(layer, bool) and layer == -1):
            return n
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer <= n:
            raise ValueError(f"layer must be in [0, {n}] ({n}, -1 or None: the final residual stream), got {layer!r}")
        return int(layer)

    def _has_mid(self, layer: int) -> bool:
        """Whether block ``layer`` has a residual between its branches (not GPT-NeoX's parallel block)."""
        return "hook_resid_mid" in self.model.layers[layer].hook_points()

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: Any = None, mlp_input: bool = False,
                          return_labels: bool = False) -> np.ndarray | tuple[np.ndarray, list[str]]:
        """The residual stream entering each block up to ``layer``, and the final one (TransformerLens's).

        Parameters
        ----------
        layer : int, optional
            The streams entering blocks 0..layer; ``None``, -1 or N: every block's and the final residual stream
            (the final norm's input, ``blocks.{N-1}.hook_resid_post``), labelled ``final_post``.
        incl_mid : bool, default False
            Add each earlier block's ``hook_resid_mid`` after its ``hook_resid_pre`` (blocks with parallel branches
            have none).
        apply_ln : bool, default False
            Through the norm that reads the stream: for the final stream each entry through the final norm with its
            own statistics (the logit lens), else the input norm of block ``layer`` frozen at the run's scale.
        pos_slice : int, slice, tuple or list of int, optional
            Positions kept (an int drops the axis).
        mlp_input : bool, default False
            End with block ``layer``'s ``hook_resid_mid`` (the MLP's input) instead of its input.
        return_labels : bool, default False

        Returns
        -------
        ndarray (C, B, L, D), or (C, B, D) for one position; with ``return_labels`` also the labels
        (``"0_pre"``, ``"0_mid"``, ..., ``"final_post"``). The last entry for ``layer=None`` is the final residual.
        """
        layer = self._layer(layer)
        n = self._num_layers()
        parts, labels = [], []
        for i in range(layer + 1):
            if i == n:
                parts.append(self[f"blocks.{n - 1}.hook_resid_post"])
                labels.append("final_post")
                continue
            parts.append(self[f"blocks.{i}.hook_resid_pre"])
            labels.append(f"{i}_pre")
            if ((incl_mid and i < layer) or (mlp_input and i == layer)) and self._has_mid(i):
                parts.append(self[f"blocks.{i}.hook_resid_mid"])
                labels.append(f"{i}_mid")
        stack = np.stack([_take(p, pos_slice, -2) for p in parts])  # (C, B, L, D) or (C, B, D)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice,
                                           recompute_ln=layer == n)
        return (stack, labels) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: Any = None, incl_embeds: bool = True,
                        return_labels: bool = False) -> np.ndarray | tuple[np.ndarray, list[str]]:
        """The residual stream entering block ``layer`` as the stack of what wrote it (TransformerLens's).

        The entries are ``embed`` and ``pos_embed`` (learned positions), then per earlier block ``{i}_attn_out``
        (a Gated DeltaNet layer's whole output too) and ``{i}_mlp_out``, and ``{i}_per_layer_out`` where a block
        has a per-layer input (Gemma 4). With every entry they sum to that stream (within float rounding).

        Parameters
        ----------
        layer : int, optional
            Decompose the stream entering this block; ``None``, -1 or N: the final residual stream.
        mlp_input : bool, default False
            Decompose the MLP's input of block ``layer`` instead: its attention output is added (a block with
            parallel branches feeds its MLP the block's input, so nothing is added there).
        mode : {"all", "attn", "mlp"}
            Keep every entry, or the attention outputs only, or the MLP outputs only.
        apply_ln : bool, default False
            Through the norm that reads the stream, frozen at the run's scale (:meth:`apply_ln_to_stack`).
        pos_slice : int, slice, tuple or list of int, optional
        incl_embeds : bool, default True
        return_labels : bool, default False

        Returns
        -------
        ndarray (C, B, L, D), or (C, B, D) for one position; with ``return_labels`` also the labels.
        """
        if mode not in ("all", "attn", "mlp"):
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        layer = self._layer(layer)
        scalars = [float(getattr(block, "layer_scalar", np.ones(1))[0]) for block in self.model.layers[:layer]]
        reach = np.append(np.cumprod(scalars[::-1])[::-1], 1.0)  # (layer + 1,): entry i reaches the stream times it
        parts, labels = [], []
        if incl_embeds:
            for name in ("hook_embed", "hook_pos_embed"):
                if name in self.cache_dict or name in self.model.hook_points():
                    parts.append(self[name] * reach[0])
                    labels.append(name[len("hook_"):])
        kinds = {"attn": ("attn_out",), "mlp": ("mlp_out",), "all": ("attn_out", "mlp_out", "per_layer_out")}[mode]
        for i in range(layer):
            for kind in kinds:
                if f"hook_{kind}" in self.model.layers[i].hook_points():
                    parts.append(self[f"blocks.{i}.hook_{kind}"] * reach[i])
                    labels.append(f"{i}_{kind}")
        if mlp_input and mode != "mlp" and layer < self._num_layers() and self._has_mid(layer):
            parts.append(self[f"blocks.{layer}.hook_attn_out"])
            labels.append(f"{layer}_attn_out")
        if not parts:
            raise ValueError(f"nothing to decompose: layer {layer} with mode={mode!r} and incl_embeds={incl_embeds}")
        stack = np.stack([_take(p, pos_slice, -2) for p in parts])  # (C, B, L, D) or (C, B, D)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: Any, layer: int | None = None, mlp_input: bool = False,
                          pos_slice: Any = None, batch_slice: Any = None, recompute_ln: bool = False) -> np.ndarray:
        """A stack of parts of the stream read by a norm: each part through the norm at the run's scale.

        The norm is the final one (``layer`` None, -1 or N), else block ``layer``'s input norm (its MLP's with
        ``mlp_input``); its scale is the one the run's stream gave it (TransformerLens's cached ``hook_scale``):
        ``center(part) * weight / rms(stream)``, the shift left out. An absent norm (OLMo 2's blocks) leaves the
        stack as it is. With ``recompute_ln`` and the final norm, each part goes through the whole final norm
        with its own statistics (shift included), as the logit lens reads a stream.

        Parameters
        ----------
        residual_stack : array_like (C, B, L, D) or (C, B, D)
            Parts of the stream, ``pos_slice`` already applied to them (as :meth:`decompose_resid` does).
        layer, mlp_input
            Which norm, as above.
        pos_slice, batch_slice : optional
            The positions and batch rows the stack holds (applied to the run's scale; ``batch_slice`` is applied
            to the stack's batch axis too).
        recompute_ln : bool, default False

        Returns
        -------
        ndarray of the stack's shape (its batch axis sliced).
        """
        stack = np.asarray(residual_stack)
        layer = self._layer(layer)
        n = self._num_layers()
        stack = _take(stack, batch_slice, 1)
        if layer == n:
            norm, stream = self.model.norm, self[f"blocks.{n - 1}.hook_resid_post"]
        else:
            block = self.model.layers[layer]
            norm = block.mlp_norm if mlp_input else block.attn_norm
            mid = mlp_input and self._has_mid(layer)
            stream = self[f"blocks.{layer}.hook_resid_mid" if mid else f"blocks.{layer}.hook_resid_pre"]
        if recompute_ln and layer == n:
            scale, shift, center = frozen_norm(norm, stack)  # each part's own statistics
            centred = stack - stack.mean(axis=-1, keepdims=True) if center else stack
            return centred * scale + shift
        stream = _take(_take(stream, batch_slice, 0), pos_slice, -2)  # (B, L, D) or (B, D)
        scale, _, center = frozen_norm(norm, stream)
        centred = stack - stack.mean(axis=-1, keepdims=True) if center else stack
        return centred * scale.astype(stack.dtype, copy=False)

    def logit_attrs(self, residual_stack: Any, tokens: Any, incorrect_tokens: Any = None, pos_slice: Any = None,
                    batch_slice: Any = None) -> np.ndarray:
        """Each part's share of the logit of ``tokens`` (minus that of ``incorrect_tokens``), through the final
        norm frozen at the run's scale (TransformerLens's).

        The stack goes through :meth:`apply_ln_to_stack` (final norm) and each part is dotted with the output head's
        row of the token: a stack that sums to the final residual (:meth:`decompose_resid`, ``pos_slice`` the
        logit's position) has attributions that sum to the logit (difference), less the final norm's shift's share
        (LayerNorm) and before a final soft-cap (Gemma 2).

        Parameters
        ----------
        residual_stack : array_like (C, B, D) or (C, B, L, D)
            Parts of the final residual stream, not normed.
        tokens : int or array_like of int, (B,) or (B, L)
        incorrect_tokens : int or array_like of int, optional
            The same shape as ``tokens``: the attribution is then of the logit difference.
        pos_slice, batch_slice : optional
            As :meth:`apply_ln_to_stack`.

        Returns
        -------
        ndarray (C, B) or (C, B, L)
        """
        weight = self.model.head_weight
        vocab = weight.shape[0]

        def rows(ids: Any, name: str) -> np.ndarray:
            arr = np.asarray(ids)
            if arr.dtype.kind not in "iu" or arr.ndim > 2 or (arr.size and (arr.min() < 0 or arr.max() >= vocab)):
                raise ValueError(f"{name} must be token ids in [0, {vocab}): an int, (B,) or (B, L), got {ids!r}")
            return arr

        correct = rows(tokens, "tokens")
        scaled = self.apply_ln_to_stack(residual_stack, None, pos_slice=pos_slice, batch_slice=batch_slice)
        # the head's rows times the model's logit scale (Granite's 1 / logits_scaling; 1 elsewhere)
        weight = weight * weight.dtype.type(self.model.config.scales.logit)  # (V, D)
        direction = weight[correct].astype(scaled.dtype)  # (D,), (B, D) or (B, L, D)
        if incorrect_tokens is not None:
            wrong = rows(incorrect_tokens, "incorrect_tokens")
            if wrong.shape != correct.shape:
                raise ValueError(f"tokens and incorrect_tokens must have the same shape, got {correct.shape} and "
                                 f"{wrong.shape}")
            direction = direction - weight[wrong].astype(scaled.dtype)
        if correct.ndim == 1 and scaled.ndim == 4:  # one token per row, every position: (B, 1, D)
            direction = direction[:, None]
        return (scaled * direction).sum(axis=-1)  # (C, B) or (C, B, L)

"""Direct logit attribution: what each head, each MLP and the embeddings write into the residual stream,
read straight through the final norm and the output head as a share of one logit.

A head is one slice of its layer's ``hook_z`` through its rows of the output projection, whatever the attention
(grouped-query, gated, latent, or reading an earlier layer's keys and values). A layer without heads (a Gated
DeltaNet layer) is split no further: its whole output (``hook_attn_out``) is one share. A mixer whose attention
sits beside a state-space half (Falcon-H1's) names its heads' writer and their factor (``head_writer()``); its heads
are split as any, and the rest of its output (the state-space half's) is one share.

The final norm is linear in its input once its scale is fixed, so with the scale taken from the run (frozen)
every component's share is a dot product, and the shares sum to the logit. Post-norms on the branches (Gemma,
OLMo 2) are frozen the same way, and Gemma 2's final soft-cap as the ratio ``logit / (logit before the cap)``.

Shapes: B batch, L tokens, N layers, H query heads, Dh head width, D model width.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import as_array
from ..kernels.linear import linear
from ._frozen_norm import frozen_norm
from ._inputs import as_id_batch, check_position
from .cache import output_factors
from .hooks import run_with_cache

__all__ = ["direct_logit_attribution", "head_writes"]


def head_writes(layer, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What each head of ``layer``'s attention writes into the residual stream (..., H, D), and the rest of the
    attention's output (..., D): its output bias, through the same post-norm and scale.

    ``z`` (..., H, Dv) is ``hook_z``; head h's write is ``z_h @ W_O[h]`` with ``W_O`` (H * Dv, D) read as
    (H, Dv, D): Dv is the head's value width (``v_head_dim`` in latent attention, a global layer's wider heads in
    Gemma 4), taken from ``z`` itself. The attention output's post-norm (Gemma, OLMo 2) and the branch's scale
    (Granite) are frozen at the output the run made, so the writes and the rest sum to ``hook_attn_out``. A mixer
    with a ``head_writer()`` (the attention beside a Mamba-2 mixer) names the module holding ``W_O`` and the factor
    of its output; what the other half writes is not in these."""
    attention, factor = layer.attention.head_writer() if hasattr(layer.attention, "head_writer") \
        else (layer.attention, 1.0)
    heads, width = z.shape[-2:]
    lead = z.shape[:-2]
    # each head's z alone in its rows of W_O's input, the other heads' zero: one product through W_O (dense or
    # packed, whose rows cannot be cut per head) gives every head's write
    alone = np.zeros(lead + (heads, heads, width), z.dtype)  # (..., H, H, Dv)
    alone[..., np.arange(heads), np.arange(heads), :] = z
    per_head = linear(alone.reshape(lead + (heads, heads * width)), attention.W_O) * z.dtype.type(factor)  # (..., H, D)
    b_o = attention.b_O if "b_O" in attention._parameters else np.zeros(per_head.shape[-1], z.dtype)  # (D,)
    b_o = b_o * z.dtype.type(factor)  # (D,)
    # the post-norm (an identity where there is none) and the scale (an identity where it is 1), frozen
    post_scale, _, _ = frozen_norm(layer.attn_post_norm, per_head.sum(axis=-2) + b_o)  # (..., D)
    post_scale = post_scale * frozen_norm(layer.attn_scale, post_scale)[0]  # (..., D)
    return per_head * post_scale[..., None, :], b_o * post_scale  # (..., H, D), (..., D)


def _head_shares(layer, z: np.ndarray, direction: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each head's share (B, H) of what ``layer``'s attention writes along ``direction`` (B, D), its output bias's
    share (B,), and what the heads and the bias write together (B, D); ``z`` (B, H, Dv) is ``hook_z`` at the
    explained position."""
    per_head, b_o = head_writes(layer, z)  # (B, H, D), (B, D)
    shares = np.einsum("bhd,bd->bh", per_head, direction)  # (B, H)
    return shares, (b_o * direction).sum(axis=-1), per_head.sum(axis=1) + b_o  # (B, H), (B,), (B, D)


def direct_logit_attribution(model, input_ids: Any, target: Any, target_position: int = -1) -> dict[str, Any]:
    """Each component's share of the logit of ``target`` after ``target_position``, summing to it exactly.

    Parameters
    ----------
    model : CausalLM
    input_ids : array_like of int, (L,) or (B, L)
    target : int or array_like of int (B,)
        The output token whose logit is split.
    target_position : int, default -1
        The position whose next-token logit is split (negative counts from the end).

    Returns
    -------
    dict
        ``"embed"``: the token embeddings' share (times Gemma's ``scales.embedding``); ``"pos_embed"``: the learned
        position embeddings' (0 for rotary models); ``"heads"`` (N, H): each head's output through its slice of the
        output projection (its query, key and value biases are in it; 0 in the rows of layers without heads);
        ``"linear_attn"`` (N,): the whole output of each Gated DeltaNet layer, which has no heads (0 for attention
        layers; the Mamba-2 half of an attention-beside-Mamba-2 layer); ``"mlp"`` (N,): each MLP's output, its biases
        included; ``"per_layer"`` (N,): what each layer's per-layer input adds (Gemma 4; 0 otherwise); ``"bias"``: the
        attention output biases of every layer and the final LayerNorm's shift, which belong to no head; ``"logit"``:
        the model's logit. Each is a float for one sequence, with a leading (B,) for a batch; ``embed + pos_embed +
        heads.sum() + linear_attn.sum() + mlp.sum() + per_layer.sum() + bias == logit`` to rounding (about 1e-15
        relative in float64). Where layers scale their output (Gemma 4's ``layer_scalar``), a share is what reaches the
        final norm: times the scalars of its layer and every later one.

    Notes
    -----
    The scale of the final norm (and of post-norms) is the run's own, held fixed: a component's share is what it
    contributes given the others, not what the logit would be without it (that is :func:`activation_patching`'s
    question). With LayerNorm each component is centred, as the norm centres their sum.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0).astype(np.float64)
    >>> parts = direct_logit_attribution(lm, [1, 2, 3], target=4)
    >>> parts["heads"].shape, parts["mlp"].shape
    ((2, 2), (2,))
    >>> total = parts["embed"] + parts["pos_embed"] + parts["heads"].sum() + parts["linear_attn"].sum() + \\
    ...     parts["mlp"].sum() + parts["bias"]
    >>> bool(abs(total - parts["logit"]) < 1e-12)
    True
    """
    cfg = model.config
    batch, single = as_id_batch(input_ids, cfg.vocab_size, "input_ids")
    b = batch.shape[0]
    position = check_position(target_position, batch.shape[1])
    targets = as_array(target, "target")
    if targets.dtype.kind not in "iu" or targets.ndim > 1 or (targets.ndim == 1 and targets.shape != (b,)) \
            or (targets < 0).any() or (targets >= cfg.vocab_size).any():
        raise ValueError(f"target must be a token id in [0, {cfg.vocab_size}) or one per row ({b},), got {target!r}")
    targets = np.broadcast_to(targets, (b,))
    n, heads = cfg.num_layers, cfg.num_heads
    learned = cfg.rotary is None
    final = f"blocks.{n - 1}.hook_resid_post"  # the final norm's input
    names = ["hook_embed", *(["hook_pos_embed"] if learned else []), final]
    names += [f"blocks.{i}.{p}" for i in range(n)
              for p in ("attn.hook_z", "hook_attn_out", "hook_mlp_out", "hook_per_layer_out")]
    # the model is causal: the tokens after the explained position change nothing before it
    wanted = set(names)  # only the points a layer has: no hook_z in a Gated DeltaNet layer, no per-layer input
    logits, cache = run_with_cache(model, batch[:, :position + 1], names=lambda name: name in wanted)
    at = {name: value[:, -1] for name, value in cache.items()}  # (B, D) or (B, H, Dh)

    scale, shift, center = frozen_norm(model.norm, at[final])  # (B, D), (D,)
    rows = model.head_weight[targets].astype(scale.dtype) * scale.dtype.type(cfg.scales.logit)  # (B, D)
    direction = rows * scale  # (B, D): d logit / d residual
    if center:
        direction = direction - direction.mean(axis=-1, keepdims=True)  # (B, D): center(c) . u == c . center(u)
    bias = rows @ shift  # (B,)

    head_parts, linear_parts = np.zeros((b, n, heads), scale.dtype), np.zeros((b, n), scale.dtype)
    mlp_parts, per_layer_parts = np.zeros((b, n), scale.dtype), np.zeros((b, n), scale.dtype)
    factors = output_factors(model).astype(scale.dtype)  # (N + 1,)
    reaching = direction
    for i, layer in enumerate(model.layers):
        direction = reaching * factors[i]  # (B, D): d logit / d what layer i writes
        if f"blocks.{i}.attn.hook_z" in at:
            head_parts[:, i], layer_bias, written = _head_shares(layer, at[f"blocks.{i}.attn.hook_z"],
                                                                 direction)  # (B, H), (B,), (B, D)
            bias = bias + layer_bias
            if hasattr(layer.attention, "head_writer"):  # the state-space half beside the heads: the rest
                linear_parts[:, i] = ((at[f"blocks.{i}.hook_attn_out"] - written) * direction).sum(axis=-1)
        elif f"blocks.{i}.hook_attn_out" in at:  # no heads: the layer's whole output is one share
            linear_parts[:, i] = (at[f"blocks.{i}.hook_attn_out"] * direction).sum(axis=-1)  # (B,)
        if f"blocks.{i}.hook_mlp_out" in at:  # a layer that is its token mixer alone has no MLP
            mlp_parts[:, i] = (at[f"blocks.{i}.hook_mlp_out"] * direction).sum(axis=-1)  # (B,)
        if f"blocks.{i}.hook_per_layer_out" in at:
            per_layer_parts[:, i] = (at[f"blocks.{i}.hook_per_layer_out"] * direction).sum(axis=-1)  # (B,)
    direction = reaching * factors[0]  # (B, D): the embeddings pass through every layer's scalar
    parts = {"embed": (at["hook_embed"] * direction).sum(axis=-1),
             "pos_embed": (at["hook_pos_embed"] * direction).sum(axis=-1) if learned else np.zeros(b, scale.dtype),
             "heads": head_parts, "linear_attn": linear_parts, "mlp": mlp_parts, "per_layer": per_layer_parts,
             "bias": bias}
    logit = logits[np.arange(b), -1, targets]  # (B,)
    if cfg.scales.final_logit_softcap is not None:  # logit = C tanh(z / C): the parts of z, times the run's logit / z
        uncapped = sum(part.reshape(b, -1).sum(axis=-1) for part in parts.values())  # (B,): z itself
        ratio = np.divide(logit, uncapped, out=np.ones_like(logit), where=uncapped != 0)  # (B,)
        parts = {k: v * ratio.reshape((b,) + (1,) * (v.ndim - 1)) for k, v in parts.items()}
    parts["logit"] = logit
    return {k: v[0] for k, v in parts.items()} if single else parts

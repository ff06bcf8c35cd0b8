"""The canonical names of a decoder's activations, which every side of a comparison records.

A trace is a dict of name to array, every array with its batch axis first:

- ``embed`` (B, L, D): the residual stream entering layer 0 (embeddings, scaled where the family scales them);
- ``layers.{i}.norm`` (B, L, D): the attention's input norm's output;
- ``layers.{i}.q`` (B, L, H, Dh), ``k`` and ``v`` (B, L, Hkv, Dh): the heads after the projections (and the q/k
  norms, if any);
- ``layers.{i}.rotary_q`` (B, L, H, Dh), ``rotary_k`` (B, L, Hkv, Dh): after the rotary embedding (rotary layers);
- ``layers.{i}.scores`` (B, H, L, S): the attention logits as the softmax sees them (scaled, soft-capped, masked),
  each row less its mean over the keys it attends; the keys it does not attend -inf;
- ``layers.{i}.probs`` (B, H, L, S): the attention probabilities;
- ``layers.{i}.heads`` (B, L, H, Dh): each head's output, as the output projection reads it;
- ``layers.{i}.attn_out`` (B, L, D): what the attention branch adds to the residual stream (after its post-norm);
- ``layers.{i}.router`` (B, L, k): a mixture of experts' weights of its chosen experts;
- ``layers.{i}.mlp`` (B, L, D): what the MLP branch adds to the residual stream (after its post-norm);
- ``layers.{i}.resid`` (B, L, D): the residual stream leaving layer i;
- ``logits`` (B, L, V).

``scores`` are made from ``probs`` (:func:`scores_from_probs`) on every side, so that every implementation can
give them (transformers' eager attention and most user code return the probabilities, not the logits): a row's
logits are fixed by its probabilities up to a constant, which the row mean takes away. A wrong scale, soft-cap,
mask or head mapping shows in ``scores`` first.

Shapes: B batch, L tokens, S keys, D model width, H query heads, Hkv key/value heads, Dh head width, V vocabulary.
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["OPS", "layer_name", "split_name", "scores_from_probs", "order_key"]

# forward order inside a layer; the first divergence is the first of these, in this order, that diverges
OPS = ("norm", "q", "k", "v", "rotary_q", "rotary_k", "scores", "probs", "heads", "attn_out", "router", "mlp",
       "resid")
_OP_RANK = {op: rank for rank, op in enumerate(OPS)}
_LAYER = re.compile(r"layers\.(\d+)\.([a-z_]+)")


def layer_name(layer: int, op: str) -> str:
    """``layers.{layer}.{op}``."""
    return f"layers.{layer}.{op}"


def split_name(name: str) -> tuple[int | None, str]:
    """``(layer, op)`` of a trace name; ``(None, name)`` for ``embed`` and ``logits``.

    Examples
    --------
    >>> split_name("layers.3.probs"), split_name("embed")
    ((3, 'probs'), (None, 'embed'))
    """
    found = _LAYER.fullmatch(name)
    if found is not None and found.group(2) in _OP_RANK:
        return int(found.group(1)), found.group(2)
    if name in ("embed", "logits"):
        return None, name
    raise ValueError(f"{name!r} is not a trace name: expected 'embed', 'logits' or 'layers.<i>.<op>' with <op> one "
                     f"of {', '.join(OPS)}")


def order_key(name: str) -> tuple[int, int]:
    """A sort key putting trace names in forward order (``embed``, layer 0's ops in :data:`OPS` order, ...,
    ``logits``)."""
    layer, op = split_name(name)
    if layer is None:
        return (-1, 0) if op == "embed" else (1 << 30, 0)
    return layer, _OP_RANK[op]


def scores_from_probs(probs: np.ndarray) -> np.ndarray:
    """The attention logits (B, H, L, S) that ``probs`` (B, H, L, S) come from, each row less its mean over the
    keys it attends (probability > 0); the keys it does not attend are -inf. Computed in float64.

    Examples
    --------
    >>> logits = np.array([[[[0.5, 1.5, -np.inf]]]])
    >>> p = np.exp(logits - logits.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    >>> scores_from_probs(p)[0, 0, 0]
    array([-0.5,  0.5, -inf])
    """
    p = np.asarray(probs, dtype=np.float64)
    attended = p > 0
    with np.errstate(divide="ignore"):
        logp = np.log(np.where(attended, p, 1.0))  # (B, H, L, S)
    count = np.maximum(attended.sum(-1, keepdims=True), 1)  # (B, H, L, 1)
    mean = np.where(attended, logp, 0.0).sum(-1, keepdims=True) / count  # (B, H, L, 1)
    return np.where(attended, logp - mean, -np.inf)  # (B, H, L, S)

"""Per-generated-token attribution, as inseq gives it: for each token a model generated, which of the tokens
before it (the prompt's and the ones generated earlier) made the model choose it.

Each generated token ``new[i]`` (at position ``P + i``) is explained from the distribution after position
``P + i - 1``: the function explained is ``log p(new[i])``, or with a foil the contrastive ``log p(new[i]) -
log p(foil[i])`` (Yin and Neubig's contrastive explanations), which equals the logit difference
``logit[new[i]] - logit[foil[i]]``. The gradients are attnkit's exact backward; gradient x input and saliency
take one forward and one backward of a batch with one row per generated token, integrated gradients
:func:`integrated_gradients` per token.

Shapes: P prompt tokens, G generated tokens, L = P + G all tokens, D model width, V vocabulary.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._validation import as_array, check_positive_int
from ._inputs import as_id_batch
from .integrated_gradients import integrated_gradients

__all__ = ["GENERATION_METHODS", "GenerationAttribution", "generation_attribution"]

GENERATION_METHODS = ("gradient_x_input", "saliency", "integrated_gradients")


class GenerationAttribution(NamedTuple):
    """``attributions`` (G, L): row i explains generated token i, over all L tokens (zero from its own position
    on); ``ids`` (L,) the prompt and the generation; ``prompt_length`` P; ``targets`` (G,) the generated ids;
    ``foils`` (G,) or None; ``completeness_gaps`` (G,) for integrated gradients, else None."""

    attributions: np.ndarray
    ids: np.ndarray
    prompt_length: int
    targets: np.ndarray
    foils: np.ndarray | None
    completeness_gaps: np.ndarray | None


def _check_new(model, prompt: np.ndarray, new_ids: Any, max_new_tokens: Any) -> np.ndarray:
    """The generated ids (G,): given, or greedy decoding of ``max_new_tokens``."""
    if (new_ids is None) == (max_new_tokens is None):
        raise ValueError("give the generation once: new_ids (the tokens generated) or max_new_tokens (decode "
                         f"greedily), got new_ids={new_ids!r} and max_new_tokens={max_new_tokens!r}")
    if new_ids is not None:
        new, single = as_id_batch(new_ids, model.config.vocab_size, "new_ids")
        if not single:
            raise ValueError(f"new_ids must be one sequence (G,), got shape {np.shape(new_ids)}")
        return new[0]
    count = check_positive_int(max_new_tokens, "max_new_tokens")
    out = model.generate(prompt[None], max_new_tokens=count, do_sample=False, eos_token_id=[])  # (1, P + G)
    return out[0, len(prompt):]


def _check_foils(foil: Any, count: int, vocab: int) -> np.ndarray | None:
    if foil is None:
        return None
    foils = as_array(foil, "foil")
    if foils.dtype.kind not in "iu" or foils.ndim > 1 or (foils.ndim == 1 and foils.shape != (count,)) \
            or (foils < 0).any() or (foils >= vocab).any():
        raise ValueError(f"foil must be a token id in [0, {vocab}) or one per generated token ({count},), "
                         f"got {foil!r}")
    return np.broadcast_to(foils, (count,)).astype(np.int64)


def _gradient_rows(model, ids: np.ndarray, prompt_length: int, targets: np.ndarray,
                   foils: np.ndarray | None) -> np.ndarray:
    """Row i: the gradient (L, D) of generated token i's function w.r.t. the token embeddings: (G, L, D)."""
    count, length = len(targets), len(ids)
    rows = np.arange(count)
    positions = prompt_length - 1 + rows  # (G,): where each generated token is predicted
    logits = model(np.repeat(ids[None], count, axis=0))  # (G, L, V)
    read = logits[rows, positions].astype(np.float64)  # (G, V)
    grad_rows = np.zeros_like(read)  # (G, V)
    if foils is None:  # d log softmax(z)[t] / dz = onehot(t) - softmax(z)
        probs = np.exp(read - read.max(axis=-1, keepdims=True))
        grad_rows -= probs / probs.sum(axis=-1, keepdims=True)
    else:  # d (z[t] - z[f]) / dz = onehot(t) - onehot(f)
        grad_rows[rows, foils] -= 1.0
    grad_rows[rows, targets] += 1.0
    grad_logits = np.zeros(logits.shape, logits.dtype)  # (G, L, V)
    grad_logits[rows, positions] = grad_rows
    with model.input_gradients_only():
        grad = model.backward(grad_logits)  # (G, L, D)
    grad[np.arange(length)[None, :] > positions[:, None]] = 0.0  # causal: exactly zero after the explained position
    return grad


def generation_attribution(model, input_ids: Any, max_new_tokens: int | None = None, *, new_ids: Any = None,
                           method: str = "gradient_x_input", foil: Any = None, steps: int = 64,
                           baseline: Any = None) -> GenerationAttribution:
    """Attribute each generated token to every token before it: a (generated tokens, all tokens) matrix.

    Parameters
    ----------
    model : CausalLM
        Its gradient buffers are left freed (zeros when read).
    input_ids : array_like of int (P,)
        The prompt.
    max_new_tokens : int, optional
        Decode this many tokens greedily (no end-of-sequence stop) and explain them; or give ``new_ids``.
    new_ids : array_like of int (G,), optional
        The generated tokens to explain (e.g. a sampled continuation, or a forced one).
    method : {"gradient_x_input", "saliency", "integrated_gradients"}
        ``gradient x input`` (signed), saliency (the gradient's L2 norm per token), or integrated gradients on
        the token embeddings (:func:`integrated_gradients` with ``steps`` and ``baseline``: each row sums to
        its token's ``f(x) - f(baseline)`` up to the completeness gap, which is returned).
    foil : int or array_like of int (G,), optional
        The contrastive variant: explain ``log p(target) - log p(foil)`` (= ``logit[target] - logit[foil]``),
        why the model chose each generated token rather than its foil.
    steps : int, default 64
        Quadrature points of integrated gradients.
    baseline : None, int or ndarray (L, D), optional
        Integrated gradients' baseline (see :func:`integrated_gradients`), for all L tokens.

    Returns
    -------
    GenerationAttribution
        ``(attributions (G, L), ids (L,), prompt_length, targets (G,), foils, completeness_gaps)``.
        Row i, column j is token j's share in generated token i; columns from ``P + i`` on are zero (the token
        itself and what came after it). Row i equals the single-prediction function on the prefix (e.g.
        :func:`gradient_x_input` of ``ids[:P + i]`` with ``target_token=targets[i]``) padded with zeros.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0).astype(np.float64)
    >>> found = generation_attribution(lm, [1, 2, 3], max_new_tokens=2)
    >>> found.attributions.shape, found.ids.shape, float(found.attributions[0, 3])
    ((2, 5), (5,), 0.0)
    >>> contrast = generation_attribution(lm, [1, 2, 3], new_ids=found.targets, foil=7)
    >>> contrast.foils.tolist()
    [7, 7]
    """
    prompt, single = as_id_batch(input_ids, model.config.vocab_size, "input_ids")
    if not single:
        raise ValueError(f"input_ids must be one sequence (P,), got shape {np.shape(input_ids)}")
    if method not in GENERATION_METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, GENERATION_METHODS))}, got {method!r}")
    targets = _check_new(model, prompt[0], new_ids, max_new_tokens)
    foils = _check_foils(foil, len(targets), model.config.vocab_size)
    ids = np.concatenate([prompt[0], targets])  # (L,)
    p = prompt.shape[1]
    if method == "integrated_gradients":
        found = [integrated_gradients(model, ids, int(t), steps=steps, baseline=baseline, target_position=p - 1 + i,
                                      foil=None if foils is None else int(foils[i]))
                 for i, t in enumerate(targets)]  # one per generated token, as a decoding step is
        attributions = np.stack([f.attributions for f in found])  # (G, L)
        return GenerationAttribution(attributions, ids, p, targets, foils,
                                     np.array([f.completeness_gap for f in found]))
    grad = _gradient_rows(model, ids, p, targets, foils)  # (G, L, D)
    if method == "saliency":
        attributions = np.sqrt((grad * grad).sum(axis=-1))  # (G, L)
    else:
        attributions = (grad * model.embed.weight[ids]).sum(axis=-1)  # (G, L)
    return GenerationAttribution(attributions, ids, p, targets, foils, None)

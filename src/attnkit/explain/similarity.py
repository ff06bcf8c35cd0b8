"""Input attributions of a sentence encoder: which tokens make two sentences' embeddings similar.

An encoder predicts no token, so its attribution needs a target; the one a user of sentence embeddings asks
about is the cosine similarity of two sentences (what search, clustering and deduplication rank by). Its
gradient with respect to one sentence's token embeddings, the other sentence held fixed, comes from attnkit's
exact backward through the BERT encoder and the mean pooling.

Shapes: L tokens of the explained sentence, D embedding width, H heads, N layers.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class SimilarityAttribution(NamedTuple):
    """Per-token attribution of ``cos(embed(sentence), embed(other))`` to ``sentence``'s tokens.

    ``tokens`` (L str, ``[CLS]`` and ``[SEP]`` included), ``gradient_x_input`` and ``saliency`` (L,) in the
    encoder's dtype, and the ``similarity`` (float)."""

    tokens: list
    gradient_x_input: np.ndarray
    saliency: np.ndarray
    similarity: float


def similarity_gradient(encoder, sentence: str, other: str) -> tuple[np.ndarray, np.ndarray, list, float]:
    """``(grad (L, D), embeddings (L, D), tokens, similarity)``: the gradient of the cosine similarity of the
    two sentences' embeddings with respect to ``sentence``'s token embeddings (``other`` held fixed)."""
    for name, value in (("sentence", sentence), ("other", other)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    target = np.asarray(encoder.encode(other, normalize=True), dtype=np.float64)  # (D,) unit
    target = target / np.linalg.norm(target)
    batch = encoder.tokenize([sentence])
    model = encoder.model
    hidden = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)  # (1, L, D)
    length = hidden.shape[1]
    pooled = hidden[0].astype(np.float64).mean(axis=0)  # (D,): one sentence has no padding
    norm = np.linalg.norm(pooled)
    unit = pooled / norm  # (D,)
    similarity = float(unit @ target)
    # d cos / d pooled = (t - cos u) / |p|; the mean spreads it evenly over the L positions.
    grad_pooled = (target - similarity * unit) / norm  # (D,)
    grad_hidden = np.broadcast_to(grad_pooled / length, hidden.shape).astype(hidden.dtype)  # (1, L, D)
    with model.input_gradients_only():
        grad = model.backward(grad_hidden)  # (1, L, D)
    embeddings = model.word_embeddings.weight[batch.input_ids]  # (1, L, D)
    return grad[0], embeddings[0], batch.tokens[0], similarity


def similarity_attribution(encoder, sentence: str, other: str) -> SimilarityAttribution:
    """Which tokens of ``sentence`` make its embedding similar to ``other``'s.

    The target is the cosine similarity of the two sentence embeddings (the encoder's pooled, normalised
    output); its gradient with respect to ``sentence``'s token embeddings gives, per token,
    ``gradient_x_input = sum_d grad * embedding`` (positive: the token raises the similarity) and
    ``saliency = ||grad||``. Swap the arguments to explain the other sentence.

    Parameters
    ----------
    encoder : SentenceEncoder
        E.g. :func:`attnkit.pretrained.load_minilm`. Its gradient buffers are left freed (zeros when read).
    sentence : str
        The sentence explained.
    other : str
        The sentence it is compared with (held fixed).

    Returns
    -------
    SimilarityAttribution
        ``(tokens, gradient_x_input (L,), saliency (L,), similarity)``.

    Examples
    --------
    >>> from attnkit.pretrained import load_minilm
    >>> enc = load_minilm()
    >>> a = similarity_attribution(enc, "A man is eating food.", "Someone eats bread.")
    >>> a.tokens[:3], a.gradient_x_input.shape, round(a.similarity, 2) == round(float(enc.similarity(
    ...     "A man is eating food.", "Someone eats bread.")[0, 0]), 2)
    (['[CLS]', 'a', 'man'], (8,), True)
    """
    grad, embeddings, tokens, similarity = similarity_gradient(encoder, sentence, other)
    return SimilarityAttribution(tokens, (grad * embeddings).sum(axis=-1),  # (L,)
                                 np.sqrt((grad * grad).sum(axis=-1)), similarity)  # (L,)


def encoder_attention(encoder, sentence: str) -> tuple[list, np.ndarray]:
    """``(tokens, weights (N, H, L, L))``: every layer's attention of one sentence."""
    layers = [encoder.attention(sentence, layer) for layer in range(encoder.num_layers)]
    return layers[0][0], np.stack([w for _, w in layers])  # (N, H, L, L)



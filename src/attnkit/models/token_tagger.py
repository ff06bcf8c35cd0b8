"""Small complete models built from :mod:`attnkit.layers`, and helpers to train and score them.

:class:`TokenTagger` classifies every token of a sequence (the :mod:`attnkit.demos.tasks` problems, tagging,
per-token labels). Dimension letters: B batch, L sequence length, V vocabulary, C classes, D ``d_model``,
H heads.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.module import Module
from ..init import as_generator
from ..layers import Embedding, LearnedPositionalEmbedding, Projection, SinusoidalPositionalEncoding, TransformerEncoder
from ..losses import softmax_cross_entropy
from ..optim.clip import clip_grad_norm
from ..optim.optimizer import Optimizer
from .config import TokenTaggerConfig

__all__ = ["TokenTagger", "train_step", "token_accuracy"]

TOKEN_INIT_STD = 0.02  # standard deviation of the initial token embeddings of TokenTagger


class TokenTagger(Module):
    """Per-token classifier: Embedding -> positional encoding -> TransformerEncoder -> Projection.

    Parameters
    ----------
    config : TokenTaggerConfig
        The sizes (V tokens, C classes, D, heads, layers), block layout and positions.
    rng : numpy.random.Generator or int, optional
        Source of every initial weight.

    Attributes
    ----------
    embedding : Embedding (token vectors initialised ``N(0, 0.02^2)`` as in BERT and GPT-2),
    positional : SinusoidalPositionalEncoding or LearnedPositionalEmbedding,
    encoder : TransformerEncoder, head : Projection (D -> C).

    Shapes
    ------
    ids : int (B, L); key_padding_mask : bool (B, L), ``True`` = real token (the opposite of torch);
    logits : (B, L, C) in the parameters' dtype (convert the model with ``astype(np.float32)`` to run in
    float32). With ``need_weights=True``, also one (B, H, L, L) array of attention weights per layer.

    Examples
    --------
    >>> from attnkit.demos.tasks import make_batch
    >>> model = TokenTagger(TokenTaggerConfig(vocab_size=10, num_classes=10, max_length=8, d_model=16, num_heads=2),
    ...                     rng=0)
    >>> ids, targets = make_batch("reverse", 4, 6, rng=0)
    >>> logits, weights = model(ids, need_weights=True)
    >>> logits.shape, len(weights), weights[0].shape
    ((4, 6, 10), 2, (4, 2, 6, 6))
    >>> loss, grad = softmax_cross_entropy(logits, targets)
    >>> model.backward(grad)
    >>> bool(model.embedding.grads["weight"].any())
    True
    """

    def __init__(self, config: TokenTaggerConfig, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        if not isinstance(config, TokenTaggerConfig):
            raise TypeError(f"config must be a TokenTaggerConfig, got {type(config).__name__}")
        self.config = c = config
        gen = as_generator(rng)
        d_model = c.d_model
        self.embedding = Embedding(c.vocab_size, d_model, rng=gen)
        # BERT/GPT-2 scale, the same as the learned position table: with torch's N(0, 1) token vectors a
        # learned position signal of 0.02 is swamped and position-driven tasks fail to break symmetry.
        self.embedding.weight = TOKEN_INIT_STD * self.embedding.weight
        if c.positional == "sinusoidal":
            self.positional = SinusoidalPositionalEncoding(c.max_length, d_model)
        else:
            self.positional = LearnedPositionalEmbedding(c.max_length, d_model, rng=gen)
        self.encoder = TransformerEncoder(c.num_layers, d_model, c.num_heads, c.d_ff, norm_first=c.norm_first,
                                          activation=c.activation, rng=gen)
        self.head = Projection(d_model, c.num_classes, rng=gen)
        self.vocab_size, self.num_classes, self.max_length = c.vocab_size, c.num_classes, c.max_length

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, num_classes={self.num_classes}, max_length={self.max_length}"

    def forward(self, ids: Any, key_padding_mask: Any = None, need_weights: bool = False):
        """Logits (B, L, C) for integer ``ids`` (B, L); with ``need_weights`` also the per-layer weights list."""
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ValueError(f"ids must be 2-D (batch, seq_len), got shape {ids.shape}")
        x = self.positional(self.embedding(ids))  # (B, L, D)
        encoded = self.encoder(x, key_padding_mask=key_padding_mask, need_weights=need_weights)  # (B, L, D)
        if need_weights:
            encoded, weights = encoded
            return self.head(encoded), weights  # (B, L, C), [(B, H, L, L)] * num_layers
        return self.head(encoded)  # (B, L, C)

    def backward(self, grad_logits: Any) -> None:
        """Backpropagate (B, L, C) ``grad_logits``, adding every parameter's gradient; returns ``None``."""
        g = self.head.backward(grad_logits)  # (B, L, D)
        g = self.encoder.backward(g)  # (B, L, D)
        self.embedding.backward(self.positional.backward(g))

    def predict(self, ids: Any, key_padding_mask: Any = None) -> np.ndarray:
        """The most likely class of every token, int64 (B, L)."""
        return self.forward(ids, key_padding_mask).argmax(axis=-1)  # (B, L)


def train_step(model: TokenTagger, optimizer: Optimizer, ids: Any, targets: Any, *, key_padding_mask: Any = None,
               ignore_index: int | None = None, max_grad_norm: float | None = None) -> float:
    """One optimisation step on the mean token cross-entropy; returns the loss before the step.

    Zeroes the gradients, runs forward and backward, optionally clips the global gradient norm to
    ``max_grad_norm``, then calls ``optimizer.step()``.

    Examples
    --------
    >>> from attnkit.optim import Adam
    >>> from attnkit.demos.tasks import make_batch
    >>> model = TokenTagger(TokenTaggerConfig(10, 10, 8, d_model=16, num_heads=2), rng=0)
    >>> ids, targets = make_batch("reverse", 8, 6, rng=0)
    >>> opt = Adam(model, lr=1e-2)
    >>> first = train_step(model, opt, ids, targets)
    >>> later = [train_step(model, opt, ids, targets) for _ in range(20)][-1]
    >>> later < first
    True
    """
    model.zero_grad()
    loss, grad = softmax_cross_entropy(model(ids, key_padding_mask), targets, ignore_index=ignore_index)
    model.backward(grad)
    if max_grad_norm is not None:
        clip_grad_norm(model, max_grad_norm)
    optimizer.step()
    return loss


def token_accuracy(model: TokenTagger, ids: Any, targets: Any, *, key_padding_mask: Any = None,
                   ignore_index: int | None = None) -> float:
    """Fraction of tokens (those whose target is not ``ignore_index``) whose predicted class is right.

    Runs the model in eval mode and restores its previous mode.
    """
    was_training = model.training
    model.eval()
    try:
        pred = model.predict(ids, key_padding_mask)  # (B, L)
    finally:
        model.train(was_training)
    targets = np.asarray(targets)
    counted = np.ones(targets.shape, bool) if ignore_index is None else targets != ignore_index  # (B, L)
    return float(np.sum((pred == targets) & counted) / max(int(counted.sum()), 1))

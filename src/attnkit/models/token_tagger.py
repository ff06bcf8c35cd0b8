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

__all__ = ["TokenTagger", "train_step", "token_accuracy"]

TOKEN_INIT_STD = 0.02  # standard deviation of the initial token embeddings of TokenTagger


class TokenTagger(Module):
    """Per-token classifier: Embedding -> positional encoding -> TransformerEncoder -> Projection.

    Parameters
    ----------
    vocab_size : int
        V, number of input token ids.
    num_classes : int
        C, number of output classes per token.
    max_length : int
        Longest sequence accepted.
    d_model : int, default 64
    num_heads : int, default 4
    num_layers : int, default 2
    d_ff : int, optional
        Feed-forward hidden size (default ``4 * d_model``).
    norm_first : bool, default True
        Pre-norm blocks (with a final LayerNorm) or post-norm blocks.
    activation : {"relu", "gelu", "gelu_tanh"}, default "relu"
    positional : {"sinusoidal", "learned"}, default "sinusoidal"
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
    >>> model = TokenTagger(vocab_size=10, num_classes=10, max_length=8, d_model=16, num_heads=2, rng=0)
    >>> ids, targets = make_batch("reverse", 4, 6, rng=0)
    >>> logits, weights = model(ids, need_weights=True)
    >>> logits.shape, len(weights), weights[0].shape
    ((4, 6, 10), 2, (4, 2, 6, 6))
    >>> loss, grad = softmax_cross_entropy(logits, targets)
    >>> model.backward(grad)
    >>> bool(model.embedding.grads["weight"].any())
    True
    """

    def __init__(self, vocab_size: int, num_classes: int, max_length: int, d_model: int = 64, num_heads: int = 4,
                 num_layers: int = 2, d_ff: int | None = None, *, norm_first: bool = True,
                 activation: str = "relu", positional: str = "sinusoidal",
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        self.embedding = Embedding(vocab_size, d_model, rng=gen)
        # BERT/GPT-2 scale, the same as the learned position table: with torch's N(0, 1) token vectors a
        # learned position signal of 0.02 is swamped and position-driven tasks fail to break symmetry.
        self.embedding.weight = TOKEN_INIT_STD * self.embedding.weight
        if positional == "sinusoidal":
            self.positional = SinusoidalPositionalEncoding(max_length, d_model)
        elif positional == "learned":
            self.positional = LearnedPositionalEmbedding(max_length, d_model, rng=gen)
        else:
            raise ValueError(f"positional must be 'sinusoidal' or 'learned', got {positional!r}")
        self.encoder = TransformerEncoder(num_layers, d_model, num_heads, d_ff, norm_first=norm_first,
                                          activation=activation, rng=gen)
        self.head = Projection(d_model, num_classes, rng=gen)
        self.vocab_size, self.num_classes, self.max_length = vocab_size, num_classes, max_length

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
    >>> model = TokenTagger(10, 10, 8, d_model=16, num_heads=2, rng=0)
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

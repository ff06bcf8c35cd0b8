"""``Seq2SeqTransformer``: token embeddings, the encoder-decoder :class:`~attnkit.layers.Transformer`, a
linear head over the target vocabulary, and cached greedy / beam-search generation.

Dimension letters: B batch, Ls source length, Lt target length, D ``d_model``, H heads, Dh = D // H,
V target vocabulary, K beams, N ``max_new_tokens``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.module import Module
from ..decoding.beam_search import search_state
from ..decoding.cache import EncoderDecoderCache, KVCache
from ..decoding.config import GenerationConfig
from ..init import as_generator
from ..layers import Embedding, Projection, SinusoidalPositionalEncoding, Transformer
from .config import Seq2SeqConfig

__all__ = ["Seq2SeqTransformer"]


def _check_ids(ids: Any, name: str, vocab_size: int, max_length: int) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 2-D integer array (batch, seq_len), got shape {ids.shape} "
                         f"and dtype {ids.dtype}")
    if ids.shape[1] > max_length:
        raise ValueError(f"{name} has length {ids.shape[1]}, the model takes at most max_length = {max_length}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} must hold ids in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
    return ids


def _check_padding(mask: Any, name: str, shape: tuple[int, int]) -> np.ndarray | None:
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ or mask.shape != shape:
        raise ValueError(f"{name} must be a boolean (batch, seq_len) = {shape} array (True = real token), "
                         f"got shape {mask.shape} and dtype {mask.dtype}")
    return mask


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)  # (R, V)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # (R, V)


class _DecodingState:
    """Per-row decoding state of a :class:`Seq2SeqTransformer`: the memory, its padding mask and the
    decoder's :class:`EncoderDecoderCache` (self-attention keys/values, and the memory's projected once)."""

    def __init__(self, model: Seq2SeqTransformer, memory: np.ndarray, memory_mask: np.ndarray | None,
                 max_new_tokens: int) -> None:
        self.model = model
        self.memory, self.memory_mask = memory, memory_mask  # (B, Ls, D), (B, Ls) or None
        self.cache = model.new_cache(memory.shape[0], max_new_tokens, memory.dtype)

    def step(self, tokens: np.ndarray, t: int) -> np.ndarray:
        """Log-probabilities (R, V) of the token after ``tokens`` (R,) at target position ``t``."""
        model = self.model
        x = model.tgt_embedding.weight[tokens] + model.tgt_positional.encodings[t]  # (R, D)
        h = model.transformer.decoder(x[:, None, :].astype(self.memory.dtype, copy=False), self.memory,
                                      memory_key_padding_mask=self.memory_mask, tgt_is_causal=True,
                                      cache=self.cache)  # (R, 1, D)
        return _log_softmax(model.head(h[:, 0]))  # (R, V)

    def reorder(self, index: np.ndarray) -> None:
        self.cache.reorder(index)
        self.memory = self.memory[index]  # (R', Ls, D)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask[index]  # (R', Ls)


class Seq2SeqTransformer(Module):
    """Encoder-decoder Transformer for sequence-to-sequence tasks (translation, normalisation, ...).

    ``logits = head(Transformer(pos(src_embed(src)), pos(tgt_embed(tgt)), causal target))``, with fixed
    sinusoidal positions, pre-norm blocks and both stacks ending in a LayerNorm.

    Parameters
    ----------
    config : Seq2SeqConfig
        Vocabularies, sizes, layer counts, the cross-attention head, dropout and activation.
    rng : numpy.random.Generator or int, optional
        Source of every initial weight.

    Attributes
    ----------
    src_embedding, tgt_embedding : Embedding; src_positional, tgt_positional : SinusoidalPositionalEncoding;
    transformer : Transformer; head : Projection (D -> V).

    Shapes
    ------
    src_ids int (B, Ls), tgt_ids int (B, Lt) -> logits (B, Lt, V) in the parameters' dtype.
    ``*_key_padding_mask``: bool (B, L), ``True`` = real token (the opposite of torch).

    Examples
    --------
    >>> config = Seq2SeqConfig(7, 6, d_model=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
    ...                        max_length=10)
    >>> model = Seq2SeqTransformer(config, rng=0)
    >>> src, tgt = np.array([[3, 4, 5, 6]]), np.array([[1, 3, 4]])
    >>> model(src, tgt).shape
    (1, 3, 6)
    >>> model.generate(src, bos_token_id=1, eos_token_id=2, max_new_tokens=5, num_beams=3).shape[1] <= 6
    True
    """

    def __init__(self, config: Seq2SeqConfig, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        if not isinstance(config, Seq2SeqConfig):
            raise TypeError(f"config must be a Seq2SeqConfig, got {type(config).__name__}")
        self.config = c = config
        gen = as_generator(rng)
        self.src_vocab_size, self.tgt_vocab_size, self.max_length = c.src_vocab_size, c.tgt_vocab_size, c.max_length
        self.src_embedding = Embedding(c.src_vocab_size, c.d_model, rng=gen)
        self.tgt_embedding = Embedding(c.tgt_vocab_size, c.d_model, rng=gen)
        self.src_positional = SinusoidalPositionalEncoding(c.max_length, c.d_model)
        self.tgt_positional = SinusoidalPositionalEncoding(c.max_length, c.d_model)
        self.transformer = Transformer(c.d_model, c.num_heads, c.num_encoder_layers, c.num_decoder_layers, c.d_ff,
                                       dropout=c.dropout, activation=c.activation, norm_first=True,
                                       cross_attention=c.cross_attention, rng=gen)
        self.head = Projection(c.d_model, c.tgt_vocab_size, rng=gen)
        # generate's defaults (explicit arguments win): an exact beam search, finished rows padded with 0, and
        # no more new tokens than the decoder has positions
        self.generation_config = GenerationConfig(early_stopping="never", pad_token_id=0,
                                                  max_new_tokens=min(20, c.max_length))

    def extra_repr(self) -> str:
        return (f"src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size}, "
                f"max_length={self.max_length}")

    def _check(self, src_ids, tgt_ids, src_key_padding_mask, tgt_key_padding_mask):
        src_ids = _check_ids(src_ids, "src_ids", self.src_vocab_size, self.max_length)
        tgt_ids = _check_ids(tgt_ids, "tgt_ids", self.tgt_vocab_size, self.max_length)
        if src_ids.shape[0] != tgt_ids.shape[0]:
            raise ValueError(f"src_ids and tgt_ids must share the batch size, got {src_ids.shape} and {tgt_ids.shape}")
        return (src_ids, tgt_ids, _check_padding(src_key_padding_mask, "src_key_padding_mask", src_ids.shape),
                _check_padding(tgt_key_padding_mask, "tgt_key_padding_mask", tgt_ids.shape))

    def forward(self, src_ids: Any, tgt_ids: Any, src_key_padding_mask: Any = None,
                tgt_key_padding_mask: Any = None) -> np.ndarray:
        """Next-token logits (B, Lt, V) at every target position (each sees the target up to itself)."""
        src_ids, tgt_ids, src_pad, tgt_pad = self._check(src_ids, tgt_ids, src_key_padding_mask,
                                                         tgt_key_padding_mask)
        src = self.src_positional(self.src_embedding(src_ids))  # (B, Ls, D)
        tgt = self.tgt_positional(self.tgt_embedding(tgt_ids))  # (B, Lt, D)
        h = self.transformer(src, tgt, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                             memory_key_padding_mask=src_pad, tgt_is_causal=True)  # (B, Lt, D)
        return self.head(h)  # (B, Lt, V)

    def backward(self, grad_logits: Any) -> None:
        """Backpropagate (B, Lt, V) ``grad_logits``, adding every parameter's gradient; returns ``None``."""
        grad_src, grad_tgt = self.transformer.backward(self.head.backward(grad_logits))  # (B, Ls, D), (B, Lt, D)
        self.src_embedding.backward(self.src_positional.backward(grad_src))
        self.tgt_embedding.backward(self.tgt_positional.backward(grad_tgt))

    def cross_attention_weights(self, src_ids: Any, tgt_ids: Any, src_key_padding_mask: Any = None) -> np.ndarray:
        """Cross-attention weights of every decoder block, (num_decoder_layers, B, H, Lt, Ls) (e.g. to plot
        which source tokens each output token looked at)."""
        src_ids, tgt_ids, src_pad, _ = self._check(src_ids, tgt_ids, src_key_padding_mask, None)
        memory = self.transformer.encoder(self.src_positional(self.src_embedding(src_ids)),
                                          key_padding_mask=src_pad)  # (B, Ls, D)
        tgt = self.tgt_positional(self.tgt_embedding(tgt_ids))  # (B, Lt, D)
        _, weights = self.transformer.decoder(tgt, memory, memory_key_padding_mask=src_pad, tgt_is_causal=True,
                                              need_weights=True)
        return np.stack(weights)  # (N_dec, B, H, Lt, Ls)

    def new_cache(self, batch_size: int, max_length: int | None = None, dtype: Any = None) -> EncoderDecoderCache:
        """An empty :class:`~attnkit.decoding.cache.EncoderDecoderCache` for this model's decoder: a
        ``max_length``-slot self-attention :class:`~attnkit.decoding.cache.KVCache` per block (``dtype``:
        the parameters' by default) and room for each block's projected memory."""
        decoder = self.transformer.decoder
        dtype = self.head.W.dtype if dtype is None else dtype
        return EncoderDecoderCache(KVCache(decoder.num_layers, batch_size, decoder.num_heads,
                                           decoder.d_model // decoder.num_heads, dtype, max_length=max_length))

    def generate(self, src_ids: Any, src_key_padding_mask: Any = None, *, bos_token_id: int,
                 generation_config: GenerationConfig | None = None, eos_token_id: int | None = None,
                 max_new_tokens: int | None = None, num_beams: int | None = None,
                 length_penalty: float | None = None, early_stopping: bool | str | None = None,
                 pad_token_id: int | None = None) -> np.ndarray:
        """Decode a target for every source row: greedy (``num_beams=1``) or beam search.

        The encoder runs once; every decoder block's cross-attention keys/values of the memory are
        projected once and its self-attention keys/values are kept, both in a :meth:`new_cache`, so
        each step costs one position. Runs in eval mode (no dropout) and restores the previous mode.

        Every option left as None takes ``generation_config``'s value (default: :attr:`generation_config`,
        whose ``early_stopping="never"`` and ``pad_token_id=0`` are this model's own defaults); the search is
        :func:`attnkit.decoding.beam_search.search_state`, which refuses options it does not implement
        (sampling, logits processors, stop strings).

        Parameters
        ----------
        src_ids : int (B, Ls)
        src_key_padding_mask : bool (B, Ls), optional
            ``True`` = real token; padded source tokens are invisible to the encoder and the decoder.
        bos_token_id : int
            The first target token.
        generation_config : GenerationConfig, optional
            The options the arguments below replace.
        eos_token_id : int
            The token that ends a hypothesis (required here or in ``generation_config``).
        max_new_tokens : int
            N, most tokens generated after bos (eos included), at most ``max_length``.
        num_beams : int
            K in ``[1, MAX_NUM_BEAMS]`` (1024); 1 is greedy decoding. Beams beyond the
            ``(V - 1) ** (N - 1)`` prefixes that can ever be open are not allocated (they cannot change the
            result: the search is already exact).
        length_penalty : float
            Beam search ranks hypotheses by ``sum(log p) / n ** length_penalty`` (n generated tokens).
        early_stopping : bool or "never"
            As ``transformers``; ``"never"`` (this model's default) keeps the search exact.
        pad_token_id : int
            Fills each row after its eos.

        Returns
        -------
        ids : int64 (B, 1 + n), bos first; n <= N is the longest row (``(0, 1)`` for an empty batch).
        """
        src_ids = _check_ids(src_ids, "src_ids", self.src_vocab_size, self.max_length)
        src_pad = _check_padding(src_key_padding_mask, "src_key_padding_mask", src_ids.shape)
        base = self.generation_config if generation_config is None else generation_config
        if not isinstance(base, GenerationConfig):
            raise TypeError(f"generation_config must be a GenerationConfig, got {type(base).__name__}")
        options = base.updated(eos_token_id=eos_token_id, max_new_tokens=max_new_tokens, num_beams=num_beams,
                               length_penalty=length_penalty, early_stopping=early_stopping,
                               pad_token_id=pad_token_id)
        if not 1 <= options.max_new_tokens <= self.max_length:  # the decoder's cache holds max_length positions
            raise ValueError(f"max_new_tokens must be in [1, max_length = {self.max_length}], got "
                             f"{options.max_new_tokens}")
        if src_ids.shape[0] == 0:  # no rows: the options are checked, and only the bos column comes back
            return search_state(None, 0, options, bos_token_id=bos_token_id, vocab_size=self.tgt_vocab_size)
        was_training = self.training
        self.eval()
        try:
            memory = self.transformer.encoder(self.src_positional(self.src_embedding(src_ids)),
                                              key_padding_mask=src_pad)  # (B, Ls, D)
            state = _DecodingState(self, memory, src_pad, options.max_new_tokens)
            return search_state(state, src_ids.shape[0], options, bos_token_id=bos_token_id,
                                vocab_size=self.tgt_vocab_size)
        finally:
            self.train(was_training)

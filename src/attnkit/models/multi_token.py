"""Multi-token prediction (MTP): the extra layers DeepSeek-V3 was trained with to predict the token after next.

Dimension letters: B rows, L slots fed, D hidden size, V vocabulary, M prediction layers.

A checkpoint with ``num_nextn_predict_layers = M`` stores M layers after its last decoder layer. Layer ``k`` reads,
at slot ``s``, the hidden state the layer before it gave there (layer 0: the model's final hidden state, after the
final norm, at position ``s``) and the embedding of token ``s + k + 1``, each RMS-normalised, concatenated
(embedding first) and projected back to D; then one decoder block of the model's kind (with the mixture of experts
where the model has one), then its own final norm. The model's head turns that into logits for token
``s + k + 2``: layer 0 at the last slot predicts the token after the one the model itself predicts there. The
embedding and head are the model's (the paper shares them; the checkpoint's copies are not read).

The layers train with the model and serve as the draft of speculative decoding
(:class:`~attnkit.decoding.speculative.MultiTokenDraft`): M tokens per round for the cost of M blocks.
transformers 5 runs them the same way (``generate(..., use_mtp=True)``, its ``MtpModel``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..core.module import Module, ModuleList
from ..decoding.cache import ModelCache
from ..init import as_generator
from ..kernels.linear import linear
from ..layers.lm_block import make_block, make_norm
from ..layers.projection import Projection
from .config import DecoderConfig

__all__ = ["MultiTokenPredictor", "MTPLayer", "mtp_config"]


def mtp_config(config: DecoderConfig, num_layers: int | None = None) -> DecoderConfig:
    """The decoder config whose layer ``k`` is prediction layer ``k``: ``config`` with ``num_layers`` layers
    (default ``config.mtp_layers``), each with the mixture of experts where the model has one (as transformers'
    ``get_mtp_config``: DeepSeek's prediction layers are expert layers though its first layers are dense).

    Raises
    ------
    ValueError
        ``num_layers`` is not positive, or the model's layers differ in kind (the layers' kinds of the
        prediction layers would then have to be given).
    """
    count = config.mtp_layers if num_layers is None else num_layers
    if count < 1:
        raise ValueError(f"a {config.family} model with mtp_layers={config.mtp_layers} has no multi-token-prediction "
                         f"layers to build (num_layers={num_layers!r})")
    kinds = set(config.layer_types)
    if len(kinds) > 1 or config.layerwise is not None:
        raise ValueError(f"multi-token prediction is read for models whose layers are all of one kind; this "
                         f"{config.family} model has {sorted(kinds)}")
    experts = config.experts
    if experts is not None:
        experts = replace(experts, layers=tuple(range(count)))
    return replace(config, num_layers=count, layer_types=(next(iter(kinds)),) * count, experts=experts,
                   mtp_layers=0)


class MTPLayer(Module):
    """One prediction layer: ``post_norm(block(eh_proj([enorm(embedding), hnorm(hidden)])))``.

    Parameters
    ----------
    config : DecoderConfig
        From :func:`mtp_config`; ``index`` is the layer's index in it (its slot in the prediction cache).
    index : int
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    enorm, hnorm, post_norm : the model's norm kind over D; eh_proj : Projection (2D -> D, no bias);
    block : the model's decoder block.

    Shapes
    ------
    embeddings, hidden : (B, L, D) -> (B, L, D), normalised (what the head and the next layer read).
    """

    def __init__(self, config: DecoderConfig, index: int, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        d = config.hidden_size
        self.enorm, self.hnorm = make_norm(config), make_norm(config)
        self.eh_proj = Projection(2 * d, d, bias=False, rng=gen)
        self.block = make_block(config, index, rng=gen)
        self.post_norm = make_norm(config)

    def forward(self, embeddings: Any, hidden: Any, *, rotary=None, attention_mask: Any = None,
                cache=None) -> np.ndarray:
        """The layer's normalised output (B, L, D); without a cache each part saves what its backward needs."""
        joined = np.concatenate([self.enorm(embeddings), self.hnorm(hidden)], axis=-1)  # (B, L, 2D)
        h = self.block(self.eh_proj(joined), rotary=rotary, attention_mask=attention_mask, cache=cache)  # (B, L, D)
        return self.post_norm(h)  # (B, L, D)

    def backward(self, grad_output: Any) -> tuple[np.ndarray, np.ndarray]:
        """Gradients of the inputs ``(embeddings, hidden)``, each (B, L, D); the parameters' grads are added."""
        g = self.eh_proj.backward(self.block.backward(self.post_norm.backward(grad_output)))  # (B, L, 2D)
        d = g.shape[-1] // 2
        return self.enorm.backward(g[..., :d]), self.hnorm.backward(g[..., d:])


class MultiTokenPredictor(Module):
    """A model's multi-token-prediction layers, sharing its embedding, rotary tables and head.

    Parameters
    ----------
    model : CausalLM
        The model whose final hidden states the layers read (held, not owned: its parameters are not this
        module's).
    num_layers : int, optional
        M, default ``model.config.mtp_layers``.
    rng : numpy.random.Generator or int, optional

    Attributes
    ----------
    layers : ModuleList of M :class:`MTPLayer`; config : the :func:`mtp_config`.

    Shapes
    ------
    input_ids : (B, L) int, token ``s + 1`` at slot ``s``; hidden : (B, L, D) the model's final hidden state at
    position ``s`` (``model.forward(..., return_hidden=True)``); attention_mask : (B, P + L) over the cached slots
    and the new ones; position_ids : (B, L), the positions of ``input_ids`` -> logits (B, M, V): layer ``k``'s
    prediction at the last slot, of the token ``k + 2`` after the last hidden state's position.

    Examples
    --------
    >>> from attnkit.models import CausalLM
    >>> from attnkit.models import MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12), mtp_layers=1)
    >>> lm = CausalLM(cfg, rng=0)
    >>> ids = np.array([[1, 2, 3, 4]])
    >>> _, hidden = lm(ids, return_hidden=True)
    >>> mtp = MultiTokenPredictor(lm, rng=1)
    >>> mtp(ids[:, 1:], hidden[:, :-1]).shape  # from positions 0..2 and tokens 1..3: a guess at token 5
    (1, 1, 11)
    """

    def __init__(self, model: Any, num_layers: int | None = None, *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.config = mtp_config(model.config, num_layers)
        gen = as_generator(rng)
        self.layers = ModuleList([MTPLayer(self.config, k, rng=gen) for k in range(self.config.num_layers)])
        object.__setattr__(self, "model", model)  # not a submodule: the model's parameters stay the model's

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def new_cache(self, batch_size: int, max_length: int | None = None, *, rollback: int = 0) -> ModelCache:
        """An empty cache of the M layers: each block's mixer's entry (latents for latent attention, else keys
        and values), as :meth:`CausalLM.new_cache` makes the model's."""
        return ModelCache([layer.block.attention.new_cache(batch_size, max_length, dtype=self.model.dtype,
                                                           rollback=rollback) for layer in self.layers],
                          batch_size, max_length=max_length)

    def forward(self, input_ids: Any, hidden: Any, attention_mask: Any = None, *, position_ids: Any = None,
                cache=None) -> np.ndarray:
        """Each layer's prediction at the last slot (B, M, V), layer ``k + 1`` reading layer ``k``'s output and
        the ids shifted one further, with layer ``k``'s own guess appended (greedy): the draft of one round."""
        logits, _ = self.draft(input_ids, hidden, attention_mask, position_ids=position_ids, cache=cache)
        return logits

    __call__ = forward

    def draft(self, input_ids: Any, hidden: Any, attention_mask: Any = None, *, position_ids: Any = None,
              cache=None) -> tuple[np.ndarray, np.ndarray]:
        """``(logits, tokens)``: each layer's logits at the last slot (B, M, V) and its greedy token (B, M)."""
        model = self.model
        ids, mask, positions = model._check_inputs(input_ids, attention_mask, position_ids, cache, self.config.layers)
        if position_ids is None:
            positions = positions + 1  # (B, L): slot s holds token s + 1
        h = np.asarray(hidden)
        if h.shape != ids.shape + (self.config.hidden_size,):
            raise ValueError(f"hidden must have shape (B, L, D) = {ids.shape + (self.config.hidden_size,)}, got "
                             f"{h.shape}")
        h = h.astype(model.dtype, copy=False)
        layer_mask = None if mask.all() else mask  # (B, S)
        weight = model.head_weight.astype(h.dtype, copy=False)
        all_logits, tokens = [], []
        scale = h.dtype.type(self.config.scales.embedding)
        for layer in self.layers:
            # read as the decoding step reads it: the model's embedding saves nothing for its backward here
            embeddings = model.embed.weight[ids].astype(h.dtype) * scale  # (B, L, D)
            rotary = None if model.rotary is None else model.rotary(positions, dtype=h.dtype)  # (B, L, R)
            h = layer(embeddings, h, rotary=rotary, attention_mask=layer_mask, cache=cache)  # (B, L, D)
            logits = model.head_scale.step(linear(h[:, -1], weight.T))  # (B, V)
            token = np.argmax(logits, axis=-1).astype(np.int64)  # (B,)
            all_logits.append(logits)
            tokens.append(token)
            # the next layer reads the tokens one further on: the last slot's is this layer's guess
            ids = np.concatenate([ids[:, 1:], token[:, None]], axis=1)  # (B, L)
            positions = np.concatenate([positions[:, 1:], positions[:, -1:] + 1], axis=1)  # (B, L)
        return np.stack(all_logits, axis=1), np.stack(tokens, axis=1)  # (B, M, V), (B, M)

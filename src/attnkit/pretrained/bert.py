"""A BERT encoder assembled from attnkit's own layers, and the map from Hugging Face BERT weights onto it.

Nothing here computes attention, normalisation or feed-forward itself: the model is three
:class:`~attnkit.layers.embedding.Embedding` tables, a :class:`~attnkit.layers.layer_norm.LayerNorm` and a
stack of post-norm :class:`~attnkit.layers.TransformerEncoderBlock` (``norm_first=False``,
``attention_bias=True``, exact erf GELU), whose ``h = LN1(x + MHA(x))``, ``out = LN2(h + FFN(h))`` is BERT's
layer exactly.

Dimension letters: B batch, L sequence length (tokens, padding included), D hidden size (384 for
MiniLM-L6), H heads, F intermediate size (1536), V vocabulary size, N layers.

Weight layout: Hugging Face ``nn.Linear`` stores (out, in) and computes ``x @ W.T``; attnkit applies
``x @ W`` with W (in, out), so every dense weight is transposed on the way in.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.hooks import block_hook_points
from ..core.module import Module, ModuleList
from ..init import as_generator
from ..io import read_json
from ..layers.embedding import Embedding
from ..layers.encoder import _backward_blocks
from ..layers.encoder_block import TransformerEncoderBlock
from ..layers.layer_norm import LayerNorm

__all__ = ["BertConfig", "BertEncoder", "bert_state_dict", "IGNORED_BERT_KEYS"]

# Hugging Face's activation names -> attnkit's (``gelu`` is the exact erf GELU in both).
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}

# Checkpoint entries that sentence embeddings do not use: the position-id buffer and the [CLS] pooler.
IGNORED_BERT_KEYS = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


@dataclass(frozen=True)
class BertConfig:
    """The hyper-parameters of a BERT encoder, as in Hugging Face's ``config.json``.

    Attributes
    ----------
    vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
    max_position_embeddings, type_vocab_size : int
    layer_norm_eps : float
        1e-12 for BERT (not torch's default 1e-5).
    hidden_act : str
        Hugging Face's name (``"gelu"`` = exact erf GELU).
    pad_token_id : int
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read a Hugging Face ``config.json`` of a BERT model.

        Raises
        ------
        ValueError
            If the file describes something attnkit's blocks do not implement (not BERT, relative
            position embeddings, an unknown activation).
        """
        path = Path(path)
        raw = read_json(path)
        if raw.get("model_type", "bert") != "bert":
            raise ValueError(f"{path} describes a {raw.get('model_type')!r} model, expected 'bert'")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: position_embedding_type {raw['position_embedding_type']!r} is not supported "
                             f"(only 'absolute')")
        if raw.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported, expected one of "
                             f"{sorted(_ACTIVATIONS)}")
        fields = cls.__dataclass_fields__
        return cls(**{name: raw[name] for name in fields if name in raw})

    @property
    def activation(self) -> str:
        """The feed-forward activation under attnkit's name."""
        return _ACTIVATIONS[self.hidden_act]


class BertEncoder(Module):
    """BERT's embeddings and encoder stack (no pooler), built from attnkit layers.

    ``embed = LayerNorm(word[ids] + token_type[type_ids] + position[0..L-1])``, then N post-norm
    encoder blocks with the padding mask. Dropout layers of the original are identity at inference
    and are left out.

    Parameters
    ----------
    config : BertConfig
    rng : numpy.random.Generator or int, optional
        Source of the initial weights (overwritten when a checkpoint is loaded).

    Attributes
    ----------
    word_embeddings : Embedding (V, D)
    position_embeddings : Embedding (max_position_embeddings, D)
    token_type_embeddings : Embedding (type_vocab_size, D)
    embedding_norm : LayerNorm (D,)
    blocks : ModuleList of N TransformerEncoderBlock

    Shapes
    ------
    input_ids : int (B, L); attention_mask : bool (B, L), ``True`` = real token (Hugging Face's 1),
    ``False`` = padding (its 0); token_type_ids : int (B, L), default zeros. Output (B, L, D) in the
    parameters' dtype. Padding positions hold finite values that mean nothing (their queries still
    attend to the real keys, as in Hugging Face's BERT).

    Examples
    --------
    >>> cfg = BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    ...                  intermediate_size=16, max_position_embeddings=10)
    >>> model = BertEncoder(cfg, rng=0)
    >>> ids = np.array([[1, 5, 7, 2], [1, 9, 2, 0]])
    >>> out = model(ids, attention_mask=ids > 0)
    >>> out.shape
    (2, 4, 8)
    >>> model.backward(np.ones_like(out)).shape  # adds every parameter's gradient; returns the embeddings'
    (2, 4, 8)
    >>> model.blocks[0].attention.grads["W_Q"].shape
    (8, 8)
    """

    def __init__(self, config: BertConfig, *, rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        gen = as_generator(rng)
        c = config
        self.config = c
        self.word_embeddings = Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id, rng=gen)
        self.position_embeddings = Embedding(c.max_position_embeddings, c.hidden_size, rng=gen)
        self.token_type_embeddings = Embedding(c.type_vocab_size, c.hidden_size, rng=gen)
        self.embedding_norm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.blocks = ModuleList([
            TransformerEncoderBlock(c.hidden_size, c.num_attention_heads, c.intermediate_size, norm_first=False,
                                    activation=c.activation, eps=c.layer_norm_eps, attention_bias=True, rng=gen)
            for _ in range(c.num_hidden_layers)])

    def extra_repr(self) -> str:
        c = self.config
        return (f"layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}, "
                f"intermediate={c.intermediate_size}, vocab={c.vocab_size}")

    # -- hook points (attnkit.explain.hooks) ----------------------------------------------------------
    def hook_points(self) -> tuple[str, ...]:
        """``hook_embed`` (B, L, D): the word embeddings, before the token-type and position embeddings and the
        embedding LayerNorm (whose output is ``blocks.0.hook_resid_pre``)."""
        return ("hook_embed",)

    def named_hook_points(self) -> list[tuple[str, Module, str]]:
        """Every hook point as ``(full name, module, local name)`` in forward order: ``hook_embed``, then each
        block's (:meth:`TransformerEncoderBlock.hook_points`) and its attention's
        (:meth:`MultiHeadAttention.hook_points`) under ``blocks.{i}.`` and ``blocks.{i}.attn.``."""
        points = [("hook_embed", self, "hook_embed")]
        for i, block in enumerate(self.blocks):
            points += block_hook_points(i, block, block.attention)
        return points

    # -- forward -------------------------------------------------------------------------------------
    def _check_inputs(self, input_ids, attention_mask, token_type_ids):
        ids = np.asarray(input_ids)
        if ids.dtype.kind not in "iu" or ids.ndim != 2:
            raise ValueError(f"input_ids must be a 2-D integer array (batch, seq), got dtype {ids.dtype} and "
                             f"shape {ids.shape}")
        batch, length = ids.shape
        if length > self.config.max_position_embeddings:
            raise ValueError(f"input_ids has {length} tokens per row, more than max_position_embeddings = "
                             f"{self.config.max_position_embeddings}: truncate the input")
        if attention_mask is None:
            mask = np.ones((batch, length), dtype=bool)  # (B, L)
        else:
            mask = np.asarray(attention_mask)
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask has shape {mask.shape}, expected the shape of input_ids {ids.shape}")
            if mask.dtype != np.bool_:
                if mask.dtype.kind not in "iu" or not np.isin(mask, (0, 1)).all():
                    raise TypeError(f"attention_mask must be boolean (True = real token) or 0/1 integers, got "
                                    f"dtype {mask.dtype}")
                mask = mask.astype(bool)  # (B, L)
        types = np.zeros_like(ids) if token_type_ids is None else np.asarray(token_type_ids)
        if types.shape != ids.shape:
            raise ValueError(f"token_type_ids has shape {types.shape}, expected the shape of input_ids {ids.shape}")
        return ids, mask, types

    def embed(self, input_ids: np.ndarray, token_type_ids: np.ndarray) -> np.ndarray:
        """The embedding layer's output, LayerNorm included: (B, L) ids -> (B, L, D)."""
        length = input_ids.shape[1]
        positions = np.arange(length)[None, :]  # (1, L)
        x = self.hook_point("hook_embed", self.word_embeddings(input_ids))  # (B, L, D)
        x = x + self.token_type_embeddings(token_type_ids)  # (B, L, D)
        x = x + self.position_embeddings(positions)  # (B, L, D)
        return self.embedding_norm(x)  # (B, L, D)

    def forward(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, *,
                output_hidden_states: bool = False) -> np.ndarray | list[np.ndarray]:
        """Encode a padded batch of token ids.

        Parameters
        ----------
        input_ids : int array (B, L)
        attention_mask : bool array (B, L), optional
            ``True`` = real token (0/1 integers accepted); default all real.
        token_type_ids : int array (B, L), optional
            Segment ids; default zeros.
        output_hidden_states : bool, default False
            Return the N + 1 hidden states (the embedding output, then each block's) instead of the last.

        Returns
        -------
        ndarray (B, L, D), or list of N + 1 ndarrays (B, L, D)
        """
        ids, mask, types = self._check_inputs(input_ids, attention_mask, token_type_ids)
        h = self.embed(ids, types)  # (B, L, D)
        # Every state but the last is the cached input of the next block: hand out copies, so that editing
        # a returned state cannot change the gradients of a later backward.
        states = [h.copy()]
        kpm = None if mask.all() else mask  # (B, L); no mask at all when nothing is padded
        for block in self.blocks:
            h = block(h, key_padding_mask=kpm)  # (B, L, D)
            if output_hidden_states:
                states.append(h.copy())
        return states if output_hidden_states else h

    def attention_weights(self, input_ids: Any, layer: int, attention_mask: Any = None,
                          token_type_ids: Any = None) -> np.ndarray:
        """The attention weights of block ``layer`` (0-based), every head: (B, H, L, L).

        Runs the stack up to that block and asks its ``MultiHeadAttention`` for the weights. Padding keys
        get weight 0.
        """
        n = len(self.blocks)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
            raise ValueError(f"layer must be an integer in [0, {n}), got {layer!r}")
        ids, mask, types = self._check_inputs(input_ids, attention_mask, token_type_ids)
        h = self.embed(ids, types)  # (B, L, D)
        kpm = None if mask.all() else mask
        for block in list(self.blocks)[:layer]:
            h = block(h, key_padding_mask=kpm)  # (B, L, D)
        attention = self.blocks[layer].attention
        _, weights = attention(h, h, h, key_padding_mask=kpm, need_weights=True)  # (B, H, L, L)
        return weights

    def backward(self, grad_output: Any) -> np.ndarray:
        """Backpropagate the gradient of the last hidden state (B, L, D) of the last :meth:`forward`.

        Adds every parameter's gradient into the ``grads`` of the layers and returns the gradient with
        respect to the looked-up token embeddings ``word_embeddings.weight[input_ids]``, (B, L, D) (token ids
        themselves have none): what input attributions are made of.
        """
        g = _backward_blocks(self.blocks, grad_output)  # (B, L, D)
        g = self.embedding_norm.backward(g)  # (B, L, D)
        self.token_type_embeddings.backward(g)
        self.position_embeddings.backward(g.sum(axis=0, keepdims=True))  # (1, L, D): positions are shared
        g = self.hook_backward("hook_embed", g)
        self.word_embeddings.backward(g)
        return g


def bert_state_dict(tensors: Mapping[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """Rename (and transpose) Hugging Face BERT weights into :class:`BertEncoder` parameter names.

    Parameters
    ----------
    tensors : mapping of str to ndarray
        The checkpoint, e.g. ``safetensors.numpy.load_file("model.safetensors")``; a ``bert.`` prefix
        (``BertForMaskedLM`` checkpoints) is accepted.
    num_layers : int
        Number of encoder layers expected.

    Returns
    -------
    dict of str to ndarray
        Ready for :meth:`BertEncoder.load_state_dict` (``strict=True``).

    Raises
    ------
    KeyError
        Missing weights, or weights this map does not know (other than :data:`IGNORED_BERT_KEYS`), named.

    Notes
    -----
    In a BERT layer, ``attention.output.LayerNorm`` normalises ``x + attention`` (attnkit's ``norm1``) and
    ``output.LayerNorm`` normalises ``h + FFN(h)`` (``norm2``); ``intermediate.dense`` is the FFN's first
    map (``ffn.W1``, ``ffn.b1``) and ``output.dense`` its second (``ffn.W2``, ``ffn.b2``).
    """
    t = {k.removeprefix("bert."): v for k, v in tensors.items()}
    plan: dict[str, tuple[str, bool]] = {  # attnkit name -> (checkpoint name, transpose)
        "word_embeddings.weight": ("embeddings.word_embeddings.weight", False),
        "position_embeddings.weight": ("embeddings.position_embeddings.weight", False),
        "token_type_embeddings.weight": ("embeddings.token_type_embeddings.weight", False),
        "embedding_norm.gamma": ("embeddings.LayerNorm.weight", False),
        "embedding_norm.beta": ("embeddings.LayerNorm.bias", False),
    }
    for i in range(num_layers):
        src, dst = f"encoder.layer.{i}.", f"blocks.{i}."
        for ours, theirs in (("Q", "self.query"), ("K", "self.key"), ("V", "self.value"), ("O", "output.dense")):
            plan[f"{dst}attention.W_{ours}"] = (f"{src}attention.{theirs}.weight", True)  # (out, in) -> (in, out)
            plan[f"{dst}attention.b_{ours}"] = (f"{src}attention.{theirs}.bias", False)
        plan[f"{dst}norm1.gamma"] = (f"{src}attention.output.LayerNorm.weight", False)
        plan[f"{dst}norm1.beta"] = (f"{src}attention.output.LayerNorm.bias", False)
        plan[f"{dst}ffn.W1"] = (f"{src}intermediate.dense.weight", True)  # (F, D) -> (D, F)
        plan[f"{dst}ffn.b1"] = (f"{src}intermediate.dense.bias", False)
        plan[f"{dst}ffn.W2"] = (f"{src}output.dense.weight", True)  # (D, F) -> (F, D)
        plan[f"{dst}ffn.b2"] = (f"{src}output.dense.bias", False)
        plan[f"{dst}norm2.gamma"] = (f"{src}output.LayerNorm.weight", False)
        plan[f"{dst}norm2.beta"] = (f"{src}output.LayerNorm.bias", False)
    missing = sorted(theirs for theirs, _ in plan.values() if theirs not in t)
    used = {theirs for theirs, _ in plan.values()}
    unknown = sorted(set(t) - used - set(IGNORED_BERT_KEYS))
    if missing or unknown:
        more_missing, more_unknown = " ..." if len(missing) > 8 else "", " ..." if len(unknown) > 8 else ""
        raise KeyError(f"the checkpoint does not match a {num_layers}-layer BERT: missing {missing[:8]}"
                       f"{more_missing}, unexpected {unknown[:8]}{more_unknown}")
    return {ours: (t[theirs].T if transpose else t[theirs]) for ours, (theirs, transpose) in plan.items()}

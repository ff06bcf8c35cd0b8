"""Steering with control vectors: directions in the residual stream, found from contrastive prompt pairs as
repeng finds them, added to each layer's output as llama.cpp adds them.

A :class:`ControlVector` holds one direction (D,) per layer. :func:`control_vector` computes one from pairs of
prompts that differ in the trait to steer ("Act happy: ..." / "Act sad: ..."), exactly as repeng 0.4's
``ControlVector.train`` does: each prompt's hidden state at its last token, per layer; then the first principal
component of the pairs' differences (``"pca_diff"``) or of the states centred on each pair's mean
(``"pca_center"``); the sign so that positives project above their negatives more often than not. Inside
:func:`steering` the model adds ``scale * direction`` to the output of each layer the vector has (every
position, the prompt and each generated token: ``generate``, ``chat``, plain forwards), as llama.cpp's
``--control-vector-scaled FILE SCALE`` does. :func:`~attnkit.explain.load_control_vector` and
:func:`~attnkit.explain.save_control_vector` read and write llama.cpp's control-vector GGUF files.

Layer ``i`` is the output of block ``i`` (0-based, ``blocks.{i}.hook_resid_post``), which is where repeng's
``ControlModel`` and llama.cpp add a vector's ``direction.{i}``. repeng reads the states from transformers'
``hidden_states``, whose entry for the last block is the final norm's output, not the block's: so does
:func:`control_vector` (``ln_final.hook_normalized`` for layer N-1), so that its vectors are repeng's.

Shapes: B batch, L tokens, D model width, N pairs.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._validation import check_positive_int
from .hooks import hooks

__all__ = ["ControlVector", "control_vector", "steering"]

METHODS = ("pca_diff", "pca_center")


class ControlVector:
    """One direction (D,) float32 per layer, and the model family it was made for.

    Vectors combine as repeng's do: ``a + b``, ``a - b``, ``-a``, ``2.0 * a``, ``a / 2``; a layer that only one
    of two vectors has counts as zero in the other (llama.cpp sums several files the same way).

    Parameters
    ----------
    directions : mapping of int to array_like (D,)
        Layer index (0-based, the output of that block) to its direction; copied as float32.
    model_hint : str, optional
        The model family (``"llama"``), written to the GGUF file as ``controlvector.model_hint``.

    Attributes
    ----------
    directions : dict of int to ndarray (D,) float32
        In layer order; read-only arrays.
    model_hint : str

    Examples
    --------
    >>> v = ControlVector({1: [1.0, 0.0], 2: [0.0, 1.0]}, "llama")
    >>> v
    ControlVector(layers=[1, 2], width=2, model_hint='llama')
    >>> (0.5 * v + ControlVector({2: [2.0, 2.0]})).directions[2].tolist()
    [2.0, 2.5]
    """

    def __init__(self, directions: Mapping[int, Any], model_hint: str = "") -> None:
        if not isinstance(directions, Mapping) or not directions:
            raise ValueError(f"directions must be a non-empty mapping of layer index to a (D,) direction, got "
                             f"{type(directions).__name__} {directions!r:.60}")
        if not isinstance(model_hint, str):
            raise TypeError(f"model_hint must be a str, got {type(model_hint).__name__}")
        table: dict[int, np.ndarray] = {}
        width = None
        for layer in sorted(directions, key=_layer_key):
            direction = np.array(directions[layer], dtype=np.float32)  # a copy: never the caller's array
            if direction.ndim != 1 or direction.size == 0:
                raise ValueError(f"directions[{layer}] must be a non-empty 1-D array (D,), got shape "
                                 f"{direction.shape}")
            if width is not None and direction.size != width:
                raise ValueError(f"directions[{layer}] has {direction.size} features but the others have {width}")
            if not np.isfinite(direction).all():
                raise ValueError(f"directions[{layer}] holds non-finite values")
            width = direction.size
            direction.flags.writeable = False
            table[int(layer)] = direction
        self.directions = table
        self.model_hint = model_hint

    @property
    def layers(self) -> list[int]:
        """The layers that have a direction, in order."""
        return list(self.directions)

    @property
    def width(self) -> int:
        """D, every direction's length."""
        return next(iter(self.directions.values())).size

    def __repr__(self) -> str:
        return f"ControlVector(layers={self.layers}, width={self.width}, model_hint={self.model_hint!r})"

    def _combined(self, other: Any, coefficient: float) -> ControlVector:
        if not isinstance(other, ControlVector):
            return NotImplemented
        if other.width != self.width:
            raise ValueError(f"cannot combine control vectors of {self.width} and {other.width} features")
        directions = dict(self.directions)
        for layer, direction in other.directions.items():
            scaled = np.float32(coefficient) * direction  # (D,)
            directions[layer] = directions[layer] + scaled if layer in directions else scaled
        return ControlVector(directions, self.model_hint)

    def __add__(self, other: Any) -> ControlVector:
        return self._combined(other, 1.0)

    def __sub__(self, other: Any) -> ControlVector:
        return self._combined(other, -1.0)

    def __neg__(self) -> ControlVector:
        return self * -1.0

    def __mul__(self, factor: Any) -> ControlVector:
        if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
            return NotImplemented
        factor = _finite(factor, "the factor")
        return ControlVector({layer: np.float32(factor) * d for layer, d in self.directions.items()},
                             self.model_hint)

    __rmul__ = __mul__

    def __truediv__(self, divisor: Any) -> ControlVector:
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float, np.integer, np.floating)):
            return NotImplemented
        if divisor == 0:
            raise ZeroDivisionError("cannot divide a control vector by zero")
        return self * (1.0 / float(divisor))


def _layer_key(layer: Any) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise ValueError(f"directions must be keyed by non-negative int layer indexes, got {layer!r}")
    return int(layer)


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
            not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


# -- computing a vector from prompt pairs -------------------------------------------------------------------
def _pair_texts(pairs: Any) -> list[str]:
    """``[positive_0, negative_0, positive_1, ...]`` from (positive, negative) tuples or objects with
    ``.positive`` and ``.negative`` (repeng's ``DatasetEntry``)."""
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or not pairs:
        raise ValueError(f"pairs must be a non-empty sequence of (positive, negative) prompt pairs, got "
                         f"{type(pairs).__name__} {pairs!r:.60}")
    texts = []
    for i, pair in enumerate(pairs):
        if hasattr(pair, "positive") and hasattr(pair, "negative"):
            pair = (pair.positive, pair.negative)
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2 or \
                not all(isinstance(t, str) for t in pair):
            raise ValueError(f"pairs[{i}] must be a (positive, negative) pair of str, got {pair!r:.80}")
        texts += list(pair)
    return texts


def _layers(layers: Any, num_layers: int) -> list[int]:
    """repeng's default (the last layer down to layer 1) or the layers given, negative ones counted from the
    end; in the order given."""
    if layers is None:
        return list(range(num_layers - 1, 0, -1))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"layers must be a sequence of int layer indexes, got {type(layers).__name__}")
    out = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                not -num_layers <= layer < num_layers:
            raise ValueError(f"layers must be ints in [-{num_layers}, {num_layers}) (the model has {num_layers} "
                             f"layers), got {layer!r}")
        out.append(int(layer) % num_layers)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"layers must name each layer once and at least one, got {list(layers)}")
    return out


def _encoded(tokenizer: Any, texts: list[str], vocab_size: int) -> list[list[int]]:
    rows = []
    for text in texts:
        encoded = tokenizer.encode(text)
        ids = [int(i) for i in getattr(encoded, "ids", encoded)]  # a tokenizers.Tokenizer gives an Encoding
        if not ids:
            raise ValueError(f"the prompt {text!r:.60} has no tokens")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"the tokenizer gave ids outside the model's vocabulary of {vocab_size} for "
                             f"{text!r:.60}")
        rows.append(ids)
    return rows


class _LastPosition:
    """A forward hook keeping each batch's states at the last position (real in a left-padded batch)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []

    def __call__(self, value: np.ndarray, name: str) -> None:
        self.rows.append(np.array(value[:, -1], dtype=np.float64))  # (B, D)


def last_token_states(model: Any, rows: list[list[int]], layers: list[int], batch_size: int) -> dict[int, np.ndarray]:
    """Each layer's output at each prompt's last token, ``{layer: (len(rows), D) float64}``; the last layer's
    is the final norm's output, as in transformers' ``hidden_states``. Prompts run in left-padded batches."""
    last = model.config.num_layers - 1
    names = {layer: "ln_final.hook_normalized" if layer == last else f"blocks.{layer}.hook_resid_post"
             for layer in layers}
    keepers = {layer: _LastPosition() for layer in layers}
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        width = max(len(r) for r in batch)
        ids = np.zeros((len(batch), width), dtype=np.int64)  # (B, L)
        mask = np.zeros((len(batch), width), dtype=bool)  # (B, L)
        for b, row in enumerate(batch):
            ids[b, width - len(row):], mask[b, width - len(row):] = row, True
        with hooks(model, {names[layer]: keepers[layer] for layer in layers}):
            model(ids, mask, logits_to_keep=1)
    return {layer: np.concatenate(keepers[layer].rows) for layer in layers}  # (2N, D) each


def first_component(train: np.ndarray) -> np.ndarray:
    """The first principal component (D,) of ``train`` (rows, D), as scikit-learn's ``PCA(n_components=1)``
    gives it: of the rows less their mean, its largest entry by magnitude positive (``svd_flip``)."""
    centred = train - train.mean(axis=0)  # (rows, D)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)  # vt: (min(rows, D), D)
    component = vt[0]  # (D,)
    return -component if component[np.argmax(np.abs(component))] < 0 else component


def direction_of(states: np.ndarray, method: str) -> np.ndarray:
    """repeng's direction (D,) float32 of one layer's states (2N, D) in the order positive, negative, ...:
    the first principal component of the pairs' differences or of the pair-centred states, signed so that
    positives project above their negatives in more pairs than the reverse (a tie keeps PCA's sign)."""
    positive, negative = states[0::2], states[1::2]  # (N, D) each
    if method == "pca_diff":
        train = positive - negative  # (N, D)
    else:
        centre = (positive + negative) / 2  # (N, D)
        train = np.stack([positive - centre, negative - centre], axis=1).reshape(states.shape)  # (2N, D)
    direction = first_component(train).astype(np.float32)  # (D,)
    unit = direction.astype(np.float64)  # (D,)
    on_positive, on_negative = positive @ unit, negative @ unit  # (N,) each: the projections
    flip = (on_positive < on_negative).mean() > (on_positive > on_negative).mean()
    return -direction if flip else direction


def control_vector(model: Any, tokenizer: Any, pairs: Any, *, layers: Any = None, method: str = "pca_diff",
                   batch_size: int = 32) -> ControlVector:
    """A control vector from contrastive prompt pairs, as repeng's ``ControlVector.train`` computes it.

    For each prompt, the output of each layer at its last token (the last layer's through the final norm, as
    transformers' ``hidden_states`` give it to repeng); per layer, the first principal component (scikit-learn's
    ``PCA``, which centres the rows first) of the differences positive - negative (``"pca_diff"``) or of the
    states less their pair's mean (``"pca_center"``), a unit vector, signed so that the positive prompt
    projects above its negative in more pairs than not.

    Parameters
    ----------
    model : CausalLM
    tokenizer : Tokenizer
        Anything with ``encode(text) -> ids`` (attnkit's, transformers', or a ``tokenizers.Tokenizer``); the
        tokenizer's own special tokens are added, as repeng's call of a transformers tokenizer adds them.
    pairs : sequence of (str, str)
        ``(positive, negative)`` prompts, or objects with ``.positive`` and ``.negative`` (repeng's
        ``DatasetEntry``); ``"pca_diff"`` needs two pairs at least (PCA centres the differences).
    layers : sequence of int, optional
        Which layers get a direction (negative counts from the end); default repeng's, every layer but the first
        (N-1 down to 1: llama.cpp never applies layer 0).
    method : {"pca_diff", "pca_center"}
        repeng's methods (its experimental ``"umap"`` is not offered: it needs umap-learn and is random).
    batch_size : int
        Prompts per forward.

    Returns
    -------
    ControlVector
        Unit directions (D,) float32 by layer, ``model_hint`` the model's family.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=30, hidden_size=8, num_layers=3, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> class Letters:
    ...     def encode(self, text):
    ...         return [ord(c) - 96 for c in text if c.isalpha()]
    >>> v = control_vector(lm, Letters(), [("good day", "bad day"), ("nice one", "nasty one"), ("joy", "sad")])
    >>> v
    ControlVector(layers=[1, 2], width=8, model_hint='llama')
    >>> round(float(np.linalg.norm(v.directions[1])), 6)
    1.0
    """
    texts = _pair_texts(pairs)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))} (repeng's; its experimental "
                         f"'umap' is not offered), got {method!r}")
    if method == "pca_diff" and len(texts) < 4:
        raise ValueError("method 'pca_diff' needs at least two pairs: PCA centres the pairs' differences, so one "
                         "pair leaves nothing (use 'pca_center', or more pairs)")
    batch_size = check_positive_int(batch_size, "batch_size")
    chosen = _layers(layers, model.config.num_layers)
    if not hasattr(tokenizer, "encode"):
        raise TypeError(f"tokenizer must have encode(text) -> ids, got {type(tokenizer).__name__}")
    rows = _encoded(tokenizer, texts, model.config.vocab_size)
    states = last_token_states(model, rows, chosen, batch_size)
    return ControlVector({layer: direction_of(states[layer], method) for layer in chosen}, model.config.family)


# -- applying a vector -------------------------------------------------------------------------------------
class _AddDirection:
    """A forward hook adding a fixed (D,) vector to the residual stream (B, L, D) in the stream's dtype."""

    def __init__(self, addition: np.ndarray) -> None:
        self.addition = addition

    def __call__(self, value: np.ndarray, name: str) -> np.ndarray:
        return value + self.addition.astype(value.dtype, copy=False)  # (B, L, D)


def _layer_range(layer_range: Any, num_layers: int) -> tuple[int, int]:
    if layer_range is None:
        return 0, num_layers - 1
    if isinstance(layer_range, (str, bytes)) or not isinstance(layer_range, Sequence) or len(layer_range) != 2 or \
            not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in layer_range):
        raise TypeError(f"layer_range must be (start, end), two ints, got {layer_range!r}")
    start, end = (int(i) for i in layer_range)
    if start < 0 or end < start:
        raise ValueError(f"layer_range must be (start, end) with 0 <= start <= end, got {layer_range!r}")
    return start, end


@contextmanager
def steering(model: Any, vector: ControlVector, scale: float = 1.0, *,
             layer_range: tuple[int, int] | None = None) -> Iterator[None]:
    """Run ``model`` with ``scale * direction`` added to the output of each layer ``vector`` has, inside the block.

    Every forward in the block is steered, at every position: plain calls, ``generate`` and
    :func:`~attnkit.decoding.sampling.generate_stream` (the prompt and each new token), the chat CLI. It is
    llama.cpp's ``--control-vector-scaled FILE SCALE`` (with ``--control-vector-layer-range START END`` as
    ``layer_range``) and repeng's ``ControlModel.set_control(vector, scale)``. To steer with several vectors,
    add them: ``steering(lm, happy + 0.5 * calm)``. The block holds the model as :func:`hooks` does (other
    threads are refused) and the steered forward runs the sequence path at every decoding step.

    Parameters
    ----------
    model : CausalLM
    vector : ControlVector
        Its width must be the model's; its layers must be the model's.
    scale : float
        The strength; negative steers the other way.
    layer_range : (int, int), optional
        Steer only the layers from ``start`` to ``end``, both included (llama.cpp's range); default all of the
        vector's.

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=11, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> lm = CausalLM(cfg, rng=0)
    >>> ids = np.array([[1, 2, 3]])
    >>> push = ControlVector({1: np.eye(8)[0]})
    >>> with steering(lm, push, 4.0):
    ...     steered = lm(ids)
    >>> bool(np.allclose(steered, lm(ids)))
    False
    """
    if not isinstance(vector, ControlVector):
        raise TypeError(f"vector must be a ControlVector (attnkit.explain.control_vector or load_control_vector), "
                        f"got {type(vector).__name__}")
    scale = _finite(scale, "scale")
    config = model.config
    if vector.width != config.hidden_size:
        raise ValueError(f"the control vector has {vector.width} features but the model's residual stream has "
                         f"{config.hidden_size} (a vector made for another model?)")
    beyond = [layer for layer in vector.layers if layer >= config.num_layers]
    if beyond:
        raise ValueError(f"the control vector has a direction for layer {beyond[0]}, but the model has "
                         f"{config.num_layers} layers (0 to {config.num_layers - 1})")
    start, end = _layer_range(layer_range, config.num_layers)
    added = {f"blocks.{layer}.hook_resid_post": _AddDirection(np.float32(scale) * direction)
             for layer, direction in vector.directions.items() if start <= layer <= end}
    with hooks(model, added):
        yield

"""Per-layer caches of a decoder, kept between decoding steps: one entry per layer, made by the layer.

Dimension letters: B batch rows, Hkv key/value heads, S slots, Lnew new tokens, Dh features per head,
W sliding window, C + R a latent attention layer's cached width.

A *slot* is the column of a token in the model's ``attention_mask`` (pad columns included): slot ``s`` holds
the key and value computed for the ``s``-th input column. The slot is not the rotary position: a left-padded
row starts its positions at its first real token while its slots start at 0, so the cache never needs to know
about positions, and the attention layer masks keys by looking up ``attention_mask[:, slots]``.

Each token mixer makes its own entry (``mixer.new_cache(batch_size, max_length)``, as mlx-lm's ``make_cache``),
and a model's cache, a :class:`ModelCache`, is the list of its layers' entries:

- :class:`KeysValues`, an attention layer's keys and values: growing (``max_length=None``: capacity doubles
  when full), bounded (``max_length=N``: grows the same way but never beyond N slots; writing past N is an
  error), or a ring buffer (the layer's window W is set: only the last W slots are kept, slot ``s`` at index
  ``s % W``, so the memory stays O(W) however long the text);
- :class:`Latents`, a latent attention layer's compressed latents (C + R numbers per token);
- a fixed-size state (Gated DeltaNet's convolution inputs and delta-rule state,
  :class:`~attnkit.layers.gated_deltanet.GatedDeltaNetCache`, Mamba-2's, a short convolution's), whatever the
  length: the cache asks of it only ``length`` (positions seen), ``reorder(index)``, ``nbytes``, ``copy()`` and
  ``cleared()`` (the state of no position);
- :class:`PairedCache`, keys and values beside a state (attention beside a Mamba-2 mixer in one layer);
- ``None``: nothing of the layer's own (it reads an earlier layer's keys and values, or has no token mixer).

:class:`KVCache` and :class:`LatentCache` make such a list from sizes alone, for code that has no model.

Going back (:meth:`ModelCache.crop`, for a prefix shared with the next prompt or a rejected draft): keys, values
and latents forget slots for free; a recurrent state cannot forget what it absorbed, and a ring buffer
overwrites its oldest slots, so those entries go back only to a length the caller marked beforehand
(:meth:`ModelCache.mark` keeps a copy of each state and of each ring's kept slots there: a turn boundary, a
draft's start), or, for a ring, within the ``rollback`` extra slots it keeps. The cache also records the ids it
was fed (``token_ids``), so a caller can find the prefix a new prompt shares with it.

Every cache speaks to an attention module through two calls, so one cached-attention path serves the
decoder-only LMs and the encoder-decoder alike: ``stored(layer)`` hands back keys and values the module
must use as they are (a memory projected once for cross-attention), or ``None``, in which case the module
projects its new keys and values and calls ``update(layer, k_new, v_new)``. Both return a :class:`CachedKV`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._validation import check_positive_int
from ..attention.cache_entry import (
    CachedKV,
    CachedLatent,
    KeysValues,
    Latents,
    PairedCache,
    _check_float_dtype,
    _check_state,
    _checked_array,
    check_max_length,
    entry_kind,
)

__all__ = ["CachedKV", "KeysValues", "CachedLatent", "Latents", "PairedCache", "ModelCache", "entry_kind", "KVCache",
           "LatentCache", "CrossAttentionCache", "EncoderDecoderCache", "crop_to_prefix"]


_MAX_MARKS = 8  # marks a cache keeps (the latest): each holds a copy of the states and windows


def _halves(entry: Any) -> tuple[Any, Any]:
    """An entry as its two possible halves: ``(slots, state)``, its keys and values or latents (or None) and its
    recurrent state (or None); a paired entry has both, a layer keeping nothing neither."""
    kind = entry_kind(entry)
    if kind == "paired":
        return entry.keys_values, entry.state
    if kind == "state":
        return None, entry
    return (None if kind == "none" else entry), None


class _Mark:
    """What :meth:`ModelCache.mark` kept, by layer: ``(ring, state)``, a ring's kept (keys, values, slots) and a
    state's copy, each None where the layer has none (growing slots keep nothing: they stay)."""

    def __init__(self, snapshots: dict[int, tuple[Any, Any]]) -> None:
        self.snapshots = snapshots

    def reorder(self, index: np.ndarray) -> None:
        for layer, (ring, state) in self.snapshots.items():
            if ring is not None:
                keys, values, slots = ring
                ring = keys[index], values[index], slots  # (B', Hkv, S, Dh) each
            if state is not None:
                state.reorder(index)
            self.snapshots[layer] = ring, state


class ModelCache:
    """A decoder's cache for incremental decoding: one entry per layer, each made by the layer's token mixer
    (``mixer.new_cache(batch_size, max_length)``; :meth:`attnkit.models.CausalLM.new_cache` makes the list).

    The cache routes a layer's calls to its entry (``update(layer, ...)``, ``state(layer)``) and does what
    concerns every layer at once: the length they share, marks and going back (:meth:`mark`, :meth:`crop`),
    beam reordering, the ids fed, saving to arrays.

    Parameters
    ----------
    entries : sequence
        One per layer: a :class:`KeysValues`, a :class:`Latents`, a :class:`PairedCache`, a state layer's state
        (any object with ``length``, ``nbytes``, ``reorder(index)``, ``copy()`` and ``cleared()``), or None for
        a layer that keeps nothing of its own.
    batch_size : int
        B, rows decoded together (every entry's).
    max_length : int, optional
        The entries' bound on slots, checked again when arrays are loaded.
    dtype : numpy dtype, optional
        What the entries store (a saved cache's files name it); default: the first entry's.

    Attributes
    ----------
    entries : list
        The layers' entries (a crop may replace a state entry with its marked copy).
    token_ids : (B, length) int64
        The ids fed so far (recorded by the model's forward, :meth:`record`); cropped with the slots.

    Examples
    --------
    >>> from attnkit.layers import GatedDeltaNet
    >>> gdn = GatedDeltaNet(4, num_key_heads=1, num_value_heads=1, key_head_dim=2, value_head_dim=2, rng=0)
    >>> cache = ModelCache([KeysValues(1, 1, 2), gdn.new_cache(1)], batch_size=1)
    >>> k = np.ones((1, 1, 3, 2), dtype=np.float32)
    >>> _ = cache.update(0, k, k)
    >>> _ = gdn(np.ones((1, 3, 4)), cache=cache.state(1))
    >>> cache.length, cache.kinds
    (3, ('keys_values', 'state'))
    """

    def __init__(self, entries, batch_size: int, *, max_length: int | None = None, dtype: Any = None) -> None:
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.max_length = check_max_length(max_length)
        entries = list(entries)
        if not entries:
            raise ValueError("entries must hold one entry per layer, got none")
        for i, entry in enumerate(entries):
            kind = entry_kind(entry)
            if kind == "state":
                _check_state(entry, f"entries[{i}]")
            rows = {"keys_values": getattr(entry, "batch_size", None), "latent": getattr(entry, "batch_size", None),
                    "paired": getattr(getattr(entry, "keys_values", None), "batch_size", None)}.get(kind)
            if rows is not None and rows != self.batch_size:
                raise ValueError(f"entries[{i}] holds {rows} rows but batch_size is {self.batch_size}")
        self.entries = entries
        self.dtype = _check_float_dtype(_entries_dtype(entries) if dtype is None else dtype)
        self.num_layers = len(entries)
        self._marks: dict[int, _Mark] = {}
        self.token_ids = np.zeros((self.batch_size, 0), np.int64)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's :func:`entry_kind`."""
        return tuple(entry_kind(entry) for entry in self.entries)

    def _check_layer(self, layer: Any) -> int:
        return _check_layer(layer, self.num_layers)

    # -- a layer's calls ------------------------------------------------------------------------------------
    def stored(self, layer: int) -> None:
        """Always ``None``: a self-attention cache takes the new positions' keys and values every step."""
        self._check_layer(layer)
        return None

    def update(self, layer: int, *new: np.ndarray) -> CachedKV | CachedLatent:
        """Append ``Lnew`` slots to ``layer``'s entry and return what its attention must read:
        ``update(layer, k_new, v_new)`` for keys and values (:meth:`KeysValues.update`),
        ``update(layer, latent_new)`` for latents (:meth:`Latents.update`)."""
        if type(layer) is not int or not 0 <= layer < self.num_layers:  # a step's every layer: the cheap test first
            layer = self._check_layer(layer)
        entry = self.entries[layer]
        if type(entry) in (KeysValues, Latents):
            return entry.update(*new)
        kind = entry_kind(entry)
        if kind == "state":
            held = "latents" if len(new) == 1 else "keys and values"
            raise ValueError(f"layer {layer} keeps a state, not {held}: use state({layer})")
        if kind == "none":
            raise ValueError(f"layer {layer} stores no keys and values (its entry is None): it reads another "
                             f"layer's, or has no token mixer")
        return (entry.keys_values if kind == "paired" else entry).update(*new)

    def state(self, layer: int) -> Any:
        """The state object of a state layer (or of the state half of a paired one), which the layer reads and
        rewrites in place."""
        layer = self._check_layer(layer)
        entry = self.entries[layer]
        state = _halves(entry)[1]
        if state is not None:
            return state
        held = {"keys_values": "keys and values", "latent": "latents", "none": "nothing"}[entry_kind(entry)]
        states = [i for i, k in enumerate(self.kinds) if k in ("state", "paired")]
        raise ValueError(f"layer {layer} keeps {held}, not a state (state layers: {states})")

    def record(self, ids: np.ndarray) -> None:
        """Append the ids (B, Lnew) just fed to :attr:`token_ids` (the model's forward calls it)."""
        self.token_ids = np.concatenate([self.token_ids, np.asarray(ids, np.int64)], axis=1)  # (B, length)

    # -- every layer ----------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Slots filled in every layer (pad slots included): the attention-mask columns seen so far. A cache
        whose layers hold nothing (an early exit's first layers, each an MLP alone) counts the ids it recorded."""
        held = [entry.length for entry in self.entries if entry is not None]
        return min(held) if held else self.token_ids.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by every entry."""
        return sum(entry.nbytes for entry in self.entries if entry is not None)

    @property
    def marks(self) -> list[int]:
        """The lengths marked with :meth:`mark` (and not cropped past), in order."""
        return sorted(self._marks)

    @property
    def needs_marks(self) -> bool:
        """Whether some layer keeps a recurrent state, which can go back only to a marked length (keys, values
        and latents go back anywhere, a ring buffer within its ``rollback`` slots unmarked)."""
        return any(kind in ("state", "paired") for kind in self.kinds)

    def mark(self) -> int:
        """Make the current length one that :meth:`crop` can return to, whatever is fed after it: keep a copy of
        every state and of every ring's kept slots. Returns the length marked.

        Growing slots need nothing (they stay). A mark costs one copy of the states (a few MB for a hybrid
        model) and of the windows; :meth:`crop` drops the marks it goes past, and only the latest eight are kept.
        """
        length = self.length
        snapshots: dict[int, tuple[Any, Any]] = {}
        for layer, entry in enumerate(self.entries):
            slots, state = _halves(entry)
            if state is not None and not callable(getattr(state, "copy", None)):
                raise TypeError(f"layer {layer}'s state ({type(state).__name__}) has no copy(): it cannot be marked")
            snapshots[layer] = (None if slots is None else slots.snapshot(), None if state is None else state.copy())
        self._marks[length] = _Mark(snapshots)
        while len(self._marks) > _MAX_MARKS:  # a long conversation marks every turn: keep the latest
            del self._marks[min(self._marks)]
        return length

    def _blocking(self, length: int) -> list[str]:
        """Why each layer that cannot go back to ``length`` without a mark cannot (none for 0: a start afresh)."""
        if length == 0:
            return []
        reasons = []
        for layer, entry in enumerate(self.entries):
            slots, state = _halves(entry)
            if state is not None and state.length != length:
                reasons.append(f"layer {layer} keeps a recurrent state of {state.length} positions")
            reason = None if slots is None else slots.blocking(length)
            if reason is not None:
                reasons.append(reason)
        return reasons

    def _set_state(self, layer: int, state: Any) -> None:
        """Make ``state`` layer ``layer``'s state (a state entry's whole, a paired entry's half)."""
        entry = self.entries[layer]
        if isinstance(entry, PairedCache):
            entry.state = state
        else:
            self.entries[layer] = state

    def _valid_length(self, length: Any) -> bool:
        return not isinstance(length, bool) and isinstance(length, (int, np.integer)) and 0 <= length <= self.length

    def can_crop(self, length: int) -> bool:
        """Whether :meth:`crop` can go back to ``length`` (every layer holds what it would need, or it is marked)."""
        return self._valid_length(length) and (length in self._marks or not self._blocking(int(length)))

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (a rejected draft, the tail a new prompt does not share).

        Keys, values and latents go back anywhere. A state goes back only to a marked length (:meth:`mark`) or
        to 0 (cleared), and a ring buffer to a marked length or within the slots it still holds (its window plus
        ``rollback``); otherwise this is a ``ValueError`` naming the layer and the marked lengths, and nothing
        changes. Marks past ``length`` are dropped.
        """
        if not self._valid_length(length):
            raise ValueError(f"length must be an integer in [0, {self.length}], got {length!r}")
        length = int(length)
        mark = self._marks.get(length)
        blocking = self._blocking(length)
        if mark is None and blocking:
            raise ValueError(f"the cache cannot go back to {length} positions: {blocking[0]}; mark the length first "
                             f"(mark()); marked lengths: {self.marks}")
        for layer, entry in enumerate(self.entries):
            ring, kept = (None, None) if mark is None else mark.snapshots[layer]
            slots, state = _halves(entry)
            if state is not None and state.length != length:
                self._set_state(layer, kept.copy() if kept is not None else state.cleared())
            if slots is not None:
                slots.crop(length, ring)
        self.token_ids = self.token_ids[:, :length]
        self._marks = {at: kept for at, kept in self._marks.items() if at <= length}

    def reorder(self, index) -> None:
        """Make row ``r`` a copy of row ``index[r]`` (beam search: rows may repeat; the batch size follows).

        Parameters
        ----------
        index : (B',) int
        """
        index = _check_index(index, self.batch_size)
        for entry in self.entries:
            for half in _halves(entry):
                if half is not None:
                    half.reorder(index)
        for mark in self._marks.values():
            mark.reorder(index)
        self.token_ids = self.token_ids[index]  # (B', length)
        self.batch_size = int(index.size)

    def select(self, rows) -> None:
        """Keep only ``rows`` (a boolean (B,) mask or distinct integer indices), e.g. rows still decoding."""
        self.reorder(_check_rows(rows, self.batch_size))

    # -- files ------------------------------------------------------------------------------------------------
    def _consistent_length(self) -> int:
        """The length every layer and the recorded ids agree on; a ``ValueError`` for a cache left between
        layers (a forward stopped part-way), which cannot be saved."""
        lengths = [half.length for entry in self.entries for half in _halves(entry) if half is not None]
        length = self.length
        if any(n != length for n in lengths) or self.token_ids.shape[1] != length:
            raise ValueError(f"the cache's layers hold different lengths ({sorted(set(lengths))}, ids "
                             f"{self.token_ids.shape[1]}): a forward through it stopped part-way; it cannot be saved")
        return length

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything the cache holds, as named arrays (copies), for a file: ``token_ids`` (B, n); for each layer
        with keys and values ``layers.{i}.keys`` and ``.values`` (B, Hkv, S, Dh), its last S slots (all n, or a
        ring's kept ones); ``layers.{i}.latent`` (B, n, C + R) for a latent layer; for each state each array
        field (``layers.{i}.state.{field}``). :meth:`load_arrays` puts them back into an empty cache of the same
        model.

        Marks are not saved: a cache loaded back goes back only where its layers allow unmarked (see
        :meth:`crop`). A state must be a dataclass of arrays and its ``length`` (as
        :class:`~attnkit.layers.gated_deltanet.GatedDeltaNetCache` is) to be saved.
        """
        length = self._consistent_length()
        out = {"token_ids": self.token_ids.copy()}
        for layer, entry in enumerate(self.entries):
            slots, state = _halves(entry)
            if slots is not None:
                out.update({f"layers.{layer}.{name}": array for name, array in slots.arrays(length).items()})
            if state is not None:
                out.update({f"layers.{layer}.state.{name}": array.copy()
                            for name, array in _state_arrays(state, layer)})
        return out

    def check_arrays(self, arrays: dict[str, np.ndarray]) -> int:
        """The checks of :meth:`load_arrays`, writing nothing: the names, shapes and dtypes of ``arrays`` are
        those of this cache's layers holding the same number of positions (returned). Only shapes and dtypes are
        read, so zero-memory stand-ins (``np.broadcast_to(np.zeros((), dtype), shape)``) of a file's headers can
        be checked before anything is read from it."""
        length = _checked_ids(arrays, self.batch_size, self.max_length).shape[1]
        expected = {"token_ids"}
        for layer, entry in enumerate(self.entries):
            slots, state = _halves(entry)
            if slots is not None:
                expected.update(slots.check_arrays(arrays, f"layers.{layer}.", length))
            for field, empty in ([] if state is None else _state_arrays(state, layer)):
                name = f"layers.{layer}.state.{field}"
                if _checked_array(arrays, name, empty.dtype).shape != empty.shape:
                    raise ValueError(f"{name} must have shape {empty.shape}, got {arrays[name].shape}")
                expected.add(name)
        unknown = sorted(set(arrays) - expected)
        if unknown:
            raise ValueError(f"arrays holds {unknown[0]!r}, which no layer of this cache keeps")
        return length

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Fill this empty cache with what :meth:`arrays` gave (of a cache of the same model, batch and dtype):
        afterwards it holds the same ids, keys, values, latents and states, and a forward through it gives the
        logits the saved one would have. Everything is checked first (:meth:`check_arrays`); a ``ValueError``
        says which array is wrong and leaves the cache empty."""
        if self.length or self.token_ids.shape[1]:
            raise ValueError(f"load_arrays fills an empty cache; this one holds {self.length} positions")
        length = self.check_arrays(arrays)
        for layer, entry in enumerate(self.entries):
            slots, state = _halves(entry)
            if slots is not None:
                slots.load_arrays(arrays, f"layers.{layer}.", length)
            if state is not None:
                fields = {field: arrays[f"layers.{layer}.state.{field}"].copy()
                          for field, _ in _state_arrays(state, layer)}
                self._set_state(layer, dataclasses.replace(state, length=length, **fields))
        self.token_ids = arrays["token_ids"].copy()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_layers={self.num_layers}, batch_size={self.batch_size}, "
                f"length={self.length}, max_length={self.max_length}, kinds={list(self.kinds)})")


class KVCache(ModelCache):
    """A :class:`ModelCache` of attention layers made from sizes alone (for code without a model): each layer's
    :class:`KeysValues`, a state, both, or nothing.

    Parameters
    ----------
    num_layers : int
    batch_size : int
        B, rows decoded together.
    num_kv_heads : int
        Hkv.
    head_dim : int
        Dh.
    dtype : numpy dtype, default float32
        Storage dtype; new keys/values are cast to it.
    max_length : int, optional
        Bound: a layer grows (doubling, from 256 slots) up to ``max_length`` slots and writing more is a
        ``ValueError``; memory follows what is written, not the bound. ``None``: no bound.
    windows : sequence of (int or None), optional
        Per-layer sliding window W; a layer with W keeps a ring buffer of its last W slots.
    states : mapping of int to state, optional
        Layers that keep a fixed-size state instead of keys and values (a hybrid model's linear-attention
        layers), each with its empty state object (e.g. ``GatedDeltaNet.new_cache(B)``). The layer fetches it
        with :meth:`state`.
    layer_shapes : sequence of ((int, int) or None), optional
        Per-layer (Hkv, Dh) where layers differ (Gemma 4's wider global layers); None for a layer that stores
        nothing because it reads another layer's keys and values or has no token mixer (it is left out of
        ``length``). Default: every layer (``num_kv_heads``, ``head_dim``).
    rollback : int, default 0
        Slots a ring-buffer layer keeps beyond its window (see :class:`KeysValues`).
    paired : iterable of int, default ()
        Layers of ``states`` that keep keys and values beside their state (a :class:`PairedCache`).

    Shapes
    ------
    ``update(layer, k_new, v_new)`` takes ``(B, Hkv, Lnew, Dh)`` and returns a :class:`CachedKV` (see
    :meth:`KeysValues.update`).

    Examples
    --------
    >>> cache = KVCache(num_layers=2, batch_size=1, num_kv_heads=1, head_dim=2, windows=[None, 2])
    >>> k = np.ones((1, 1, 3, 2), dtype=np.float32)
    >>> cache.update(0, k, k).slots, cache.update(1, k, k).slots
    (array([0, 1, 2]), array([0, 1, 2]))
    >>> cache.length
    3
    >>> step = np.ones((1, 1, 1, 2), dtype=np.float32)
    >>> cache.update(0, step, step).slots, cache.update(1, step, step).slots
    (array([0, 1, 2, 3]), array([1, 2, 3]))
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32, *, max_length: int | None = None, windows=None, states=None,
                 layer_shapes=None, rollback: int = 0, paired=()) -> None:
        num_layers = check_positive_int(num_layers, "num_layers")
        batch_size = check_positive_int(batch_size, "batch_size")
        self.num_kv_heads = check_positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.dtype = _check_float_dtype(dtype)
        windows = [None] * num_layers if windows is None else list(windows)
        if len(windows) != num_layers:
            raise ValueError(f"windows has {len(windows)} entries but num_layers is {num_layers}")
        self.windows = [None if w is None else check_positive_int(w, f"windows[{i}]") for i, w in enumerate(windows)]
        self.rollback = check_positive_int(rollback, "rollback", allow_zero=True)
        states = _checked_states(states, num_layers)
        for layer in states:
            if self.windows[layer] is not None:
                raise ValueError(f"layer {layer} has both a window and a state: a layer keeps one or the other")
        paired = frozenset(int(layer) for layer in paired)
        if not paired <= set(states):
            raise ValueError(f"paired layers {sorted(paired - set(states))} have no state: a paired layer keeps keys "
                             f"and values beside the state given in states")
        shapes = self._check_shapes(layer_shapes, num_layers)
        entries: list[Any] = []
        for i in range(num_layers):
            held = None if shapes[i] is None or (i in states and i not in paired) else KeysValues(
                batch_size, *shapes[i], self.dtype, max_length=max_length, window=self.windows[i],
                rollback=self.rollback, layer=i)
            entries.append(held if i not in states else PairedCache(held, states[i]) if i in paired else states[i])
        super().__init__(entries, batch_size, max_length=max_length, dtype=self.dtype)

    def _check_shapes(self, layer_shapes, num_layers: int) -> list[tuple[int, int] | None]:
        if layer_shapes is None:
            return [(self.num_kv_heads, self.head_dim)] * num_layers
        shapes = list(layer_shapes)
        if len(shapes) != num_layers:
            raise ValueError(f"layer_shapes has {len(shapes)} entries but num_layers is {num_layers}")
        return [None if shape is None else (check_positive_int(shape[0], f"layer_shapes[{i}][0]"),
                                            check_positive_int(shape[1], f"layer_shapes[{i}][1]"))
                for i, shape in enumerate(shapes)]


class LatentCache(ModelCache):
    """A :class:`ModelCache` of latent attention layers made from sizes alone: each layer's :class:`Latents`
    (one (B, S, C + R) array, not the (B, Hkv, S, Dh) keys and values of a :class:`KVCache`), or a state.

    Parameters
    ----------
    num_layers : int
    batch_size : int
        B.
    latent_dim : int
        C + R (``LatentAttentionConfig.cache_dim``: the latent and rotary key, then a sparse attention indexer's key).
    dtype : numpy dtype, default float32
    max_length : int, optional
        Bound on the slots of every layer (memory follows what is written, doubling from 256 slots up to it).
    states : dict of int to state, optional
        The fixed-size states of the layers that are not latent attention (Kimi Linear's Kimi Delta Attention
        layers).

    Shapes
    ------
    ``update(layer, latent_new)`` takes ``(B, Lnew, C + R)`` and returns a :class:`CachedLatent` (see
    :meth:`Latents.update`).

    Examples
    --------
    >>> cache = LatentCache(num_layers=1, batch_size=2, latent_dim=576, dtype=np.float16, max_length=4)
    >>> cache.update(0, np.ones((2, 3, 576))).latent.shape, cache.length
    ((2, 3, 576), 3)
    >>> cache.nbytes // (2 * 4)   # bytes per token and layer: 576 float16 numbers (KVCache with 8 heads of 128: 4096)
    1152
    """

    def __init__(self, num_layers: int, batch_size: int, latent_dim: int, dtype=np.float32, *,
                 max_length: int | None = None, states: dict[int, Any] | None = None) -> None:
        num_layers = check_positive_int(num_layers, "num_layers")
        batch_size = check_positive_int(batch_size, "batch_size")
        self.latent_dim = check_positive_int(latent_dim, "latent_dim")
        self.dtype = _check_float_dtype(dtype)
        states = _checked_states(states, num_layers)
        if len(states) == num_layers:
            raise ValueError("states: at least one layer must be latent attention (else use a KVCache)")
        entries = [states[i] if i in states else Latents(batch_size, self.latent_dim, self.dtype,
                                                           max_length=max_length, layer=i)
                   for i in range(num_layers)]
        super().__init__(entries, batch_size, max_length=max_length, dtype=self.dtype)


def _entries_dtype(entries: list) -> np.dtype:
    """The dtype of the first entry that stores something (float32 for a cache of empty entries)."""
    for entry in entries:
        slots, state = _halves(entry)
        if slots is not None:
            return slots.dtype
        arrays = [] if state is None else [value for value in vars(state).values() if isinstance(value, np.ndarray)]
        if arrays:
            return arrays[0].dtype
    return np.dtype(np.float32)


def _checked_states(states, num_layers: int) -> dict[int, Any]:
    """``states`` (layer -> a state layer's state) as a dict by layer index, each state checked."""
    states = {} if states is None else dict(states)
    for layer, state in states.items():
        _check_layer(layer, num_layers)
        _check_state(state, f"states[{layer}]")
    return {int(layer): state for layer, state in states.items()}


def _check_layer(layer: Any, num_layers: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an integer in [0, {num_layers}), got {layer!r}")
    return int(layer)


def _check_rows(rows: Any, batch_size: int) -> np.ndarray:
    """``rows`` as distinct integer indices into a batch of ``batch_size`` (a boolean mask is converted)."""
    rows = np.asarray(rows)
    if rows.dtype == bool:
        if rows.shape != (batch_size,):
            raise ValueError(f"a boolean rows mask must have shape ({batch_size},), got {rows.shape}")
        rows = np.flatnonzero(rows)
    elif rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise ValueError(f"rows must be a boolean mask or 1-D integer indices, got shape {rows.shape} "
                         f"and dtype {rows.dtype}")
    if len(np.unique(rows)) != rows.size:
        raise ValueError("rows must not repeat (use reorder to duplicate rows)")
    return rows


def _check_index(index: Any, batch_size: int) -> np.ndarray:
    """``index`` as a non-empty 1-D integer array of rows in ``[0, batch_size)`` (rows may repeat)."""
    index = np.asarray(index)
    if index.ndim != 1 or index.dtype.kind not in "iu" or index.size == 0:
        raise ValueError(f"index must be a non-empty 1-D integer array, got shape {index.shape} "
                         f"and dtype {index.dtype}")
    if index.min() < -batch_size or index.max() >= batch_size:
        raise ValueError(f"index must hold rows in [0, {batch_size}), got {index.min()}..{index.max()}")
    return index


class CrossAttentionCache:
    """Each decoder layer's cross-attention keys and values of the encoder memory, projected once.

    The first :meth:`update` of a layer stores what the attention module projected from the memory; from
    then on :meth:`stored` hands it back and the module projects nothing. Beam search reorders rows like a
    :class:`KVCache`.

    Parameters
    ----------
    num_layers : int

    Shapes
    ------
    ``update(layer, k, v)`` takes the memory's keys and values ``(B, H, Ls, Dh)`` and returns them as a
    :class:`CachedKV` with slots ``arange(Ls)``.

    Examples
    --------
    >>> cache = CrossAttentionCache(num_layers=2)
    >>> cache.stored(0) is None
    True
    >>> memory_kv = np.ones((1, 2, 5, 4))
    >>> cache.update(0, memory_kv, memory_kv).slots
    array([0, 1, 2, 3, 4])
    >>> cache.stored(0).keys.shape
    (1, 2, 5, 4)
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self._stored: list[CachedKV | None] = [None] * self.num_layers

    def _check_layer(self, layer) -> int:
        return _check_layer(layer, self.num_layers)

    def stored(self, layer: int) -> CachedKV | None:
        """The layer's memory keys and values, or ``None`` before its first :meth:`update`."""
        return self._stored[self._check_layer(layer)]

    def update(self, layer: int, k: np.ndarray, v: np.ndarray) -> CachedKV:
        """Store the memory's keys and values ``(B, H, Ls, Dh)`` of ``layer`` (once: a second call is an error)."""
        layer = self._check_layer(layer)
        if self._stored[layer] is not None:
            raise ValueError(f"layer {layer} already holds the memory's keys and values")
        k, v = np.asarray(k), np.asarray(v)
        if k.ndim != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k and v must be (B, H, Ls, Dh) arrays of one batch, head count and length, got "
                             f"{k.shape} and {v.shape}")
        self._stored[layer] = CachedKV(k, v, np.arange(k.shape[2], dtype=np.int64))
        return self._stored[layer]

    @property
    def batch_size(self) -> int | None:
        """Rows held (``None`` before any layer is stored)."""
        kept = next((c for c in self._stored if c is not None), None)
        return None if kept is None else kept.keys.shape[0]

    def reorder(self, index) -> None:
        """Make row ``r`` a copy of row ``index[r]`` in every stored layer (rows may repeat)."""
        if self.batch_size is None:
            return
        index = _check_index(index, self.batch_size)
        self._stored = [None if c is None else CachedKV(c.keys[index], c.values[index], c.slots)
                        for c in self._stored]  # (B', H, Ls, Dh) each

    def select(self, rows) -> None:
        """Keep only ``rows`` (a boolean (B,) mask or distinct integer indices)."""
        if self.batch_size is not None:
            self.reorder(_check_rows(rows, self.batch_size))

    def __repr__(self) -> str:
        done = sum(c is not None for c in self._stored)
        return f"CrossAttentionCache(num_layers={self.num_layers}, stored={done})"


class EncoderDecoderCache:
    """What an encoder-decoder keeps between decoding steps: its decoder's self-attention :class:`KVCache`
    and the :class:`CrossAttentionCache` of the memory (the names and split of Hugging Face's class).

    A decoder block hands ``self_attention`` to its self-attention module and ``cross_attention`` to its
    cross-attention module; :meth:`reorder` and :meth:`select` act on both.

    Parameters
    ----------
    self_attention : KVCache
    cross_attention : CrossAttentionCache, optional
        Default: an empty one with the self-attention cache's layer count.
    """

    def __init__(self, self_attention: KVCache, cross_attention: CrossAttentionCache | None = None) -> None:
        if not isinstance(self_attention, KVCache):
            raise TypeError(f"self_attention must be a KVCache, got {type(self_attention).__name__}")
        if cross_attention is None:
            cross_attention = CrossAttentionCache(self_attention.num_layers)
        if not isinstance(cross_attention, CrossAttentionCache):
            raise TypeError(f"cross_attention must be a CrossAttentionCache, got {type(cross_attention).__name__}")
        if cross_attention.num_layers != self_attention.num_layers:
            raise ValueError(f"the caches have {self_attention.num_layers} and {cross_attention.num_layers} layers")
        self.self_attention, self.cross_attention = self_attention, cross_attention

    @property
    def length(self) -> int:
        """Target positions decoded so far."""
        return self.self_attention.length

    def reorder(self, index) -> None:
        """Make row ``r`` a copy of row ``index[r]`` in both caches (beam search)."""
        self.self_attention.reorder(index)
        self.cross_attention.reorder(index)

    def select(self, rows) -> None:
        """Keep only ``rows`` in both caches."""
        self.self_attention.select(rows)
        self.cross_attention.select(rows)

    def __repr__(self) -> str:
        return f"EncoderDecoderCache({self.self_attention!r}, {self.cross_attention!r})"


def _state_arrays(state: Any, layer: int) -> list[tuple[str, np.ndarray]]:
    """The array fields of a state layer's state (a dataclass of arrays and its ``length``), by name."""
    if not dataclasses.is_dataclass(state):
        raise TypeError(f"layer {layer}'s state ({type(state).__name__}) is not a dataclass of arrays: it cannot "
                        f"be saved or loaded")
    return [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)
            if isinstance(getattr(state, f.name), np.ndarray)]


def _checked_ids(arrays: Any, batch_size: int, max_length: int | None) -> np.ndarray:
    if not hasattr(arrays, "keys") or not hasattr(arrays, "__getitem__"):
        raise TypeError(f"arrays must be a mapping of names to arrays, got {type(arrays).__name__}")
    ids = _checked_array(arrays, "token_ids", np.dtype(np.int64))
    if ids.ndim != 2 or ids.shape[0] != batch_size:
        raise ValueError(f"token_ids must have shape ({batch_size}, n), got {ids.shape}")
    if max_length is not None and ids.shape[1] > max_length:
        raise ValueError(f"token_ids holds {ids.shape[1]} positions, more than the cache's max_length={max_length}")
    if ids.size and ids.min() < 0:
        raise ValueError(f"token_ids must be ids >= 0, got {int(ids.min())}")
    return ids

def crop_to_prefix(cache: Any, ids: Any) -> Any:
    """Crop ``cache`` to the longest prefix of ``ids`` it holds and can go back to, and return it, ready to be fed
    the rest (``generate``'s ``past_key_values``).

    At most ``L - 1`` positions are kept, so at least the last id is fed again (its logits give the next token).
    Where the cache cannot go back to the whole shared prefix (a recurrent state, a ring past its window), it goes
    back to the latest marked length within it, else to 0.

    Parameters
    ----------
    cache : KVCache or LatentCache
        Filled by a model's forward (which records ``token_ids``).
    ids : int array (B, L)
        The prompt about to be fed, B the cache's rows.

    Examples
    --------
    >>> cache = KVCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2)
    >>> _ = cache.update(0, np.ones((1, 1, 4, 2)), np.ones((1, 1, 4, 2)))
    >>> cache.record(np.array([[5, 6, 7, 8]]))
    >>> crop_to_prefix(cache, np.array([[5, 6, 9, 9, 9]])).length
    2
    """
    for name in ("token_ids", "crop", "can_crop", "marks", "batch_size"):
        if not hasattr(cache, name):
            raise TypeError(f"past_key_values must be a cache from the model's new_cache, got {type(cache).__name__}")
    ids = np.asarray(ids)
    if cache.batch_size != ids.shape[0]:
        raise ValueError(f"past_key_values holds {cache.batch_size} rows but the prompt has {ids.shape[0]} (with "
                         f"num_return_sequences counted)")
    held = cache.token_ids
    if held.shape[1] != cache.length:
        raise ValueError(f"past_key_values holds {cache.length} positions but recorded {held.shape[1]} ids: fill it "
                         f"only through the model's forward or generate")
    width = min(held.shape[1], ids.shape[1] - 1)
    differs = np.flatnonzero((held[:, :width] != ids[:, :width]).any(axis=0))
    shared = int(differs[0]) if differs.size else width
    target = shared if cache.can_crop(shared) else max([at for at in cache.marks if at <= shared], default=0)
    cache.crop(target)
    return cache

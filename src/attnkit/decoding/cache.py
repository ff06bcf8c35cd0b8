"""Per-layer keys and values of a decoder, kept between decoding steps.

Dimension letters: B batch rows, Hkv key/value heads, S slots, Lnew new tokens, Dh features per head,
W sliding window.

A *slot* is the column of a token in the model's ``attention_mask`` (pad columns included): slot ``s`` holds
the key and value computed for the ``s``-th input column. The slot is not the rotary position: a left-padded
row starts its positions at its first real token while its slots start at 0, so the cache never needs to know
about positions, and the attention layer masks keys by looking up ``attention_mask[:, slots]``.

Four storage kinds, chosen per layer:

- growing (``max_length=None``, full-attention layer): capacity doubles when full;
- bounded (``max_length=N``): grows the same way but never beyond N slots; writing past N is an error;
- ring buffer (the layer's window W is set): only the last W slots are kept, slot ``s`` lives at index
  ``s % W``; a layer with window W never reads older keys, so the memory stays O(W) however long the text;
- state (the layer is given in ``states``): no keys or values at all, but a fixed-size object the layer reads
  and rewrites every step (Gated DeltaNet's convolution inputs and delta-rule state,
  :class:`~attnkit.layers.gated_deltanet.GatedDeltaNetCache`), whatever the length: a hybrid model's
  linear-attention layers cost O(1) memory and time per token. The cache asks of such a state only a
  ``length`` (positions it has seen), ``reorder(index)``, ``nbytes``, ``copy()`` and ``cleared()`` (the
  state of no position); it reorders and selects
  rows of it with the keys and values of the other layers.

Going back (:meth:`KVCache.crop`, for a prefix shared with the next prompt or a rejected draft): a full layer
forgets slots for free; a recurrent state cannot forget what it absorbed, and a ring buffer overwrites its
oldest slots, so those layers go back only to a length the caller marked beforehand (:meth:`KVCache.mark` keeps
a copy of each state and of each ring's kept slots there: a turn boundary, a draft's start), or, for a ring,
within the ``rollback`` extra slots it keeps. The cache also records the ids it was fed (``token_ids``), so a
caller can find the prefix a new prompt shares with it.

Every cache speaks to an attention module through two calls, so one cached-attention path serves the
decoder-only LMs and the encoder-decoder alike: ``stored(layer)`` hands back keys and values the module
must use as they are (a memory projected once for cross-attention), or ``None``, in which case the module
projects its new keys and values and calls ``update(layer, k_new, v_new)``. Both return a :class:`CachedKV`.

Multi-head latent attention keeps no keys or values at all: :class:`LatentCache` holds each token's latent and
shared rotary key (C + R numbers per token), from which the layer attends directly.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .._validation import check_positive_int

__all__ = ["CachedKV", "KVCache", "CrossAttentionCache", "EncoderDecoderCache", "CachedLatent", "LatentCache",
           "crop_to_prefix"]


_FIRST_SLOTS = 256  # slots a full-attention layer starts with (before its first doubling)
_MAX_MARKS = 8  # marks a cache keeps (the latest): each holds a copy of the states and windows


class CachedKV(NamedTuple):
    """What one layer's attention reads after :meth:`KVCache.update`.

    keys, values : (B, Hkv, S, Dh), the kept past slots followed by the new ones, in slot order
    slots : (S,) int64, the slot (attention-mask column) of every returned key
    """

    keys: np.ndarray
    values: np.ndarray
    slots: np.ndarray


class _SlotCache:
    """What :class:`KVCache` and :class:`LatentCache` share: the ids fed (``token_ids``), the marks of the lengths
    :meth:`crop` can go back to, and the rows (``batch_size``, each state layer's ``_states``)."""

    token_ids: np.ndarray
    batch_size: int
    _states: dict[int, Any]
    _marks: dict[int, _Mark]

    def record(self, ids: np.ndarray) -> None:
        """Append the ids (B, Lnew) just fed to :attr:`token_ids` (the model's forward calls it)."""
        self.token_ids = np.concatenate([self.token_ids, np.asarray(ids, np.int64)], axis=1)  # (B, length)

    @property
    def marks(self) -> list[int]:
        """The lengths marked with :meth:`mark` (and not cropped past), in order."""
        return sorted(self._marks)

    @property
    def needs_marks(self) -> bool:
        """Whether some layer keeps a recurrent state, which can go back only to a marked length (keys, values
        and latents go back anywhere, a ring buffer within its ``rollback`` slots unmarked)."""
        return bool(self._states)

    def _keep_mark(self, length: int, mark: _Mark) -> None:
        self._marks[length] = mark
        while len(self._marks) > _MAX_MARKS:  # a long conversation marks every turn: keep the latest
            del self._marks[min(self._marks)]

    def _forget_marks_after(self, length: int) -> None:
        self._marks = {at: kept for at, kept in self._marks.items() if at <= length}

    def _reorder_rows(self, index: np.ndarray) -> None:
        """Reorder what both caches hold by row: the states, the marks, the ids; the batch size follows."""
        for state in self._states.values():
            state.reorder(index)
        for mark in self._marks.values():
            mark.reorder(index)
        self.token_ids = self.token_ids[index]  # (B', length)
        self.batch_size = int(index.size)

    def select(self, rows) -> None:
        """Keep only ``rows`` (a boolean (B,) mask or distinct integer indices), e.g. rows still decoding."""
        self.reorder(_check_rows(rows, self.batch_size))


class KVCache(_SlotCache):
    """Keys and values of every layer of a decoder for incremental decoding.

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
        Bound: a full-attention layer grows (doubling, from 256 slots) up to ``max_length`` slots and writing
        more is a ``ValueError``; memory follows what is written, not the bound. ``None``: no bound.
    windows : sequence of (int or None), optional
        Per-layer sliding window W; a layer with W keeps a ring buffer of its last W slots.
    states : mapping of int to state, optional
        Layers that keep a fixed-size state instead of keys and values (a hybrid model's linear-attention
        layers), each with its empty state object (e.g. ``GatedDeltaNet.new_cache(B)``): any object with
        ``length``, ``nbytes`` and ``reorder(index)``. The layer fetches it with :meth:`state`.
    layer_shapes : sequence of ((int, int) or None), optional
        Per-layer (Hkv, Dh) where layers differ (Gemma 4's wider global layers); None for a layer that stores
        nothing because it reads another layer's keys and values or has no token mixer (it is left out of
        ``length``). Default: every layer (``num_kv_heads``, ``head_dim``).
    rollback : int, default 0
        Slots a ring-buffer layer keeps beyond its window, so :meth:`crop` can go back that far without a mark
        (a speculative draft's length). Its attention still sees only the window.
    paired : iterable of int, default ()
        Layers of ``states`` that keep keys and values beside their state (Falcon-H1's attention beside a
        Mamba-2 mixer): the pair marks, crops, reorders and saves together (:meth:`crop` goes back as the state
        allows).

    Attributes
    ----------
    token_ids : (B, length) int64
        The ids fed so far (recorded by the model's forward, :meth:`record`); cropped with the slots.

    Shapes
    ------
    ``update(layer, k_new, v_new)`` takes ``(B, Hkv, Lnew, Dh)`` and returns a :class:`CachedKV` with keys and
    values ``(B, Hkv, S, Dh)`` and slots ``(S,)``. For a full layer S = ``length`` after the update; for a
    window-W layer S = min(W, past) + Lnew (the kept past slots plus every new one, since the first new
    queries still need keys older than the last W). The returned arrays may be views of the storage: read
    them before the next ``update`` of that layer.

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

    A hybrid model's cache: layer 1 keeps a recurrent state, layer 0 keys and values.

    >>> from attnkit.layers import GatedDeltaNet
    >>> gdn = GatedDeltaNet(4, num_key_heads=1, num_value_heads=1, key_head_dim=2, value_head_dim=2, rng=0)
    >>> hybrid = KVCache(2, 1, 1, 2, states={1: gdn.new_cache(1)})
    >>> _ = hybrid.update(0, k, k)
    >>> _ = gdn(np.ones((1, 3, 4)), cache=hybrid.state(1))
    >>> hybrid.length, hybrid.state(1).recurrent_state.shape
    (3, (1, 1, 2, 2))
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32, *, max_length: int | None = None, windows=None, states=None,
                 layer_shapes=None, rollback: int = 0, paired=()) -> None:
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.num_kv_heads = check_positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype, got {self.dtype}")
        self.max_length = None if max_length is None else check_positive_int(max_length, "max_length")
        windows = [None] * self.num_layers if windows is None else list(windows)
        if len(windows) != self.num_layers:
            raise ValueError(f"windows has {len(windows)} entries but num_layers is {self.num_layers}")
        self.windows = [None if w is None else check_positive_int(w, f"windows[{i}]") for i, w in enumerate(windows)]
        self.rollback = check_positive_int(rollback, "rollback", allow_zero=True)
        self._states = self._check_states(states)
        self._paired = frozenset(int(layer) for layer in paired)
        if not self._paired <= set(self._states):
            raise ValueError(f"paired layers {sorted(self._paired - set(self._states))} have no state: a paired layer "
                             f"keeps keys and values beside the state given in states")
        # the layers keeping a state and no keys or values
        self._state_only = frozenset(self._states) - self._paired
        self._shapes = self._check_shapes(layer_shapes)
        self._holding = [i for i, shape in enumerate(self._shapes) if shape is not None]
        self._lengths = [0] * self.num_layers
        self._keys = [self._empty(self._initial_capacity(i), layer=i) for i in range(self.num_layers)]
        self._values = [self._empty(self._initial_capacity(i), layer=i) for i in range(self.num_layers)]
        self._marks: dict[int, _Mark] = {}
        self.token_ids = np.zeros((self.batch_size, 0), np.int64)

    def _check_states(self, states) -> dict[int, Any]:
        states = _checked_states(states, self.num_layers)
        for layer in states:
            if self.windows[layer] is not None:
                raise ValueError(f"layer {layer} has both a window and a state: a layer keeps one or the other")
        return states

    # ------------------------------------------------------------------------------------------------
    def _initial_capacity(self, layer: int) -> int:
        window = self.windows[layer]
        if layer in self._state_only:
            return 0  # a state layer keeps no keys or values
        if window is not None:
            return window + self.rollback if self.max_length is None else min(window + self.rollback,
                                                                              self.max_length)
        # max_length is a bound, not an allocation: a generous max_new_tokens must not reserve memory for
        # tokens that may never come. Slots double as they fill (amortised copies), up to max_length.
        return 0 if self.max_length is None else min(self.max_length, _FIRST_SLOTS)

    def _check_shapes(self, layer_shapes) -> list[tuple[int, int] | None]:
        if layer_shapes is None:
            return [(self.num_kv_heads, self.head_dim)] * self.num_layers
        shapes = list(layer_shapes)
        if len(shapes) != self.num_layers:
            raise ValueError(f"layer_shapes has {len(shapes)} entries but num_layers is {self.num_layers}")
        return [None if shape is None else (check_positive_int(shape[0], f"layer_shapes[{i}][0]"),
                                            check_positive_int(shape[1], f"layer_shapes[{i}][1]"))
                for i, shape in enumerate(shapes)]

    def _empty(self, slots: int, rows: int | None = None, *, layer: int) -> np.ndarray:
        rows = self.batch_size if rows is None else rows
        heads, dim = self._shapes[layer] or (0, 0)  # a layer storing nothing holds an empty array
        return np.zeros((rows, heads, slots if heads else 0, dim), dtype=self.dtype)  # (B, Hkv, S, Dh)

    def _check_layer(self, layer) -> int:
        return _check_layer(layer, self.num_layers)

    def _check_new(self, array, name: str, layer: int) -> np.ndarray:
        array = np.asarray(array)
        heads, dim = self._shapes[layer]
        expected = (self.batch_size, heads, "Lnew", dim)
        if (array.ndim != 4 or array.shape[0] != self.batch_size or array.shape[1] != heads
                or array.shape[3] != dim):
            raise ValueError(f"{name} must have shape {expected}, got {array.shape}")
        if array.dtype.kind != "f":
            raise TypeError(f"{name} must be a floating array, got dtype {array.dtype}")
        return array

    # ------------------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Slots filled in every layer (pad slots included): the attention-mask columns seen so far. A cache
        whose layers hold nothing (an early exit's first layers, each an MLP alone) counts the ids it recorded."""
        if not self._holding:
            return self.token_ids.shape[1]
        return min(self._states[i].length if i in self._states else self._lengths[i] for i in self._holding)

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value storage and the states of all layers."""
        return (sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values))
                + sum(state.nbytes for state in self._states.values()))

    def state(self, layer: int) -> Any:
        """The state object of a layer given in ``states`` (the layer reads and rewrites it in place)."""
        layer = self._check_layer(layer)
        if layer not in self._states:
            raise ValueError(f"layer {layer} keeps keys and values, not a state (state layers: "
                             f"{sorted(self._states)})")
        return self._states[layer]

    def stored(self, layer: int) -> None:
        """Always ``None``: a self-attention cache takes the new positions' keys and values every step."""
        self._check_layer(layer)
        return None

    def update(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> CachedKV:
        """Append ``Lnew`` slots to ``layer`` and return the keys/values its attention must read.

        Parameters
        ----------
        layer : int
        k_new, v_new : (B, Hkv, Lnew, Dh)

        Returns
        -------
        CachedKV
            ``keys``, ``values`` (B, Hkv, S, Dh) in slot order and ``slots`` (S,).
        """
        layer = self._check_layer(layer)
        if layer in self._state_only:
            raise ValueError(f"layer {layer} keeps a state, not keys and values: use state({layer})")
        if self._shapes[layer] is None:
            raise ValueError(f"layer {layer} stores no keys and values (layer_shapes[{layer}] is None): it reads "
                             f"another layer's")
        k_new = self._check_new(k_new, "k_new", layer)
        v_new = self._check_new(v_new, "v_new", layer)
        if k_new.shape != v_new.shape:
            raise ValueError(f"k_new and v_new must have the same shape, got {k_new.shape} and {v_new.shape}")
        past, new = self._lengths[layer], k_new.shape[2]
        end = past + new
        if self.max_length is not None and end > self.max_length:
            raise ValueError(f"the cache holds max_length={self.max_length} slots but layer {layer} would "
                             f"reach {end} ({past} filled + {new} new)")
        if self.windows[layer] is not None and end > self._keys[layer].shape[2]:
            return self._update_ring(layer, k_new, v_new)
        # a window layer whose ring has not come round yet keeps slot s at index s, as a full layer does
        if end > self._keys[layer].shape[2]:
            capacity = max(end, 2 * self._keys[layer].shape[2])
            self._grow(layer, capacity if self.max_length is None else min(capacity, self.max_length))
        self._keys[layer][:, :, past:end] = k_new
        self._values[layer][:, :, past:end] = v_new
        self._lengths[layer] = end
        return CachedKV(self._keys[layer][:, :, :end], self._values[layer][:, :, :end],
                        np.arange(end, dtype=np.int64))

    def _grow(self, layer: int, capacity: int) -> None:
        for store in (self._keys, self._values):
            bigger = self._empty(capacity, layer=layer)  # (B, Hkv, capacity, Dh)
            bigger[:, :, :self._lengths[layer]] = store[layer][:, :, :self._lengths[layer]]
            store[layer] = bigger

    def _kept_slots(self, layer: int) -> np.ndarray:
        """Slots still held by a ring-buffer layer, oldest first."""
        length, capacity = self._lengths[layer], self._keys[layer].shape[2]
        return np.arange(max(0, length - capacity), length, dtype=np.int64)

    def _update_ring(self, layer: int, k_new: np.ndarray, v_new: np.ndarray) -> CachedKV:
        kept = self._kept_slots(layer)  # (Skept,)
        capacity = self._keys[layer].shape[2]
        new = k_new.shape[2]
        slots = np.concatenate([kept, np.arange(self._lengths[layer], self._lengths[layer] + new)])  # (S,)
        ring_index = kept % capacity
        keys = np.concatenate([self._keys[layer][:, :, ring_index], k_new.astype(self.dtype, copy=False)],
                              axis=2)  # (B, Hkv, S, Dh)
        values = np.concatenate([self._values[layer][:, :, ring_index], v_new.astype(self.dtype, copy=False)],
                                axis=2)  # (B, Hkv, S, Dh)
        # Only the last `capacity` slots survive; older ones would be overwritten in the same write anyway.
        last = slots[-capacity:]
        self._keys[layer][:, :, last % capacity] = keys[:, :, -capacity:]
        self._values[layer][:, :, last % capacity] = values[:, :, -capacity:]
        self._lengths[layer] += new
        return CachedKV(keys, values, slots)

    # ------------------------------------------------------------------------------------------------
    def mark(self) -> int:
        """Make the current length one that :meth:`crop` can return to, whatever is fed after it: keep a copy of
        every state layer's state and of every ring layer's kept slots. Returns the length marked.

        A full-attention layer needs nothing (its slots stay). A mark costs one copy of the states (a few MB for
        a hybrid model) and of the windows; :meth:`crop` drops the marks it goes past, and only the latest
        eight are kept.
        """
        length = self.length
        states = {}
        for layer, state in self._states.items():
            if not callable(getattr(state, "copy", None)):
                raise TypeError(f"layer {layer}'s state ({type(state).__name__}) has no copy(): it cannot be marked")
            states[layer] = state.copy()
        rings = {layer: self._ring_slots(layer) for layer in self._holding if self.windows[layer] is not None}
        self._keep_mark(length, _Mark(states, rings))
        return length

    def can_crop(self, length: int) -> bool:
        """Whether :meth:`crop` can go back to ``length`` (every layer holds what it would need, or it is marked)."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= self.length:
            return False
        return length in self._marks or not self._blocking(int(length))

    def _blocking(self, length: int) -> list[str]:
        """Why each layer that cannot go back to ``length`` without a mark cannot (none for 0: a start afresh)."""
        if length == 0:
            return []
        reasons = [f"layer {layer} keeps a recurrent state of {state.length} positions"
                   for layer, state in self._states.items() if state.length != length]
        for layer in self._holding:
            window = self.windows[layer]
            if window is not None and max(0, length - window) < self._ring_slots_start(layer):
                reasons.append(f"layer {layer} keeps a ring of {self._keys[layer].shape[2]} slots and has "
                               f"overwritten slots before {self._ring_slots_start(layer)}")
        return reasons

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (a rejected draft, the tail a new prompt does not share).

        Full-attention layers go back anywhere. A state layer goes back only to a marked length (:meth:`mark`) or
        to 0 (its state cleared), and a ring-buffer layer to a marked length or within the slots it still holds
        (its window plus ``rollback``); otherwise this is a ``ValueError`` naming the layer and the marked
        lengths, and nothing changes. Marks past ``length`` are dropped.
        """
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an integer in [0, {self.length}], got {length!r}")
        length = int(length)
        mark = self._marks.get(length)
        if mark is None and self._blocking(length):
            raise ValueError(f"the cache cannot go back to {length} positions: {self._blocking(length)[0]}; mark "
                             f"the length first (KVCache.mark); marked lengths: {self.marks}")
        for layer, state in self._states.items():
            if state.length != length:
                self._states[layer] = mark.states[layer].copy() if mark is not None else state.cleared()
        for layer in self._holding:
            window = self.windows[layer]
            if window is not None and length and max(0, length - window) < self._ring_slots_start(layer):
                self._restore_ring(layer, *mark.rings[layer])
        self._lengths = [length] * self.num_layers
        self.token_ids = self.token_ids[:, :length]
        self._forget_marks_after(length)

    def _ring_slots_start(self, layer: int) -> int:
        """The oldest slot a ring-buffer layer still holds."""
        return max(0, self._lengths[layer] - self._keys[layer].shape[2])

    def _ring_slots(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of a ring layer's kept keys and values (B, Hkv, S, Dh), oldest first, and their slots (S,)."""
        slots = self._kept_slots(layer)
        index = slots % self._keys[layer].shape[2]
        return self._keys[layer][:, :, index], self._values[layer][:, :, index], slots

    def _restore_ring(self, layer: int, keys: np.ndarray, values: np.ndarray, slots: np.ndarray) -> None:
        capacity = self._keys[layer].shape[2]
        self._keys[layer][:, :, slots % capacity] = keys
        self._values[layer][:, :, slots % capacity] = values

    # ------------------------------------------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        """Everything the cache holds, as named arrays (copies), for a file: ``token_ids`` (B, n); for each layer
        with keys and values ``layers.{i}.keys`` and ``.values`` (B, Hkv, S, Dh), its last S slots (all n for a
        full layer, the ring's kept ones for a window); for each state layer each array field of its state
        (``layers.{i}.state.{field}``). :meth:`load_arrays` puts them back into an empty cache of the same model.

        Marks are not saved: a cache loaded back goes back only where its layers allow unmarked (see
        :meth:`crop`). A state must be a dataclass of arrays and its ``length`` (as
        :class:`~attnkit.layers.gated_deltanet.GatedDeltaNetCache` is) to be saved.
        """
        length = _consistent_length(self)
        out = {"token_ids": self.token_ids.copy()}
        for layer in self._holding:
            if layer in self._state_only:
                continue
            if self.windows[layer] is None:
                keys, values = self._keys[layer][:, :, :length].copy(), self._values[layer][:, :, :length].copy()
            else:
                keys, values, _ = self._ring_slots(layer)  # (B, Hkv, S, Dh): fancy indexing copies
            out[f"layers.{layer}.keys"], out[f"layers.{layer}.values"] = keys, values
        for layer, state in self._states.items():
            out.update({f"layers.{layer}.state.{name}": array.copy() for name, array in _state_arrays(state, layer)})
        return out

    def check_arrays(self, arrays: dict[str, np.ndarray]) -> int:
        """The checks of :meth:`load_arrays`, writing nothing: the names, shapes and dtypes of ``arrays`` are
        those of this cache's layers holding the same number of positions (returned). Only shapes and dtypes are
        read, so zero-memory stand-ins (``np.broadcast_to(np.zeros((), dtype), shape)``) of a file's headers can
        be checked before anything is read from it."""
        ids = _checked_ids(arrays, self.batch_size, self.max_length)
        length = ids.shape[1]
        expected = {"token_ids"}
        for layer in self._holding:
            if layer in self._state_only:
                continue
            heads, dim = self._shapes[layer]
            capacity = length if self.windows[layer] is None else min(length, self._keys[layer].shape[2])
            for part in ("keys", "values"):
                name = f"layers.{layer}.{part}"
                array = _checked_array(arrays, name, self.dtype)
                held = array.shape[2] if array.ndim == 4 else -1
                if array.shape[:2] + array.shape[3:] != (self.batch_size, heads, dim) or not capacity <= held <= length:
                    raise ValueError(f"{name} must have shape ({self.batch_size}, {heads}, S, {dim}) with S in "
                                     f"[{capacity}, {length}] (the slots layer {layer} keeps of {length}), got "
                                     f"{array.shape}")
                expected.add(name)
        for layer, state in self._states.items():
            for field, empty in _state_arrays(state, layer):
                name = f"layers.{layer}.state.{field}"
                array = _checked_array(arrays, name, empty.dtype)
                if array.shape != empty.shape:
                    raise ValueError(f"{name} must have shape {empty.shape}, got {array.shape}")
                expected.add(name)
        unknown = sorted(set(arrays) - expected)
        if unknown:
            raise ValueError(f"arrays holds {unknown[0]!r}, which no layer of this cache keeps")
        return length

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Fill this empty cache with what :meth:`arrays` gave (of a cache of the same model, batch and dtype):
        afterwards it holds the same ids, keys, values and states, and a forward through it gives the logits
        the saved one would have. Everything is checked first (:meth:`check_arrays`); a ``ValueError`` says
        which array is wrong and leaves the cache empty."""
        if self.length or self.token_ids.shape[1]:
            raise ValueError(f"load_arrays fills an empty cache; this one holds {self.length} positions")
        length = self.check_arrays(arrays)
        for layer in self._holding:
            if layer in self._state_only:
                continue
            keys, values = arrays[f"layers.{layer}.keys"], arrays[f"layers.{layer}.values"]
            if self.windows[layer] is None:
                self._keys[layer] = self._empty(max(length, self._keys[layer].shape[2]), layer=layer)
                self._values[layer] = self._empty(self._keys[layer].shape[2], layer=layer)
                self._keys[layer][:, :, :length], self._values[layer][:, :, :length] = keys, values
            else:
                capacity = self._keys[layer].shape[2]
                kept = min(length, capacity)
                slots = np.arange(length - kept, length) % capacity  # (S,): where the kept slots live
                self._keys[layer][:, :, slots] = keys[:, :, keys.shape[2] - kept:]
                self._values[layer][:, :, slots] = values[:, :, values.shape[2] - kept:]
        for layer, state in self._states.items():
            fields = {field: arrays[f"layers.{layer}.state.{field}"].copy() for field, _ in _state_arrays(state, layer)}
            self._states[layer] = dataclasses.replace(state, length=length, **fields)
        self._lengths = [length] * self.num_layers
        self.token_ids = arrays["token_ids"].copy()

    def reorder(self, index) -> None:
        """Make row ``r`` a copy of row ``index[r]`` (beam search: rows may repeat; the batch size follows).

        Parameters
        ----------
        index : (B',) int
        """
        index = _check_index(index, self.batch_size)
        self._keys = [k[index] for k in self._keys]  # (B', Hkv, S, Dh)
        self._values = [v[index] for v in self._values]  # (B', Hkv, S, Dh)
        self._reorder_rows(index)

    def __repr__(self) -> str:
        states = f", states={sorted(self._states)}" if self._states else ""
        return (f"KVCache(num_layers={self.num_layers}, batch_size={self.batch_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, length={self.length}, "
                f"max_length={self.max_length}, windows={self.windows}{states})")


class _Mark:
    """What :meth:`KVCache.mark` or :meth:`LatentCache.mark` kept: each state layer's state, each ring layer's kept
    (keys, values, slots)."""

    def __init__(self, states: dict[int, Any], rings: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]):
        self.states, self.rings = states, rings

    def reorder(self, index: np.ndarray) -> None:
        for state in self.states.values():
            state.reorder(index)
        self.rings = {layer: (k[index], v[index], slots) for layer, (k, v, slots) in self.rings.items()}


def _checked_states(states, num_layers: int) -> dict[int, Any]:
    """``states`` (layer -> a state layer's state, or None) as a dict by layer index, each state checked."""
    states = {} if states is None else dict(states)
    for layer, state in states.items():
        _check_layer(layer, num_layers)
        if not all(hasattr(state, name) for name in ("length", "nbytes", "reorder", "copy", "cleared")):
            raise TypeError(f"states[{layer}] must have length, nbytes, reorder, copy and cleared (e.g. a "
                            f"GatedDeltaNetCache), got {type(state).__name__}")
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


class CachedLatent(NamedTuple):
    """What one latent-attention layer reads after :meth:`LatentCache.update`.

    latent : (B, S, C + R), the kept slots in slot order (each the token's normalised latent, then its rotated key)
    slots : (S,) int64, the slot (attention-mask column) of every returned token
    """

    latent: np.ndarray
    slots: np.ndarray


class LatentCache(_SlotCache):
    """Each layer's compressed latents for incremental decoding with multi-head latent attention.

    :class:`~attnkit.attention.latent.MultiHeadLatentAttention` attends from its ``[c, k_r]`` latent (C + R
    numbers per token: DeepSeek-V3's 576) without ever forming per-head keys or values, so this is all a layer
    keeps: one (B, S, C + R) array, not the (B, Hkv, S, Dh) keys and values of a :class:`KVCache`. Slots work
    as in :class:`KVCache` (growing, or bounded by ``max_length``); a windowed layer masks the slots it may not
    see rather than dropping them.

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
        layers), as :class:`KVCache` keeps them: :meth:`state` hands a layer its own, :meth:`mark` copies them
        and :meth:`crop` goes back to a marked length (or 0).

    Shapes
    ------
    ``update(layer, latent_new)`` takes ``(B, Lnew, C + R)`` and returns a :class:`CachedLatent` with ``latent``
    ``(B, S, C + R)`` (a view of the storage: read it before the next update of that layer) and ``slots (S,)``.

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
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.latent_dim = check_positive_int(latent_dim, "latent_dim")
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype, got {self.dtype}")
        self.max_length = None if max_length is None else check_positive_int(max_length, "max_length")
        first = 0 if self.max_length is None else min(self.max_length, _FIRST_SLOTS)
        self._states = _checked_states(states, self.num_layers)
        self._holding = [i for i in range(self.num_layers) if i not in self._states]  # the latent layers
        if not self._holding:
            raise ValueError("states: at least one layer must be latent attention (else use a KVCache)")
        self._lengths = [0] * self.num_layers
        self._latents = [self._empty(0 if i in self._states else first) for i in range(self.num_layers)]
        self._marks: dict[int, _Mark] = {}
        self.token_ids = np.zeros((self.batch_size, 0), np.int64)

    def _empty(self, slots: int) -> np.ndarray:
        return np.zeros((self.batch_size, slots, self.latent_dim), dtype=self.dtype)  # (B, S, C+R)

    @property
    def length(self) -> int:
        """Slots filled in every layer (pad slots included)."""
        return min(self._states[i].length if i in self._states else self._lengths[i] for i in range(self.num_layers))

    @property
    def nbytes(self) -> int:
        """Bytes held by the latent storage and the states of all layers."""
        return sum(a.nbytes for a in self._latents) + sum(state.nbytes for state in self._states.values())

    def state(self, layer: int) -> Any:
        """The state object of a layer given in ``states`` (the layer reads and rewrites it in place)."""
        layer = _check_layer(layer, self.num_layers)
        if layer not in self._states:
            raise ValueError(f"layer {layer} keeps latents, not a state (state layers: {sorted(self._states)})")
        return self._states[layer]

    def stored(self, layer: int) -> None:
        """Always ``None``: the layer hands over its new tokens' latents every step."""
        _check_layer(layer, self.num_layers)
        return None

    def update(self, layer: int, latent_new: np.ndarray) -> CachedLatent:
        """Append ``Lnew`` slots to ``layer`` and return every slot it holds.

        Parameters
        ----------
        layer : int
        latent_new : (B, Lnew, C + R)
        """
        layer = _check_layer(layer, self.num_layers)
        if layer in self._states:
            raise ValueError(f"layer {layer} keeps a state, not latents: use state({layer})")
        latent_new = np.asarray(latent_new)
        if latent_new.ndim != 3 or latent_new.shape[0] != self.batch_size or latent_new.shape[2] != self.latent_dim:
            raise ValueError(f"latent_new must have shape ({self.batch_size}, Lnew, {self.latent_dim}), got "
                             f"{latent_new.shape}")
        if latent_new.dtype.kind != "f":
            raise TypeError(f"latent_new must be a floating array, got dtype {latent_new.dtype}")
        past = self._lengths[layer]
        end = past + latent_new.shape[1]
        if self.max_length is not None and end > self.max_length:
            raise ValueError(f"the cache holds max_length={self.max_length} slots but layer {layer} would "
                             f"reach {end} ({past} filled + {latent_new.shape[1]} new)")
        store = self._latents[layer]
        if end > store.shape[1]:
            capacity = max(end, 2 * store.shape[1])
            bigger = self._empty(capacity if self.max_length is None else min(capacity, self.max_length))
            bigger[:, :past] = store[:, :past]
            self._latents[layer] = store = bigger
        store[:, past:end] = latent_new
        self._lengths[layer] = end
        return CachedLatent(store[:, :end], np.arange(end, dtype=np.int64))

    def mark(self) -> int:
        """Make the current length one that :meth:`crop` can return to and return it: the latent slots stay until
        cropped, so only the states are copied (as :meth:`KVCache.mark` does; the latest eight marks are kept)."""
        length = self.length
        if self._states:
            self._keep_mark(length, _Mark({layer: state.copy() for layer, state in self._states.items()}, {}))
        return length

    def can_crop(self, length: int) -> bool:
        """Whether :meth:`crop` can go back to ``length``: in [0, length], and marked (or 0, or where every state
        stands) when there are states."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= self.length:
            return False
        return length in self._marks or length == 0 or all(s.length == length for s in self._states.values())

    def crop(self, length: int) -> None:
        """Forget every slot from ``length`` on (e.g. rejected draft tokens); a state goes back to the mark of
        ``length`` (or is cleared at 0), else this is a ``ValueError`` and nothing changes."""
        if not self.can_crop(length):
            raise ValueError(f"the cache cannot go back to {length!r} positions: it holds {self.length}, and its "
                             f"states go back only to a marked length (marked: {self.marks}) or 0")
        length = int(length)
        mark = self._marks.get(length)
        for layer, state in self._states.items():
            if state.length != length:
                self._states[layer] = mark.states[layer].copy() if mark is not None else state.cleared()
        self._lengths = [length] * self.num_layers
        self.token_ids = self.token_ids[:, :length]
        self._forget_marks_after(length)

    def arrays(self) -> dict[str, np.ndarray]:
        """Everything the cache holds, as named arrays (copies), for a file: ``token_ids`` (B, n) and each layer's
        ``layers.{i}.latent`` (B, n, C + R), and each state layer's array fields (``layers.{i}.state.{field}``).
        :meth:`load_arrays` puts them back into an empty cache."""
        length = _consistent_length(self)
        out = {"token_ids": self.token_ids.copy()}
        out.update({f"layers.{i}.latent": self._latents[i][:, :length].copy() for i in self._holding})
        for layer, state in self._states.items():
            out.update({f"layers.{layer}.state.{name}": array.copy() for name, array in _state_arrays(state, layer)})
        return out

    def check_arrays(self, arrays: dict[str, np.ndarray]) -> int:
        """The checks of :meth:`load_arrays`, writing nothing; returns the positions held (see
        :meth:`KVCache.check_arrays`)."""
        length = _checked_ids(arrays, self.batch_size, self.max_length).shape[1]
        expected = {"token_ids"}
        for layer in self._holding:
            name = f"layers.{layer}.latent"
            array = _checked_array(arrays, name, self.dtype)
            if array.shape != (self.batch_size, length, self.latent_dim):
                raise ValueError(f"{name} must have shape {(self.batch_size, length, self.latent_dim)}, got "
                                 f"{array.shape}")
            expected.add(name)
        for layer, state in self._states.items():
            for field, empty in _state_arrays(state, layer):
                name = f"layers.{layer}.state.{field}"
                if _checked_array(arrays, name, empty.dtype).shape != empty.shape:
                    raise ValueError(f"{name} must have shape {empty.shape}, got {arrays[name].shape}")
                expected.add(name)
        unknown = sorted(set(arrays) - expected)
        if unknown:
            raise ValueError(f"arrays holds {unknown[0]!r}, which no layer of this cache keeps")
        return length

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        """Fill this empty cache with what :meth:`arrays` gave, everything checked first (:meth:`check_arrays`)."""
        if self.length or self.token_ids.shape[1]:
            raise ValueError(f"load_arrays fills an empty cache; this one holds {self.length} positions")
        length = self.check_arrays(arrays)
        for layer in self._holding:
            self._latents[layer] = self._empty(max(length, self._latents[layer].shape[1]))  # (B, S, C+R)
            self._latents[layer][:, :length] = arrays[f"layers.{layer}.latent"]
        for layer, state in self._states.items():
            fields = {field: arrays[f"layers.{layer}.state.{field}"].copy() for field, _ in _state_arrays(state, layer)}
            self._states[layer] = dataclasses.replace(state, length=length, **fields)
        self._lengths = [length] * self.num_layers
        self.token_ids = arrays["token_ids"].copy()

    def reorder(self, index) -> None:
        """Make row ``r`` a copy of row ``index[r]`` (beam search: rows may repeat; the batch size follows)."""
        index = _check_index(index, self.batch_size)
        self._latents = [a[index] for a in self._latents]  # (B', S, C+R)
        self._reorder_rows(index)

    def __repr__(self) -> str:
        states = f", states={sorted(self._states)}" if self._states else ""
        return (f"LatentCache(num_layers={self.num_layers}, batch_size={self.batch_size}, "
                f"latent_dim={self.latent_dim}, length={self.length}, max_length={self.max_length}{states})")


def _consistent_length(cache: Any) -> int:
    """The length every layer and the recorded ids agree on; a ``ValueError`` for a cache left between layers
    (a forward stopped part-way), which cannot be saved."""
    length = cache.length
    layers = [cache._lengths[i] for i in getattr(cache, "_holding", range(cache.num_layers))
              if i not in getattr(cache, "_states", {})]
    layers += [state.length for state in getattr(cache, "_states", {}).values()]
    if any(n != length for n in layers) or cache.token_ids.shape[1] != length:
        raise ValueError(f"the cache's layers hold different lengths ({sorted(set(layers))}, ids "
                         f"{cache.token_ids.shape[1]}): a forward through it stopped part-way; it cannot be saved")
    return length


def _state_arrays(state: Any, layer: int) -> list[tuple[str, np.ndarray]]:
    """The array fields of a state layer's state (a dataclass of arrays and its ``length``), by name."""
    if not dataclasses.is_dataclass(state):
        raise TypeError(f"layer {layer}'s state ({type(state).__name__}) is not a dataclass of arrays: it cannot "
                        f"be saved or loaded")
    return [(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)
            if isinstance(getattr(state, f.name), np.ndarray)]


def _checked_array(arrays: Any, name: str, dtype: np.dtype) -> np.ndarray:
    if name not in arrays:
        raise ValueError(f"arrays has no {name!r}")
    array = arrays[name]
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise ValueError(f"{name} must be a {np.dtype(dtype)} array, got "
                         f"{getattr(array, 'dtype', type(array).__name__)}")
    return array


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

"""A layer's entry of a decoder's cache: the keys and values of an attention layer, the latents of a latent
attention layer, both keys and values and a state for attention beside a state-space mixer.

Dimension letters: B batch rows, Hkv key/value heads, S slots, Lnew new tokens, Dh features per head,
W sliding window, C + R a latent attention layer's cached width.

A token mixer makes its own entry (``new_cache(batch_size, max_length)``); a state layer's entry is its state
(:class:`~attnkit.layers.recurrent_state.RecurrentState`). :class:`~attnkit.decoding.cache.ModelCache` holds a
model's list of them and does what concerns every layer at once (the shared length, marks, going back, beams,
files); an entry answers for itself: its ``update``, ``length``, ``nbytes``, ``reorder(index)``, what a mark keeps
(``snapshot()``), whether it can go back unmarked (``blocking(length)``), ``crop(length, snapshot)`` and its
arrays for a file.

A *slot* is the column of a token in the model's ``attention_mask`` (pad columns included): slot ``s`` holds
the key and value computed for the ``s``-th input column, whatever its rotary position.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .._validation import check_positive_int

__all__ = ["CachedKV", "KeysValues", "CachedLatent", "Latents", "PairedCache", "entry_kind"]

_FIRST_SLOTS = 256  # slots a growing entry starts with when bounded (before its first doubling)
_STATE_PROTOCOL = ("length", "nbytes", "reorder", "copy", "cleared")


class CachedKV(NamedTuple):
    """What one layer's attention reads after :meth:`KeysValues.update`.

    keys, values : (B, Hkv, S, Dh), the kept past slots followed by the new ones, in slot order
    slots : (S,) int64, the slot (attention-mask column) of every returned key
    """

    keys: np.ndarray
    values: np.ndarray
    slots: np.ndarray


class CachedLatent(NamedTuple):
    """What one latent-attention layer reads after :meth:`Latents.update`.

    latent : (B, S, C + R), the kept slots in slot order (each the token's normalised latent, then its rotated key)
    slots : (S,) int64, the slot (attention-mask column) of every returned token
    """

    latent: np.ndarray
    slots: np.ndarray


def _where(layer: int | None) -> str:
    return "the layer" if layer is None else f"layer {layer}"


def _check_float_dtype(dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    return dtype


def _initial_slots(max_length: int | None, ring: int | None = None) -> int:
    """The slots an entry starts with: a ring's all of them (within the bound). Otherwise ``max_length`` is a bound,
    not an allocation (a generous ``max_new_tokens`` must not reserve memory for tokens that may never come): none
    unbounded, else the first 256."""
    if ring is None:
        return 0 if max_length is None else min(max_length, _FIRST_SLOTS)
    return ring if max_length is None else min(ring, max_length)


def _grown_slots(end: int, capacity: int, max_length: int | None) -> int:
    """The slots growing storage takes to hold ``end``: doubling (amortised copies), never past ``max_length``."""
    capacity = max(end, 2 * capacity)
    return capacity if max_length is None else min(capacity, max_length)


def _check_room(max_length: int | None, layer: int | None, past: int, new: int) -> None:
    if max_length is not None and past + new > max_length:
        raise ValueError(f"the cache holds max_length={max_length} slots but {_where(layer)} would reach "
                         f"{past + new} ({past} filled + {new} new)")


def check_max_length(max_length: Any) -> int | None:
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer))):
        raise TypeError(f"max_length must be an int or None, got {max_length!r} (dtype is a keyword "
                        f"argument)")
    return None if max_length is None else check_positive_int(max_length, "max_length")


class KeysValues:
    """One attention layer's keys and values: slots that grow, up to a bound, or a ring buffer of the last W.

    Parameters
    ----------
    batch_size : int
        B, rows decoded together.
    num_kv_heads, head_dim : int
        Hkv and Dh.
    dtype : numpy dtype, default float32
        Storage dtype; new keys/values are cast to it.
    max_length : int, optional
        Bound: the slots grow (doubling, from 256) up to ``max_length`` and writing more is a ``ValueError``;
        memory follows what is written, not the bound. ``None``: no bound.
    window : int, optional
        W: only the last W slots are ever read, so only they (and ``rollback`` more) are kept, in a ring.
    rollback : int, default 0
        Slots a ring keeps beyond its window, so :meth:`ModelCache.crop` can go back that far without a mark (a
        speculative draft's length). The attention still sees only the window.
    layer : int, optional
        The layer's index, for messages.

    Shapes
    ------
    ``update(k_new, v_new)`` takes ``(B, Hkv, Lnew, Dh)`` and returns a :class:`CachedKV` with keys and
    values ``(B, Hkv, S, Dh)`` and slots ``(S,)``: S = ``length`` after the update, or for a window-W layer
    min(W, past) + Lnew (the kept past slots plus every new one, since the first new queries still need keys
    older than the last W). The returned arrays may be views of the storage: read them before the next update.

    Examples
    --------
    >>> ring = KeysValues(batch_size=1, num_kv_heads=1, head_dim=2, window=2)
    >>> ring.update(np.ones((1, 1, 3, 2)), np.ones((1, 1, 3, 2))).slots
    array([0, 1, 2])
    >>> ring.update(np.ones((1, 1, 1, 2)), np.ones((1, 1, 1, 2))).slots, ring.length
    (array([1, 2, 3]), 4)
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype=np.float32, *,
                 max_length: int | None = None, window: int | None = None, rollback: int = 0,
                 layer: int | None = None) -> None:
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.num_kv_heads = check_positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = check_positive_int(head_dim, "head_dim")
        self.dtype = _check_float_dtype(dtype)
        self.max_length = check_max_length(max_length)
        self.window = None if window is None else check_positive_int(window, "window")
        self.rollback = check_positive_int(rollback, "rollback", allow_zero=True)
        self.layer = layer
        self._length = 0
        self._first_capacity = _initial_slots(self.max_length, None if window is None else self.window + self.rollback)
        self._keys = self._empty(self._first_capacity)  # (B, Hkv, capacity, Dh)
        self._values = self._empty(self._first_capacity)  # (B, Hkv, capacity, Dh)

    def _empty(self, slots: int) -> np.ndarray:
        return np.zeros((self.batch_size, self.num_kv_heads, slots, self.head_dim), dtype=self.dtype)  # (B, Hkv, S, Dh)

    @property
    def length(self) -> int:
        """Slots written so far (pad slots included)."""
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value storage."""
        return self._keys.nbytes + self._values.nbytes

    @property
    def capacity(self) -> int:
        """Slots the storage holds now (a ring's: its window plus ``rollback``)."""
        return self._keys.shape[2]

    def _check_new(self, array: Any, name: str) -> np.ndarray:
        array = np.asarray(array)
        expected = (self.batch_size, self.num_kv_heads, "Lnew", self.head_dim)
        if (array.ndim != 4 or array.shape[0] != self.batch_size or array.shape[1] != self.num_kv_heads
                or array.shape[3] != self.head_dim):
            raise ValueError(f"{name} must have shape {expected}, got {array.shape}")
        if array.dtype.kind != "f":
            raise TypeError(f"{name} must be a floating array, got dtype {array.dtype}")
        return array

    def update(self, k_new: np.ndarray, v_new: np.ndarray) -> CachedKV:
        """Append ``Lnew`` slots and return the keys/values the layer's attention must read.

        Parameters
        ----------
        k_new, v_new : (B, Hkv, Lnew, Dh)

        Returns
        -------
        CachedKV
            ``keys``, ``values`` (B, Hkv, S, Dh) in slot order and ``slots`` (S,).
        """
        k_new, v_new = self._check_new(k_new, "k_new"), self._check_new(v_new, "v_new")
        if k_new.shape != v_new.shape:
            raise ValueError(f"k_new and v_new must have the same shape, got {k_new.shape} and {v_new.shape}")
        past, new = self._length, k_new.shape[2]
        end = past + new
        _check_room(self.max_length, self.layer, past, new)
        if self.window is not None and end > self.capacity:
            return self._update_ring(k_new, v_new)
        # a window layer whose ring has not come round yet keeps slot s at index s, as a full layer does
        if end > self.capacity:
            self._grow(_grown_slots(end, self.capacity, self.max_length))
        self._keys[:, :, past:end] = k_new
        self._values[:, :, past:end] = v_new
        self._length = end
        return CachedKV(self._keys[:, :, :end], self._values[:, :, :end], np.arange(end, dtype=np.int64))

    def _grow(self, capacity: int) -> None:
        keys, values = self._empty(capacity), self._empty(capacity)  # (B, Hkv, capacity, Dh)
        keys[:, :, :self._length] = self._keys[:, :, :self._length]
        values[:, :, :self._length] = self._values[:, :, :self._length]
        self._keys, self._values = keys, values

    def _kept_slots(self) -> np.ndarray:
        """Slots still held, oldest first (a ring's last ``capacity``)."""
        return np.arange(max(0, self._length - self.capacity), self._length, dtype=np.int64)

    def _update_ring(self, k_new: np.ndarray, v_new: np.ndarray) -> CachedKV:
        kept, capacity, new = self._kept_slots(), self.capacity, k_new.shape[2]  # kept: (Skept,)
        slots = np.concatenate([kept, np.arange(self._length, self._length + new)])  # (S,)
        ring_index = kept % capacity
        keys = np.concatenate([self._keys[:, :, ring_index], k_new.astype(self.dtype, copy=False)],
                              axis=2)  # (B, Hkv, S, Dh)
        values = np.concatenate([self._values[:, :, ring_index], v_new.astype(self.dtype, copy=False)],
                                axis=2)  # (B, Hkv, S, Dh)
        # Only the last `capacity` slots survive; older ones would be overwritten in the same write anyway.
        last = slots[-capacity:]
        self._keys[:, :, last % capacity] = keys[:, :, -capacity:]
        self._values[:, :, last % capacity] = values[:, :, -capacity:]
        self._length += new
        return CachedKV(keys, values, slots)

    # -- going back -------------------------------------------------------------------------------------
    def _ring_start(self) -> int:
        """The oldest slot still held."""
        return max(0, self._length - self.capacity)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """What a mark keeps: a ring's kept keys, values (B, Hkv, S, Dh) and slots (S,), copied; None for growing
        slots, which stay until cropped."""
        if self.window is None:
            return None
        slots = self._kept_slots()
        index = slots % self.capacity
        return self._keys[:, :, index], self._values[:, :, index], slots

    def blocking(self, length: int) -> str | None:
        """Why this entry cannot go back to ``length`` without a mark, or None."""
        if self.window is None or not length or max(0, length - self.window) >= self._ring_start():
            return None
        return (f"{_where(self.layer)} keeps a ring of {self.capacity} slots and has overwritten slots before "
                f"{self._ring_start()}")

    def crop(self, length: int, snapshot: Any = None) -> None:
        """Forget every slot from ``length`` on; a ring past its kept slots is restored from ``snapshot`` (a
        :meth:`snapshot` taken at ``length``)."""
        if self.blocking(length) is not None:
            keys, values, slots = snapshot
            self._keys[:, :, slots % self.capacity] = keys
            self._values[:, :, slots % self.capacity] = values
        self._length = length

    def reorder(self, index: np.ndarray) -> None:
        """Make row ``r`` a copy of row ``index[r]`` (rows may repeat; the batch size follows)."""
        self._keys, self._values = self._keys[index], self._values[index]  # (B', Hkv, S, Dh)
        self.batch_size = int(index.size)

    # -- files --------------------------------------------------------------------------------------------
    def arrays(self, length: int) -> dict[str, np.ndarray]:
        """``keys`` and ``values`` (B, Hkv, S, Dh), copies: all ``length`` slots, or a ring's kept ones."""
        if self.window is None:
            return {"keys": self._keys[:, :, :length].copy(), "values": self._values[:, :, :length].copy()}
        keys, values, _ = self.snapshot()  # fancy indexing copies
        return {"keys": keys, "values": values}

    def check_arrays(self, arrays: Any, prefix: str, length: int) -> list[str]:
        """Check ``{prefix}keys`` and ``{prefix}values`` of ``arrays`` for ``length`` positions; their names."""
        capacity = length if self.window is None else min(length, self._first_capacity)
        names = []
        for part in ("keys", "values"):
            name = prefix + part
            array = _checked_array(arrays, name, self.dtype)
            held = array.shape[2] if array.ndim == 4 else -1
            if (array.shape[:2] + array.shape[3:] != (self.batch_size, self.num_kv_heads, self.head_dim)
                    or not capacity <= held <= length):
                raise ValueError(f"{name} must have shape ({self.batch_size}, {self.num_kv_heads}, S, "
                                 f"{self.head_dim}) with S in [{capacity}, {length}] (the slots "
                                 f"{_where(self.layer)} keeps of {length}), got {array.shape}")
            names.append(name)
        return names

    def load_arrays(self, arrays: Any, prefix: str, length: int) -> None:
        """Fill this empty entry from checked arrays (:meth:`check_arrays`)."""
        keys, values = arrays[prefix + "keys"], arrays[prefix + "values"]
        if self.window is None:
            self._keys = self._empty(max(length, self.capacity))  # (B, Hkv, S, Dh)
            self._values = self._empty(self.capacity)  # (B, Hkv, S, Dh)
            self._keys[:, :, :length], self._values[:, :, :length] = keys, values
        else:
            kept = min(length, self.capacity)
            slots = np.arange(length - kept, length) % self.capacity  # (S,): where the kept slots live
            self._keys[:, :, slots] = keys[:, :, keys.shape[2] - kept:]
            self._values[:, :, slots] = values[:, :, values.shape[2] - kept:]
        self._length = length

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (f"KeysValues(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, length={self.length}{window})")


class Latents:
    """One latent attention layer's cache: each token's compressed latent and shared rotary key (C + R numbers,
    then a sparse attention indexer's key), from which
    :class:`~attnkit.attention.latent.MultiHeadLatentAttention` attends without forming per-head keys or values.
    Slots grow as :class:`KeysValues`' do (a windowed layer masks the slots it may not see rather than dropping
    them).

    Parameters
    ----------
    batch_size : int
    latent_dim : int
        C + R (``LatentAttentionConfig.cache_dim``).
    dtype : numpy dtype, default float32
    max_length : int, optional
        Bound on the slots (memory follows what is written, doubling from 256 slots up to it).
    layer : int, optional
        The layer's index, for messages.

    Shapes
    ------
    ``update(latent_new)`` takes ``(B, Lnew, C + R)`` and returns a :class:`CachedLatent` with ``latent``
    ``(B, S, C + R)`` (a view of the storage: read it before the next update) and ``slots (S,)``.
    """

    def __init__(self, batch_size: int, latent_dim: int, dtype=np.float32, *, max_length: int | None = None,
                 layer: int | None = None) -> None:
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.latent_dim = check_positive_int(latent_dim, "latent_dim")
        self.dtype = _check_float_dtype(dtype)
        self.max_length = check_max_length(max_length)
        self.layer = layer
        self._length = 0
        self._latent = self._empty(_initial_slots(self.max_length))

    def _empty(self, slots: int) -> np.ndarray:
        return np.zeros((self.batch_size, slots, self.latent_dim), dtype=self.dtype)  # (B, S, C+R)

    @property
    def length(self) -> int:
        """Slots written so far (pad slots included)."""
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes of the latent storage."""
        return self._latent.nbytes

    def update(self, latent_new: np.ndarray) -> CachedLatent:
        """Append ``Lnew`` slots and return every slot held.

        Parameters
        ----------
        latent_new : (B, Lnew, C + R)
        """
        latent_new = np.asarray(latent_new)
        if latent_new.ndim != 3 or latent_new.shape[0] != self.batch_size or latent_new.shape[2] != self.latent_dim:
            raise ValueError(f"latent_new must have shape ({self.batch_size}, Lnew, {self.latent_dim}), got "
                             f"{latent_new.shape}")
        if latent_new.dtype.kind != "f":
            raise TypeError(f"latent_new must be a floating array, got dtype {latent_new.dtype}")
        past = self._length
        end = past + latent_new.shape[1]
        _check_room(self.max_length, self.layer, past, latent_new.shape[1])
        if end > self._latent.shape[1]:
            bigger = self._empty(_grown_slots(end, self._latent.shape[1], self.max_length))  # (B, S', C+R)
            bigger[:, :past] = self._latent[:, :past]
            self._latent = bigger
        self._latent[:, past:end] = latent_new
        self._length = end
        return CachedLatent(self._latent[:, :end], np.arange(end, dtype=np.int64))

    def snapshot(self) -> None:
        """Nothing: the slots stay until cropped."""
        return None

    def blocking(self, length: int) -> None:
        """Never blocks: latents go back anywhere."""
        return None

    def crop(self, length: int, snapshot: Any = None) -> None:
        """Forget every slot from ``length`` on."""
        self._length = length

    def reorder(self, index: np.ndarray) -> None:
        """Make row ``r`` a copy of row ``index[r]`` (rows may repeat; the batch size follows)."""
        self._latent = self._latent[index]  # (B', S, C+R)
        self.batch_size = int(index.size)

    def arrays(self, length: int) -> dict[str, np.ndarray]:
        """``latent`` (B, length, C + R), a copy."""
        return {"latent": self._latent[:, :length].copy()}

    def check_arrays(self, arrays: Any, prefix: str, length: int) -> list[str]:
        """Check ``{prefix}latent`` of ``arrays`` for ``length`` positions; its name."""
        name = prefix + "latent"
        array = _checked_array(arrays, name, self.dtype)
        if array.shape != (self.batch_size, length, self.latent_dim):
            raise ValueError(f"{name} must have shape {(self.batch_size, length, self.latent_dim)}, got "
                             f"{array.shape}")
        return [name]

    def load_arrays(self, arrays: Any, prefix: str, length: int) -> None:
        """Fill this empty entry from checked arrays."""
        self._latent = self._empty(max(length, self._latent.shape[1]))  # (B, S, C+R)
        self._latent[:, :length] = arrays[prefix + "latent"]
        self._length = length

    def __repr__(self) -> str:
        return f"Latents(batch_size={self.batch_size}, latent_dim={self.latent_dim}, length={self.length})"


@dataclasses.dataclass
class PairedCache:
    """The entry of a layer with attention beside a state-space mixer (Falcon-H1): the attention's keys and
    values and the mixer's state, which mark, crop, reorder and save together.

    Parameters
    ----------
    keys_values : KeysValues
    state : a state layer's state (e.g. :class:`~attnkit.layers.mamba2.Mamba2Cache`)
    """

    keys_values: KeysValues
    state: Any

    def __post_init__(self) -> None:
        if not isinstance(self.keys_values, KeysValues):
            raise TypeError(f"keys_values must be a KeysValues, got {type(self.keys_values).__name__}")
        _check_state(self.state, "state")

    @property
    def length(self) -> int:
        """Positions both halves hold (the fewer, while a forward is between them)."""
        return min(self.keys_values.length, self.state.length)

    @property
    def nbytes(self) -> int:
        """Bytes of both halves."""
        return self.keys_values.nbytes + self.state.nbytes


def _check_state(state: Any, name: str) -> Any:
    if not all(hasattr(state, attr) for attr in _STATE_PROTOCOL):
        raise TypeError(f"{name} must have length, nbytes, reorder, copy and cleared (e.g. a GatedDeltaNetCache), "
                        f"got {type(state).__name__}")
    return state


def entry_kind(entry: Any) -> str:
    """What a layer's cache entry holds: ``"keys_values"``, ``"latent"``, ``"paired"``, ``"state"`` or ``"none"``
    (the kinds of :data:`attnkit.models.layer_spec.CACHE_KINDS`, a layer reading another's keys and values
    holding nothing of its own)."""
    if entry is None:
        return "none"
    if isinstance(entry, KeysValues):
        return "keys_values"
    if isinstance(entry, Latents):
        return "latent"
    if isinstance(entry, PairedCache):
        return "paired"
    return "state"


def _checked_array(arrays: Any, name: str, dtype: np.dtype) -> np.ndarray:
    if name not in arrays:
        raise ValueError(f"arrays has no {name!r}")
    array = arrays[name]
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise ValueError(f"{name} must be a {np.dtype(dtype)} array, got "
                         f"{getattr(array, 'dtype', type(array).__name__)}")
    return array

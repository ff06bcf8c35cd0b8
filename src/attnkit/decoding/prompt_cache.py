"""A prompt's cache on disk, as llama.cpp's ``--prompt-cache``: a run saves its cache once the prompt is read, and a
later run whose prompt starts with the same ids loads it and reads only the rest.

The file is a NumPy ``.npz`` (a zip of ``.npy`` arrays, never pickles): the cache's :meth:`arrays
<attnkit.decoding.cache.ModelCache.arrays>` and a JSON header naming the format, its version, the cache's dtype and
the model's :func:`fingerprint`. Loading refuses, with a :class:`PromptCacheError` saying why in one line, a file
that is not one of these, is cut short or damaged, was written for another model (another config, other
weights, another dtype), or does not fit this model's cache; nothing from a refused file is used. Every array's
header is checked against the cache's layout before its data is read, so a file claiming a huge array costs
nothing. Files are written atomically (a temporary file beside it, then renamed over it).
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..io import atomic_write
from .cache import crop_to_prefix

__all__ = ["PromptCacheError", "fingerprint", "prefill", "save_prompt_cache", "load_prompt_cache", "FORMAT", "VERSION"]

FORMAT = "attnkit prompt cache"
VERSION = 1
_HEADER = "header"  # the member holding the JSON header
_MAX_HEADER_BYTES = 1 << 16
_SAMPLES = 4096  # values of each tensor read into the fingerprint
_MAX_ROWS = 1 << 16  # rows a file may claim (its arrays must then hold them: this only bounds the empty cache)


class PromptCacheError(ValueError):
    """A prompt-cache file that cannot be used: its message says why, in one line."""


def fingerprint(model: Any) -> str:
    """A hex digest identifying a model's computation: its class, config and dtype, and every tensor's name,
    shape, dtype and 4,096 evenly spaced values (packed tensors: of their stored blocks).

    Two loads of one checkpoint give the same fingerprint; another checkpoint of the same architecture (another
    fine-tune, another quantization, ``keep_quantized`` or not) gives another, since its tensors differ at
    nearly every element. Reading a sample rather than every byte keeps it to milliseconds on any model size.

    Parameters
    ----------
    model : CausalLM
        Anything with ``config``, ``dtype`` and ``named_parameters()``.

    Returns
    -------
    str
        32 hex digits (BLAKE2b, 16 bytes).
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{type(model).__qualname__}|{model.config!r}|{np.dtype(model.dtype)}".encode())
    for name, tensor in model.named_parameters():
        raw = getattr(tensor, "blocks", tensor)  # a PackedWeight: the bytes as stored
        raw = np.asarray(raw)
        digest.update(f"|{name}|{getattr(tensor, 'shape', raw.shape)}|{raw.dtype}|{getattr(tensor, 'kind', '')}"
                      .encode())
        if raw.size:
            flat = np.linspace(0, raw.size - 1, min(raw.size, _SAMPLES)).astype(np.int64)  # (S,)
            digest.update(np.ascontiguousarray(raw[np.unravel_index(flat, raw.shape)]).tobytes())  # no copy of raw
    return digest.hexdigest()


def prefill(model: Any, cache: Any, ids: Any) -> int:
    """Make ``cache`` hold every id of ``ids`` but the last: cropped to the prefix it shares with them
    (:func:`~attnkit.decoding.cache.crop_to_prefix`), then fed the rest in one forward. Returns the ids read.

    The last id is left for ``generate`` (given the cache as ``past_key_values``), whose first step reads it and
    gives the first new token; so the cache holds exactly the prompt's reusable part when it is saved. A cache
    that needs marks (a recurrent state) is marked at the end, so a generation from it can go back there.

    Parameters
    ----------
    model : CausalLM
    cache : ModelCache
        The model's, B rows.
    ids : int array (B, L)
        No padding.
    """
    ids = np.asarray(ids, np.int64)
    crop_to_prefix(cache, ids)
    start = cache.length
    if ids.shape[1] - 1 > start:
        model.forward(ids[:, start:-1], cache=cache, logits_to_keep=1)  # (B, 1, V), unused: the cache is the point
        if getattr(cache, "needs_marks", False):
            cache.mark()
    return max(0, ids.shape[1] - 1 - start)


def save_prompt_cache(path: str | os.PathLike, model: Any, cache: Any) -> Path:
    """Write ``cache`` (of ``model``, one row) to ``path`` atomically; returns the path.

    Parameters
    ----------
    path : str or path-like
    model : CausalLM
        The model whose forward filled ``cache`` (its :func:`fingerprint` is recorded).
    cache : ModelCache
        Holding the ids it was fed (``token_ids``) and their keys, values and states.
    """
    path = Path(path)
    arrays = cache.arrays()  # a ValueError for a cache between layers, before any file is touched
    if _HEADER in arrays:
        raise ValueError(f"a cache array may not be named {_HEADER!r}")
    header = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint(model), "dtype": str(cache.dtype),
              "batch_size": int(cache.batch_size), "length": int(cache.token_ids.shape[1])}
    arrays[_HEADER] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    return atomic_write(path, lambda f: np.savez(f, **arrays))


def load_prompt_cache(path: str | os.PathLike, model: Any, *, max_length: int | None = None,
                      rollback: int = 0) -> Any:
    """The cache saved in ``path`` for ``model``, as a new cache of it (``model.new_cache(B, max_length,
    rollback=rollback)``, B the saved rows) holding the saved ids, keys, values and states.

    Raises
    ------
    PromptCacheError
        The file is not a prompt cache of this version, is cut short or damaged, was written for another model
        or dtype, or does not fit the cache (more positions than ``max_length``, another layout): one line why.
    FileNotFoundError
        No file at ``path``.
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = {info.filename: info for info in archive.infolist()}
            header = _read_header(archive, members)
            _check_header(header, model)
            cache = model.new_cache(header["batch_size"], max_length=max_length, rollback=rollback)
            shapes = {name[:-4]: _array_header(archive, info) for name, info in members.items()
                      if name != f"{_HEADER}.npy"}
            stand_ins = {name: np.broadcast_to(np.zeros((), dtype), shape) for name, (shape, dtype) in shapes.items()}
            try:
                length = cache.check_arrays(stand_ins)
            except ValueError as exc:
                raise PromptCacheError(f"does not fit this model's cache: {exc}") from None
            if length != header["length"]:
                raise PromptCacheError(f"its header says {header['length']} positions but its arrays hold {length}")
            arrays = {name: _read_array(archive, members[f"{name}.npy"]) for name in shapes}
    except zipfile.BadZipFile as exc:
        raise PromptCacheError(f"not a prompt cache file (not a zip archive: {exc})") from None
    except (OSError, EOFError, zipfile.LargeZipFile) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise PromptCacheError(f"cannot be read: {exc}") from None
    cache.load_arrays(arrays)
    return cache


def _read_header(archive: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo]) -> dict[str, Any]:
    info = members.get(f"{_HEADER}.npy")
    if info is None:
        raise PromptCacheError("not a prompt cache file (no header)")
    if info.file_size > _MAX_HEADER_BYTES:
        raise PromptCacheError(f"not a prompt cache file (a header of {info.file_size} bytes)")
    raw = _read_array(archive, info)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise PromptCacheError("not a prompt cache file (a header that is not text)")
    try:
        header = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PromptCacheError("not a prompt cache file (a header that is not JSON)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise PromptCacheError("not a prompt cache file (another format)")
    if header.get("version") != VERSION:
        raise PromptCacheError(f"written by another version of attnkit (format version {header.get('version')!r}, "
                               f"this one reads {VERSION})")
    for key, kind in (("fingerprint", str), ("dtype", str), ("batch_size", int), ("length", int)):
        if not isinstance(header.get(key), kind):
            raise PromptCacheError(f"a damaged header (its {key} is {header.get(key)!r})")
    return header


def _check_header(header: dict[str, Any], model: Any) -> None:
    if header["dtype"] != str(np.dtype(model.dtype)):
        raise PromptCacheError(f"written for {header['dtype']} and this model runs in {np.dtype(model.dtype)}")
    if header["fingerprint"] != fingerprint(model):
        raise PromptCacheError("written for another model (its config or weights differ from this one's)")
    if not 1 <= header["batch_size"] <= _MAX_ROWS or header["length"] < 0:
        raise PromptCacheError(f"a damaged header ({header['batch_size']} rows, {header['length']} positions)")


def _array_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype]:
    """An ``.npy`` member's shape and dtype, from its header alone; its size must be what they say."""
    if not info.filename.endswith(".npy"):
        raise PromptCacheError(f"not a prompt cache file (a member {info.filename!r})")
    with archive.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except ValueError as exc:
            raise PromptCacheError(f"a damaged array {info.filename!r}: {exc}") from None
        start = f.tell()
    if dtype.hasobject or fortran:
        raise PromptCacheError(f"an array {info.filename!r} of objects or in Fortran order")
    if start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != info.file_size:
        raise PromptCacheError(f"the array {info.filename!r} is cut short or padded ({info.file_size} bytes for "
                               f"shape {shape} of {dtype})")
    return tuple(shape), dtype


def _read_array(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    with archive.open(info) as f:
        try:
            return np.lib.format.read_array(f, allow_pickle=False)
        except ValueError as exc:
            raise PromptCacheError(f"a damaged array {info.filename!r}: {exc}") from None

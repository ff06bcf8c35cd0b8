"""A GGUF file's header read into Python values at a cost bounded by its bytes, and checked before use.

A GGUF file is the magic ``GGUF``, a version, the tensor and metadata counts, the metadata (key, value type,
value), the tensor table (name, dimensions, type, offset), then the tensor data from the next multiple of
``general.alignment``. :func:`read_header` walks it on the memory-mapped file with every length checked against
the bytes left before it is used, so a truncated or corrupt file fails at its first impossible length. What it
builds is a bounded multiple of what it reads, in time near-linear in it: a numeric array is one
``np.frombuffer`` copy (never a Python object per element), a string array one ``str`` per item, and an array
of arrays is refused, as llama.cpp refuses it.

Then the header is checked: every metadata key attnkit reads has one of the GGUF types :data:`METADATA_TYPES`
accepts for it, and every tensor's bytes are aligned to ``general.alignment``, lie in the file and overlap no
other tensor's. Each fault is a ``ValueError`` naming the file and the key or tensor.
"""
from __future__ import annotations

import fnmatch
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["METADATA_TYPES", "GGUFHeader", "HeaderCursor", "TensorEntry", "read_header", "check_metadata_types",
           "check_tensor_layout"]

_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type id -> its name and, for numbers and bools, the little-endian NumPy dtype of one item.
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_DTYPES = {kind: np.dtype(code) for kind, code in {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
                                                   6: "<f4", 7: "u1", 10: "<u8", 11: "<i8", 12: "<f8"}.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

_INTEGERS = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64")
_INTEGER = (frozenset(_INTEGERS), "an integer (any GGUF integer type)")
_NUMBER = (frozenset(_INTEGERS + ("float32", "float64")), "a number (a GGUF integer or float type)")
_BOOL = (frozenset({"bool"}), "a bool")
_TEXT = (frozenset({"string"}), "a string")

# Every metadata key attnkit reads, with the GGUF types it accepts and what they are called in an error.
# "{arch}" is general.architecture; "*" matches any text.
METADATA_TYPES: dict[str, tuple[frozenset[str], str]] = {
    "general.architecture": _TEXT,
    "general.alignment": (frozenset({"uint32"}), "a uint32"),
    "split.count": _INTEGER,
    **{f"{{arch}}.{key}": _INTEGER for key in (
        "vocab_size", "context_length", "embedding_length", "block_count",
        "attention.head_count", "attention.key_length", "attention.sliding_window", "rope.dimension_count",
        "rope.scaling.original_context_length", "shortconv.l_cache", "expert_count", "expert_used_count",
        "expert_feed_forward_length", "expert_shared_count", "leading_dense_block_count", "expert_group_count",
        "expert_group_used_count", "expert_gating_func", "nextn_predict_layers", "expert_shared_feed_forward_length",
        "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.inner_size", "ssm.time_step_rank")},
    "{arch}.expert_weights_norm": _BOOL,
    # a hybrid's (LFM2's, Granite 4's, Nemotron-H's) are one count per layer, 0 on a layer without the part
    **{f"{{arch}}.{key}": (_INTEGER[0] | {f"array[{t}]" for t in _INTEGERS},
                           "an integer or an array of integers (one per layer)")
       for key in ("attention.head_count_kv", "feed_forward_length")},
    **{f"{{arch}}.{key}": _NUMBER for key in (
        "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "attn_logit_softcapping",
        "final_logit_softcapping", "rope.freq_base", "rope.freq_base_swa", "rope.scaling.factor",
        "rope.scaling.attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
        "expert_weights_scale", "attention.scale", "embedding_scale", "residual_scale", "logit_scale")},
    "{arch}.rope.scaling.finetuned": _BOOL,
    "{arch}.rope.scaling.type": _TEXT,
    "{arch}.attention.sliding_window_pattern": (_INTEGER[0] | {"array[bool]"},
                                                "an integer (a period) or an array of bools (one per layer)"),
    "tokenizer.ggml.model": _TEXT,
    "tokenizer.ggml.pre": _TEXT,
    "tokenizer.ggml.tokens": (frozenset({"array[string]"}), "an array of strings"),
    "tokenizer.ggml.merges": (frozenset({"array[string]"}), "an array of strings"),
    "tokenizer.ggml.scores": (frozenset(f"array[{t}]" for t in _NUMBER[0]), "an array of numbers"),
    "tokenizer.ggml.token_type": (frozenset(f"array[{t}]" for t in _INTEGERS), "an array of integers"),
    "tokenizer.ggml.*_token_id": _INTEGER,
    "tokenizer.ggml.add_bos_token": _BOOL,
    "tokenizer.ggml.add_eos_token": _BOOL,
    "tokenizer.ggml.add_space_prefix": _BOOL,
    "tokenizer.chat_template": _TEXT,
    "tokenizer.chat_template.*": _TEXT,
}


@dataclass(frozen=True)
class TensorEntry:
    """One row of the tensor table: ``shape`` in GGUF order (fastest-varying dimension first), ``offset`` from
    the start of the tensor data, ``nbytes`` the size its type and shape imply."""

    name: str
    shape: tuple[int, ...]
    kind: Any  # gguf.GGMLQuantizationType
    offset: int
    nbytes: int
    at: int  # where the entry begins in the file


@dataclass(frozen=True)
class GGUFHeader:
    """A read header: ``metadata`` (key -> value: a Python scalar or str, a NumPy array for an array of numbers
    or bools, a list of str for an array of strings), ``types`` (key -> its GGUF type, e.g. ``"uint32"``,
    ``"array[string]"``), the tensor table, and where the tensor data begins."""

    size: int
    metadata: dict[str, Any]
    types: dict[str, str]
    tensors: list[TensorEntry]
    alignment: int
    data_start: int


class HeaderCursor:
    """A bounds-checked walk over the memory-mapped bytes ``data`` of the GGUF file ``path``'s header: every
    length is checked against the bytes left before it is used, so a truncated or corrupt file fails at the first
    impossible length instead of reading past the end (or looping over a count no file could hold). ``at`` is the
    next byte to read."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.path, self.size, self.at = data, path, len(data), 0

    def truncated(self, what: str) -> ValueError:
        return ValueError(f"{self.path} is truncated or corrupt ({self.size} bytes): {what} runs past the end of "
                          f"the file")

    def skip(self, n: int, what: str) -> int:
        """Step over ``n`` bytes; returns where they begin."""
        if n < 0 or self.at + n > self.size:
            raise self.truncated(what)
        self.at += n
        return self.at - n

    def take(self, n: int, what: str) -> bytes:
        begin = self.skip(n, what)
        return bytes(self.data[begin:self.at])

    def uint(self, n: int, what: str) -> int:
        begin = self.skip(n, what)
        return int.from_bytes(self.data[begin:self.at], "little")

    def prelude(self) -> None:
        """Step over the magic (the caller has checked it) and the version, refusing one attnkit does not read."""
        self.skip(4, "the magic")
        version = self.uint(4, "the version")
        if version not in _VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not read (attnkit reads versions 2 and 3, "
                             f"little-endian)")

    def skip_value(self, kind: int, what: str, depth: int = 0) -> None:
        """Step over one metadata value of GGUF type ``kind`` without building it (an array of fixed-size items
        in one step)."""
        if kind in _DTYPES:
            self.skip(_DTYPES[kind].itemsize, what)
        elif kind == _STRING:
            self.skip(self.uint(8, what), what)
        elif kind == _ARRAY and depth < 2:
            item, count = self.uint(4, what), self.uint(8, what)
            if item in _DTYPES:  # no walk over the items: their size is known
                self.skip(count * _DTYPES[item].itemsize, what)
                return
            if count > (self.size - self.at) // 8:  # each string or array item holds an 8-byte length
                raise self.truncated(what)
            for _ in range(count):
                self.skip_value(item, what, depth + 1)
        else:
            raise ValueError(f"{self.path} is corrupt: {what} has the unknown GGUF value type {kind}")

    def text(self, what: str) -> str:
        n = self.uint(8, what)
        begin = self.skip(n, what)
        try:
            return str(self.data[begin:self.at], "utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path} is corrupt: {what} is not UTF-8 text") from None

    def value(self, kind: int, what: str) -> tuple[Any, str]:
        """One metadata value and its GGUF type name."""
        if kind == _STRING:
            return self.text(what), "string"
        if kind in _DTYPES:
            dtype = _DTYPES[kind]
            begin = self.skip(dtype.itemsize, what)
            item = np.frombuffer(self.data, dtype, 1, begin)[0].item()
            return (bool(item) if kind == 7 else item), _TYPE_NAMES[kind]
        if kind == _ARRAY:
            return self.array(what)
        raise ValueError(f"{self.path} is corrupt: {what} has the unknown GGUF value type {kind}")

    def array(self, what: str) -> tuple[Any, str]:
        item, count = self.uint(4, what), self.uint(8, what)
        if item in _DTYPES:  # one copy of the bytes, whatever the count
            dtype = _DTYPES[item]
            begin = self.skip(count * dtype.itemsize, what)
            stored = np.frombuffer(self.data, dtype, count, begin)  # a view of the mapping, released below
            values = stored != 0 if item == 7 else stored.copy()
            del stored
            return values, f"array[{_TYPE_NAMES[item]}]"
        if item == _STRING:
            return self.texts(count, what), "array[string]"
        if item == _ARRAY:
            raise ValueError(f"{self.path}: {what} is an array of arrays, which GGUF readers (llama.cpp's) refuse")
        raise ValueError(f"{self.path} is corrupt: {what} is an array of the unknown GGUF value type {item}")

    def texts(self, count: int, what: str) -> list[str]:
        """``count`` strings, each decoded as it is read (no second copy of the list as bytes)."""
        if count > (self.size - self.at) // 8:  # each string holds an 8-byte length
            raise self.truncated(what)
        data, size, at = self.data, self.size, self.at
        unpack, items = _U64.unpack_from, []
        try:
            for _ in range(count):
                if at + 8 > size:
                    raise self.truncated(what)
                n = unpack(data, at)[0]
                at += 8
                if n > size - at:
                    raise self.truncated(what)
                items.append(str(data[at:at + n], "utf-8"))
                at += n
        except UnicodeDecodeError:
            raise ValueError(f"{self.path} is corrupt: item {len(items)} of {what} is not UTF-8 text") from None
        self.at = at
        return items


def read_header(path: Path, data: Any, gguf: Any) -> GGUFHeader:
    """Read the header of the GGUF file ``path`` from ``data`` (its bytes, memory-mapped).

    Raises
    ------
    ValueError
        Naming the file: an unsupported version (or byte order), a length running past the end of the file,
        an unknown value or tensor type id, a key or tensor name given twice, an array of arrays, text that is
        not UTF-8, a tensor of more than four dimensions or of rows that are not whole blocks of its type, a
        ``general.alignment`` that is not a power of two.
    """
    cursor = HeaderCursor(data, path)
    cursor.prelude()
    tensors, keys = cursor.uint(8, "the tensor count"), cursor.uint(8, "the metadata count")
    if keys > cursor.size // 12 or tensors > cursor.size // 24:  # the smallest entries take 12 and 24 bytes
        raise cursor.truncated(f"a header of {keys} metadata entries and {tensors} tensors")
    metadata, types = _read_metadata(cursor, keys)
    alignment = _alignment(path, metadata, types)
    table = [_read_tensor_entry(cursor, gguf) for _ in range(tensors)]
    names: set[str] = set()
    for entry in table:
        if entry.name in names:
            raise ValueError(f"{path} is corrupt: tensor {entry.name!r} appears twice in the tensor table")
        names.add(entry.name)
    start = -(-cursor.at // alignment) * alignment  # the data begins at the next multiple of the alignment
    return GGUFHeader(cursor.size, metadata, types, table, alignment, start)


def _alignment(path: Path, metadata: dict[str, Any], types: dict[str, str]) -> int:
    """``general.alignment``: a uint32 power of two (what GGUF readers read), 32 when absent."""
    if "general.alignment" not in types:
        return _DEFAULT_ALIGNMENT
    kind, value = types["general.alignment"], metadata["general.alignment"]
    if kind != "uint32":
        raise ValueError(f"{path}: metadata 'general.alignment' is {_article(kind)} {kind}, but GGUF readers "
                         f"read it as a uint32")
    if value == 0 or value & (value - 1):
        raise ValueError(f"{path} is corrupt: general.alignment = {value} is not a power of two")
    return value


def _read_metadata(cursor: HeaderCursor, count: int) -> tuple[dict[str, Any], dict[str, str]]:
    metadata: dict[str, Any] = {}
    types: dict[str, str] = {}
    for _ in range(count):
        key = cursor.text("a metadata key")
        what = f"metadata {key[:80]!r}"
        if key in metadata:
            raise ValueError(f"{cursor.path} is corrupt: {what} appears twice")
        metadata[key], types[key] = cursor.value(cursor.uint(4, what), what)
    return metadata, types


def _read_tensor_entry(cursor: HeaderCursor, gguf: Any) -> TensorEntry:
    at = cursor.at
    name = cursor.text("a tensor name")
    what = f"tensor {name[:80]!r}"
    dims = cursor.uint(4, what)
    if not 1 <= dims <= _MAX_DIMS:
        raise ValueError(f"{cursor.path} is corrupt: {what} has {dims} dimensions (GGUF allows 1 to 4)")
    shape = tuple(cursor.uint(8, what) for _ in range(dims))
    type_id = cursor.uint(4, what)
    offset = cursor.uint(8, what)
    try:
        kind = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise ValueError(f"{cursor.path}: {what} has tensor type id {type_id}, which no GGUF reader knows") from None
    if shape[0] % block:
        raise ValueError(f"{cursor.path} is corrupt: {what} has rows of {shape[0]} values, not whole {kind.name} "
                         f"blocks of {block}")
    return TensorEntry(name, shape, kind, offset, math.prod(shape) // block * type_size, at)


def check_metadata_types(path: Path, header: GGUFHeader) -> None:
    """Every key :data:`METADATA_TYPES` names that the file holds must have one of the types it accepts.

    Raises
    ------
    ValueError
        Naming the file, the key, its GGUF type and what attnkit reads it as.
    """
    arch = header.metadata.get("general.architecture")
    named = header.types.get("general.architecture") == "string"
    exact, patterns = {}, []
    for pattern, expected in METADATA_TYPES.items():
        if "{arch}" in pattern:
            if not named:  # refused below as general.architecture's own type
                continue
            pattern = pattern.replace("{arch}", arch)
        if "*" in pattern:
            patterns.append((pattern, expected))
        else:
            exact[pattern] = expected
    for key, kind in header.types.items():
        expected = exact.get(key) or next((e for p, e in patterns if fnmatch.fnmatchcase(key, p)), None)
        if expected is not None and kind not in expected[0]:
            raise ValueError(f"{path}: metadata {key!r} is {_article(kind)} {kind}, but attnkit reads it as "
                             f"{expected[1]}")


def _article(kind: str) -> str:
    return "an" if kind.startswith(("int", "array")) else "a"


def check_tensor_layout(path: Path, header: GGUFHeader) -> None:
    """Every tensor's bytes start at a multiple of ``general.alignment``, end inside the file, and overlap no
    other tensor's.

    Raises
    ------
    ValueError
        Naming the file and the tensor (both tensors of an overlap).
    """
    for entry in header.tensors:
        if entry.offset % header.alignment:
            raise ValueError(f"{path} is corrupt: tensor {entry.name!r} starts at data offset {entry.offset}, not a "
                             f"multiple of general.alignment ({header.alignment})")
        end = header.data_start + entry.offset + entry.nbytes
        if end > header.size:
            raise ValueError(f"{path} is truncated: tensor {entry.name!r} needs bytes up to {end}, the file has "
                             f"{header.size}")
    ordered = sorted((e for e in header.tensors if e.nbytes), key=lambda e: e.offset)
    for first, second in zip(ordered, ordered[1:]):
        if first.offset + first.nbytes > second.offset:
            raise ValueError(f"{path} is corrupt: tensors {first.name!r} (data bytes {first.offset} to "
                             f"{first.offset + first.nbytes}) and {second.name!r} (from {second.offset}) overlap")

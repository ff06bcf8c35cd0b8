"""GGUF files (llama.cpp's and ollama's format) loaded as an attnkit :class:`~attnkit.models.CausalLM`.

A GGUF file is one self-contained model: metadata (the architecture's numbers under llama.cpp's key names, the
tokenizer's vocabulary and the chat template) and the tensors, many of them quantized. It is read with the
header's own reader (:mod:`.gguf_header`, every length checked, at a cost bounded by the header's size) and the
``gguf`` package (the ``pretrained`` extra) for the tensor types and dequantization; the file is mapped into
memory, and nothing else is imported (no torch, no transformers).

Loading reuses the Hugging Face path. The metadata becomes the ``config.json`` dict Hugging Face would have
written (:func:`gguf_hf_config`), read by :func:`~attnkit.pretrained.decoder_config_from_hf`; each tensor the
config implies (:func:`~attnkit.pretrained.checkpoint.checkpoint_map`) is found under its GGUF name, with
``gguf``'s own table of names, the one llama.cpp's converter writes with. Every tensor's type, shape and byte
range is checked before the model is built; then each is dequantized alone (``gguf.quants.dequantize``, float32)
and copied into its parameter, so loading costs the model plus its largest tensor in float32.

What llama.cpp's converter changed is undone here, so the model computes what llama.cpp computes; each family's
module states it (``Family.gguf``, a :class:`~attnkit.pretrained.gguf_metadata.GGUFArchitecture`: the
architecture's name, its metadata reader and the changes to undo), and this module spells no family's name:

- ``llama``: the rows of q and k are permuted per head (GGML rotates adjacent pairs, Hugging Face the two
  halves of a head); the permutation is reversed. Llama 3's ``rope_freqs.weight`` (one divisor per rotary
  frequency) becomes a rotary scaling with exactly those divisors.
- ``gemma2`` / ``gemma3``: every RMSNorm weight is stored as ``1 + w``; ``1`` is subtracted.
- ``gpt2``: the ``Conv1D`` matrices are stored (out, in) like every GGML matrix; they are transposed back.
- ``phi3``: ``longrope``'s divisors are the tensors ``rope_factors_short`` / ``rope_factors_long``.
- ``lfm2``: the short convolution's weights (C, 1, K) are stored as (C, K).
- a mixture's experts, one tensor per expert in Hugging Face's checkpoints, are one (E, ...) tensor per matrix
  (``ffn_gate_exps``, ...); GLM-4.5's multi-token-prediction blocks after the model's are left unread.
- ``granitehybrid`` (Bamba and Granite 4 hybrid): Mamba-2's ``A_log`` stored as ``-exp(A_log)`` and its tensors
  reshaped; each fused ``input_linear`` stored as its gate and up tensors, read with the family's own maps
  (``GGUFArchitecture.tensors``).
- ``nemotron_h``: Mamba-2's tensors as for ``granitehybrid``; q and k permuted as Llama's.

Dimension letters: V vocabulary, D hidden size, Hq/Hkv heads, Dh head features, R rotated features.
"""
from __future__ import annotations

import math
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..kernels.packed import PACKED_FORMATS, PackedWeight
from ..models.config import DecoderConfig
from ._extra import import_extra
from .checkpoint import HEAD_NAMES, TensorMap, checkpoint_map
from .families import REGISTRY
from .gguf_header import GGUFHeader, HeaderCursor, check_metadata_types, check_tensor_layout, read_header
from .gguf_metadata import GGUFArchitecture, special_token_ids
from .hf_config import read_decoder_keys

__all__ = ["GGUF_ARCHITECTURES", "GGUF_TENSOR_TYPES", "GGUFFile", "read_gguf", "read_gguf_strings", "gguf_hf_config",
           "read_gguf_config", "is_gguf_path", "special_token_ids", "validate_gguf_tensors", "load_gguf_tensors_into",
           "pack_gguf_tensors", "gguf_architecture"]

# GGUF architecture (general.architecture) -> Hugging Face model_type, from the families' own entries
# (``Family.gguf``). Mistral's files say "llama": llama.cpp runs them as Llama (no sliding window), and so does
# attnkit.
GGUF_ARCHITECTURES = {f.gguf.name: f.model_type for f in REGISTRY.values() if f.gguf is not None}

# The tensor types read (each dequantized by gguf.quants to float32).
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K")

_MAGIC = b"GGUF"
_MAX_INT = 2**31 - 1  # no size of a real model comes near it (the config reader's bound)
# Tensor types whose data gguf's reader gives as typed values rather than bytes.
_ITEM_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its metadata and tensor headers (the tensor data stays mapped, unread).

    Attributes
    ----------
    path : Path
    architecture : str
        ``general.architecture``, one of :data:`GGUF_ARCHITECTURES`.
    metadata : dict
        Every key-value pair: a Python number, bool or str; a NumPy array for an array of numbers or bools; a
        list of str for an array of strings.
    tensors : dict
        Tensor name -> ``gguf.ReaderTensor`` (type, shape, the memory-mapped bytes).
    types : dict
        Metadata key -> its GGUF type (``"uint32"``, ``"string"``, ``"array[float32]"``, ...), each key attnkit
        reads checked against :data:`~attnkit.pretrained.gguf_header.METADATA_TYPES`.
    """

    path: Path
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, Any]
    types: dict[str, str] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        """The Hugging Face ``model_type`` of the architecture."""
        return GGUF_ARCHITECTURES[self.architecture]

    def fail(self, what: str) -> ValueError:
        """A ``ValueError`` naming the file."""
        return ValueError(f"{self.path}: {what}")


def gguf_architecture(file: GGUFFile) -> GGUFArchitecture:
    """The entry of ``file``'s family (its ``general.architecture``) that says how its metadata and tensors are
    read."""
    return REGISTRY[GGUF_ARCHITECTURES[file.architecture]].gguf


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file: a path ending in ``.gguf`` that is not a folder (loaders dispatch on
    it; whether the file really is GGUF is checked when it is read)."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def _gguf_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path, once it is known to be a regular file that starts with GGUF's magic."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file; a GGUF model is one file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {magic!r}, not {_MAGIC!r}")
    return path


def read_gguf_strings(path: str | os.PathLike, keys: Any) -> dict[str, str]:
    """The string metadata of a GGUF file under the keys ``keys(key)`` accepts, read by walking the header alone
    (no tensor, no vocabulary, no ``gguf`` package): what can be known of a file in milliseconds, before it is
    loaded, such as its chat template (``tokenizer.chat_template``).

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        Naming the file: not a regular file, not GGUF, a version other than 2 and 3, a header whose lengths run
        past the end of the file, or one of the strings asked for that is not UTF-8.
    """
    path = _gguf_path(path)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = HeaderCursor(data, path)
        header.prelude()
        header.uint(8, "the tensor count")
        found = {}
        for _ in range(header.uint(8, "the metadata count")):
            raw = header.take(header.uint(8, "a metadata key"), "a metadata key")
            key = raw.decode("utf-8", "replace")
            kind = header.uint(4, f"metadata {key[:80]!r}")
            if kind != 8 or not keys(key):
                header.skip_value(kind, f"metadata {key[:80]!r}")
                continue
            value = header.take(header.uint(8, f"metadata {key[:80]!r}"), f"metadata {key[:80]!r}")
            try:
                found[key] = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}: metadata {key[:80]!r} is not UTF-8 text (byte {exc.start + 1})") \
                    from None
    return found


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header (metadata and tensor table) without reading any tensor data.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        Naming the file: not a regular file, not GGUF (no ``GGUF`` magic), a version other than 2 and 3, a
        header whose lengths run past the end of the file or tensor data that does (truncated), an unknown value
        or tensor type id, a metadata key attnkit reads holding another GGUF type than it reads
        (:data:`~attnkit.pretrained.gguf_header.METADATA_TYPES`), tensor data that is misaligned or overlaps
        another tensor's, a file split in parts, or an architecture attnkit does not load. The header is read
        by :func:`~attnkit.pretrained.gguf_header.read_header`, every length checked before it is used, at a
        cost bounded by its size.
    ImportError
        ``gguf`` is not installed (naming ``pip install 'attnkit[pretrained]'``).

    Examples
    --------
    A file written with ``gguf``'s own writer (metadata and one tensor):

    >>> import tempfile, gguf
    >>> path = Path(tempfile.mkdtemp()) / "tiny.gguf"
    >>> writer = gguf.GGUFWriter(str(path), "llama")
    >>> writer.add_block_count(1)
    >>> writer.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))  # (V, D)
    >>> for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
    ...     write()
    >>> writer.close()
    >>> file = read_gguf(path)
    >>> file.architecture, file.metadata["llama.block_count"], file.tensors["token_embd.weight"].tensor_type.name
    ('llama', 1, 'F32')
    >>> _ = path.write_bytes(path.read_bytes()[:-100])  # cut into the tensor data
    >>> read_gguf(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: ...tiny.gguf is truncated: tensor 'token_embd.weight' needs bytes up to ..., the file has ...
    """
    path = _gguf_path(path)
    gguf = import_extra("gguf", "read GGUF files")
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = read_header(path, data, gguf)
    check_metadata_types(path, header)
    metadata = header.metadata
    parts = metadata.get("split.count", 1)
    if parts != 1:
        raise ValueError(f"{path} is part of a GGUF split in {parts} files; merge them into one first "
                         f"(llama.cpp's llama-gguf-split --merge)")
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not one attnkit loads; it loads "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    check_tensor_layout(path, header)
    return GGUFFile(path, arch, metadata, _mapped_tensors(path, header, gguf), header.types)


def _mapped_tensors(path: Path, header: GGUFHeader, gguf: Any) -> dict[str, Any]:
    """Tensor name -> ``gguf.ReaderTensor`` whose ``data`` is a view of the memory-mapped file, typed as
    ``gguf``'s own reader types it (float arrays for F16/F32/F64, integers for I8..I64, bytes in rows of
    blocks for the rest)."""
    mapped = np.memmap(path, mode="r")
    tensors = {}
    for entry in header.tensors:
        begin = header.data_start + entry.offset
        dims = tuple(reversed(entry.shape))  # NumPy order
        dtype = _ITEM_TYPES.get(entry.kind.name)
        if dtype is None:
            dtype, dims = np.uint8, gguf.quants.quant_shape_to_byte_shape(dims, entry.kind)
        data = mapped[begin:begin + entry.nbytes].view(dtype).reshape(dims)
        tensors[entry.name] = gguf.ReaderTensor(
            name=entry.name, tensor_type=entry.kind, shape=np.array(entry.shape, np.uint64),
            n_elements=math.prod(entry.shape), n_bytes=entry.nbytes, data_offset=begin, data=data,
            field=gguf.ReaderField(entry.at, entry.name))
    return tensors


def gguf_hf_config(file: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict a GGUF file's metadata describes.

    The family's :class:`~attnkit.pretrained.gguf_metadata.GGUFArchitecture` reads it. Biases are read from the
    tensors (llama.cpp loads them when present): ``blk.0.attn_q.bias`` sets ``attention_bias``,
    ``blk.0.ffn_up.bias`` Llama's ``mlp_bias``.

    Raises
    ------
    ValueError
        A required key missing or of the wrong type, or a rotary scaling attnkit does not read (naming the file
        and the key).
    """
    return gguf_architecture(file).hf_config(file)


def read_gguf_config(file: GGUFFile) -> DecoderConfig:
    """The :class:`~attnkit.models.DecoderConfig` of a parsed GGUF file (see :func:`gguf_hf_config`), read by
    :func:`~attnkit.pretrained.hf_config.read_decoder_keys` (the loader checks the rotary tables once the tensor
    table has confirmed the sizes)."""
    config = gguf_hf_config(file)
    try:
        return read_decoder_keys(config)
    except ValueError as exc:
        raise file.fail(f"its metadata describes a model attnkit does not load: "
                        f"{_in_gguf_terms(str(exc), file.architecture)}") from None


# The Hugging Face (and DecoderConfig) names of what the metadata states -> the GGUF key (after "{arch}."), so a
# message of the config reader names the file's own key.
_GGUF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "embedding_length", "n_embd": "embedding_length",
    "intermediate_size": "feed_forward_length", "n_inner": "feed_forward_length",
    "num_hidden_layers": "block_count", "n_layer": "block_count", "num_layers": "block_count",
    "num_attention_heads": "attention.head_count", "n_head": "attention.head_count",
    "num_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv", "num_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "max_position_embeddings": "context_length", "n_positions": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "layer_norm_epsilon": "attention.layer_norm_epsilon",
    "rope_theta": "rope.freq_base", "sliding_window": "attention.sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
}
_HF_NAME = re.compile(r"(?<![\w.])(" + "|".join(sorted(_GGUF_KEYS, key=len, reverse=True)) + r")(?![\w.])")


def _in_gguf_terms(message: str, arch: str) -> str:
    """A config reader's message with the Hugging Face names of metadata replaced by the file's GGUF keys."""
    message = re.sub(r"^\w+ config: ", "", message)
    return _HF_NAME.sub(lambda m: f"{arch}.{_GGUF_KEYS[m.group(1)]}", message)


@dataclass(frozen=True)
class _Entry:
    """One GGUF tensor and where it goes: its map (Hugging Face layout) and the change llama.cpp made; for a
    stack of experts (E, ...) in one tensor, every expert's map, in order (``mapping`` the first)."""

    mapping: TensorMap
    fix: str  # "", "permute_q", "permute_k", "norm_offset", "transpose", "squeeze"
    stacked: tuple[TensorMap, ...] = ()


def _gguf_names(file: GGUFFile, config: DecoderConfig) -> dict[str, _Entry]:
    """GGUF tensor name -> its entry, for every tensor ``config`` needs (names from ``gguf``'s own table; a
    family whose converter writes a fused tensor as its parts maps them with its ``GGUFArchitecture.tensors``)."""
    gguf = import_extra("gguf", "read GGUF files")
    arch = gguf_architecture(file)
    maps, prefix = checkpoint_map(config)
    if arch.tensors is not None:
        maps = arch.tensors(config, maps)
    # gguf's own names of its architectures (not always the upper-cased name: glm4moe is GLM4_MOE,
    # granitehybrid GRANITE_HYBRID)
    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[file.architecture]
    table = gguf.get_tensor_name_map(model_arch, config.num_layers)
    entries: dict[str, _Entry] = {}
    for m in maps:
        if m.source in HEAD_NAMES:
            name = "output.weight"
        else:
            source = prefix + m.source
            for old, new in arch.renamed:
                if source.endswith(old):
                    source = source[:-len(old)] + new
            if m.stack_size:  # one expert's matrix: the converter stacks them under the name without the index
                parts = source.split(".")
                del parts[len(parts) - 1 - parts[::-1].index(str(m.stack_index))]
                source = ".".join(parts)
            # a name gguf maps whole has no .weight / .bias of its own (Mamba's and Gated DeltaNet's A_log)
            name = table.get_name(source)
            if name is None:
                stem, suffix = source.rsplit(".", 1)
                base = table.get_name(stem)
                if base is None:
                    raise RuntimeError(f"gguf has no {file.architecture} tensor name for {prefix + m.source}")
                name = f"{base}.{suffix}"
        if m.stack_size:
            first = entries.get(name)
            entries[name] = _Entry(m, "", (m,)) if first is None else replace(first, stacked=first.stacked + (m,))
        else:
            entries[name] = _Entry(m, arch.fix(name))
    return entries


def _stored_shape(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in NumPy order (GGUF lists the fastest-varying dimension first)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def validate_gguf_tensors(file: GGUFFile, config: DecoderConfig) -> dict[str, _Entry]:
    """Match the file's tensor table against what ``config`` needs, before any tensor is read.

    Returns
    -------
    dict
        GGUF tensor name -> its entry (the Hugging Face map and llama.cpp's change to undo).

    Raises
    ------
    ValueError
        Naming the file and the tensor: missing, unexpected, of the wrong shape, or of a type attnkit does not
        dequantize.
    """
    if config.num_layers > len(file.tensors):
        raise file.fail(f"block_count = {config.num_layers} cannot match a file of {len(file.tensors)} tensors")
    entries = _gguf_names(file, config)
    missing = [name for name in entries if name not in file.tensors]
    if missing:
        raise file.fail(f"the file has no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more missing)"
                                                                    if len(missing) > 1 else "")
                        + f" needed by this {file.architecture} model")
    arch = gguf_architecture(file)
    consumed = set(arch.rope_tensors)
    if arch.nextn_blocks:
        extra = file.metadata.get(f"{file.architecture}.nextn_predict_layers", 0)
        blocks = tuple(f"blk.{i}." for i in range(config.num_layers, config.num_layers + extra))
        consumed |= {name for name in file.tensors if name.startswith(blocks)}
    unexpected = [name for name in file.tensors if name not in entries and name not in consumed]
    if unexpected:
        raise file.fail(f"unexpected tensor {unexpected[0]!r}" + (f" (and {len(unexpected) - 1} more)"
                                                                  if len(unexpected) > 1 else "")
                        + f" for this {file.architecture} model")
    for name, entry in entries.items():
        tensor = file.tensors[name]
        kind = tensor.tensor_type.name
        if kind not in GGUF_TENSOR_TYPES:
            raise file.fail(f"tensor {name!r} is of type {kind}, which attnkit does not dequantize; it reads "
                            f"{', '.join(GGUF_TENSOR_TYPES)}")
        expected = entry.mapping.shape
        if entry.stacked:
            expected = (len(entry.stacked), *expected)  # (E, ...)
        elif entry.fix == "transpose":
            expected = expected[::-1]
        elif entry.fix == "squeeze":
            expected = expected[:1] + expected[2:]  # (C, 1, K) stored as (C, K)
        if entry.fix == "restore" and math.prod(_stored_shape(tensor)) == math.prod(expected):
            continue  # the family's restore gives the shape back (a squeezed convolution, a reshaped vector)
        if _stored_shape(tensor) != expected:
            raise file.fail(f"tensor {name!r} has shape {_stored_shape(tensor)}, but the metadata implies {expected}")
    return entries


def _reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q or k rows: within each head, rows in (Dh/2, 2) order back to
    Hugging Face's (2, Dh/2)."""
    rows = w.shape[0]
    grouped = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])  # (H, Dh/2, 2, ...)
    return grouped.swapaxes(1, 2).reshape(w.shape)  # (H*Dh, ...)


_CHUNK_VALUES = 1 << 16  # values dequantized at once (256 kB of float32): bounds gguf's own temporaries


def _dequantize(gguf: Any, tensor: Any, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor as float32 of ``shape``, dequantized a few rows at a time into one array (``gguf``'s dequantizer
    holds its whole result twice; chunks keep that to a chunk). F32 is the mapped file itself, no copy."""
    if tensor.tensor_type.name == "F32":
        return tensor.data.reshape(shape)
    out = np.empty(shape, np.float32)
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])  # (R, stored units per row)
    flat = out.reshape(-1, shape[-1])  # (R, values per row)
    step = max(1, _CHUNK_VALUES // shape[-1])
    for start in range(0, rows.shape[0], step):
        flat[start:start + step] = gguf.quants.dequantize(rows[start:start + step], tensor.tensor_type)
    return out


def _packed_tensor(fh: Any, tensor: Any) -> PackedWeight | None:
    """A quantized matrix's blocks as a packed weight of its stored rows, read from the open file into an array
    of their own (a model must not depend on the file staying as it is, and a plain read leaves no mapped page
    resident); None for a float type or a vector, which stay dense."""
    kind = tensor.tensor_type.name
    if kind not in PACKED_FORMATS or len(tensor.shape) != 2:
        return None
    rows = np.empty((int(tensor.shape[1]), int(tensor.n_bytes) // int(tensor.shape[1])), np.uint8)  # (R, bytes)
    fh.seek(int(tensor.data_offset))
    if fh.readinto(memoryview(rows).cast("B")) != rows.nbytes:  # the header check saw it inside the file
        raise ValueError(f"{fh.name}: tensor {tensor.name!r} was cut short while it was read")
    return PackedWeight(rows, kind, int(tensor.shape[0]))  # (R, C) as stored


def _fixed_packed(packed: PackedWeight, entry: _Entry, config: DecoderConfig) -> PackedWeight:
    """llama.cpp's change undone on stored rows: q/k rows permuted back (whole rows move, blocks intact),
    GPT-2's matrices read transposed."""
    if entry.fix == "permute_q":
        return PackedWeight(_reverse_permute(packed.blocks, config.num_heads), packed.kind, packed.columns)
    if entry.fix == "permute_k":
        return PackedWeight(_reverse_permute(packed.blocks, config.num_kv_heads), packed.kind, packed.columns)
    if entry.fix == "transpose":
        return packed.T
    return packed


def pack_gguf_tensors(file: GGUFFile, entries: dict[str, _Entry], config: DecoderConfig
                      ) -> tuple[dict[str, PackedWeight], dict[str, _Entry]]:
    """The quantized matrices of a validated file kept as they are stored: packed weights by attnkit parameter
    name, and the entries left for :func:`load_gguf_tensors_into` (F32/F16/BF16 tensors, vectors, and any
    matrix whose layout would cut its blocks).

    Memory: the packed blocks, about the file's size (each tensor read once, with plain reads).
    """
    packed: dict[str, PackedWeight] = {}
    dense: dict[str, _Entry] = {}
    with open(file.path, "rb") as fh:
        for name, entry in entries.items():
            # a family's own restore, and a squeezed convolution, work on values: such a tensor is read dense
            weight = None if entry.fix in ("squeeze", "restore") else _packed_tensor(fh, file.tensors[name])
            parts = None if weight is None else entry.mapping.convert_packed(_fixed_packed(weight, entry, config))
            if parts is None:
                dense[name] = entry
            else:
                packed.update(parts)
    return packed, dense


def load_gguf_tensors_into(params: dict[str, np.ndarray], file: GGUFFile, entries: dict[str, _Entry],
                           config: DecoderConfig, step: Callable[[int], None] | None = None) -> None:
    """Dequantize each validated tensor alone (float32), undo llama.cpp's change, copy it into ``params``;
    ``step(n)``, if given, after each tensor, ``n`` its bytes in the file (a progress line's unit).

    The file stays memory-mapped: an F32 tensor is read in place; any other is dequantized, a few rows at a
    time, into one float32 array of its size, so loading costs the model's memory plus the largest tensor in
    float32 (twice for a permuted q/k matrix, which is small), never a second copy of the model.
    """
    gguf = import_extra("gguf", "read GGUF files")
    arch = gguf_architecture(file)
    for name, entry in entries.items():
        tensor = file.tensors[name]
        stored = _stored_shape(tensor)  # NumPy order: (out, in) for a matrix, as Hugging Face stores nn.Linear
        values = _dequantize(gguf, tensor, stored)  # float32, stored shape
        if entry.fix == "restore":
            values = arch.restore(name, values, config).reshape(entry.mapping.shape)  # the Hugging Face tensor
        elif entry.fix == "permute_q":
            values = _reverse_permute(values, config.num_heads)  # (Hq*Dh, D) or (Hq*Dh,)
        elif entry.fix == "permute_k":
            values = _reverse_permute(values, config.num_kv_heads)  # (Hkv*Dh, D) or (Hkv*Dh,)
        elif entry.fix == "norm_offset":
            # 1 + (stored - 1) gives back the stored float32 exactly whenever it lies in [0.5, 2] (Sterbenz)
            values = values - np.float32(1.0)
        elif entry.fix == "transpose":
            values = values.T  # GPT-2's Conv1D layout (in, out)
        elif entry.fix == "squeeze":
            values = values.reshape(entry.mapping.shape)  # (C, K) -> (C, 1, K)
        for m in entry.stacked or (entry.mapping,):
            for target, value in m.convert(values[m.stack_index] if entry.stacked else values).items():
                np.copyto(m.destination(params, target), value, casting="unsafe")
        if step is not None:
            step(int(tensor.n_bytes))

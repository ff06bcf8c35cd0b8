"""Hugging Face decoder checkpoints: the one name map onto attnkit's ``CausalLM``, and validated safetensors reads.

A checkpoint is ``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Before any tensor is
read, every header is checked against what the :class:`~attnkit.models.DecoderConfig` implies: each expected
tensor present once, nothing unexpected, every shape right, every dtype a float attnkit converts (F64, F32,
F16, BF16). Then tensors are read one at a time, converted to the requested dtype and written into the model.

Weight layouts. attnkit computes ``x @ W`` with W (in, out). Hugging Face ``nn.Linear`` stores (out, in), so
those weights are transposed. GPT-2's ``Conv1D`` already stores (in, out); its fused ``c_attn`` (D, 3D) is
split column-wise into W_Q, W_K, W_V (and its bias into b_Q, b_K, b_V). A tied head has no tensor of its own
(a checkpoint that still carries ``lm_head.weight`` has it ignored, as Hugging Face ties it).

Dimension letters: V vocabulary, D hidden size, P positions, F MLP width, Hq/Hkv heads, Dh head features.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..io import read_json
from ..kernels.mxfp4 import check_scales, dequantize_mxfp4
from ..kernels.packed import PackedWeight
from ..models.config import DecoderConfig
from ._extra import import_extra
from .families import family
from .tensor_map import TensorMap

__all__ = ["TensorMap", "checkpoint_map", "checkpoint_tensors",
           "TensorHeader", "CheckpointIndex", "read_checkpoint_index", "read_file_headers", "read_tensor",
           "validate_checkpoint", "expected_parameter_shapes", "check_model_matches", "load_tensors_into",
           "pack_mxfp4_tensors",
           "SINGLE_FILE", "INDEX_FILE", "HEAD_NAMES"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype names attnkit converts, with their byte sizes.
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}

# The output head's name, outside the base model's prefix (GPT-NeoX calls it embed_out).
HEAD_NAMES = ("lm_head.weight", "embed_out.weight")

# The name that marks a checkpoint whose experts are MXFP4 blocks (gpt-oss as published).
_MXFP4_MARK = "experts.gate_up_proj_blocks"

# Buffers some checkpoints carry that are not weights: GPT-2's causal mask and old rotary frequency tables.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                     ".rotary_emb.inv_freq")


def checkpoint_tensors(config: DecoderConfig, params: dict[str, Any]) -> dict[str, Any]:
    """attnkit parameters (name -> array) as the tensors of a Hugging Face ``*ForCausalLM``
    checkpoint of ``config``'s family, named as ``save_pretrained`` names them (the inverse of loading).

    Examples
    --------
    >>> from attnkit.models import AttentionConfig, CausalLM, DecoderConfig, NormConfig, MLPConfig
    >>> cfg = DecoderConfig(family="gpt2", vocab_size=8, hidden_size=4, num_layers=1, num_heads=2,
    ...                     num_kv_heads=2, head_dim=2, mlp=MLPConfig(8, kind="plain"), rotary=None,
    ...                     norm=NormConfig(kind="layernorm"), tie_word_embeddings=True,
    ...                     attention=AttentionConfig(bias=True, output_bias=True), max_position_embeddings=6)
    >>> tensors = checkpoint_tensors(cfg, dict(CausalLM(cfg, rng=0).named_parameters()))
    >>> tensors["transformer.h.0.attn.c_attn.weight"].shape, "lm_head.weight" in tensors
    ((4, 12), False)
    """
    maps, prefix = checkpoint_map(config)
    return {(m.source if m.source in HEAD_NAMES else prefix + m.source): m.gather(params) for m in maps}


def checkpoint_map(config: DecoderConfig, *, mxfp4: bool = False) -> tuple[list[TensorMap], str]:
    """Every tensor a Hugging Face checkpoint of ``config``'s family holds, with its attnkit destination.

    ``mxfp4=True``: the experts' matrices are MXFP4 blocks and scales, as gpt-oss is published.

    Returns
    -------
    maps : list of TensorMap
        In checkpoint order (embeddings, layers, final norm, head).
    base_prefix : str
        The prefix of the base model's names in a ``*ForCausalLM`` checkpoint (``"transformer."`` for GPT-2,
        ``"model."`` otherwise); the head is named without it.

    Examples
    --------
    >>> from attnkit.models import DecoderConfig, MLPConfig
    >>> cfg = DecoderConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=1, num_heads=4,
    ...                     num_kv_heads=2, head_dim=4, mlp=MLPConfig(24))
    >>> maps, prefix = checkpoint_map(cfg)
    >>> prefix, [(m.source, m.shape, m.targets[0], m.layout) for m in maps if "k_proj" in m.source][0]
    ('model.', ('layers.0.self_attn.k_proj.weight', (8, 16), 'layers.0.attention.W_K', 'transpose'))
    """
    entry = family(config.family)
    if mxfp4 and "mxfp4" not in entry.quantizations:
        raise ValueError(f"MXFP4 tensors are read only for mixture-of-experts models (gpt-oss), not {config.family}")
    return entry.tensors(config, mxfp4)


@dataclass(frozen=True)
class TensorHeader:
    """What a safetensors header says about one tensor: its file, dtype, shape, and where its bytes lie
    (``offset`` from the start of the file, ``nbytes`` long)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a checkpoint folder, from the headers only (no tensor data read)."""

    folder: Path
    tensors: dict[str, TensorHeader]


def _shard_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    for path in (index, single):
        if path.exists() and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file (a FIFO, a device or a socket)"
            raise ValueError(f"{path} is {kind}; attnkit reads weights from regular files")
    if index.is_file():
        raw = read_json(index)
        if "weight_map" not in raw:
            raise ValueError(f"{index} is not a safetensors index: it has no 'weight_map'")
        weight_map = raw["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        shards = []
        for name in sorted(set(weight_map.values())):
            shard = folder / name
            if Path(name).name != name or not shard.is_file():
                raise ValueError(f"{index} lists the shard {name!r}, which is not a file in {folder}")
            shards.append(shard)
        return shards, weight_map
    if single.is_file():
        return [single], None
    raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_checkpoint_index(folder: str | Path) -> CheckpointIndex:
    """Read the headers of a folder's safetensors file(s): every tensor's file, dtype and shape.

    Raises
    ------
    FileNotFoundError
        No ``model.safetensors`` and no ``model.safetensors.index.json``.
    ValueError
        An unreadable header, a tensor in two shards, or an index that disagrees with its shards.
    """
    folder = Path(folder)
    safetensors = import_extra("safetensors", "read safetensors checkpoints")
    shards, weight_map = _shard_files(folder)
    tensors: dict[str, TensorHeader] = {}
    for shard in shards:
        for name, header in read_file_headers(shard, safetensors).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both {tensors[name].file.name} and {shard.name}")
            tensors[name] = header
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors or tensors[name].file.name != file:
                raise ValueError(f"{INDEX_FILE} places {name!r} in {file}, but that shard does not hold it")
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise ValueError(f"shards hold tensors {INDEX_FILE} does not list: {unlisted[:5]}")
    return CheckpointIndex(folder, tensors)


def read_file_headers(file: Path, safetensors: Any = None) -> dict[str, TensorHeader]:
    """Every tensor's header in one safetensors file (no tensor data read), checked by safetensors itself.

    Raises
    ------
    ValueError
        Naming the file, when safetensors cannot read its header.
    """
    safetensors = safetensors or import_extra("safetensors", "read safetensors files")
    try:
        with safetensors.safe_open(str(file), framework="numpy") as handle:
            names = list(handle.keys())
            pieces = {name: handle.get_slice(name) for name in names}
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise ValueError(f"{file} is not a readable safetensors file: {exc}") from None
    # safetensors has checked the header (offsets inside the file, no overlaps); its byte ranges let the
    # loader read each tensor straight into place without mapping the whole file.
    data_start, ranges = _data_ranges(file)
    return {name: TensorHeader(file, pieces[name].get_dtype(), tuple(int(n) for n in pieces[name].get_shape()),
                               data_start + ranges[name][0], ranges[name][1] - ranges[name][0]) for name in names}


def validate_checkpoint(index: CheckpointIndex, config: DecoderConfig) -> dict[str, TensorMap]:
    """Match the checkpoint's headers against what ``config`` needs, before reading any tensor.

    Returns
    -------
    dict
        Checkpoint tensor name (as stored) -> its :class:`TensorMap`.

    Raises
    ------
    ValueError
        A missing or unexpected tensor, a wrong shape or an unsupported dtype, naming the tensor.
    """
    for claim, units in _claimed_units(config):
        if units > len(index.tensors):
            # Each unit needs tensors of its own: refuse before building a map (or a model) for the claim.
            raise ValueError(f"{index.folder}: the config's {claim} cannot match a checkpoint of "
                             f"{len(index.tensors)} tensors")
    mxfp4 = any(n.endswith(_MXFP4_MARK) for n in index.tensors)
    maps, prefix = checkpoint_map(config, mxfp4=mxfp4)
    names = [n for n in index.tensors if not n.endswith(_IGNORED_SUFFIXES)]
    # A *ForCausalLM checkpoint prefixes the base model's names; a bare base model (GPT2Model) does not.
    prefixed = any(n.startswith(prefix) for n in names)
    stored: dict[str, TensorMap] = {}
    for m in maps:
        name = m.source if (m.source in HEAD_NAMES or not prefixed) else prefix + m.source
        if name in HEAD_NAMES and name not in index.tensors:  # the head under its other name
            name = next((n for n in HEAD_NAMES if n in index.tensors), name)
        stored[name] = m
    companions = {(prefix if prefixed else "") + m.scales: m for m in maps if m.scales}
    missing = [n for n in list(stored) + list(companions) if n not in index.tensors]
    if missing:
        raise ValueError(f"{index.folder}: the checkpoint has no tensor {missing[0]!r}"
                         + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
                         + f" needed by this {config.family} config")
    ignorable = set(HEAD_NAMES) if config.tie_word_embeddings else set()
    unused = family(config.family).unused_tensors
    if unused is not None:
        ignorable |= {(prefix if prefixed else "") + n for n in unused(config)}
    if family(config.family).mtp_tensors is not None:  # read on request only (load_multi_token_predictor)
        mtp_maps, mtp_copies = family(config.family).mtp_tensors(config)
        ignorable |= {(prefix if prefixed else "") + n for n in [m.source for m in mtp_maps] + list(mtp_copies)}
    unexpected = [n for n in names if n not in stored and n not in companions and n not in ignorable]
    if unexpected:
        raise ValueError(f"{index.folder}: unexpected tensor {unexpected[0]!r}"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
                         + f" for this {config.family} config")
    check_headers(index, stored)
    return stored


def check_headers(index: CheckpointIndex, stored: dict[str, TensorMap]) -> None:
    """Every stored tensor's dtype and shape against its map (MXFP4 pairs as their blocks and scales), naming the
    first that differs."""
    for name, m in stored.items():
        header = index.tensors[name]
        if m.scales:
            columns = m.shape[1]  # C of the dequantized (E, C, R)
            if columns % 32:
                # The header holds C // 32 blocks, so it would match; dequantized, every row is a whole number
                # of 32-value blocks and could never fill C columns.
                raise ValueError(f"{header.file}: MXFP4 tensor {name!r} would hold {columns} columns (its "
                                 f"dequantized shape is {m.shape}), not a multiple of MXFP4's 32-value blocks")
            scales_name = name[:-len(m.source)] + m.scales
            for part, shape in zip((name, scales_name), m.stored_shapes.values()):
                part_header = index.tensors[part]
                if part_header.dtype != "U8" or part_header.shape != shape:
                    raise ValueError(f"{part_header.file}: MXFP4 tensor {part!r} is {part_header.dtype} of shape "
                                     f"{part_header.shape}; the config implies U8 of shape {shape}")
            continue
        if header.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{header.file}: tensor {name!r} has dtype {header.dtype}; attnkit reads "
                             f"{', '.join(_FLOAT_DTYPES)}")
        if header.shape != m.shape:
            raise ValueError(f"{header.file}: tensor {name!r} has shape {header.shape}, but the config implies "
                             f"{m.shape}")


def _claimed_units(config: DecoderConfig) -> list[tuple[str, int]]:
    """The counts of ``config`` whose every unit has tensors of its own in a checkpoint (its layers, and experts
    stored one tensor per expert), as ``(what is claimed, units)``: a checkpoint of T tensors holds at most T."""
    claims = [(f"num_hidden_layers = {config.num_layers}", config.num_layers)]
    experts = config.experts
    if experts is not None:
        # A checkpoint storing each expert's tensors holds at least E of them; one stacking them (gpt-oss) holds
        # fewer, but every real one still has more tensors than experts, and 10**9 experts is refused either way.
        claims.append((f"{experts.num_experts} experts", experts.num_experts))
    return claims


def _data_ranges(file: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where the data of a (validated) safetensors file starts, and each tensor's byte range within it."""
    with open(file, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        meta = json.loads(fh.read(size))
    ranges = {name: (int(entry["data_offsets"][0]), int(entry["data_offsets"][1]))
              for name, entry in meta.items() if name != "__metadata__"}
    return 8 + size, ranges


_NUMPY_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
                 "U8": np.dtype("u1")}


def _read_into(fh: Any, header: TensorHeader, target: np.ndarray, name: str) -> None:
    """Fill the C-contiguous ``target`` with the tensor's bytes (``target`` has the stored dtype and size)."""
    fh.seek(header.offset)
    got = fh.readinto(memoryview(target).cast("B"))
    if got != header.nbytes:
        raise ValueError(f"{header.file}: tensor {name!r} should hold {header.nbytes} bytes, the file gave {got}")


def read_tensor(fh: Any, header: TensorHeader, name: str) -> np.ndarray:
    """One tensor as a new array (BF16 widened to float32: NumPy has no bfloat16, and a BF16 value is the top
    half of the float32 with the same bits)."""
    stored = _NUMPY_DTYPES[header.dtype]
    if int(np.prod(header.shape)) * stored.itemsize != header.nbytes:
        raise ValueError(f"{header.file}: tensor {name!r} holds {header.nbytes} bytes, its shape {header.shape} "
                         f"and dtype {header.dtype} say {int(np.prod(header.shape)) * stored.itemsize}")
    array = np.empty(header.shape, stored)
    _read_into(fh, header, array, name)
    if header.dtype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def load_tensors_into(params: dict[str, np.ndarray], index: CheckpointIndex, stored: dict[str, TensorMap],
                      step: Callable[[int], None] | None = None) -> None:
    """Read each validated tensor and copy it, converted, into ``params`` (attnkit name -> array, in place);
    ``step(n)``, if given, after each tensor, ``n`` its bytes in the file (a progress line's unit).

    The files are read with plain reads, never mapped: a tensor whose layout and dtype equal its parameter's
    is read straight into the parameter, any other goes through one temporary of its own size. So loading
    costs the model's memory plus at most the largest converted tensor.
    """
    by_file: dict[Path, list[str]] = {}
    for name in stored:
        by_file.setdefault(index.tensors[name].file, []).append(name)
    for file, names in by_file.items():
        with open(file, "rb") as fh:
            for name in names:
                header, mapping = index.tensors[name], stored[name]
                _load_one(fh, index, name, mapping, params)
                if step is not None:
                    step(header.nbytes)


def _load_one(fh: Any, index: CheckpointIndex, name: str, mapping: TensorMap, params: dict[str, np.ndarray]) -> None:
    """Read one validated tensor from the open file ``fh`` into its parameters."""
    header = index.tensors[name]
    if mapping.scales:
        _load_mxfp4(fh, index, name, mapping, params)
        return
    target = mapping.destination(params, mapping.targets[0])
    if (mapping.layout == "copy" and _NUMPY_DTYPES[header.dtype] == target.dtype
            and target.flags.c_contiguous and target.nbytes == header.nbytes):
        _read_into(fh, header, target, name)
        return
    for target_name, value in mapping.convert(read_tensor(fh, header, name)).items():
        np.copyto(mapping.destination(params, target_name), value, casting="unsafe")


def _load_mxfp4(fh: Any, index: CheckpointIndex, name: str, mapping: TensorMap, params: dict[str, np.ndarray]
                ) -> None:
    """Dequantize an MXFP4 expert matrix one expert at a time (a temporary of one expert's size) into place.

    The scales (a sixteenth of the blocks' size) are read and checked first: a NaN scale is refused by name
    before the blocks are read."""
    blocks, scales, scales_name = _read_mxfp4(fh, index, name, mapping)  # (E, R, C / 32, 16), (E, R, C / 32)
    for expert in range(blocks.shape[0]):  # one expert's matrix at a time bounds the float temporary
        values = dequantize_mxfp4(blocks[expert], scales[expert], name=scales_name).T  # (C, R)
        for target_name, value in mapping.convert(values[None]).items():
            np.copyto(params[target_name][expert], value[0], casting="unsafe")


def _read_mxfp4(fh: Any, index: CheckpointIndex, name: str, mapping: TensorMap
                ) -> tuple[np.ndarray, np.ndarray, str]:
    """An MXFP4 matrix's blocks (E, R, C / 32, 16) and scales (E, R, C / 32), and the scales' name. The scales
    (a sixteenth of the blocks' size) are read and checked first: a NaN scale is refused by name before the
    blocks are read."""
    scales_name = name[:-len(mapping.source)] + mapping.scales
    scales_header = index.tensors[scales_name]
    with open(scales_header.file, "rb") as sfh:
        scales = read_tensor(sfh, scales_header, scales_name)  # (E, R, C / 32)
    check_scales(scales, scales_name)
    return read_tensor(fh, index.tensors[name], name), scales, scales_name


def pack_mxfp4_tensors(index: CheckpointIndex, stored: dict[str, TensorMap]
                       ) -> tuple[dict[str, PackedWeight], dict[str, TensorMap]]:
    """gpt-oss's MXFP4 expert matrices kept packed: packed weights (E, C, R) by attnkit parameter name (each
    block's scale byte put before its 16 code bytes, the layout :mod:`attnkit.kernels.packed` reads as
    ``"MXFP4"``), and the validated tensors left for :func:`load_tensors_into` (every float one).

    Memory: the packed experts (their blocks and scales) and one matrix's blocks read twice while it is packed.
    """
    packed: dict[str, PackedWeight] = {}
    rest: dict[str, TensorMap] = {}
    for name, mapping in stored.items():
        if not mapping.scales:
            rest[name] = mapping
            continue
        with open(index.tensors[name].file, "rb") as fh:
            blocks, scales, _ = _read_mxfp4(fh, index, name, mapping)  # (E, R, G, 16), (E, R, G)
        rows = np.concatenate([scales[..., None], blocks], axis=-1)  # (E, R, G, 17)
        del blocks
        weight = PackedWeight(rows.reshape(*scales.shape[:-1], -1), "MXFP4", scales.shape[-1] * 32,
                              transposed=True)  # (E, C, R)
        packed.update(mapping.convert_packed(weight))
    return packed, rest


def expected_parameter_shapes(stored: dict[str, TensorMap]) -> dict[str, tuple[int, ...]]:
    """attnkit parameter name -> shape, as the checkpoint map fills them."""
    shapes: dict[str, tuple[int, ...]] = {}
    for m in stored.values():
        shapes.update(m.target_shapes())
    return shapes


def check_model_matches(params: dict[str, Any], stored: dict[str, TensorMap]) -> None:
    """Fail loudly if the model's parameters and the checkpoint map disagree (names or shapes)."""
    expected = expected_parameter_shapes(stored)
    missing = sorted(set(params) - set(expected))
    extra = sorted(set(expected) - set(params))
    if missing or extra:
        raise RuntimeError(f"CausalLM parameters and the checkpoint map disagree: parameters with no "
                           f"checkpoint tensor {missing[:5]}, map targets the model lacks {extra[:5]}")
    for name, shape in expected.items():
        if tuple(params[name].shape) != tuple(shape):
            raise RuntimeError(f"CausalLM parameter {name!r} has shape {params[name].shape}, the checkpoint map "
                               f"gives {shape}")

"""llama.cpp's control-vector GGUF files: read and write them as llama.cpp and repeng do.

A control-vector file is a GGUF file of architecture ``controlvector`` (metadata ``controlvector.model_hint``,
the model family, and ``controlvector.layer_count``) whose tensors are ``direction.{i}``: one 1-D float32 tensor
(D,) per layer i, added to the output of block i (0-based). :func:`load_control_vector` applies llama.cpp's
rules (``common_control_vector_load_one``): every tensor is named ``direction.`` and a layer number, no layer 0
(llama.cpp never steers block 0's output and refuses the file), float32, one dimension, the same length for all;
and attnkit's GGUF header checks (every length inside the file, tensors aligned and not overlapping) run on the
header before anything is allocated. :func:`save_control_vector` writes what repeng's ``export_gguf`` writes,
with the ``gguf`` package's writer, atomically (a temporary file renamed into place).
"""
from __future__ import annotations

import mmap
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..io import atomic_write
from ..pretrained._extra import import_extra
from ..pretrained.gguf_header import check_tensor_layout, read_header
from .steering import ControlVector

__all__ = ["load_control_vector", "save_control_vector"]

ARCHITECTURE = "controlvector"
_MAGIC = b"GGUF"
_DIRECTION = re.compile(r"direction\.(\d{1,10})")
_MAX_LAYER = 2**31 - 1  # llama.cpp parses the number with std::stoi (an int)


def load_control_vector(path: str | os.PathLike) -> ControlVector:
    """The control vector of a llama.cpp control-vector GGUF file (repeng's ``export_gguf``, llama.cpp's
    ``cvector-generator``, or :func:`save_control_vector`).

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    ControlVector
        ``directions[i]`` from tensor ``direction.{i}``; ``model_hint`` from ``controlvector.model_hint`` (empty
        when absent: llama.cpp does not read it).

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        Naming the file: not GGUF, a damaged header, a model's file rather than a control vector (its
        ``general.architecture``), no tensors, a tensor not named ``direction.{i}`` or for layer 0, not float32,
        not 1-D, of another length than the others, or holding NaN or infinity.

    Examples
    --------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "happy.gguf")
    >>> _ = save_control_vector(ControlVector({1: [0.6, 0.8], 2: [1.0, 0.0]}, "llama"), path)
    >>> v = load_control_vector(path)
    >>> v, v.directions[1].tolist()
    (ControlVector(layers=[1, 2], width=2, model_hint='llama'), [0.6000000238418579, 0.800000011920929])
    """
    gguf = import_extra("gguf", "read control-vector GGUF files")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file; a control vector is one GGUF file")
    with open(path, "rb") as fh:
        if fh.read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file: it does not start with {_MAGIC!r}")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header = read_header(path, data, gguf)
            check_tensor_layout(path, header)
            hint = _check_metadata(path, header)
            layers = _check_tensors(path, header, gguf)
            directions = {}
            for layer, entry in layers.items():
                stored = np.frombuffer(data, "<f4", entry.shape[0], header.data_start + entry.offset)  # (D,)
                directions[layer] = stored.astype(np.float32)  # a copy: the mapping closes below
                del stored
                if not np.isfinite(directions[layer]).all():
                    raise ValueError(f"{path}: tensor {entry.name!r} holds NaN or infinite values")
    return ControlVector(directions, hint)


def _check_metadata(path: Path, header: Any) -> str:
    """The model hint; a file of another architecture (a model) is refused."""
    arch = header.metadata.get("general.architecture")
    if arch is not None and arch != ARCHITECTURE:
        raise ValueError(f"{path} is not a control vector: its general.architecture is {str(arch)[:40]!r}, not "
                         f"{ARCHITECTURE!r} (a model's GGUF file?)")
    hint = header.metadata.get(f"{ARCHITECTURE}.model_hint", "")
    if not isinstance(hint, str):
        raise ValueError(f"{path}: metadata '{ARCHITECTURE}.model_hint' is "
                         f"{header.types[f'{ARCHITECTURE}.model_hint']}, expected a string")
    return hint


def _check_tensors(path: Path, header: Any, gguf: Any) -> dict[int, Any]:
    """``{layer: tensor entry}`` once every tensor passes llama.cpp's rules."""
    if not header.tensors:
        raise ValueError(f"{path} holds no direction tensors (a control vector has direction.1, direction.2, ...)")
    layers: dict[int, Any] = {}
    width = None
    for entry in header.tensors:
        name = entry.name
        found = _DIRECTION.fullmatch(name)
        if found is None or int(found.group(1)) > _MAX_LAYER:
            raise ValueError(f"{path}: tensor {name[:80]!r} is not a direction (a control vector's tensors are "
                             f"named direction.<layer>)")
        layer = int(found.group(1))
        if layer == 0:
            raise ValueError(f"{path}: tensor 'direction.0' is for layer 0, which llama.cpp never steers and "
                             f"refuses")
        if layer in layers:
            raise ValueError(f"{path}: layer {layer} has two tensors ({layers[layer].name!r} and {name!r})")
        if entry.kind != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: tensor {name!r} is {entry.kind.name}, but a direction is F32")
        if len(entry.shape) != 1:
            raise ValueError(f"{path}: tensor {name!r} has shape {entry.shape}, but a direction is 1-D")
        if width is not None and entry.shape[0] != width:
            raise ValueError(f"{path}: tensor {name!r} has {entry.shape[0]} values, the others {width}")
        width = entry.shape[0]
        layers[layer] = entry
    return dict(sorted(layers.items()))


def save_control_vector(vector: ControlVector, path: str | os.PathLike) -> Path:
    """Write ``vector`` as a llama.cpp control-vector GGUF file (what repeng's ``export_gguf`` writes), atomically.

    Parameters
    ----------
    vector : ControlVector
        Without layer 0 (llama.cpp refuses a file that has it).
    path : str or os.PathLike
        The file to create or replace, in an existing folder.

    Returns
    -------
    Path
        The path written.
    """
    if not isinstance(vector, ControlVector):
        raise TypeError(f"vector must be a ControlVector, got {type(vector).__name__}")
    if 0 in vector.directions:
        raise ValueError("vector has a direction for layer 0, which llama.cpp refuses to load (it never steers "
                         "block 0's output); drop it first")
    gguf = import_extra("gguf", "write control-vector GGUF files")
    with tempfile.TemporaryDirectory(prefix="attnkit-control-vector-") as folder:
        staged = Path(folder) / "vector.gguf"
        writer = gguf.GGUFWriter(str(staged), ARCHITECTURE)
        writer.add_string(f"{ARCHITECTURE}.model_hint", vector.model_hint)
        writer.add_uint32(f"{ARCHITECTURE}.layer_count", len(vector.directions))
        for layer, direction in vector.directions.items():
            writer.add_tensor(f"direction.{layer}", np.ascontiguousarray(direction, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(staged, "rb") as source:  # the writer wants a path: staged, then copied into place whole
            return atomic_write(path, lambda f: shutil.copyfileobj(source, f))

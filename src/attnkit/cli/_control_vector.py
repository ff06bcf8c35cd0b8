"""The steering flags of ``attnkit generate`` and ``attnkit chat``, llama.cpp's: ``--control-vector FILE[:SCALE]``
(repeatable; the files' directions times their scales are summed, as llama.cpp's ``--control-vector`` and
``--control-vector-scaled FILE SCALE`` sum them) and ``--control-vector-layer-range START END`` (the layers
steered, both included).

The files are read and checked before the model's weights are (:func:`attnkit.explain.load_control_vector`); their
width and layers against the model once it is loaded. Every fault is one line and exit 2. A ``--prompt-cache``
file is refused with them: it holds the keys and values of the unsteered model (or of another steering).
"""
from __future__ import annotations

import argparse
import math
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .._arguments import UsageError, printable

__all__ = ["add_control_vector_arguments", "control_vector_option", "steering_for_command", "steering_text"]


def _file_and_scale(text: str) -> tuple[str, float]:
    """``FILE[:SCALE]`` -> (FILE, SCALE); a tail after the last ':' that is not a number belongs to the name."""
    name, colon, tail = text.rpartition(":")
    if colon and name:
        try:
            scale = float(tail)
        except ValueError:
            return text, 1.0
        if not math.isfinite(scale):
            raise argparse.ArgumentTypeError(f"the scale of {printable(repr(text), 80)} must be a finite number")
        return name, scale
    return text, 1.0


_file_and_scale.__name__ = "FILE[:SCALE]"


def _layer(text: str) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 9:
        raise argparse.ArgumentTypeError(f"must be a layer index (a non-negative integer), got "
                                         f"{printable(repr(text), 40)}")
    return int(text)


_layer.__name__ = "layer index"


def add_control_vector_arguments(parser: Any) -> None:
    """``--control-vector FILE[:SCALE]`` (repeatable) and ``--control-vector-layer-range START END``."""
    parser.add_argument("--control-vector", metavar="FILE[:SCALE]", type=_file_and_scale, action="append",
                        default=None,
                        help="steer with a llama.cpp control-vector GGUF file (repeng's export_gguf), its "
                             "directions times SCALE (default 1) added to each layer's output; repeatable: the "
                             "vectors are summed, as llama.cpp's --control-vector-scaled")
    parser.add_argument("--control-vector-layer-range", metavar=("START", "END"), type=_layer, nargs=2,
                        default=None, help="steer only the layers from START to END, both included")


def control_vector_option(args: argparse.Namespace, prog: str) -> Any:
    """The sum of the ``--control-vector`` files times their scales (a ``ControlVector``), or None without the
    flag; read before the model is loaded. A file that cannot be read, or vectors of different widths, are a
    :class:`UsageError` of ``prog``."""
    from ..explain import load_control_vector

    if args.control_vector is None:
        if args.control_vector_layer_range is not None:
            raise UsageError("--control-vector-layer-range needs --control-vector", prog)
        return None
    if getattr(args, "prompt_cache", None) is not None:
        raise UsageError("--prompt-cache cannot be combined with --control-vector: a cache file holds the keys and "
                         "values of one model, and a steered model is another one", prog)
    start_end = args.control_vector_layer_range
    if start_end is not None and start_end[0] > start_end[1]:
        raise UsageError(f"--control-vector-layer-range: START {start_end[0]} is after END {start_end[1]}", prog)
    total = None
    for file, scale in args.control_vector:
        try:
            vector = scale * load_control_vector(file)
        except (ValueError, OSError) as exc:
            raise UsageError(f"--control-vector {printable(repr(file), 80)}: {printable(exc, 300)}", prog) from None
        if total is not None and total.width != vector.width:
            raise UsageError(f"--control-vector {printable(repr(file), 80)} has {vector.width} features, the files "
                             f"before it {total.width}", prog)
        total = vector if total is None else total + vector
    return total


def steering_for_command(model: Any, vector: Any, args: argparse.Namespace, prog: str) -> AbstractContextManager:
    """A block in which ``model`` is steered by ``vector`` (none: a block that does nothing); a vector that does
    not fit the model is a :class:`UsageError` of ``prog``."""
    from ..explain import steering

    if vector is None:
        return nullcontext()
    config = model.config
    if vector.width != config.hidden_size:
        raise UsageError(f"--control-vector: the vectors have {vector.width} features, but the model's residual "
                         f"stream has {config.hidden_size} (made for another model?)", prog)
    if vector.layers[-1] >= config.num_layers:
        raise UsageError(f"--control-vector: a direction for layer {vector.layers[-1]}, but the model has "
                         f"{config.num_layers} layers (0 to {config.num_layers - 1})", prog)
    layer_range = args.control_vector_layer_range
    return steering(model, vector, layer_range=None if layer_range is None else tuple(layer_range))


def steering_text(args: argparse.Namespace) -> str:
    """The steering flags in words for a settings line (``"steered by happy.gguf x0.8 (layers 1 to 3)"``), or ""."""
    if not getattr(args, "control_vector", None):
        return ""
    from pathlib import Path

    files = ", ".join(f"{printable(Path(file).name, 60)} x{scale:g}" for file, scale in args.control_vector)
    layers = args.control_vector_layer_range
    return f"steered by {files}" + ("" if layers is None else f" (layers {layers[0]} to {layers[1]})")

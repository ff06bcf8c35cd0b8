"""``attnkit generate``: continue a prompt with a Hugging Face decoder folder (any supported family) on attnkit.

The prompt is text (``--prompt``, tokenised with the folder's ``tokenizer.json`` through ``tokenizers``) or token
ids (``--ids 1,2,3``, no tokenizer needed). ``--chat`` renders the prompt as a user message with the folder's chat
template (``--system TEXT`` adds a system message before it; ``--chat-template NAME|FILE`` replaces the template,
:mod:`attnkit.cli._chat_template`; both imply ``--chat``; a model without a template is refused before its weights
are read) and prints the reply only. The generation flags are ``attnkit chat``'s, with Hugging Face's names
(:mod:`attnkit.cli._generation`): decoding is greedy unless a sampling flag is given (``--temperature`` above 0,
``--top-k``, ``--top-p``, ``--min-p`` or ``--seed``); it stops at the model's end-of-sequence token, a ``--stop``
string or after ``--max-new-tokens``. Text is printed as it is produced (beam search prints at the end);
``--prompt``, ``--system`` and ``--stop`` take backslash escapes (``\\n``, ``\\t``,
``\\uXXXX``: :func:`~attnkit.cli._common.unescape`), as llama.cpp's text flags do. A prompt whose length in
characters alone shows it cannot fit the context is refused before it is tokenized. ``--control-vector
FILE[:SCALE]`` (repeatable) steers every step with llama.cpp control-vector files, as llama.cpp does
(:mod:`attnkit.cli._control_vector`). ``--verbose`` prints the
speed line of :mod:`attnkit.cli._speed` on stderr at the end. ``--json`` prints one object at the end::

    {"ids": [...prompt ids, new ids...], "new_ids": [...], "text": "...prompt and continuation...",
     "new_text": "..."}

(``text`` and ``new_text`` are null without a tokenizer).

On a terminal, stderr shows the waits (:mod:`attnkit._progress`; ``--quiet`` hides them): the weights loading,
the prefill layer by layer, and the tokens or beam-search steps when the text does not appear as it comes (beam
search, ``--json``, stdout not the terminal).
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .. import _progress
from ._chat_template import add_chat_template_argument, chat_template_option, require_chat_template
from ._common import (
    ESCAPES,
    UsageError,
    add_dtype_argument,
    add_keep_quantized_argument,
    add_quiet_argument,
    add_threads_argument,
    escaped_text,
    json_text,
    model_types_text,
    positive_int,
    printable,
    progress_of,
    use_threads,
)
from ._control_vector import add_control_vector_arguments, control_vector_option, steering_for_command
from ._generation import add_generation_arguments, add_speculation_arguments, generation_kwargs, speculation_kwargs
from ._prompt_cache import add_prompt_cache_argument, open_prompt_cache, read_prompt
from ._speed import Speed, Stopwatch

__all__ = ["NAME", "add_parser", "run", "check_model_path", "model_for_command", "tokenizer_for_command", "parse_ids",
           "prompt_ids", "assistant_for_command"]

NAME = "generate"
PROG = f"attnkit {NAME}"


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number, got {printable(repr(text), 40)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {printable(text, 40)}")
    return value


_finite_float.__name__ = "finite number"


def parse_ids(text: str, prog: str = PROG) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (spaces allowed); anything else is a :class:`UsageError` of ``prog``.

    Examples
    --------
    >>> parse_ids("5, 7,9")
    [5, 7, 9]
    """
    pieces = [p.strip() for p in text.split(",")]
    if not text.strip() or not all(p.isdigit() and p.isascii() and len(p) <= 12 for p in pieces):
        raise UsageError(f"--ids must be comma-separated non-negative integers like 1,2,3, got "
                         f"{printable(repr(text), 40)}", prog)
    return [int(p) for p in pieces]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit generate`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="continue a prompt with a Hugging Face causal-LM folder or a GGUF file (the 'pretrained' "
                                   "extra)",
        description="Continue a prompt with a Hugging Face decoder folder (config.json + model.safetensors, "
                    f"model_type {model_types_text()}) running on attnkit's NumPy layers. Greedy unless "
                    "a sampling flag (--temperature above 0, --top-k, --top-p, --min-p, --seed) is given; the "
                    "warpers apply in Hugging Face's order: temperature, top-k, top-p, min-p. --chat renders the "
                    "prompt with the folder's chat template and prints the reply only.")
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="a folder written by save_pretrained, or a GGUF file (llama.cpp, ollama)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", type=escaped_text,
                        help=f"prompt text (needs the folder's tokenizer.json; {ESCAPES})")
    prompt.add_argument("--ids", metavar="IDS", help="prompt token ids, comma-separated (no tokenizer needed)")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the folder's chat template; print the reply only")
    p.add_argument("--system", metavar="TEXT", type=escaped_text, default=None,
                   help=f"a system message before the prompt (implies --chat; {ESCAPES})")
    add_chat_template_argument(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens to add at most (default 32)")
    add_generation_arguments(p, greedy_unless_asked=True)
    p.add_argument("--length-penalty", type=_finite_float, default=1.0,
                   help="beam search: a hypothesis scores sum(log p) / new_tokens ** this (default 1)")
    p.add_argument("--early-stopping", choices=("true", "false", "never"), default="false",
                   help="beam search: stop when every beam has finished (true), when no open beam can win at "
                        "its current length (false, default) or at the longest length (never)")
    add_speculation_arguments(p)
    add_prompt_cache_argument(p, "the prompt")
    add_control_vector_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (ids, new_ids, text, new_text)")
    add_keep_quantized_argument(p)
    p.add_argument("--verbose", action="store_true",
                   help="at the end, report on stderr the load time, the prompt's and the generated tokens and "
                        "their rates (tokens/s), as llama.cpp and ollama do")
    add_dtype_argument(p)
    add_threads_argument(p)
    add_quiet_argument(p)
    p.set_defaults(run=run)
    return p


def check_model_path(model_dir: str, prog: str = PROG) -> None:
    """A :class:`UsageError` of ``prog`` unless ``model_dir`` is a folder or a ``.gguf`` file."""
    from ..pretrained.gguf_file import is_gguf_path

    path = Path(model_dir)
    if path.is_dir() or (is_gguf_path(path) and path.exists()):
        return
    raise UsageError(f"{printable(repr(model_dir))} is not a folder nor a .gguf file", prog)


def model_for_command(model_dir: str, prog: str = PROG, keep_quantized: bool = False,
                      progress: bool | None = None, dtype: Any = np.float32) -> Any:
    """The CausalLM of ``model_dir`` (a folder or a GGUF file) in ``dtype`` (``--dtype``; quantized weights kept
    packed with ``keep_quantized``), its loading shown as ``progress`` says; a missing or damaged one is a
    :class:`UsageError` of ``prog`` (exit 2)."""
    from ..pretrained import load_causal_lm

    try:
        return load_causal_lm(model_dir, dtype=dtype, keep_quantized=keep_quantized, progress=progress)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UsageError(f"cannot load the model {printable(repr(model_dir))}: {printable(message, 300)}",
                         prog) from None


def assistant_for_command(args: argparse.Namespace, model: Any, tokenizer: Any, prog: str = PROG) -> Any:
    """The draft model of ``--assistant-model`` (None without it), loaded as the model was (``--dtype``,
    ``--keep-quantized``); a :class:`UsageError` of ``prog`` when it cannot load, or its tokenizer or vocabulary is
    not the model's (its drafts would be other tokens). Also checks ``--assistant-early-exit`` against the model's
    layers. With ``--draft-mtp``, the multi-token-prediction layers of the model's own folder."""
    early = getattr(args, "assistant_early_exit", None)
    if early is not None and early >= model.config.num_layers:
        raise UsageError(f"--assistant-early-exit {early}: the draft must be fewer layers than the model's "
                         f"{model.config.num_layers}", prog)
    if getattr(args, "draft_mtp", None):
        from ..pretrained.multi_token import load_multi_token_predictor
        try:
            return load_multi_token_predictor(args.model_dir, model)
        except (ValueError, OSError) as exc:
            raise UsageError(f"--draft-mtp: {exc}", prog) from None
    path = getattr(args, "assistant_model", None)
    if path is None:
        return None
    check_model_path(path, prog)
    draft = model_for_command(path, prog, keep_quantized=args.keep_quantized, progress=progress_of(args),
                              dtype=args.dtype)
    if draft.config.vocab_size > model.config.vocab_size:
        raise UsageError(f"--assistant-model {printable(repr(path))} has a vocabulary of {draft.config.vocab_size} "
                         f"tokens, more than the model's {model.config.vocab_size}: it needs the same tokenizer", prog)
    theirs = tokenizer_for_command(path, needed=False, prog=prog)
    if tokenizer is not None and theirs is not None and _vocabulary(theirs) != _vocabulary(tokenizer):
        raise UsageError(f"--assistant-model {printable(repr(path))} has another tokenizer than the model: its "
                         f"drafts would be other tokens", prog)
    return draft


def _vocabulary(tokenizer: Any) -> dict[str, int]:
    backend = getattr(tokenizer, "backend", tokenizer)  # attnkit's Tokenizer or a tokenizers.Tokenizer
    return backend.get_vocab(with_added_tokens=True)


def tokenizer_for_command(model_dir: str, needed: bool, prog: str = PROG) -> Any:
    """The ``tokenizers.Tokenizer`` of ``model_dir/tokenizer.json`` (of a GGUF file: the one its metadata
    describes), or None when there is none and it is not ``needed``; a missing-but-needed or unreadable file is
    a :class:`UsageError` of ``prog``."""
    from ..pretrained.gguf_file import is_gguf_path

    if is_gguf_path(model_dir):
        from ..pretrained.gguf_file import read_gguf
        from ..pretrained.gguf_tokenizer import gguf_tokenizer

        try:
            return gguf_tokenizer(read_gguf(model_dir)).backend
        except (ValueError, OSError) as exc:
            raise UsageError(f"cannot load the tokenizer of {printable(repr(model_dir))}: {printable(exc, 300)}",
                             prog) from None
    file = Path(model_dir) / "tokenizer.json"
    if not file.is_file():
        if needed:
            raise UsageError(f"{printable(repr(model_dir))} has no tokenizer.json: pass token ids with --ids "
                             f"instead of --prompt", prog)
        return None
    from ..pretrained._extra import import_extra

    tokenizers = import_extra("tokenizers", "read tokenizer.json")
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type for a bad file
        raise UsageError(f"cannot read {printable(repr(str(file)))}: {printable(exc, 200)}", prog) from None


def prompt_ids(args: argparse.Namespace, tokenizer: Any, config: Any, prog: str = PROG) -> list[int]:
    """The token ids of ``args.ids`` or ``args.prompt``, checked against the vocabulary and the context
    (else a :class:`UsageError` of ``prog``); a prompt whose characters alone show it cannot fit the context is
    refused before it is tokenized (:func:`check_prompt_length`)."""
    if args.ids is not None:
        return check_prompt_ids(parse_ids(args.ids, prog), config, prog)
    check_prompt_length(args.prompt, tokenizer, config, "the prompt", prog)
    return check_prompt_ids(tokenizer.encode(args.prompt).ids, config, prog)


def check_prompt_length(text: str, backend: Any, config: Any, what: str, prog: str = PROG) -> None:
    """A :class:`UsageError` of ``prog`` when ``text`` needs more tokens than the model's context by its length
    alone (:func:`attnkit.pretrained.tokenizer.fewest_tokens`): tokenizing 10 MB of text takes seconds and
    gigabytes, counting its characters does not."""
    from ..pretrained.tokenizer import fewest_tokens, max_token_chars

    longest = max_token_chars(backend)
    least = fewest_tokens(backend, text, longest)
    limit = config.max_position_embeddings
    if least > limit:
        raise UsageError(f"{what} has at least {least:,} tokens ({len(text):,} characters, and a token of this "
                         f"vocabulary holds at most {longest}), longer than the model's context of {limit}", prog)


def check_prompt_ids(ids: list[int], config: Any, prog: str = PROG) -> list[int]:
    """``ids`` when they are a prompt the model can read: not empty, in its vocabulary, inside its context
    (else a :class:`UsageError` of ``prog``)."""
    if not ids:
        raise UsageError("the prompt is empty (no tokens)", prog)
    bad = [i for i in ids if i >= config.vocab_size]
    if bad:
        raise UsageError(f"token id {bad[0]} is outside the model's vocabulary of {config.vocab_size}", prog)
    limit = config.max_position_embeddings
    if len(ids) > limit:
        raise UsageError(f"the prompt has {len(ids)} tokens, longer than the model's context of {limit}", prog)
    return ids


def _shown(text: str) -> str:
    """Model output made safe for a terminal, keeping its line breaks and tabs."""
    return "\n".join("\t".join(printable(cell) for cell in line.split("\t")) for line in text.split("\n"))


def _chat_template(args: argparse.Namespace) -> str | None:
    """``--chat``: the ``--chat-template`` given (None: the model's own, which must exist), checked before the
    model is loaded."""
    if args.prompt is None:
        raise UsageError("--chat, --system and --chat-template need --prompt (a message, rendered by the chat "
                         "template)", PROG)
    if args.chat_template is not None:
        return chat_template_option(args.chat_template, PROG)
    require_chat_template(args.model_dir, PROG)
    return None


def _chat_prompt(args: argparse.Namespace, config: Any, template: str | None) -> tuple[list[int], list[int] | None]:
    """``--chat``: the prompt ids of ``--system`` and ``--prompt`` rendered by the chat template (``template``,
    else the model's; a GGUF file's from its header), and the end-of-sequence ids the chat uses
    (``generation_config.json``'s, else the tokenizer's ``eos_token``). A conversation whose length in characters
    alone shows it cannot fit the context is refused before it is tokenized."""
    from ..pretrained import ChatTemplateError, load_tokenizer
    from ..pretrained.gguf_file import is_gguf_path, read_gguf
    from ..pretrained.gguf_tokenizer import gguf_tokenizer

    try:
        if is_gguf_path(args.model_dir):  # the tokenizer and templates its metadata describes
            tokenizer = gguf_tokenizer(read_gguf(args.model_dir))
        else:
            tokenizer = load_tokenizer(args.model_dir)
        if template is not None:
            tokenizer.chat_templates["default"] = template
        tokenizer.get_chat_template()
    except (ValueError, KeyError, TypeError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UsageError(f"cannot load {printable(repr(args.model_dir))}: {printable(message, 300)}", PROG) from None
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    messages.append({"role": "user", "content": args.prompt})
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except ChatTemplateError as exc:
        raise UsageError(str(exc), PROG) from None
    check_prompt_length(text, tokenizer.backend, config, "the conversation", PROG)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return check_prompt_ids(ids, config), list(tokenizer.eos_token_ids) or None


def run(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Generate from ``args`` and stream the text (or the ids, without a tokenizer) to ``stdout``."""
    out = sys.stdout if stdout is None else stdout
    check_model_path(args.model_dir, PROG)
    options = _decoding_options(args)  # flag errors before the (slow) load
    chat = args.chat or args.system is not None or args.chat_template is not None
    template = _chat_template(args) if chat else None
    vector = control_vector_option(args, PROG)  # the files read before the (slow) load
    progress = progress_of(args)
    use_threads(args.threads)
    start = time.perf_counter()
    tokenizer = tokenizer_for_command(args.model_dir, needed=args.prompt is not None)
    model = model_for_command(args.model_dir, keep_quantized=args.keep_quantized, progress=progress,
                              dtype=args.dtype)
    assistant = assistant_for_command(args, model, tokenizer)
    load_seconds = time.perf_counter() - start
    config = model.config
    if chat:
        prompt, eos_ids = _chat_prompt(args, config, template)
        options["eos_token_id"] = eos_ids
    else:
        prompt = prompt_ids(args, tokenizer, config)
    max_new = args.max_new_tokens
    if model.max_sequence_length is not None:  # a learned position table cannot go past its last row
        max_new = min(max_new, model.max_sequence_length - len(prompt))
    beams = options.get("num_beams", 1)
    _check_stops(options, model.generation_config.stop_strings, tokenizer, beams)
    with steering_for_command(model, vector, args, PROG):  # every forward below, the prefill and each step
        watch = Stopwatch(len(prompt))
        if beams > 1:
            stream = _beam_tokens(model, prompt, max_new, args, options, progress)
        else:
            steps = _steps(args, model, prompt, max_new, options, tokenizer, assistant, watch)
            # the prefill runs now, before the prompt is written: its line must not share a line with the text
            stream = _prefilled(model, steps, watch.prompt_tokens, max_new, progress,
                                counted=args.json or not _progress.wanted(None, out))
        prompt_text = tokenizer.decode(prompt) if tokenizer is not None else ""
        if not args.json and not chat:
            out.write(_shown(prompt_text) if tokenizer is not None else " ".join(map(str, prompt)))
            out.flush()
        eos = options.get("eos_token_id") or config.tokens.eos
        eos = set(eos if isinstance(eos, (tuple, list)) else () if eos is None else (eos,))
        new = _write_stream(out, watch.watch(stream), tokenizer, prompt, prompt_text, quiet=args.json)
    if args.json:
        text = tokenizer.decode(prompt + new) if tokenizer is not None else None
        record = {"ids": prompt + new, "new_ids": new, "text": text,
                  "new_text": None if text is None else text[len(prompt_text):],
                  "stopped_at_eos": bool(new) and new[-1] in eos}
        out.write(json_text(record))
    out.write("\n")
    if args.verbose:
        out.flush()
        _report_speed(watch.speed(), load_seconds, beams)
    return 0


def _decoding_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``generate`` keyword arguments of the generation and speculation flags, checked together."""
    options = generation_kwargs(args, PROG, greedy_unless_asked=True)
    options.update(speculation_kwargs(args, PROG))
    if args.prompt_cache is not None and options.get("num_beams", 1) > 1:
        raise UsageError("--prompt-cache cannot be combined with --num-beams (beam search starts from the prompt "
                         "alone)", PROG)
    return options


def _steps(args: argparse.Namespace, model: Any, prompt: list[int], max_new: int, options: dict[str, Any],
           tokenizer: Any, assistant: Any, watch: Stopwatch) -> Iterator[np.ndarray]:
    """The token stream of greedy or sampled decoding, from ``--prompt-cache``'s cache when given (the prompt is
    read into it and saved first; ``watch`` then counts only the ids read)."""
    from ..decoding.config import MAX_DRAFT_TOKENS
    from ..decoding.sampling import generate_stream

    cache = None
    if args.prompt_cache is not None:
        cache = open_prompt_cache(args.prompt_cache, model, PROG, rollback=MAX_DRAFT_TOKENS)
        read = read_prompt(args.prompt_cache, model, cache, prompt, PROG)
        watch.prompt_tokens, watch.cached_tokens = read + 1, len(prompt) - 1 - read
    return generate_stream(model, np.array([prompt], dtype=np.int64), max_new_tokens=max_new, tokenizer=tokenizer,
                           past_key_values=cache, assistant_model=assistant,
                           **{k: v for k, v in options.items() if k != "num_beams"})


def _write_stream(out: TextIO, stream: Iterator[np.ndarray], tokenizer: Any, prompt: list[int], prompt_text: str,
                  quiet: bool) -> list[int]:
    """Write each new token of ``stream`` as it comes (its text, once a multi-byte character is whole; its id
    without a tokenizer; nothing when ``quiet``) and return the new ids."""
    new: list[int] = []
    shown = ""
    for tokens in stream:
        token = int(tokens[0])
        new.append(token)
        if quiet:
            continue
        if tokenizer is None:
            out.write(f" {token}")
        else:
            text = tokenizer.decode(prompt + new)[len(prompt_text):]
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                out.write(_shown(text[len(shown):]))
                shown = text
        out.flush()
    return new


def _report_speed(speed: Speed, load_seconds: float, beams: int) -> None:
    """``--verbose``: the speed line on stderr. Beam search decides every token before it shows the first, so its
    prompt's pass and decode steps cannot be timed apart: its line has no rates."""
    if beams > 1:
        speed = Speed(speed.prompt_tokens, 0.0, speed.new_tokens, 0, speed.prompt_seconds + speed.decode_seconds, 1)
    print(speed.line(load_seconds), file=sys.stderr, flush=True)


def _check_stops(options: dict[str, Any], configured: Any, tokenizer: Any, beams: int) -> None:
    """Stop strings (``--stop``, else the folder's) need the tokenizer, and no beams."""
    stops = options.get("stop_strings", configured)
    if stops is not None and tokenizer is None:
        where = "--stop needs" if "stop_strings" in options else \
            "the folder's generation_config.json sets stop_strings, which need"
        raise UsageError(f"{where} its tokenizer.json to read the text, and there is none", PROG)
    if stops is not None and beams > 1:
        raise UsageError("the folder's generation_config.json sets stop_strings, which beam search does not "
                         "support: use --num-beams 1", PROG)


def _prefilled(model: Any, steps: Iterator[np.ndarray], length: int, max_new: int, progress: bool | None,
               counted: bool) -> Iterator[np.ndarray]:
    """``steps`` with its first step (the prefill) taken now, under a line counting the layers it has gone
    through; then the rest, under a line counting the tokens when ``counted`` (the text does not show them)."""
    with _prefill_line(model, length, progress):
        first = next(steps, None)
    return _counted([] if first is None else [first], steps, max_new, progress if counted else False)


@contextmanager
def _prefill_line(model: Any, length: int, progress: bool | None):
    """A line counting the layers the prompt's forward has gone through (each block's ``hook_resid_pre`` fires
    once; the hooks are removed before the decoding steps, which run faster without any)."""
    from ..explain.hooks import hook_names, hooks

    with _progress.progress(model.config.num_layers, f"prefill ({length} tokens)", unit="layer",
                            enabled=progress) as line:
        if not line.enabled:
            yield
            return

        def tick(value: np.ndarray, name: str) -> None:
            line.update()

        with hooks(model, {name: tick for name in hook_names(model) if name.endswith(".hook_resid_pre")}):
            yield


def _counted(head: Iterable[np.ndarray], rest: Iterator[np.ndarray], total: int,
             progress: bool | None) -> Iterator[np.ndarray]:
    with _progress.progress(total, "generating", unit="token", enabled=progress) as line:
        for tokens in itertools.chain(head, rest):
            line.update()
            yield tokens


def _beam_tokens(model: Any, prompt: list[int], max_new: int, args: argparse.Namespace,
                 options: dict[str, Any], progress: bool | None) -> list[np.ndarray]:
    """The best beam's new tokens, one (1,) array per token as the stream gives them, up to its eos."""
    from ..decoding.sampling import generate

    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    out = generate(model, np.array([prompt], dtype=np.int64), max_new_tokens=max_new,
                   length_penalty=args.length_penalty, early_stopping=early, progress=progress,
                   **options)[0, len(prompt):]  # (T,)
    eos = options.get("eos_token_id") or model.config.tokens.eos
    eos = set(eos if isinstance(eos, (tuple, list)) else () if eos is None else (eos,))
    ends = [i for i, token in enumerate(out.tolist()) if token in eos]
    return [out[i:i + 1] for i in range(ends[0] + 1 if ends else out.size)]

r'''``attnkit chat``: talk to a Hugging Face chat model folder (or a GGUF file) on attnkit, the reply streamed
as it is generated.

Each turn renders the whole conversation with the folder's chat template (as ``transformers`` renders it, with the
assistant prompt added; ``--chat-template`` replaces it with a jinja FILE or the NAME of a family's format,
:mod:`attnkit.cli._chat_template`; a model with neither is refused before its weights are read), generates until
an end-of-sequence id (``generation_config.json``'s list, else the tokenizer's ``eos_token``) or
``--max-new-tokens``, and prints the text piece by piece, never half of a character. Decoding follows
``generation_config.json`` unless a flag is given, as ``transformers`` does; ``--temperature 0`` means greedy, as
in llama.cpp and ollama. On a terminal a banner shows the settings once (the context, the reply length, the
threads, greedy or the sampling options). ``--system`` and ``--stop`` take backslash escapes (``\n``, ``\t``,
``\uXXXX``: :func:`~attnkit.cli._common.unescape`). ``--control-vector FILE[:SCALE]`` (repeatable) steers every
reply with llama.cpp control-vector files (:mod:`attnkit.cli._control_vector`). ``--verbose`` reports loading
and, after each reply, its speed line on stderr (:mod:`attnkit.cli._speed`: the load time, the prompt's tokens and
rate, the generated tokens and rate). On a terminal, a line on stderr shows the weights loading (``--quiet`` hides it).

Typing (:mod:`attnkit.cli._chat_input`): a line ending in ``\`` continues on the next line; a line starting
with ``"""`` opens a block of lines that ends at a line ending with ``"""`` (a block is always a message, never
a command). On a terminal, lines are edited with ``readline`` where Python has it, with a history of this
session kept in memory only (never written to disk).

Commands: ``/system TEXT`` sets or replaces the system message (``/system`` alone shows it); ``/set NAME VALUE``
changes a setting for the rest of the session, as ollama's ``/set parameter`` (:data:`SETTINGS`: every generation
flag by its argument name, ``max_new_tokens`` and ``system``), the value checked by the flag's own parser, so
that a value the flag would refuse is a message and changes nothing; ``/show`` prints the model and every
setting as the next reply will use it; ``/stats`` the speed of the last reply and the session's totals;
``/reset`` forgets the conversation (the system message stays); ``/save PATH`` writes the conversation as a JSON
list of ``{"role", "content"}`` messages (atomically; ``.json`` is added to a name without a suffix, another
suffix is refused); ``/load PATH`` replaces the conversation with such a file (:mod:`attnkit.cli._conversation`
checks it; a bad file is a message and the conversation stays as it was); ``/help`` lists them; ``/exit`` or end
of input (Ctrl-D) ends the chat. TEXT and VALUE take the escapes of the flags, and quotes around them are dropped.

The chat survives its user. A turn that cannot be answered is said on stderr and the chat goes on, the message
not sent: a line that is not UTF-8, a chat template that refuses the conversation, fails, renders nothing or goes
past its time or size budget (:mod:`attnkit.pretrained.chat_template`), a conversation longer than the model's
context (checked before the prefill, and, by its length in characters, before it is tokenized). Ctrl-C during a
reply stops it and returns to the prompt, keeping what was shown as the assistant's message (nothing shown: the
message is dropped too); Ctrl-C at the prompt ends the session, as end of input does; Ctrl-C at a continuation
prompt drops the unfinished message. A command changes the conversation or the settings only once it has
succeeded: Ctrl-C during a command, an error in it or a path no file can have (a NUL byte, an unknown ``~user``,
a name too long, a folder) is a message, after which the chat goes on as it was.
'''
from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ._chat_input import BLOCK, MessageReader
from ._chat_template import add_chat_template_argument, chat_template_option, require_chat_template
from ._common import (
    ESCAPES,
    Parser,
    UsageError,
    add_dtype_argument,
    add_keep_quantized_argument,
    add_quiet_argument,
    add_threads_argument,
    check_utf8,
    escaped_text,
    model_types_text,
    output_file,
    positive_int,
    printable,
    progress_of,
    tolerant_input,
    unescape,
    use_threads,
)
from ._control_vector import (
    add_control_vector_arguments,
    control_vector_option,
    steering_for_command,
    steering_text,
)
from ._generation import (
    GENERATION_OPTIONS,
    add_generation_arguments,
    add_speculation_arguments,
    generation_kwargs,
    speculation_kwargs,
)
from ._prompt_cache import add_prompt_cache_argument, open_prompt_cache, read_prompt
from ._speed import Speed, Stopwatch

__all__ = ["NAME", "add_parser", "run", "terminal_safe"]

NAME = "chat"
PROG = f"attnkit {NAME}"

# The commands typed at the prompt, with their argument and what they do (/help and --help list them).
COMMANDS = {
    "/system": ("TEXT", "set or replace the system message (/system alone shows it)"),
    "/set": ("NAME VALUE", "change a setting, checked as its flag is: /set alone lists them"),
    "/show": ("", "show the model and the settings"),
    "/stats": ("", "the speed of the last reply and of the session"),
    "/reset": ("", "forget the conversation (the system message stays)"),
    "/save": ("PATH", "write the conversation to PATH (.json added to a name without a suffix)"),
    "/load": ("PATH", "replace the conversation with one /save wrote"),
    "/help": ("", "list the commands and how to type several lines"),
    "/exit": ("", "end the chat (so do Ctrl-D and Ctrl-C at the prompt)"),
}
# What /set changes: the chat's generation flags, by their argument names (--top-p is top_p), and the system
# message. A value is checked by the flag's own parser (_with_setting).
SETTINGS = ("max_new_tokens", *GENERATION_OPTIONS, "system")
HELP = "\n".join([f"  {name + (' ' + arg if arg else ''):<18}{what}" for name, (arg, what) in COMMANDS.items()] + [
    f"  settings: {', '.join(SETTINGS)}; TEXT and VALUE take the flags' {ESCAPES}",
    "  a line ending in \\ continues on the next line",
    f'  {BLOCK} opens a block of several lines, ended by a line ending in {BLOCK} (a block is never a command)',
    "  Ctrl-C stops a reply (what was shown is kept) or a command (which then changes nothing); up and down "
    "recall earlier lines"])


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit chat`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="chat with a Hugging Face chat model folder or a GGUF file (the 'pretrained' extra)",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the epilog's list of commands in lines
        description=textwrap.fill(
            "Chat with a Hugging Face decoder folder (config.json with model_type "
            f"{model_types_text()}; model.safetensors, tokenizer.json and a chat template) or a GGUF file, on "
            "attnkit's NumPy layers. Type a message and press Enter; the reply streams. Decoding "
            "follows the folder's generation_config.json unless a flag is given; --temperature 0 is greedy.",
            width=100),
        epilog="while chatting:\n" + HELP)
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="a folder written by save_pretrained, or a GGUF file (llama.cpp, ollama)")
    p.add_argument("--system", metavar="TEXT", type=escaped_text, default=None,
                   help=f"a system message opening the conversation ({ESCAPES})")
    add_chat_template_argument(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="reply length at most (default 512)")
    add_generation_arguments(p, streamed=True)
    add_speculation_arguments(p)
    add_prompt_cache_argument(p, "the first message (the system message and the first message, rendered)")
    add_control_vector_arguments(p)
    add_dtype_argument(p)
    add_threads_argument(p)
    add_keep_quantized_argument(p)
    p.add_argument("--verbose", action="store_true",
                   help="report loading and, after each reply, the load time, the prompt's and the generated "
                        "tokens and their rates (tokens/s) on stderr, as /stats shows them")
    add_quiet_argument(p)
    p.set_defaults(run=run)
    return p


def _load(model_dir: str, verbose: bool, template: str | None = None, keep_quantized: bool = False,
          progress: bool | None = None, dtype: Any = np.float32) -> tuple[Any, Any]:
    from ..pretrained import load

    start = time.perf_counter()
    if verbose:
        print(f"loading {printable(model_dir)} ...", file=sys.stderr, flush=True)
    try:
        model, tokenizer = load(model_dir, dtype=dtype, keep_quantized=keep_quantized, progress=progress)
        if template is not None:
            tokenizer.chat_templates["default"] = template
        tokenizer.get_chat_template()
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UsageError(f"cannot load {printable(repr(model_dir))}: {printable(message, 300)}", PROG) from None
    if verbose:
        size = sum(p.nbytes for _, p in model.named_parameters()) / 2**20
        print(f"loaded {size:.0f} MB of weights in {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
    return model, tokenizer


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``generate`` keyword arguments of the flags; beam search is refused: it settles its tokens only at
    the end, so there would be nothing to stream."""
    options = generation_kwargs(args, PROG)
    if options.get("num_beams", 1) > 1:
        raise UsageError("--num-beams: beam search settles its tokens only at the end, so a chat cannot stream "
                         "it; use attnkit generate --chat --num-beams N for one reply", PROG)
    options.pop("num_beams", None)
    return {**options, **speculation_kwargs(args, PROG)}


def terminal_safe(text: str) -> str:
    """Model output made safe for a terminal, keeping its line breaks and tabs."""
    return "\n".join("\t".join(printable(cell) for cell in line.split("\t")) for line in text.split("\n"))


def _say(message: str) -> None:
    """A message about this turn on stderr; the chat goes on."""
    print(f"{PROG}: {printable(message, 500)}", file=sys.stderr, flush=True)


# -- one turn --------------------------------------------------------------------------------------------
@dataclass
class _Session:
    """One chat: the model, its settings (the flags, changed by ``/set``), the conversation and the speed so far.

    A reply or a command replaces ``messages`` or ``args`` whole once it has succeeded, never edits them in
    place, so that one which fails or is interrupted leaves them as they were."""

    model: Any
    tokenizer: Any
    args: argparse.Namespace
    messages: list[dict]
    out: TextIO
    load_seconds: float
    max_token_chars: int | None  # the most characters one token stands for (None: no bound holds)
    last: Speed | None = None
    total: Speed = field(default_factory=Speed)
    # The keys, values and states of the ids fed so far: the next turn's prompt starts with most of them, so only
    # its new tail is read (generate crops the cache to the prefix the two share). Dropped, to be rebuilt, when a
    # reply stops in the middle of a forward (its layers may then hold different lengths).
    cache: Any = None
    assistant: Any = None  # the draft model of --assistant-model
    prompt_cache: str | None = None  # the --prompt-cache file, until the first prompt is saved to it

    @property
    def context(self) -> int:
        return self.model.config.max_position_embeddings


def _prompt_ids(session: _Session, messages: list[dict]) -> list[int] | None:
    """``messages`` rendered by the chat template and tokenized, or None (said on stderr) when they cannot be
    sent: the template refuses them or renders nothing, or they do not fit the context. A conversation whose
    characters alone show it cannot fit (:func:`~attnkit.pretrained.tokenizer.fewest_tokens`) is refused before
    it is tokenized: tokenizing a pasted 10 MB line took 17 s and 2 GB."""
    from ..pretrained import ChatTemplateError
    from ..pretrained.tokenizer import fewest_tokens

    tokenizer = session.tokenizer
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except ChatTemplateError as exc:
        _say(f"{exc}; the message was not sent")
        return None
    if not text:
        _say("the chat template rendered nothing for this conversation; the message was not sent")
        return None
    least = fewest_tokens(tokenizer.backend, text, session.max_token_chars)
    if least >= session.context:
        _too_long(messages, f"at least {least:,} tokens: {len(text):,} characters, and a token of this vocabulary "
                            f"holds at most {session.max_token_chars}", session.context)
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) >= session.context:  # no room for one new token
        _too_long(messages, f"{len(ids)} tokens", session.context)
        return None
    return ids


def _too_long(messages: list[dict], count: str, context: int) -> None:
    hint = " (the system message stays: /system TEXT replaces it)" if _system_message(messages) else ""
    _say(f"the conversation ({count}) fills the model's context of {context} tokens; the message was not sent: "
         f"/reset to start again{hint}")


def _reply(session: _Session, text: str) -> None:
    """Answer ``text`` after the conversation, streaming the reply. A turn that cannot be answered
    (:func:`_prompt_ids`) is said on stderr and changes nothing. Ctrl-C stops the reply: what was shown so far is
    kept as the assistant's message (it is what the user saw), or, when nothing was shown, the turn is dropped."""
    from ..decoding.config import MAX_DRAFT_TOKENS
    from ..decoding.sampling import generate_stream

    model, tokenizer, args, out = session.model, session.tokenizer, session.args, session.out
    messages = [*session.messages, {"role": "user", "content": text}]
    ids = _prompt_ids(session, messages)
    if ids is None:
        return
    eos = list(tokenizer.eos_token_ids) or None
    cache, session.cache = session.cache, None  # held again only once this reply has run to its end
    if cache is None:
        cache = model.new_cache(1, max_length=session.context, rollback=MAX_DRAFT_TOKENS)
    watch = Stopwatch(len(ids))
    cached = None
    if session.prompt_cache is not None:  # the first prompt: read now, to be saved before the reply
        try:
            cached = len(ids) - 1 - read_prompt(session.prompt_cache, model, cache, ids, PROG)
        except UsageError as exc:
            _say(f"{exc}; the chat goes on without saving it")
        session.prompt_cache = None
    steps = generate_stream(model, np.array([ids], dtype=np.int64), max_new_tokens=min(args.max_new_tokens,
                            session.context - len(ids)), eos_token_id=eos, tokenizer=tokenizer, past_key_values=cache,
                            assistant_model=session.assistant, **_options(args))
    cached = cache.length if cached is None else cached  # generate_stream cropped it to the prefix it shares
    watch.prompt_tokens, watch.cached_tokens = len(ids) - cached, cached
    pieces = []
    stopped = False
    try:
        for piece in tokenizer.stream_decode(watch.watch(steps), skip_special_tokens=True):
            pieces.append(piece)
            out.write(terminal_safe(piece))
            out.flush()
        session.cache = cache
    except KeyboardInterrupt:
        steps.close()
        stopped = True
        out.write("\n[stopped]" if pieces else "[stopped]")
    out.write("\n")
    out.flush()
    if pieces or not stopped:
        session.messages = [*messages, {"role": "assistant", "content": "".join(pieces)}]
    speed = watch.speed()
    if speed.new_tokens:
        session.last, session.total = speed, session.total + speed
        if args.verbose:
            print(speed.line(session.load_seconds), file=sys.stderr, flush=True)


# -- the settings, shown once ----------------------------------------------------------------------------
def _settings(model: Any, args: argparse.Namespace) -> str:
    """One line of what decoding will do: the model's context, the reply length, the threads, greedy or the
    sampling options, and the logits processors (flags over the folder's ``generation_config.json``)."""
    from .. import get_num_threads
    from ..decoding.sampling import resolve_generation_options

    o = resolve_generation_options(model, **{k: v for k, v in _options(args).items() if k != "seed"})
    if o["do_sample"]:
        shown = [("temperature", o["temperature"]), ("top-k", o["top_k"]), ("top-p", o["top_p"]),
                 ("min-p", o["min_p"]), ("seed", args.seed)]
        decoding = "sampling: " + ", ".join(f"{name} {value:g}" for name, value in shown if value is not None)
    else:
        decoding = ("greedy: the same conversation always gets the same reply, so a reply that repeats itself is "
                    "the model's own; to sample, try --temperature 0.7 --top-p 0.9")
    processors = [("repetition penalty", o["repetition_penalty"]), ("no-repeat n-gram size", o["no_repeat_ngram_size"]),
                  ("min new tokens", o["min_new_tokens"])]
    decoding += "".join(f"; {name} {value:g}" for name, value in processors if value)
    stops = o["stop_strings"]
    if stops:
        stops = [stops] if isinstance(stops, str) else stops
        decoding += "; stops at " + ", ".join(printable(repr(stop), 40) for stop in stops)
    steered = steering_text(args)
    decoding += f"; {steered}" if steered else ""
    threads = get_num_threads()
    return (f"context {model.config.max_position_embeddings} tokens, replies up to {args.max_new_tokens} new "
            f"tokens, {threads} thread{'s' if threads != 1 else ''}; {decoding}")


# -- the commands ----------------------------------------------------------------------------------------
# What is true after a command was interrupted (each command changes the session only once it has succeeded).
_INTERRUPTED = {"/save": "the file is as it was, or holds the whole conversation (it is replaced whole)",
                "/load": "the conversation is as it was"}


def _system_message(messages: list[dict]) -> list[dict]:
    """The conversation's opening system message, as a list of zero or one message."""
    return messages[:1] if messages and messages[0]["role"] == "system" else []


def _run_command(name: str, arg: str, session: _Session) -> bool:
    """Carry out one command; True when the chat should end. Nothing a command meets ends the chat: Ctrl-C
    stops it and an error in it is a message, and either way the conversation and the settings stay as they
    were (a command replaces them only once it has succeeded; one that finished after a Ctrl-C that Python
    dropped is undone, see :func:`_interrupts_noted`)."""
    before = (session.messages, session.args)
    try:
        with _interrupts_noted() as interrupted:
            end = _command(name, arg, session)
        if interrupted():
            raise KeyboardInterrupt
        return end
    except KeyboardInterrupt:
        session.messages, session.args = before
        session.out.write(f"\n({name} interrupted: {_INTERRUPTED.get(name, 'nothing changed')})\n")
    except MemoryError:
        _say(f"{name}: not enough memory; the conversation and the settings are as they were")
    except Exception as exc:  # noqa: BLE001 - the chat outlives any command: its conversation is the user's
        _say(f"{name} failed ({type(exc).__name__}: {printable(exc, 200)}); the conversation and the settings are "
             f"as they were")
    session.out.flush()
    return False


@contextmanager
def _interrupts_noted() -> Iterator[Callable[[], bool]]:
    """While a command runs, Ctrl-C raises :class:`KeyboardInterrupt` as usual and is also noted; the context
    gives a function that says whether one came.

    Python runs a signal's handler wherever the interpreter next checks, and that may be inside a finalizer the
    garbage collector calls (a ``WeakSet``'s callback, while ``/load`` builds 300,000 messages); an exception
    raised there is printed as "Exception ignored" and dropped, so the Ctrl-C would be lost and the command
    would finish. Noted here, the dropped interrupt is not printed as a traceback either. Only on the main
    thread, and only when Ctrl-C has Python's own handler."""
    seen = False

    def noted(signum: int, frame: Any) -> None:
        nonlocal seen
        seen = True
        raise KeyboardInterrupt

    def unraisable(info: Any) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):
            hook(info)

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield lambda: False
        return
    previous, hook = signal.signal(signal.SIGINT, noted), sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield lambda: seen
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook


def _command(name: str, arg: str, session: _Session) -> bool:
    if name == "/exit":
        return True
    out = session.out
    if name == "/help":
        out.write(HELP + "\n")
    elif name == "/reset":
        session.messages = _system_message(session.messages)
        out.write("(conversation reset)\n")
    elif name == "/system":
        _set_system(arg, session)
    elif name == "/set":
        _set(arg, session)
    elif name == "/show":
        _show(session)
    elif name == "/stats":
        _stats(session)
    elif name == "/save":
        _save(arg, session)
    elif name == "/load":
        _load_conversation(arg, session)
    out.flush()
    return False


def _unquote(text: str) -> str:
    """``text`` without one pair of quotes around it (as a shell would need them around a path with spaces)."""
    return text[1:-1] if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"" else text


# -- /system, /set, /show, /stats ------------------------------------------------------------------------
def _set_system(arg: str, session: _Session) -> None:
    """``/system TEXT`` and ``/set system TEXT``: TEXT takes the escapes of ``--system``."""
    if not arg:
        current = _system_message(session.messages)
        session.out.write(f"(system message: {terminal_safe(current[0]['content'])})\n" if current else
                          "(no system message; /system TEXT sets one)\n")
        return
    from ..pretrained.tokenizer import fewest_tokens

    try:
        text = unescape(_unquote(arg))
    except ValueError as exc:
        _say(f"/system: {exc}; the system message is as it was")
        return
    least = fewest_tokens(session.tokenizer.backend, text, session.max_token_chars)
    if least >= session.context:
        _say(f"/system: that system message alone needs at least {least:,} tokens ({len(text):,} characters), more "
             f"than the model's context of {session.context} tokens; the system message is as it was")
        return
    system = {"role": "system", "content": text}
    replaced = bool(_system_message(session.messages))
    session.messages = [system, *session.messages[1:]] if replaced else [system, *session.messages]
    session.out.write("(system message replaced)\n" if replaced else "(system message set)\n")


@functools.cache
def _flags() -> argparse.ArgumentParser:
    """The chat's own parser: ``/set`` checks a value by parsing it as the flag of the same name."""
    return add_parser(Parser(prog="attnkit").add_subparsers(parser_class=Parser))


def _with_setting(args: argparse.Namespace, name: str, value: str) -> argparse.Namespace:
    """A copy of ``args`` with ``--NAME VALUE`` parsed into it (``stop`` replaces the stop strings), checked as
    the command line is: each flag's type, then the flags together (:func:`_options`). Raises
    :class:`UsageError` with the parser's message."""
    changed = argparse.Namespace(**vars(args))
    if name == "stop":
        changed.stop = None
    _flags().parse_args([f"--{name.replace('_', '-')}={value}", "--", args.model_dir], namespace=changed)
    _options(changed)
    return changed


def _set(arg: str, session: _Session) -> None:
    """``/set NAME VALUE``: change one setting for the rest of the session, as ollama's ``/set parameter``."""
    name, value = (arg.split(None, 1) + ["", ""])[:2]
    key = name.lower().replace("-", "_")
    if key not in SETTINGS:
        unknown = f"unknown setting {printable(repr(name), 40)}; " if name else ""
        session.out.write(f"({unknown}/set NAME VALUE, NAME one of: {', '.join(SETTINGS)}; /show shows them)\n")
        return
    if key == "system":
        _set_system(value.strip(), session)
        return
    value = _unquote(value.strip())
    if not value:
        _say(f"/set {key} needs a value: /set {key} VALUE")
        return
    try:
        args = _with_setting(session.args, key, value)
        summary = _settings(session.model, args)  # with the folder's defaults, as the next reply will use them
    except (UsageError, ValueError, TypeError) as exc:
        _say(f"/set {key}: {printable(exc, 300)}; the settings are as they were")
        return
    session.args = args
    session.out.write(f"({key} set; {summary})\n")


def _show(session: _Session) -> None:
    """``/show``: the model, every setting /set changes (as the next reply will use it) and the system message."""
    from ..decoding.sampling import resolve_generation_options

    args, model, out = session.args, session.model, session.out
    config = model.config
    out.write(f"model {printable(args.model_dir)}: {printable(config.family)} family, {config.num_layers} layers, "
              f"context {session.context} tokens, vocabulary {config.vocab_size} tokens, loaded in "
              f"{session.load_seconds:.2f} s\n{_settings(model, args)}\n")
    options = _options(args)
    o = resolve_generation_options(model, **{k: v for k, v in options.items() if k != "seed"})
    values = {"max_new_tokens": args.max_new_tokens, "stop": o["stop_strings"], "seed": args.seed,
              "temperature": o["temperature"] if o["do_sample"] else "0 (greedy)"}
    for name in SETTINGS[:-1]:
        value = values[name] if name in values else o.get(name)
        shown = "none" if value is None or value == [] else (
            ", ".join(printable(repr(v), 40) for v in value) if isinstance(value, list) else printable(value, 40))
        out.write(f"  {name} {shown}\n")
    system = _system_message(session.messages)
    out.write(f"  system {printable(repr(system[0]['content']), 200) if system else 'none'}\n"
              f"conversation: {len(session.messages)} message{'s' if len(session.messages) != 1 else ''}\n")


def _stats(session: _Session) -> None:
    """``/stats``: the speed of the last reply and the totals of the session (:mod:`attnkit.cli._speed`)."""
    if session.last is None:
        session.out.write("(no reply yet)\n")
        return
    total = session.total
    session.out.write(f"last reply: {session.last.line(session.load_seconds)}\n"
                      f"session, {total.replies} repl{'ies' if total.replies != 1 else 'y'}: "
                      f"{total.line(session.load_seconds)}\n")


# -- /save and /load -------------------------------------------------------------------------------------
def _path(arg: str, name: str) -> Path | None:
    """The file a command names (``~`` expanded; quotes around it dropped), or None (said on stderr) when no
    file can have that name."""
    arg = _unquote(arg)
    if not arg:
        _say(f"{name} needs a file: {name} PATH")
    elif "\x00" in arg:
        _say(f"{name}: a file name cannot hold a NUL byte, got {printable(repr(arg), 60)}")
    else:
        try:
            return Path(arg).expanduser()
        except RuntimeError:  # ~name of a user this system does not know
            _say(f"{name}: cannot expand {printable(repr(arg.split(os.sep)[0]), 60)}: no such user")
    return None


def _save(arg: str, session: _Session) -> None:
    """``/save PATH``: the conversation as JSON, written atomically; ``.json`` is added to a name without a
    suffix, and any other suffix is refused (a folder too)."""
    from ._conversation import write_conversation

    path = _path(arg, "/save")
    if path is None:
        return
    shown = printable(repr(str(path)), 200)
    try:
        if _unquote(arg).endswith(os.sep) or path.is_dir():
            _say(f"/save: {shown} is a folder; name a file in it (/save {printable(path)}{os.sep}chat.json)")
            return
        if not path.suffix:
            path = path.with_name(path.name + ".json")
        write_conversation(output_file(path, (".json",), PROG, "/save's file"), session.messages)
    except UsageError as exc:
        _say(f"{exc}; nothing was saved")
        return
    except OSError as exc:
        _say(f"cannot write {shown}: {exc.strerror or exc}; nothing was saved")
        return
    count = len(session.messages)
    session.out.write(f"(saved {count} message{'s' if count != 1 else ''} to {printable(path)})\n")


def _load_conversation(arg: str, session: _Session) -> None:
    """``/load PATH``: replace the conversation with a file /save wrote (``PATH.json`` when PATH has no suffix
    and does not exist, as /save names it), checked whole before anything changes."""
    from ._conversation import read_conversation

    path = _path(arg, "/load")
    if path is None:
        return
    try:
        if not path.suffix and not path.exists():
            path = path.with_name(path.name + ".json")
        loaded = read_conversation(path)
    except (ValueError, OSError) as exc:
        reason = exc.strerror or exc if isinstance(exc, OSError) else exc
        _say(f"cannot load {printable(repr(str(path)), 200)}: {reason}; the conversation is unchanged")
        return
    session.messages = loaded
    session.out.write(f"(loaded {len(loaded)} message{'s' if len(loaded) != 1 else ''} from {printable(path)})\n")


# -- the loop --------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Load the folder, then read a message at a time and stream each reply."""
    from ..pretrained.tokenizer import max_token_chars

    src = tolerant_input(sys.stdin if stdin is None else stdin)
    out = sys.stdout if stdout is None else stdout
    from ..decoding.config import MAX_DRAFT_TOKENS
    from .generate import assistant_for_command, check_model_path

    check_model_path(args.model_dir, PROG)
    _options(args)  # flag errors before the (slow) load
    template = None if args.chat_template is None else chat_template_option(args.chat_template, PROG)
    if template is None:
        require_chat_template(args.model_dir, PROG)  # before the (slow) load
    vector = control_vector_option(args, PROG)  # the files read before the (slow) load too
    use_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = _load(args.model_dir, args.verbose, template, args.keep_quantized, progress_of(args),
                             args.dtype)
    assistant = assistant_for_command(args, model, tokenizer, PROG)
    load_seconds = time.perf_counter() - start
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    session = _Session(model, tokenizer, args, messages, out, load_seconds, max_token_chars(tokenizer.backend),
                       assistant=assistant, prompt_cache=args.prompt_cache)
    if args.prompt_cache is not None:
        session.cache = open_prompt_cache(args.prompt_cache, model, PROG, rollback=MAX_DRAFT_TOKENS)
    with steering_for_command(model, vector, args, PROG):  # every reply of the session is steered
        return _converse(session, src, out)


def _converse(session: _Session, src: TextIO, out: TextIO) -> int:
    """Read a message or a command at a time until the end of input or /exit, answering each message."""
    model, args = session.model, session.args
    interactive = src.isatty()
    reader = MessageReader(src, out, interactive, _say, commands=tuple(COMMANDS))
    if interactive:
        out.write(f"{PROG}: {printable(Path(args.model_dir).name or args.model_dir)}: {_settings(model, args)}\n"
                  f"type a message (a line ending in \\ continues, {BLOCK} opens a block of lines); /help lists the "
                  f"commands; Ctrl-C stops a reply, Ctrl-D ends the chat\n")
    while True:
        typed = reader.read()
        if typed is None:
            return 0
        text = typed.text
        try:
            check_utf8(text, "that line" if typed.lines == 1 else "that message")
        except UsageError as exc:
            _say(f"{exc}; type it again")
            continue
        command = text.strip()
        if not command:
            continue
        if command.startswith("/") and not typed.block:
            name, arg = (command.split(None, 1) + [""])[:2]
            if name not in COMMANDS:
                known = ", ".join(COMMANDS)
                out.write(f"unknown command {printable(name, 40)}; commands: {known} (/help says more; a "
                          f"{BLOCK} block sends a message that starts with /)\n")
                continue
            if _run_command(name, arg.strip(), session):
                return 0
            continue
        try:
            _reply(session, text)
        except KeyboardInterrupt:  # before the reply began (rendering, tokenizing): as if never sent
            out.write("[stopped]\n")

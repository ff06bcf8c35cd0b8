r'''``attnkit chat``: talk to a Hugging Face chat model folder on attnkit, the reply streamed as it is generated.

Each turn renders the whole conversation with the folder's chat template (as ``transformers`` renders it, with
the assistant prompt added; ``--chat-template FILE`` replaces it), generates until an end-of-sequence id
(``generation_config.json``'s list, else the tokenizer's ``eos_token``) or ``--max-new-tokens``, and prints the
text piece by piece, never half of a character. Decoding follows ``generation_config.json`` unless a flag is
given, as ``transformers`` does; ``--temperature 0`` means greedy, as in llama.cpp and ollama. On a terminal a
banner shows the settings once (the context, the reply length, the threads, greedy or the sampling options).
``--verbose`` reports loading and each reply's tokens per second on stderr.

Typing (:mod:`attnkit.cli._chat_input`): a line ending in ``\`` continues on the next line; a line starting
with ``"""`` opens a block of lines that ends at a line ending with ``"""`` (a block is always a message, never
a command). On a terminal, lines are edited with ``readline`` where Python has it, with a history of this
session kept in memory only (never written to disk).

Commands: ``/system TEXT`` sets or replaces the system message (``/system`` alone shows it), ``/reset`` forgets
the conversation (the system message stays), ``/save PATH`` writes the conversation as a JSON list of
``{"role", "content"}`` messages (atomically; the path must end in ``.json``), ``/load PATH`` replaces the
conversation with such a file (:mod:`attnkit.cli._conversation` checks it; a bad file is a message and the
conversation stays as it was), ``/help`` lists them, ``/exit`` or end of input (Ctrl-D) ends the chat.

The chat survives its user. A turn that cannot be answered is said on stderr and the chat goes on, the message
not sent: a line that is not UTF-8, a chat template that refuses the conversation, fails, renders nothing or goes
past its time or size budget (:mod:`attnkit.pretrained.chat_template`), a conversation longer than the model's
context (checked before the prefill). Ctrl-C during a reply stops it and returns to the prompt, keeping what was
shown as the assistant's message (nothing shown: the message is dropped too); Ctrl-C at the prompt ends the
session, as end of input does; Ctrl-C at a continuation prompt drops the unfinished message.
'''
from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ._chat_input import BLOCK, MessageReader
from ._common import (
    UsageError,
    add_dtype_argument,
    add_threads_argument,
    check_utf8,
    output_file,
    positive_int,
    printable,
    tolerant_input,
    use_threads,
)
from ._generation import add_generation_arguments, generation_kwargs

__all__ = ["NAME", "add_parser", "run", "terminal_safe"]

NAME = "chat"
PROG = f"attnkit {NAME}"

# The commands typed at the prompt, with their argument and what they do (/help and --help list them).
COMMANDS = {
    "/system": ("TEXT", "set or replace the system message (/system alone shows it)"),
    "/reset": ("", "forget the conversation (the system message stays)"),
    "/save": ("PATH", "write the conversation to PATH (.json: a list of {role, content} messages)"),
    "/load": ("PATH", "replace the conversation with one /save wrote"),
    "/help": ("", "list the commands and how to type several lines"),
    "/exit": ("", "end the chat (so do Ctrl-D and Ctrl-C at the prompt)"),
}
HELP = "\n".join([f"  {name + (' ' + arg if arg else ''):<14}{what}" for name, (arg, what) in COMMANDS.items()] + [
    "  a line ending in \\ continues on the next line",
    f'  {BLOCK} opens a block of several lines, ended by a line ending in {BLOCK} (a block is never a command)',
    "  Ctrl-C stops a reply (what was shown is kept); up and down recall earlier lines"])


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit chat`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="chat with a Hugging Face chat model folder or a GGUF file (the 'pretrained' extra)",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the epilog's list of commands in lines
        description=textwrap.fill(
            "Chat with a Hugging Face decoder folder (config.json, model.safetensors, tokenizer.json and a chat "
            "template) on attnkit's NumPy layers. Type a message and press Enter; the reply streams. Decoding "
            "follows the folder's generation_config.json unless a flag is given; --temperature 0 is greedy.",
            width=100),
        epilog="while chatting:\n" + HELP)
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="a folder written by save_pretrained, or a GGUF file (llama.cpp, ollama)")
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message opening the conversation")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a jinja chat template to use instead of the folder's")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="reply length at most (default 512)")
    add_generation_arguments(p, streamed=True)
    add_dtype_argument(p)
    add_threads_argument(p)
    p.add_argument("--verbose", action="store_true", help="report loading and tokens/s on stderr")
    p.set_defaults(run=run)
    return p


def _load(model_dir: str, verbose: bool, template: str | None = None, dtype: Any = np.float32) -> tuple[Any, Any]:
    from ..pretrained import load

    start = time.perf_counter()
    if verbose:
        print(f"loading {printable(model_dir)} ...", file=sys.stderr, flush=True)
    try:
        model, tokenizer = load(model_dir, dtype=dtype)
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
    return options


def _read_template(path: str) -> str:
    """The text of ``--chat-template`` (UTF-8, at most 1 MB), else a :class:`UsageError`."""
    file = Path(path).expanduser()
    shown = printable(repr(path))
    if not file.is_file():
        raise UsageError(f"--chat-template {shown} is not a file", PROG)
    if file.stat().st_size > 2**20:
        raise UsageError(f"--chat-template {shown} is larger than 1 MB; a chat template is a page of jinja", PROG)
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--chat-template {shown} is not UTF-8 text (byte {exc.start + 1})", PROG) from None


def terminal_safe(text: str) -> str:
    """Model output made safe for a terminal, keeping its line breaks and tabs."""
    return "\n".join("\t".join(printable(cell) for cell in line.split("\t")) for line in text.split("\n"))


def _say(message: str) -> None:
    """A message about this turn on stderr; the chat goes on."""
    print(f"{PROG}: {printable(message, 500)}", file=sys.stderr, flush=True)


def _reply(model: Any, tokenizer: Any, messages: list[dict], args: argparse.Namespace, out: TextIO) -> None:
    """Answer the last message, streaming the reply. A turn that cannot be answered (the template refuses the
    conversation, renders nothing, or the conversation fills the context) is said on stderr and the user's
    message is dropped. Ctrl-C stops the reply: what was shown so far is kept as the assistant's message (it is
    what the user saw), or, when nothing was shown, the user's message is dropped too."""
    from ..decoding.sampling import generate_stream
    from ..pretrained import ChatTemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    except ChatTemplateError as exc:
        _say(f"{exc}; the message was not sent")
        messages.pop()
        return
    if not ids:
        _say("the chat template rendered nothing for this conversation; the message was not sent")
        messages.pop()
        return
    context = model.config.max_position_embeddings
    max_new = min(args.max_new_tokens, context - len(ids))
    if max_new <= 0:
        _say(f"the conversation ({len(ids)} tokens) fills the model's context of {context} tokens; the message "
             f"was not sent: /reset to start again")
        messages.pop()
        return
    eos = list(tokenizer.eos_token_ids) or None
    start = time.perf_counter()
    steps = generate_stream(model, np.array([ids], dtype=np.int64), max_new_tokens=max_new, eos_token_id=eos,
                            tokenizer=tokenizer, **_options(args))
    count = 0

    def tokens():
        nonlocal count
        for step in steps:
            count += 1
            yield step

    pieces = []
    try:
        for piece in tokenizer.stream_decode(tokens(), skip_special_tokens=True):
            pieces.append(piece)
            out.write(terminal_safe(piece))
            out.flush()
    except KeyboardInterrupt:
        steps.close()
        out.write("\n[stopped]" if pieces else "[stopped]")
        if not pieces:
            messages.pop()
    out.write("\n")
    out.flush()
    if pieces:
        messages.append({"role": "assistant", "content": "".join(pieces)})
    if args.verbose:
        seconds = time.perf_counter() - start
        print(f"[{count} tokens, {count / max(seconds, 1e-9):.1f} tokens/s, prompt {len(ids)} tokens]",
              file=sys.stderr, flush=True)


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
    threads = get_num_threads()
    return (f"context {model.config.max_position_embeddings} tokens, replies up to {args.max_new_tokens} new "
            f"tokens, {threads} thread{'s' if threads != 1 else ''}; {decoding}")


# -- the commands ----------------------------------------------------------------------------------------
def _system_message(messages: list[dict]) -> list[dict]:
    """The conversation's opening system message, as a list of zero or one message."""
    return messages[:1] if messages and messages[0]["role"] == "system" else []


def _command(name: str, arg: str, messages: list[dict], out: TextIO) -> bool:
    """Carry out one command on ``messages`` (edited in place); True when the chat should end."""
    if name == "/exit":
        return True
    if name == "/help":
        out.write(HELP + "\n")
    elif name == "/reset":
        messages[:] = _system_message(messages)
        out.write("(conversation reset)\n")
    elif name == "/system":
        _set_system(arg, messages, out)
    elif name == "/save":
        _save(arg, messages, out)
    elif name == "/load":
        _load_conversation(arg, messages, out)
    return False


def _set_system(text: str, messages: list[dict], out: TextIO) -> None:
    if not text:
        current = _system_message(messages)
        out.write(f"(system message: {terminal_safe(current[0]['content'])})\n" if current else
                  "(no system message; /system TEXT sets one)\n")
        return
    if _system_message(messages):
        messages[0] = {"role": "system", "content": text}
        out.write("(system message replaced)\n")
    else:
        messages.insert(0, {"role": "system", "content": text})
        out.write("(system message set)\n")


def _path(arg: str, name: str) -> Path | None:
    """The file a command names (``~`` expanded; quotes around it, as a shell would need, dropped)."""
    if len(arg) > 1 and arg[0] == arg[-1] and arg[0] in "'\"":
        arg = arg[1:-1]
    if not arg:
        _say(f"{name} needs a file: {name} PATH")
        return None
    return Path(arg).expanduser()


def _save(arg: str, messages: list[dict], out: TextIO) -> None:
    from ._conversation import write_conversation

    path = _path(arg, "/save")
    if path is None:
        return
    try:
        write_conversation(output_file(path, (".json",), PROG, "/save's file"), messages)
    except UsageError as exc:
        _say(f"{exc}; nothing was saved")
        return
    except OSError as exc:
        _say(f"cannot write {printable(repr(str(path)))}: {exc.strerror or exc}; nothing was saved")
        return
    out.write(f"(saved {len(messages)} message{'s' if len(messages) != 1 else ''} to {printable(path)})\n")


def _load_conversation(arg: str, messages: list[dict], out: TextIO) -> None:
    from ._conversation import read_conversation

    path = _path(arg, "/load")
    if path is None:
        return
    try:
        loaded = read_conversation(path)
    except (ValueError, OSError) as exc:
        reason = exc.strerror or exc if isinstance(exc, OSError) else exc
        _say(f"cannot load {printable(repr(str(path)))}: {reason}; the conversation is unchanged")
        return
    messages[:] = loaded
    out.write(f"(loaded {len(loaded)} message{'s' if len(loaded) != 1 else ''} from {printable(path)})\n")


# -- the loop --------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Load the folder, then read a message at a time and stream each reply."""
    src = tolerant_input(sys.stdin if stdin is None else stdin)
    out = sys.stdout if stdout is None else stdout
    from .generate import check_model_path

    check_model_path(args.model_dir, PROG)
    _options(args)  # flag errors before the (slow) load
    template = None if args.chat_template is None else _read_template(args.chat_template)
    use_threads(args.threads)
    model, tokenizer = _load(args.model_dir, args.verbose, template, args.dtype)
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
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
            if _command(name, arg.strip(), messages, out):
                return 0
            continue
        messages.append({"role": "user", "content": text})
        try:
            _reply(model, tokenizer, messages, args, out)
        except KeyboardInterrupt:  # before the reply began (rendering, tokenizing): as if never sent
            out.write("[stopped]\n")
            if messages and messages[-1] == {"role": "user", "content": text}:
                messages.pop()

"""``attnkit chat``: talk to a Hugging Face chat model folder on attnkit, the reply streamed as it is generated.

Each turn renders the whole conversation with the folder's chat template (as ``transformers`` renders it, with
the assistant prompt added), generates until an end-of-sequence id (``generation_config.json``'s list, else the
tokenizer's ``eos_token``) or ``--max-new-tokens``, and prints the text piece by piece, never half of a
character. ``/reset`` forgets the conversation (keeping ``--system``), ``/exit`` or end of input (Ctrl-D) ends
it. Sampling follows ``generation_config.json`` unless an option is given; ``--temperature 0`` means greedy, as
in llama.cpp and ollama. ``--verbose`` reports loading and each reply's tokens per second on stderr.

The chat survives its user. A turn that cannot be answered is said on stderr and the chat goes on, the message
not sent: a line that is not UTF-8, a chat template that refuses the conversation, fails, renders nothing or goes
past its time or size budget (:mod:`attnkit.pretrained.chat_template`), a conversation longer than the model's
context (checked before the prefill). Ctrl-C during a reply stops it and returns to the prompt, keeping what was
shown as the assistant's message (nothing shown: the message is dropped too); Ctrl-C at the prompt ends the
session, as end of input does.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import numpy as np

from ._common import UsageError, check_utf8, non_negative_int, positive_int, printable, tolerant_input

__all__ = ["NAME", "add_parser", "run", "terminal_safe"]

NAME = "chat"
PROG = f"attnkit {NAME}"
COMMANDS = {"/exit": "end the chat", "/reset": "forget the conversation (the system message stays)"}


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {printable(repr(text), 40)}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {printable(text, 40)}")
    return value


_non_negative_float.__name__ = "number >= 0"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``attnkit chat`` and its arguments."""
    p = subparsers.add_parser(
        NAME, help="chat with a Hugging Face chat model folder (needs the 'pretrained' extra)",
        description="Chat with a Hugging Face decoder folder (config.json, model.safetensors, tokenizer.json and "
                    "a chat template) on attnkit's NumPy layers. Type a message and press Enter; /reset forgets "
                    "the conversation, /exit (or Ctrl-D) ends it.")
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="a folder written by save_pretrained, or a GGUF file (llama.cpp, ollama)")
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message opening the conversation")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="reply length at most (default 512)")
    p.add_argument("--temperature", type=_non_negative_float, default=None,
                   help="sampling temperature; 0 = greedy (default: the folder's generation_config.json)")
    p.add_argument("--top-k", type=non_negative_int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--top-p", type=_non_negative_float, default=None, help="nucleus sampling mass in [0, 1]")
    p.add_argument("--repetition-penalty", type=_non_negative_float, default=None,
                   help="> 1 discourages repeating tokens (Hugging Face's repetition_penalty)")
    p.add_argument("--seed", type=non_negative_int, default=None, help="seed for reproducible sampling")
    p.add_argument("--verbose", action="store_true", help="report loading and tokens/s on stderr")
    p.set_defaults(run=run)
    return p


def _load(model_dir: str, verbose: bool) -> tuple[Any, Any]:
    from ..pretrained import load

    start = time.perf_counter()
    if verbose:
        print(f"loading {printable(model_dir)} ...", file=sys.stderr, flush=True)
    try:
        model, tokenizer = load(model_dir)
        tokenizer.get_chat_template()
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UsageError(f"cannot load {printable(repr(model_dir))}: {printable(message, 300)}", PROG) from None
    if verbose:
        size = sum(p.nbytes for _, p in model.named_parameters()) / 2**20
        print(f"loaded {size:.0f} MB of weights in {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
    return model, tokenizer


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                               "repetition_penalty": args.repetition_penalty}
    if args.top_p is not None and args.top_p > 1:
        raise UsageError(f"--top-p must be in [0, 1], got {args.top_p}", PROG)
    if args.repetition_penalty == 0:
        raise UsageError("--repetition-penalty must be > 0", PROG)
    if args.temperature == 0:
        options["do_sample"] = False
    elif args.temperature is not None:
        options.update(do_sample=True, temperature=args.temperature)
    elif args.top_k is not None or args.top_p is not None or args.seed is not None:
        options["do_sample"] = True
    return options


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
                            tokenizer=tokenizer, **_sampling(args))
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


def _read_message(src: TextIO, out: TextIO, interactive: bool) -> str | None:
    """The next line typed, or None at the end of the session (end of input, or Ctrl-C at the prompt)."""
    try:  # the prompt too: Ctrl-C as soon as it shows may arrive before the read begins
        if interactive:
            out.write("> ")
            out.flush()
        line = src.readline()
    except KeyboardInterrupt:
        out.write("\n")
        return None
    return line.rstrip("\n") if line else None


def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Load the folder, then read a message per line and stream each reply."""
    src = tolerant_input(sys.stdin if stdin is None else stdin)
    out = sys.stdout if stdout is None else stdout
    from .generate import check_model_path

    check_model_path(args.model_dir, PROG)
    _sampling(args)  # option errors before the (slow) load
    model, tokenizer = _load(args.model_dir, args.verbose)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    messages = list(system)
    interactive = src.isatty()
    if interactive:
        out.write("type a message; /reset forgets the conversation, /exit ends it; Ctrl-C stops a reply\n")
    while True:
        text = _read_message(src, out, interactive)
        if text is None:
            return 0
        try:
            check_utf8(text, "that line")
        except UsageError as exc:
            _say(f"{exc}; type it again")
            continue
        command = text.strip()
        if command == "/exit":
            return 0
        if command == "/reset":
            messages = list(system)
            out.write("(conversation reset)\n")
            continue
        if command.startswith("/") and command.split()[0] not in COMMANDS:
            known = ", ".join(f"{name} ({what})" for name, what in COMMANDS.items())
            out.write(f"unknown command {printable(command.split()[0], 40)}; commands: {known}\n")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": text})
        try:
            _reply(model, tokenizer, messages, args, out)
        except KeyboardInterrupt:  # before the reply began (rendering, tokenizing): as if never sent
            out.write("[stopped]\n")
            if messages and messages[-1] == {"role": "user", "content": text}:
                messages.pop()

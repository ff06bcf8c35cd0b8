"""``--chat-template NAME|FILE``, shared by ``attnkit chat`` and ``attnkit generate --chat``: a jinja file, or the
name of a family's format (:mod:`attnkit.pretrained.named_chat_templates`); a path that exists is read as the
file even when it is also a name. And the check, before the weights are loaded, that a model without this
option has a chat template of its own."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..pretrained.named_chat_templates import NAMED_CHAT_TEMPLATES, named_chat_template
from ._common import UsageError, printable

__all__ = ["add_chat_template_argument", "chat_template_option", "require_chat_template"]

_NAMES = ", ".join(NAMED_CHAT_TEMPLATES)
_MAX_BYTES = 2**20  # a chat template is a page of jinja


def add_chat_template_argument(parser: Any) -> None:
    """Register ``--chat-template NAME|FILE``."""
    parser.add_argument("--chat-template", metavar="NAME|FILE", default=None,
                        help=f"the chat template to use instead of the model's (needed when it has none): a jinja "
                             f"FILE, or the NAME of a family's format: {_NAMES} (a FILE that exists wins over a "
                             f"NAME)")


def chat_template_option(value: str, prog: str) -> str:
    """The template ``--chat-template value`` names: the file's text (UTF-8, at most 1 MB) when ``value`` is a
    path that exists, else the format of that name; else a :class:`UsageError` of ``prog``."""
    file = Path(value).expanduser()
    shown = printable(repr(value))
    if not file.exists():
        template = named_chat_template(value)
        if template is None:
            raise UsageError(f"--chat-template {shown} is neither a file nor the name of a chat format "
                             f"({_NAMES})", prog)
        return template
    if not file.is_file():
        raise UsageError(f"--chat-template {shown} is not a file", prog)
    if file.stat().st_size > _MAX_BYTES:
        raise UsageError(f"--chat-template {shown} is larger than 1 MB; a chat template is a page of jinja", prog)
    try:
        return file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--chat-template {shown} is not UTF-8 text (byte {exc.start + 1})", prog) from None
    except OSError as exc:
        raise UsageError(f"--chat-template {shown} cannot be read: {exc.strerror or exc}", prog) from None


def require_chat_template(model: str, prog: str) -> None:
    """A :class:`UsageError` of ``prog`` when the model folder or GGUF file has no chat template, found from its
    small files or its GGUF header before any weight is read (a model takes seconds to minutes to load)."""
    from ..pretrained import read_chat_templates

    try:
        templates = read_chat_templates(model)
    except (ValueError, OSError) as exc:
        raise UsageError(f"cannot load {printable(repr(model))}: {printable(exc, 300)}", prog) from None
    if "default" not in templates:
        raise UsageError(f"{printable(repr(model))} has no chat template (no chat_template.jinja, no chat_template "
                         f"in tokenizer_config.json, no tokenizer.chat_template in a GGUF file); give one with "
                         f"--chat-template NAME or FILE (NAME: {_NAMES})", prog)

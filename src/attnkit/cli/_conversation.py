"""A chat conversation as a file: ``attnkit chat``'s ``/save`` and ``/load``.

The file is JSON, a list of messages as ``transformers``' ``apply_chat_template`` takes them::

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi."}]

:func:`read_conversation` takes only that shape: a list of objects with exactly the keys ``role`` (a
non-empty string) and ``content`` (a string), every string UTF-8 text, the file at most
:data:`MAX_CONVERSATION_BYTES`. Anything else is a :class:`ValueError` naming the message and what was
wrong, so that a hand-edited or foreign file is refused where it is read, not by the chat template later.
"""
from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from ..io import atomic_write
from ._common import UsageError, check_utf8, printable

__all__ = ["MAX_CONVERSATION_BYTES", "read_conversation", "write_conversation"]

# Far more than any model's context holds as text; a file larger than this is not a conversation.
MAX_CONVERSATION_BYTES = 64 * 2**20
_KEYS = ("role", "content")


def write_conversation(path: str | Path, messages: Sequence[dict]) -> Path:
    """Write ``messages`` to ``path`` as a JSON list, atomically (the previous file stays whole on failure).

    Examples
    --------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "chat.json")
    >>> _ = write_conversation(path, [{"role": "user", "content": "caf\\u00e9"}])
    >>> read_conversation(path)
    [{'role': 'user', 'content': 'café'}]
    """
    records = [{key: message[key] for key in _KEYS} for message in messages]
    data = (json.dumps(records, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
    return atomic_write(path, lambda f: f.write(data))


def read_conversation(path: str | Path) -> list[dict]:
    """The messages saved in ``path``: a list of ``{"role": str, "content": str}``.

    Raises
    ------
    ValueError
        The path is not a regular file, the file is too large, not UTF-8, not JSON, or not a list of
        messages with exactly a non-empty string ``role`` and a string ``content`` (the message says which
        message and what it held).
    OSError
        The file cannot be read.
    """
    raw = _read_regular_file(Path(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at byte {exc.start + 1}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # a number of too many digits, nesting too deep
        raise ValueError(f"not JSON attnkit can read: {printable(exc, 100)}") from None
    if not isinstance(data, list):
        kind = "null" if data is None else type(data).__name__
        raise ValueError(f"must hold a JSON list of messages, got {kind}")
    return [_message(item, number) for number, item in enumerate(data, 1)]


def _read_regular_file(file: Path) -> bytes:
    """The bytes of ``file``, checked to be a regular file of at most :data:`MAX_CONVERSATION_BYTES` on the
    descriptor that is read (opened without blocking), so that a FIFO or a device, which would block or never
    end, is refused even when it replaces the file after a check by name."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ValueError("no such file") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_CONVERSATION_BYTES:
            raise ValueError(f"larger than {MAX_CONVERSATION_BYTES // 2**20} MB; a conversation is text")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_CONVERSATION_BYTES + 1)
    finally:
        os.close(fd)


def _message(item: object, number: int) -> dict:
    where = f"message {number}"
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object with role and content, got {printable(repr(item), 60)}")
    extra = [key for key in item if key not in _KEYS]
    if extra:
        raise ValueError(f"{where} has the key {printable(repr(extra[0]), 60)}; a message holds only role and "
                         f"content")
    for key in _KEYS:
        if key not in item:
            raise ValueError(f"{where} has no {key}")
        if not isinstance(item[key], str):
            raise ValueError(f"{where}'s {key} must be a string, got {printable(repr(item[key]), 60)}")
        try:  # a JSON escape can write a lone surrogate
            check_utf8(item[key], f"{where}'s {key}")
        except UsageError as exc:
            raise ValueError(str(exc)) from None
    if not item["role"].strip():
        raise ValueError(f"{where}'s role is empty")
    return {"role": item["role"], "content": item["content"]}

"""Token pieces as people read them: tokenizer markers undone and invisible characters made visible.

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) stores each byte of the UTF-8 text as one printable character
(GPT-2's ``bytes_to_unicode`` table: ``Ġ`` is a space, ``Ċ`` a newline, ``Ã©`` the two bytes of ``é``,
``âĢĻ`` the three of ``’``); the piece is shown as the text those bytes spell. A piece holding only part of
a character's bytes (a character split over two tokens) cannot be shown as text on its own: its bytes are
shown as ``\\xNN``. SentencePiece writes a leading space as ``▁`` and raw bytes as ``<0x0A>``; WordPiece marks
a word's continuation with ``##``.

Then what cannot be seen is drawn: a newline as ``↵``, a carriage return as ``␍``, a tab as ``→``, a piece
that is only spaces as one ``␣`` per space, a no-break space as ``⍽``. The viewers keep the raw piece for a
tooltip.

Whether a piece is byte-level is known from the tokenizer (:func:`is_byte_level_tokenizer`); without it,
a piece is read as byte-level when every character is in the table and one of them is a stand-in for a byte
that is not printable (``Ġ``, ``Ċ``, ``Ģ``...), or its bytes spell UTF-8 text other than the piece itself.
"""
from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["readable_token", "is_byte_level_tokenizer", "BYTE_LEVEL_DECODER"]

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_VISIBLE = {"\n": "\u21b5", "\r": "\u240d", "\t": "\u2192", "\u00a0": "\u237d"}  # ↵ ␍ → ⍽
_SPACE = "\u2423"  # ␣


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes stand for themselves, the others for the characters from U+0100
    on, in byte order (as ``tokenizers``' ``ByteLevel`` pre-tokenizer and ``transformers`` define it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_LEVEL_DECODER = {char: byte for byte, char in _bytes_to_unicode().items()}  # the table's inverse
_STAND_INS = frozenset(char for char, byte in BYTE_LEVEL_DECODER.items() if ord(char) >= 256)


def _from_byte_level(text: str, known: bool) -> str | None:
    """The text the byte-level piece ``text`` spells, with bytes that are not UTF-8 shown as ``\\xNN``; None
    when ``text`` is not (or, unless ``known``, does not look like) a byte-level piece."""
    if not text or any(char not in BYTE_LEVEL_DECODER for char in text):
        return None
    raw = bytes(BYTE_LEVEL_DECODER[char] for char in text)
    if known or any(char in _STAND_INS for char in text):
        return raw.decode("utf-8", "backslashreplace")
    try:  # only printable Latin-1: byte-level if its bytes spell other text (Ã© -> é), else a plain word
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return decoded if decoded != text else None


def readable_token(piece: str, byte_level: bool | None = None) -> str:
    """The readable form of one token piece.

    Parameters
    ----------
    piece : str
        The piece as the vocabulary stores it (``tokenizer.id_to_token(i)``).
    byte_level : bool, optional
        Whether the tokenizer is byte-level BPE (:func:`is_byte_level_tokenizer`); None: judge by the piece.

    Examples
    --------
    >>> [readable_token(p) for p in ["Ġcat", "▁the", "##ing", "<0x0A>", "ĊĊ", "Hello\\n", "<0x41>"]]
    [' cat', ' the', 'ing', '↵', '↵↵', 'Hello↵', 'A']
    >>> [readable_token(p) for p in ["ĠcafÃ©", "âĢĻ", "Ġ", "ĠĠ", "Âł", "ðŁĺ", "café"]]
    [' café', '’', '␣', '␣␣', '⍽', '\\\\xf0\\\\x9f\\\\x98', 'café']
    >>> readable_token("Ã", byte_level=True), readable_token("Ã")
    ('\\\\xc3', 'Ã')
    """
    text = str(piece)
    byte = _BYTE_PIECE.match(text)
    if byte:
        value = int(byte.group(1), 16)
        text = chr(value) if 0x20 <= value < 0x7F or chr(value) in _VISIBLE else f"\\x{value:02x}"
    elif text.startswith("##") and len(text) > 2:
        text = text[2:]
    elif "\u2581" in text:
        text = text.replace("\u2581", " ")
    elif byte_level is not False:
        decoded = _from_byte_level(text, known=bool(byte_level))
        text = text if decoded is None else decoded
    if text and text.strip(" ") == "":
        return _SPACE * len(text)
    return "".join(_VISIBLE.get(char, char) for char in text)


def is_byte_level_tokenizer(tokenizer: Any) -> bool | None:
    """Whether a ``tokenizers.Tokenizer`` (or attnkit's, through its ``backend``) decodes with byte-level BPE's
    ``ByteLevel`` decoder; None when it cannot be told (no tokenizer, or one that does not say)."""
    backend = getattr(tokenizer, "backend", tokenizer)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None if tokenizer is None else False
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    return _names_byte_level(state)


def _names_byte_level(state: Any) -> bool:
    if isinstance(state, dict):
        return state.get("type") == "ByteLevel" or any(_names_byte_level(v) for v in state.get("decoders", []))
    return False

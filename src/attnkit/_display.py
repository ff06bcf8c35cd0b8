"""Token pieces as people read them: tokenizer markers and invisible characters made visible.

Byte-level BPE (GPT-2, Llama 3, Qwen) writes a leading space as ``Ġ`` and a newline as ``Ċ``; SentencePiece
writes a leading space as ``▁`` and raw bytes as ``<0x0A>``; WordPiece marks a word's continuation with
``##``. The viewers show the readable form and keep the raw piece for a tooltip.
"""
from __future__ import annotations

import re

__all__ = ["readable_token"]

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_VISIBLE = {"\n": "\u21b5", "\r": "\u240d", "\t": "\u2192"}  # ↵ ␍ →
_BYTE_LEVEL = {"\u0120": " ", "\u010a": "\n", "\u0109": "\t", "\u010d": "\r"}  # Ġ Ċ ĉ č


def readable_token(piece: str) -> str:
    """The readable form of one token piece: spaces shown as spaces, newlines as ``↵``, tabs as ``→``.

    Examples
    --------
    >>> [readable_token(p) for p in ["Ġcat", "▁the", "##ing", "<0x0A>", "ĊĊ", "Hello\\n", "<0x41>"]]
    [' cat', ' the', 'ing', '↵', '↵↵', 'Hello↵', 'A']
    """
    text = str(piece)
    byte = _BYTE_PIECE.match(text)
    if byte:
        value = int(byte.group(1), 16)
        text = chr(value) if 0x20 <= value < 0x7F or chr(value) in _VISIBLE else f"\\x{value:02x}"
    elif text.startswith("##") and len(text) > 2:
        text = text[2:]
    else:
        text = text.replace("\u2581", " ")
        if any(ch in _BYTE_LEVEL for ch in text):
            text = "".join(_BYTE_LEVEL.get(ch, ch) for ch in text)
    return "".join(_VISIBLE.get(ch, ch) for ch in text)

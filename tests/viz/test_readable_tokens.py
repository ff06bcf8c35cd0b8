"""Tokens drawn as the text they stand for: byte-level BPE pieces decoded through GPT-2's byte table (a piece that
holds part of a character shows its bytes), SentencePiece and WordPiece markers undone, lone spaces and no-break
spaces visible; in the explain page, the attention explorer and ``attnkit attention``."""
from __future__ import annotations

import pytest

from attnkit._display import BYTE_LEVEL_DECODER, is_byte_level_tokenizer, readable_token
from attnkit.cli import main
from page_data import embedded

STAND_INS = {chr(c) for c in range(0x100, 0x144)}  # the characters byte-level BPE writes for unprintable bytes


def test_the_byte_table_is_the_one_tokenizers_uses():
    pre_tokenizers = pytest.importorskip("tokenizers.pre_tokenizers")
    assert set(BYTE_LEVEL_DECODER) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_LEVEL_DECODER.values()) == list(range(256))


@pytest.mark.parametrize("piece, byte_level, shown", [
    ("\u0120caf\u00c3\u00a9", None, " caf\u00e9"),  # GPT-2's "Ġcafé" (as in its vocabulary)
    ("\u00e2\u0122\u013b", None, "\u2019"),  # "’" in one piece
    ("\u0120\u00e2\u0122\u0135", None, " \u2013"),  # " –"
    ("\u00c3\u00a9", None, "\u00e9"),  # é: only printable Latin-1 stand-ins, but they spell other text
    ("\u0120", None, "\u2423"), ("\u0120\u0120\u0120", True, "\u2423\u2423\u2423"),  # lone spaces: ␣
    ("\u00c2\u0142", None, "\u237d"),  # a no-break space: ⍽
    ("\u0120\u00c2\u0142", None, " \u237d"),
    ("\u00f0\u0141\u013a", None, "\\xf0\\x9f\\x98"),  # three of the four bytes of an emoji
    ("\u00c3", True, "\\xc3"), ("\u00c3", None, "\u00c3"),  # half of "é": its byte when the tokenizer says so
    ("\u00e6\u0139\u00a5\u00e6\u013e\u00ac", None, "\u65e5\u672c"),  # 日本
    ("caf\u00e9", None, "caf\u00e9"), ("caf\u00e9", False, "caf\u00e9"),  # text that is not byte-level stays
    ("\u0120cat", False, "\u0120cat"),  # a tokenizer that is not byte-level keeps its characters
    ("\u2581caf\u00e9", None, " caf\u00e9"), ("##caf\u00e9", None, "caf\u00e9"), ("<0xC3>", None, "\\xc3"),
    ("\u2581", None, "\u2423"), ("\u010a", None, "\u21b5"), ("a\u0109b", None, "a\u2192b"),
])
def test_a_piece_is_shown_as_its_text(piece, byte_level, shown):
    assert readable_token(piece, byte_level) == shown


def test_the_tokenizers_own_decoding_agrees_on_whole_characters(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from text_models import write_chat_tokenizer

    write_chat_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert is_byte_level_tokenizer(tok) is True
    for text in [" caf\u00e9 cr\u00e8me", "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0", "na\u00efve co\u00f6perate"]:
        ids = tok.encode(text).ids
        pieces = [readable_token(tok.id_to_token(i), True) for i in ids]
        for i, piece in zip(ids, pieces, strict=True):
            alone = tok.decode([i])
            if "\ufffd" not in alone and alone.strip(" "):  # a whole character or more: the same text
                assert piece == alone
        assert not any(set(piece) & STAND_INS for piece in pieces)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from text_models import write_chat_model

    folder = tmp_path_factory.mktemp("bpe")
    write_chat_model(folder)
    return folder


def test_the_explain_page_shows_cafe_as_text(chat_folder, tmp_path):
    page = tmp_path / "explain.html"
    assert main(["explain", str(chat_folder), "--prompt", " caf\u00e9 \u2019", "--html", str(page)]) == 0
    data = embedded(page)
    assert "".join(data["tokens"]).startswith(" caf\u00e9")  # not " cafÃ©"
    assert "\u00c3" in "".join(data["raw_tokens"])  # the raw pieces stay for the tooltip
    shown = data["tokens"] + [c["text"] for c in data["candidates"]] + list(data["vocab"].values())
    assert not any(set(text) & STAND_INS for text in shown), shown
    assert "\u2019" in "".join(data["tokens"]) or "\\xe2" in "".join(data["tokens"])  # ’ whole or as its bytes


def test_the_attention_explorer_shows_tokens_as_text(chat_folder, tmp_path, capsys):
    page = tmp_path / "attention.html"
    assert main(["attention", str(chat_folder), "--prompt", " caf\u00e9 na\u00efve", "--html", str(page)]) == 0
    data = embedded(page)
    tokens = data["tokens"]
    # This small vocabulary has no merge for "ï": each of the two tokens it is split over shows its byte, and
    # the space before "na" is a token of its own, drawn as ␣.
    assert "\u2423" in tokens
    assert "".join(tokens).replace("\u2423", " ").replace("\\xc3\\xaf", "\u00ef") == " caf\u00e9 na\u00efve"
    assert not any(set(text) & STAND_INS for text in tokens)

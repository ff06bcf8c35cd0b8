"""Stop strings whose characters a tokenizer splits over several tokens (CJK, the euro sign, emoji): generation
stops on the token that completes the stop string, exactly where transformers' ``StopStringCriteria`` stops on
the same ids."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.generation.stopping_criteria import StopStringCriteria  # noqa: E402

from attnkit.decoding.sampling import generate  # noqa: E402
from attnkit.pretrained import load_tokenizer  # noqa: E402
from text_models import write_chat_tokenizer  # noqa: E402


class ScriptedModel:
    """A causal LM that writes ``script`` whatever it reads: the logits put all mass on the next token of it."""

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab = script, vocab
        self.config = SimpleNamespace(vocab_size=vocab, tokens=SimpleNamespace(eos=None, pad=None),
                                      max_position_embeddings=4096, position="rotary")
        self.generation_config = {}
        self.prompt_length = None

    def new_cache(self, batch: int, max_length: int) -> SimpleNamespace:
        return SimpleNamespace(length=0)

    def forward(self, ids: np.ndarray, mask: np.ndarray, cache=None) -> np.ndarray:
        if self.prompt_length is None:
            self.prompt_length = mask.shape[1]
        step = mask.shape[1] - self.prompt_length
        logits = np.zeros((ids.shape[0], ids.shape[1], self.vocab), dtype=np.float32)  # (B, L, V)
        logits[:, -1, self.script[step]] = 1.0
        return logits


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    hf_tok = write_chat_tokenizer(folder)
    return load_tokenizer(folder), hf_tok


def byte_tokens(tok, text: str) -> list[int]:
    """One token per UTF-8 byte of ``text`` (the byte-level alphabet's tokens): every multi-byte character is
    split over as many tokens as it has bytes."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    return [tok.token_to_id(alphabet[b]) for b in text.encode("utf-8")]


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes-to-unicode table, inverted)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def hf_stop_position(hf_tok, prompt: list[int], new: list[int], stops: list[str]) -> int | None:
    """How many new tokens transformers generates before StopStringCriteria stops it (None: never)."""
    criteria = StopStringCriteria(tokenizer=hf_tok, stop_strings=stops)
    for n in range(1, len(new) + 1):
        ids = torch.tensor([prompt + new[:n]])
        if bool(criteria(ids, torch.zeros(1, 1))[0]):
            return n
    return None


@pytest.mark.parametrize("text, stop", [
    ("ab\u20accd", "\u20ac"),                  # the euro sign: three bytes, three tokens
    ("x\u65e5\u672c\u8a9ey", "\u672c\u8a9e"),  # two CJK characters, six tokens
    ("go \U0001f680 now", "\U0001f680"),       # an emoji: four bytes
    ("caf\u00e9 cr\u00e8me", "\u00e8m"),       # a two-byte letter and an ASCII one
    ("plain text here", "text"),
])
def test_a_stop_string_split_over_tokens_stops_where_transformers_stops(tokenizers, text, stop):
    tok, hf_tok = tokenizers
    assert all(i is not None for i in byte_tokens(tok, text))
    assert tok.decode(byte_tokens(tok, text)) == text
    prompt = tok.encode("Hello", add_special_tokens=False)
    script = byte_tokens(tok, text) + byte_tokens(tok, " and more after it")
    model = ScriptedModel(script, tok.vocab_size)
    out = generate(model, np.array([prompt]), max_new_tokens=len(script), stop_strings=[stop], tokenizer=tok)
    new = out[0, len(prompt):].tolist()
    expected = hf_stop_position(hf_tok, prompt, script, [stop])
    assert expected is not None
    assert len(new) == expected
    assert tok.decode(new).endswith(stop)  # the stop string was completed by the last token, not before

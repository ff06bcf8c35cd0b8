"""How many tokens a text needs at least, found without tokenizing it (``max_token_chars`` and ``fewest_tokens``):
never more than the tokenizer gives, for each kind of tokenizer a chat model ships (byte-level BPE, SentencePiece
BPE with byte fallback, a normalizer that composes characters), and no bound where a token may stand for a run
of any length. The chat and ``generate`` refuse a text by this bound before they tokenize it."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")

from attnkit.pretrained.tokenizer import fewest_tokens, max_token_chars  # noqa: E402
from text_models import CORPUS, SPECIALS  # noqa: E402

models, normalizers, pre_tokenizers, trainers = (tokenizers.models, tokenizers.normalizers, tokenizers.pre_tokenizers,
                                                 tokenizers.trainers)
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Long runs of spaces and repeated words, so that the vocabulary learns long tokens (the bound divides by them).
TRAINING = CORPUS + ["    " * 8 + "indented", "=" * 40, "word " * 30, "\u1100\u1161\u11a8 e\u0301 \ufb01 \u00c5"]


def _trained(backend, special=(), vocab_size=400, texts=TRAINING):
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                           special_tokens=list(special)))
    return backend


def byte_level():
    """GPT-2, Llama 3, Qwen, SmolLM: every byte is a character of the vocabulary."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TRAINING, trainer)
    return backend


def sentencepiece_metaspace():
    """Llama 2 and Mistral as GGUF files describe them: spaces become ▁, unknown characters their bytes."""
    backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    return _trained(backend, ["<unk>", "<s>", "</s>", *BYTES])


def sentencepiece_normalizer():
    """Phi-3 and the Llama 2 folders: the ▁ prefix and replacement are a normalizer."""
    backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    return _trained(backend, ["<unk>", "<s>", "</s>", *BYTES])


def composing_normalizer():
    """NFKC composes characters (e + combining acute is one é; three Hangul jamo are one syllable): the text
    the model sees is shorter than the text typed, so the bound counts the normalized text."""
    backend = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    return _trained(backend, ["<unk>"], vocab_size=300, texts=CORPUS + [" ".join(["\u00e9" * 32] * 20)])


KINDS = {"byte_level": byte_level(), "sentencepiece_metaspace": sentencepiece_metaspace(),
         "sentencepiece_normalizer": sentencepiece_normalizer(), "composing_normalizer": composing_normalizer()}
PIECES = st.sampled_from([*"".join(TRAINING).split(" "), " ", "    " * 8, "=" * 40, *SPECIALS, "\u1100\u1161\u11a8",
                          "e\u0301", "\ufb01", "\U0001f600", "\n\n", "\t"])
TEXTS = st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=60).map("".join)


@pytest.mark.parametrize("kind", list(KINDS))
@given(text=TEXTS)
def test_the_bound_never_exceeds_the_tokens_the_tokenizer_gives(kind, text):
    backend = KINDS[kind]
    longest = max_token_chars(backend)
    assert longest is not None and longest >= 8  # the vocabulary learned long tokens: the bound is tight enough
    assert fewest_tokens(backend, text, longest) <= len(backend.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_bound_of_a_text_made_of_the_longest_token_is_its_length(kind):
    backend = KINDS[kind]
    longest = max_token_chars(backend)
    vocab = backend.get_vocab(with_added_tokens=True)
    token = next(t for t in vocab if len(t) == longest)
    count = len(backend.encode(token * 50, add_special_tokens=False).ids)
    assert fewest_tokens(backend, token * 50, longest) <= count
    assert fewest_tokens(backend, "x" * 10**6, longest) >= 10**6 // longest  # a megabyte needs many tokens


def test_a_normalizer_that_composes_characters_is_counted_after_it():
    backend = KINDS["composing_normalizer"]
    longest = max_token_chars(backend)
    assert longest == len("\u2581" + "\u00e9" * 32)  # the longest token is a word of 32 composed é
    typed = " ".join(["e\u0301" * 32] * 50)  # each é typed as e and a combining acute: twice the characters
    count = len(backend.encode(typed).ids)
    assert count == 50  # one token per word
    assert len(typed) / longest > count  # so a bound on the typed characters would refuse what fits
    assert fewest_tokens(backend, typed, longest) == count


def test_no_bound_where_one_token_may_stand_for_a_run_of_any_length():
    fused = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))  # no byte fallback
    fused.pre_tokenizer = pre_tokenizers.Metaspace()
    fused = _trained(fused, ["<unk>"], vocab_size=120)
    assert len(fused.encode("\u4e00" * 1000).ids) <= 2  # a thousand unknown characters: one token
    dropping = _trained(tokenizers.Tokenizer(models.BPE()), vocab_size=120)
    dropping.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    assert len(dropping.encode(" " * 1000).ids) == 0  # whitespace is dropped
    removed = _trained(tokenizers.Tokenizer(models.BPE()), vocab_size=120)
    removed.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="removed"),
                                                     pre_tokenizers.ByteLevel()])
    wordpiece = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    for backend in (fused, dropping, removed, wordpiece):
        assert max_token_chars(backend) is None
        assert fewest_tokens(backend, " " * 1000 + "\u4e00" * 1000, max_token_chars(backend)) == 0


def test_the_chat_models_tokenizers_have_a_bound(chat_folder):
    from attnkit.pretrained import load_tokenizer

    backend = load_tokenizer(chat_folder).backend
    longest = max_token_chars(backend)
    assert longest == max(len(t) for t in backend.get_vocab(with_added_tokens=True))
    text = "Hello world, how are you today? " * 100
    assert 0 < fewest_tokens(backend, text, longest) <= len(backend.encode(text).ids)

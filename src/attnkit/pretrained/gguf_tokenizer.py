"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers`` tokenizer inside attnkit's :class:`Tokenizer`.

A GGUF file has no ``tokenizer.json``: it keeps the vocabulary as metadata under llama.cpp's names
(``tokenizer.ggml.*``), and the chat template as ``tokenizer.chat_template``. Two kinds are read, by
``tokenizer.ggml.model``:

``"gpt2"``
    Byte-level BPE (GPT-2, Llama 3, Qwen, OLMo 2, ...): the tokens (spelled in GPT-2's byte alphabet) and the
    merges, with the text split by the regular expression ``tokenizer.ggml.pre`` names.
``"llama"``
    SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3): the pieces (``▁`` for a space), their scores (the
    merges are rebuilt from them: a pair merges with the rank of the piece it makes) and the byte tokens
    ``<0x00>`` .. ``<0xFF>`` for characters outside the vocabulary. Gemma splits at spaces and Phi-3 prepends
    ``▁`` by normalizing, as their published tokenizers do.

Control tokens (type 3) become special tokens, user-defined ones (type 4, e.g. ``<think>``) added tokens, so
neither is cut into pieces; ``add_bos_token`` / ``add_eos_token`` decide what ``encode`` adds (``bos`` by default
for SentencePiece vocabularies, as llama.cpp does). The end-of-sequence ids are ``eos_token_id`` and the
end-of-turn ids (``eot_token_id``, ``eom_token_id``) llama.cpp also stops at.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._extra import import_extra
from .gguf_file import GGUFFile, gguf_architecture, special_token_ids
from .tokenizer import Tokenizer

__all__ = ["gguf_tokenizer", "GGUF_PRE_TOKENIZERS"]

# GPT-2's split, which ByteLevel(use_regex=True) applies itself.
_GPT2 = None
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# SmolLM: every digit alone, then GPT-2's split of what is left (two passes, as llama.cpp and the published
# tokenizer's Digits + ByteLevel do: one regex would split runs of spaces before a digit differently)
_SMOLLM = (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the split of the text before byte-level BPE (llama.cpp's names and regexes; a tuple is
# applied in turn, each to the pieces the one before made).
GGUF_PRE_TOKENIZERS = {
    "default": _GPT2, "gpt-2": _GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
    "falcon3": _LLAMA3, "pixtral": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
    "tekken": _TEKKEN, "gpt-4o": _GPT4O, "llama4": _GPT4O, "smollm": _SMOLLM,
}

_CONTROL, _USER_DEFINED = 3, 4
_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (the printable ones as themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _strings(file: GGUFFile, key: str, count: int | None = None) -> list[str]:
    """An array of strings (its GGUF type is checked when the file is read): present, non-empty, and of
    ``count`` items when given."""
    value = file.metadata.get(key)
    if not value:
        raise file.fail(f"metadata {key!r} must be a non-empty array of strings, and the file has "
                        + ("none" if value is None else "an empty one"))
    if count is not None and len(value) != count:
        raise file.fail(f"metadata {key!r} has {len(value)} entries for {count} tokens")
    return value


def _numbers(file: GGUFFile, key: str, count: int, default: Any) -> np.ndarray:
    """A per-token array of numbers (its GGUF type is checked when the file is read), ``default`` for every
    token when the file has none."""
    value = file.metadata.get(key)
    if value is None:
        return np.full(count, default)
    if len(value) != count:
        raise file.fail(f"metadata {key!r} has {len(value)} entries; it must have one per token ({count}, the "
                        f"length of tokenizer.ggml.tokens)")
    return value


def _stored_merges(file: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges``: each two tokens of ``vocab`` joined by a space, whose concatenation is a token
    too (``tokenizers`` would fail on anything else, or abort the process)."""
    entries = _strings(file, "tokenizer.ggml.merges")
    merges = [tuple(entry.split(" ")) for entry in entries]
    wrong = [index for index, merge in enumerate(merges) if len(merge) != 2]
    if wrong:
        raise file.fail(f"metadata 'tokenizer.ggml.merges' item {wrong[0]} is {entries[wrong[0]]!r:.80}, not two "
                        f"tokens joined by a space")
    unknown = [index for index, (left, right) in enumerate(merges)
               if left not in vocab or right not in vocab or left + right not in vocab]
    if unknown:
        left, right = merges[unknown[0]]
        token = next(t for t in (left, right, left + right) if t not in vocab)
        raise file.fail(f"metadata 'tokenizer.ggml.merges' item {unknown[0]} ({entries[unknown[0]]!r:.80}) needs the "
                        f"token {token!r:.80}, which tokenizer.ggml.tokens does not hold")
    return merges


# The characters the merge rebuild may slice, per character of the vocabulary: it examines each split of a
# piece whose two sides have lengths that occur in the vocabulary. A vocabulary of short pieces needs less than
# its pieces' typical length (9.5 for a synthetic one of Gemma 3's size, pieces of up to 31 characters); past
# this budget the vocabulary is refused rather than rebuilt in time growing faster than its size. The merges
# kept hold at most _MERGE_BUDGET characters per character of the vocabulary (about 1 for that synthetic one,
# about 2 for published SentencePiece vocabularies: Llama 2's 61k merges of 32k pieces).
_SPLIT_BUDGET = 64
_MERGE_BUDGET = 8


def _merges_from_scores(file: GGUFFile, tokens: list[str], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges rebuilt from the vocabulary: every split of a piece into two pieces is a merge,
    ranked by the merged piece's score (best first), ties by the longer left then right part, then by the
    piece's place in ``scores`` and the parts' ids; the rule ``transformers`` uses, so both tokenize alike.

    A piece is split only where both sides have a length some piece has (the split points of each length are
    listed once), so a piece longer than any two others costs nothing. The characters sliced are bounded by
    ``_SPLIT_BUDGET`` times the vocabulary's, those of the merges kept by ``_MERGE_BUDGET`` times.

    Raises
    ------
    ValueError
        The rebuild would slice more than its budget (naming ``tokenizer.ggml.tokens``).
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    present = {len(token) for token in vocab}
    lengths = sorted(present)
    points: dict[int, list[int]] = {}  # a piece's length -> where it may split
    characters = sum(len(token) for token in vocab) + (1 << 16)
    sliced, kept = _SPLIT_BUDGET * characters, _MERGE_BUDGET * characters
    merges = []
    for token, score in scores.items():
        n = len(token)
        if n not in points:
            points[n] = [i for i in lengths if i < n and n - i in present]
        sliced -= n * len(points[n])
        if sliced < 0:  # checked before the slicing it pays for
            raise _too_many_splits(file)
        local = [(token[:i], token[i:], score) for i in points[n] if token[:i] in vocab and token[i:] in vocab]
        kept -= n * len(local)
        if kept < 0:
            raise _too_many_splits(file)
        if len(local) > 1:
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _too_many_splits(file: GGUFFile) -> ValueError:
    return file.fail(f"metadata 'tokenizer.ggml.tokens' holds pieces that split in too many ways: rebuilding their "
                     f"merges would slice more than {_SPLIT_BUDGET} times the vocabulary's characters or keep more "
                     f"than {_MERGE_BUDGET} times them")


def _byte_level(tk: Any, file: GGUFFile, tokens: list[str]) -> Any:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    if set().union(*tokens) <= alphabet:  # every token spelled in the byte alphabet, as converters write them
        vocab = {token: index for index, token in enumerate(tokens)}
    else:
        vocab = {(token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))): index
                 for index, token in enumerate(tokens)}
    merges = _stored_merges(file, vocab) if "tokenizer.ggml.merges" in file.metadata else []
    backend = tk.Tokenizer(tk.models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    pre = file.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise file.fail(f"metadata tokenizer.ggml.pre = {pre!r} names a pre-tokenizer attnkit does not know; it "
                        f"knows {', '.join(GGUF_PRE_TOKENIZERS)}")
    split = GGUF_PRE_TOKENIZERS[pre]
    if split is None:
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    else:
        passes = split if isinstance(split, tuple) else (split,)
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence([
            *(tk.pre_tokenizers.Split(tk.Regex(regex), behavior="isolated") for regex in passes),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = tk.decoders.ByteLevel()
    return backend


def _sentencepiece(tk: Any, file: GGUFFile, tokens: list[str], ids: dict[str, int]) -> Any:
    style = gguf_architecture(file).tokenizer_style
    if style == "gemma":
        # Gemma stores pieces of two or more spaces as spaces, and its scores do not follow its merge order:
        # the order of the tokens does.
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = {token: -float(index) for index, token in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, _numbers(file, "tokenizer.ggml.scores", len(tokens), 0.0).tolist()))
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in file.metadata:
        merges = _stored_merges(file, vocab)
    else:
        merges = _merges_from_scores(file, tokens, scores)
    unk = ids.get("unknown_token_id")
    backend = tk.Tokenizer(tk.models.BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True,
                                         unk_token=tokens[unk] if style == "gemma" and unk is not None else None))
    decoders = [tk.decoders.Replace("\u2581", " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    if style == "gemma":  # no space is prepended, so none is stripped
        backend.normalizer = tk.normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = tk.pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
        backend.decoder = tk.decoders.Sequence(decoders)
        return backend
    if style == "phi3":  # the prefix space from a normalizer: "  hi" keeps both of its spaces
        backend.normalizer = tk.normalizers.Sequence([tk.normalizers.Prepend("\u2581"),
                                                      tk.normalizers.Replace(" ", "\u2581")])
    else:
        prefix = file.metadata.get("tokenizer.ggml.add_space_prefix", True)
        backend.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="\u2581",
                                                            prepend_scheme="first" if prefix else "never",
                                                            split=False)
    backend.decoder = tk.decoders.Sequence(decoders + [tk.decoders.Strip(content=" ", left=1, right=0)])
    return backend


def _special_tokens(tokens: list[str], ids: dict[str, int]) -> dict[str, str]:
    return {name: tokens[ids[key]] for name, key in _SPECIAL_IDS if key in ids}


def _chat_templates(file: GGUFFile) -> dict[str, str]:
    templates = {}
    prefix = "tokenizer.chat_template."
    for key, value in file.metadata.items():
        if key == "tokenizer.chat_template" or key.startswith(prefix):
            if not isinstance(value, str):
                raise file.fail(f"metadata {key!r} must be a string (a jinja template)")
            templates["default" if key == "tokenizer.chat_template" else key[len(prefix):]] = value
    return templates


def gguf_tokenizer(file: GGUFFile) -> Tokenizer:
    """The tokenizer of a parsed GGUF file (see the module docstring for what is read).

    Raises
    ------
    ValueError
        Naming the file: no vocabulary, a ``tokenizer.ggml.model`` other than ``"gpt2"`` and ``"llama"``, an
        unknown ``tokenizer.ggml.pre``, per-token lists of the wrong length, a special id that is no token.
    ImportError
        ``tokenizers`` is not installed (naming the ``pretrained`` extra).
    """
    tk = import_extra("tokenizers", "build the tokenizer of a GGUF file")
    kind = file.metadata.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise file.fail(f"metadata tokenizer.ggml.model = {kind!r} is not a tokenizer attnkit rebuilds; it reads "
                        f"'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")
    tokens = _strings(file, "tokenizer.ggml.tokens")
    types = _numbers(file, "tokenizer.ggml.token_type", len(tokens), 1).tolist()
    ids = special_token_ids(file)
    try:
        backend = _byte_level(tk, file, tokens) if kind == "gpt2" else _sentencepiece(tk, file, tokens, ids)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type for a bad vocabulary
        raise file.fail(f"its vocabulary (tokenizer.ggml.tokens, tokenizer.ggml.merges) cannot be built into a "
                        f"tokenizer: {exc}") from None
    special = _special_tokens(tokens, ids)
    named = set(special.values())
    control = [t for t, kind_ in zip(tokens, types) if kind_ == _CONTROL or t in named]
    if kind == "gpt2":  # a control token outside the byte alphabet is a mislabel, and no token of this vocabulary
        alphabet = set(_bytes_to_unicode().values())
        control = [t for t in control if set(t) <= alphabet]
    backend.add_special_tokens([tk.AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([tk.AddedToken(t, normalized=False, special=False)
                        for t, kind_ in zip(tokens, types)
                        if kind_ == _USER_DEFINED and backend.token_to_id(t) is not None])
    add_bos = file.metadata.get("tokenizer.ggml.add_bos_token", kind == "llama") and "bos_token" in special
    add_eos = file.metadata.get("tokenizer.ggml.add_eos_token", False) and "eos_token" in special
    single = ([f"{special['bos_token']}:0"] if add_bos else []) + ["$A:0"] + \
        ([f"{special['eos_token']}:0"] if add_eos else [])
    pair = single + ([f"{special['bos_token']}:1"] if add_bos else []) + ["$B:1"] + \
        ([f"{special['eos_token']}:1"] if add_eos else [])
    pieces = [special[n] for n, on in (("bos_token", add_bos), ("eos_token", add_eos)) if on]
    backend.post_processor = tk.processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=[(t, backend.token_to_id(t)) for t in pieces])
    eos_ids = dict.fromkeys(ids[key] for key in ("eos_token_id", "eot_token_id", "eom_token_id") if key in ids)
    return Tokenizer(backend, special, _chat_templates(file), list(eos_ids))

"""Text in and out for a Hugging Face model folder: its tokenizer, special tokens, chat template and streaming.

:func:`load_tokenizer` reads ``tokenizer.json`` with the ``tokenizers`` library, the special tokens from
``tokenizer_config.json`` / ``special_tokens_map.json`` (and the end-of-sequence ids of
``generation_config.json``), and the chat template from ``chat_template.jinja`` or ``tokenizer_config.json``.
Chat templates are rendered the way ``transformers`` renders them, in a sandbox with a time and size budget
(:mod:`.chat_template`); the special
tokens (``bos_token``, ``eos_token``, ...) are template variables, and the rendered text is tokenized without
adding special tokens. Needs the ``pretrained`` extra (``tokenizers``; ``jinja2`` for chat templates).

Dimension letters: B batch, L padded length.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..io import read_json, read_text
from ._extra import import_extra
from .chat_template import compile_chat_template, render_chat_template
from .named_chat_templates import NAMED_CHAT_TEMPLATES, named_chat_template

__all__ = ["Tokenizer", "load_tokenizer", "read_generation_config", "chat_templates_of_folder", "SPECIAL_TOKEN_NAMES",
           "max_token_chars", "fewest_tokens"]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any, where: str) -> str | None:
    """A special token as saved by ``transformers``: a string, or an ``AddedToken`` dict with ``content``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where} must be a string or an object with a 'content' string, got {value!r}")


def read_generation_config(folder: str | Path) -> dict:
    """The ``generation_config.json`` of ``folder`` as a dict (empty when the folder has none).

    Raises
    ------
    ValueError
        The file is not a JSON object.
    """
    file = Path(folder) / "generation_config.json"
    return read_json(file) if file.is_file() else {}


def _plain(value: Any) -> Any:
    """Template data rebuilt from plain JSON types (a template never sees a caller's rich objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


class Tokenizer:
    """A model folder's tokenizer: ``tokenizers`` for the text, the folder's files for everything around it.

    Build it with :func:`load_tokenizer`. Ids are Python ints (one text) or int64 arrays (a padded batch).

    Attributes
    ----------
    backend : tokenizers.Tokenizer
        The ``tokenizer.json`` tokenizer.
    special_tokens : dict of str to str
        The special tokens the folder names (``bos_token``, ``eos_token``, ``pad_token``, ...).
    chat_templates : dict of str to str
        Named chat templates; ``"default"`` is the one :meth:`apply_chat_template` uses.
    eos_token_ids : tuple of int
        Every end-of-sequence id: ``generation_config.json``'s ``eos_token_id`` (an int or a list), else the
        id of ``eos_token``.
    padding_side : str
        ``"left"``: batches are padded on the left, as decoding needs.

    Examples
    --------
    >>> from attnkit.pretrained import default_model_dir
    >>> tok = load_tokenizer(default_model_dir())
    >>> tok.encode("Hello world")
    [101, 7592, 2088, 102]
    >>> tok.decode([101, 7592, 2088, 102], skip_special_tokens=True)
    'hello world'
    >>> batch = tok(["a b c", "hi"])
    >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist()
    ([[101, 1037, 1038, 1039, 102], [0, 0, 101, 7632, 102]], [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    """

    padding_side = "left"

    def __init__(self, backend: Any, special_tokens: Mapping[str, str], chat_templates: Mapping[str, str],
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)
        self.chat_templates = dict(chat_templates)
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self._compiled: dict[str, Any] = {}

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, special_tokens={self.special_tokens}, "
                f"chat_template={'default' in self.chat_templates})")

    # -- vocabulary --------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token``, or None when it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, id: int) -> str | None:  # noqa: A002 - the name tokenizers and transformers use
        """The token of ``id`` (as ``tokenizers.Tokenizer.id_to_token``), or None when it is not in the
        vocabulary.

        Examples
        --------
        >>> from attnkit.pretrained import default_model_dir
        >>> tok = load_tokenizer(default_model_dir())
        >>> tok.id_to_token(tok.token_to_id("hello")), tok.id_to_token(10**9)
        ('hello', None)
        """
        if isinstance(id, bool) or not isinstance(id, (int, np.integer)):
            raise TypeError(f"id must be an int, got {type(id).__name__}")
        return self.backend.id_to_token(int(id)) if 0 <= id < 2**32 else None

    def convert_ids_to_tokens(self, ids: Iterable[int] | np.ndarray) -> list[str | None]:
        """The token of each id (``transformers``' name for a batch of :meth:`id_to_token`)."""
        return [self.id_to_token(int(i)) for i in np.asarray(ids).reshape(-1)]

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """Id of ``bos_token`` (None when the folder names none)."""
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (see :attr:`eos_token_ids`), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        """Id of ``pad_token``, else the first eos id (what batches are padded with), else None."""
        pad = self._special_id("pad_token")
        return self.eos_token_id if pad is None else pad

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token the folder names."""
        ids = {self.token_to_id(t) for t in self.special_tokens.values()}
        return sorted(i for i in ids | set(self.eos_token_ids) if i is not None)

    # -- text <-> ids ------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies ``tokenizer.json``'s post-processor (e.g. bos)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """The text of a sequence of ids."""
        return self.backend.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                   skip_special_tokens=skip_special_tokens)

    def batch_decode(self, ids: Any, skip_special_tokens: bool = False) -> list[str]:
        """One text per row of ``ids`` ((B, L) array or a list of lists)."""
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in ids]

    def __call__(self, texts: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, np.ndarray]:
        """Encode a text or a batch of texts, left-padded to the longest.

        Returns
        -------
        dict
            ``input_ids`` int64 (B, L) and ``attention_mask`` int64 (B, L) (1 = real token, 0 = padding on the
            left, padded with :attr:`pad_token_id`); B = 1 for a single string.

        Raises
        ------
        ValueError
            The batch needs padding and the folder names neither a pad nor an eos token.
        """
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) for t in texts):
            raise TypeError(f"texts must be a str or a non-empty sequence of str, got {texts!r:.80}")
        rows = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        width = max(len(r) for r in rows)
        pad = self.pad_token_id
        if pad is None and any(len(r) < width for r in rows):
            raise ValueError("padding a batch needs a pad_token or eos_token, and the tokenizer names neither")
        ids = np.full((len(rows), width), 0 if pad is None else pad, dtype=np.int64)  # (B, L)
        mask = np.zeros((len(rows), width), dtype=np.int64)  # (B, L)
        for b, row in enumerate(rows):
            if row:
                ids[b, width - len(row):] = row
                mask[b, width - len(row):] = 1
        return {"input_ids": ids, "attention_mask": mask}

    # -- chat --------------------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None) -> str:
        """The template source: the folder's template named ``chat_template``, else the format of that name
        (:mod:`.named_chat_templates`: ``"chatml"``, ``"llama3"``, ...), else ``chat_template`` itself (a jinja
        source); without ``chat_template``, the folder's default.

        Raises
        ------
        ValueError
            The folder has no chat template (and none was passed).
        """
        if chat_template is not None:
            if chat_template in self.chat_templates:
                return self.chat_templates[chat_template]
            return named_chat_template(chat_template) or chat_template
        if "default" not in self.chat_templates:
            raise ValueError(f"this tokenizer has no chat template (no chat_template.jinja, no chat_template in "
                             f"tokenizer_config.json, no tokenizer.chat_template in a GGUF file); pass "
                             f"chat_template= a jinja template or the name of a family's format "
                             f"({', '.join(NAMED_CHAT_TEMPLATES)})")
        return self.chat_templates["default"]

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping]],
                            *, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, chat_template: str | None = None,
                            tools: Sequence[Mapping] | None = None, documents: Sequence[Mapping] | None = None,
                            **template_kwargs: Any) -> Any:
        """Render a conversation with the chat template, as ``transformers``' ``apply_chat_template`` does.

        Parameters
        ----------
        conversation : list of dict, or a list of such lists
            Messages ``{"role": ..., "content": ...}``; keys whose value is None are dropped first. A list of
            conversations renders each one (batched).
        add_generation_prompt : bool, default False
            Append the template's opening of an assistant turn (the template decides what that is).
        tokenize : bool, default True
            False: return the rendered text. True: tokenize it without adding special tokens (the template
            writes them).
        return_dict : bool, default True
            With ``tokenize``: return ``{"input_ids", "attention_mask"}`` (lists, or lists of lists when
            batched); False returns the ids alone. Ignored when ``tokenize`` is False.
        chat_template : str, optional
            A template name of the folder, the name of a family's format (``"chatml"``, ``"llama3"``, ``"gemma"``,
            ... :mod:`.named_chat_templates`), or a template source; default the folder's default template.
        tools, documents : list of dict, optional
            JSON-schema tool descriptions and retrieval documents, passed to the template as they are.
        **template_kwargs
            More template variables (they override the special tokens of the same name).

        Examples
        --------
        >>> from attnkit.pretrained import default_model_dir
        >>> tok = load_tokenizer(default_model_dir())
        >>> tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
        ...     chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        ...                   "{% if add_generation_prompt %}<assistant>{% endif %}", add_generation_prompt=True)
        '<user>hi<assistant>'
        """
        source = self.get_chat_template(chat_template)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("conversation is empty: give at least one message")
        batched = isinstance(conversation, (list, tuple)) and isinstance(conversation[0], (list, tuple))
        conversations = list(conversation) if batched else [conversation]
        for chat in conversations:
            for message in chat:
                if not isinstance(message, Mapping):
                    raise TypeError(f"chat messages must be dicts, got {message!r:.80}")
        if source not in self._compiled:
            self._compiled[source] = compile_chat_template(source)
        template = self._compiled[source]
        variables = _plain({**self.special_tokens, **template_kwargs})
        rendered = [render_chat_template(
            template, messages=_plain([{k: v for k, v in m.items() if v is not None} for m in chat]),
            tools=_plain(None if tools is None else list(tools)),
            documents=_plain(None if documents is None else list(documents)),
            add_generation_prompt=add_generation_prompt, **variables) for chat in conversations]
        if not tokenize:
            return rendered if batched else rendered[0]
        ids = [self.encode(text, add_special_tokens=False) for text in rendered]
        if not return_dict:
            return ids if batched else ids[0]
        masks = [[1] * len(row) for row in ids]
        return {"input_ids": ids, "attention_mask": masks} if batched else \
            {"input_ids": ids[0], "attention_mask": masks[0]}

    # -- streaming ---------------------------------------------------------------------------------------
    def stream_decode(self, tokens: Iterable[Any], skip_special_tokens: bool = False) -> Iterator[str]:
        """Decode ids as they arrive: an iterator of text pieces whose concatenation is the decoded whole.

        A piece is emitted only once it is final: never half of a multi-byte character (a trailing
        ``\\ufffd``), and never text the next token could still change.

        Parameters
        ----------
        tokens : iterable of int (or of (1,) arrays, as :func:`attnkit.decoding.sampling.generate_stream` yields)
        skip_special_tokens : bool, default False

        Examples
        --------
        >>> from attnkit.pretrained import default_model_dir
        >>> tok = load_tokenizer(default_model_dir())
        >>> ids = tok.encode("streaming text", add_special_tokens=False)
        >>> "".join(tok.stream_decode(iter(ids))) == tok.decode(ids)
        True
        """
        ids: list[int] = []
        shown = ""
        for token in tokens:
            ids.append(int(np.asarray(token).reshape(-1)[0]))
            text = self.decode(ids, skip_special_tokens=skip_special_tokens)
            if text.endswith("\ufffd") or not text.startswith(shown):
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
                shown = text
        text = self.decode(ids, skip_special_tokens=skip_special_tokens)
        if text.startswith(shown):
            if len(text) > len(shown):
                yield text[len(shown):]
        else:  # a later token rewrote earlier text (rare decoders): the joined pieces must still be the whole
            raise RuntimeError("the tokenizer's decoder changed text it had already produced; decode the ids "
                               "at once instead of streaming")


def _special_tokens(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    tokens: dict[str, str] = {}
    map_file = folder / "special_tokens_map.json"
    sources = [(read_json(map_file), map_file.name)] if map_file.is_file() else []
    sources.append((config, "tokenizer_config.json"))  # tokenizer_config.json wins, as transformers reads it
    for source, where in sources:
        for name in SPECIAL_TOKEN_NAMES:
            if source.get(name) is not None:
                tokens[name] = _token_text(source[name], f"{where}'s {name}")
    return tokens


def chat_templates_of_folder(folder: Path, config: Mapping[str, Any] | None = None) -> dict[str, str]:
    """A model folder's chat templates by name: ``tokenizer_config.json``'s ``chat_template`` (a string, or a
    list of ``{"name", "template"}``), ``chat_template.jinja`` (the default, over the config's copy, as in
    transformers) and ``additional_chat_templates/*.jinja``. ``config`` is the folder's
    ``tokenizer_config.json`` when the caller has read it already."""
    if config is None:
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file) if config_file.is_file() else {}
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        for entry in raw:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"tokenizer_config.json's chat_template list must hold {{'name', 'template'}} "
                                 f"objects, got {entry!r:.80}")
            templates[entry["name"]] = entry["template"]
    elif raw is not None:
        raise ValueError(f"tokenizer_config.json's chat_template must be a string or a list, got {raw!r:.80}")
    file = folder / "chat_template.jinja"
    if file.is_file():  # the file takes precedence over the config's copy, as in transformers
        templates["default"] = read_text(file)
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = read_text(path)
    return templates


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder.

    Parameters
    ----------
    folder : str or Path
        Holds ``tokenizer.json``; optionally ``tokenizer_config.json``, ``special_tokens_map.json``,
        ``chat_template.jinja`` and ``generation_config.json``.

    Returns
    -------
    Tokenizer

    Raises
    ------
    FileNotFoundError
        No such folder, or it has no ``tokenizer.json``.
    ValueError
        A JSON file that is not an object, a special token or chat template of the wrong type, or a
        ``tokenizer.json`` that ``tokenizers`` cannot read.
    ImportError
        ``tokenizers`` is not installed (naming the ``pretrained`` extra).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json")
    tokenizers = import_extra("tokenizers", "read tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception type for a bad file
        raise ValueError(f"cannot read {file}: {exc}") from None
    # Padding and truncation are per call (as in transformers), not the fixed ones tokenizer.json may carry.
    backend.no_padding()
    backend.no_truncation()
    config_file = folder / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    special = _special_tokens(folder, config)
    eos = read_generation_config(folder).get("eos_token_id")
    if eos is None and special.get("eos_token") is not None:
        eos = backend.token_to_id(special["eos_token"])
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
        raise ValueError(f"generation_config.json's eos_token_id must be a non-negative int or a list of them, "
                         f"got {eos!r}")
    return Tokenizer(backend, special, chat_templates_of_folder(folder, config), eos_ids)


# -- how many tokens a text needs at least, without tokenizing it --------------------------------------
# Pre-tokenizers that keep every character of the text (each splits it, or maps characters one to one or one to
# several); any other kind (Whitespace, BertPreTokenizer, CharDelimiterSplit, a split whose behavior is
# "Removed") may drop characters, and then no bound holds.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts", "Sequence"}


def max_token_chars(backend: Any) -> int | None:
    """The most characters of text one token of ``backend`` (a ``tokenizers.Tokenizer``) stands for, or None
    when no such bound holds.

    A token's string in the vocabulary is at least as long as the text it covers: a byte-level token has one
    character per byte (and a character is at least one byte), a SentencePiece token writes a space as one
    ``▁``, a byte-fallback token ``<0xAB>`` covers one byte, an added token is its text. So the number of tokens
    of a text is at least its length divided by the longest string of the vocabulary (:func:`fewest_tokens`).
    None when the tokenizer could make one token of a run of any length: a pre-tokenizer that drops characters,
    a BPE model that fuses unknown characters into one unknown token (without byte fallback), or a WordPiece,
    WordLevel or Unigram model (an unknown word, or a run of unknown characters, is one token).
    """
    model = type(backend.model).__name__
    if model != "BPE" or (backend.model.unk_token is not None and backend.model.fuse_unk
                          and not backend.model.byte_fallback):
        return None
    if backend.pre_tokenizer is not None and not _keeps_every_character(
            json.loads(backend.pre_tokenizer.__getstate__())):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(map(len, vocab), default=None)


def _keeps_every_character(pre_tokenizer: Mapping[str, Any]) -> bool:
    if pre_tokenizer.get("type") not in _KEEPING_PRE_TOKENIZERS or pre_tokenizer.get("behavior") == "Removed":
        return False
    return all(_keeps_every_character(part) for part in pre_tokenizer.get("pretokenizers", ()))


def fewest_tokens(backend: Any, text: str, max_chars: int | None) -> int:
    """A number of tokens ``backend`` needs at least for ``text``, found without tokenizing it: the characters
    of the text as the tokenizer's normalizer leaves them, divided by ``max_chars`` (:func:`max_token_chars`),
    rounded up; 0 when ``max_chars`` is None.

    Counting costs one pass of the normalizer (a few milliseconds per megabyte) where tokenizing a large text
    costs seconds and gigabytes, so a text far longer than a model's context is refused before it is tokenized.

    Examples
    --------
    >>> from attnkit.pretrained import default_model_dir
    >>> tok = load_tokenizer(default_model_dir())  # WordPiece: an unknown word is one token, so no bound
    >>> max_token_chars(tok.backend) is None, fewest_tokens(tok.backend, "a" * 1000, None)
    (True, 0)
    """
    if max_chars is None or max_chars <= 0:
        return 0
    normalizer = backend.normalizer
    length = len(text) if normalizer is None else len(normalizer.normalize_str(text))
    return -(-length // max_chars)

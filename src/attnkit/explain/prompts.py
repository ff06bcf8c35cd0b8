"""TransformerLens's everyday helpers for looking at a prompt: its tokens as text, and how the model ranks an
answer after it.

- :func:`to_str_tokens`: text, texts or token ids to the text of each token (``HookedTransformer.to_str_tokens``);
- :func:`test_prompt`: the rank, logit and probability of an answer's tokens after a prompt and the model's top
  tokens there, printed as ``transformer_lens.utils.test_prompt`` prints them and returned as data.

attnkit's models hold no tokenizer, so both take one: :func:`attnkit.pretrained.load_tokenizer`'s, or anything with
``encode(text, add_special_tokens=...)``, ``decode(ids)`` and ``bos_token_id`` (a ``transformers`` tokenizer).

Shapes: L prompt tokens, T answer positions, A answers, K top_k.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._validation import as_array, check_positive_int

__all__ = ["PromptTest", "test_prompt", "to_str_tokens"]


def _encode(tokenizer: Any, text: str, prepend_bos: bool | None) -> list[int]:
    """``text``'s ids: with the tokenizer's own special tokens (None), or with exactly one BOS first (True) or none
    (False) and no other special token."""
    if prepend_bos is None:
        return list(tokenizer.encode(text))
    if not isinstance(prepend_bos, bool):
        raise TypeError(f"prepend_bos must be None, True or False, got {prepend_bos!r}")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not prepend_bos:
        return ids
    bos = tokenizer.bos_token_id
    if bos is None:
        raise ValueError("prepend_bos=True, but the tokenizer has no BOS token; pass prepend_bos=None (the "
                         "tokenizer's own special tokens) or False")
    return [int(bos)] + ids


def to_str_tokens(tokenizer: Any, input: Any, prepend_bos: bool | None = None) -> list:  # noqa: A002 - TL's name
    """The text of each token: of a text (tokenized first), of each of several texts, or of token ids.

    Each token is decoded alone, as TransformerLens does (byte-level BPE's ``Ġcat`` is `` cat``; a token holding part
    of a character decodes to the replacement character).

    Parameters
    ----------
    tokenizer : Tokenizer
    input : str, list of str, or array_like of int (L,), (1, L) or (B, L)
    prepend_bos : bool, optional
        For text: None (default) encodes with the tokenizer's own special tokens (what the model saw in training;
        TransformerLens adds a BOS by default, which Llama's tokenizer does and GPT-2's does not); True puts one
        BOS first and no other special token; False no special token at all.

    Returns
    -------
    list of str, or a list of them for several texts or a (B, L) batch with B > 1.

    Examples
    --------
    >>> class Letters:  # a tokenizer of one token per letter, "^" its BOS
    ...     bos_token_id = 0
    ...     def encode(self, text, add_special_tokens=True):
    ...         return [0] * add_special_tokens + [ord(c) - 96 for c in text]
    ...     def decode(self, ids):
    ...         return "".join("^" if i == 0 else chr(i + 96) for i in ids)
    >>> to_str_tokens(Letters(), "cab"), to_str_tokens(Letters(), [[3, 1], [2, 2]])
    (['^', 'c', 'a', 'b'], [['c', 'a'], ['b', 'b']])
    """
    if isinstance(input, str):
        return [tokenizer.decode([t]) for t in _encode(tokenizer, input, prepend_bos)]
    if isinstance(input, (list, tuple)) and input and all(isinstance(text, str) for text in input):
        return [to_str_tokens(tokenizer, text, prepend_bos) for text in input]
    ids = as_array(input, "input")
    if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2):
        raise ValueError(f"input must be a text, a list of texts or token ids (L,) or (B, L), got "
                         f"{type(input).__name__} of shape {ids.shape} and dtype {ids.dtype}")
    if ids.ndim == 2 and ids.shape[0] != 1:
        return [[tokenizer.decode([int(t)]) for t in row] for row in ids]
    return [tokenizer.decode([int(t)]) for t in ids.reshape(-1)]


class PromptTest(NamedTuple):
    """What :func:`test_prompt` found (and printed).

    ``prompt_tokens``: the prompt's tokens as text; ``answer_tokens``: each answer's tokens as text (its first only
    when several answers are compared); ``answer_ids`` (A, T); per answer position t and answer a, ``ranks`` (T, A)
    (0 = the model's top token), ``logits`` and ``probs`` (T, A); the model's top tokens there (after the first
    answer's earlier tokens), ``top_ids``, ``top_logits`` and ``top_probs`` (T, K); ``report``, the text printed.
    """

    prompt_tokens: list
    answer_tokens: list
    answer_ids: np.ndarray
    ranks: np.ndarray
    logits: np.ndarray
    probs: np.ndarray
    top_ids: np.ndarray
    top_logits: np.ndarray
    top_probs: np.ndarray
    report: str


def test_prompt(prompt: str, answer: str | list[str], model: Any, tokenizer: Any, *,
                prepend_space_to_answer: bool = True, print_details: bool = True, prepend_bos: bool | None = None,
                top_k: int = 10) -> PromptTest:
    """How the model ranks ``answer`` after ``prompt``: printed as TransformerLens prints it, and returned.

    For each answer token: its rank among the vocabulary, logit and probability, and the model's top ``top_k``
    tokens at that position (the answer's earlier tokens fed after the prompt). With several answers, their first
    tokens are compared at the first position.

    Parameters
    ----------
    prompt : str
    answer : str or list of str
    model : CausalLM
    tokenizer : Tokenizer
        See :func:`to_str_tokens`.
    prepend_space_to_answer : bool, default True
        Put a space before an answer that does not start with one (``"road"`` -> ``" road"``).
    print_details : bool, default True
        Print the tokens and every position's details; the ranks are printed either way.
    prepend_bos : bool, optional
        For the prompt, as :func:`to_str_tokens` (the answers get no special tokens).
    top_k : int, default 10

    Returns
    -------
    PromptTest

    Examples
    --------
    >>> from attnkit.models import CausalLM, DecoderConfig, MLPConfig
    >>> class Letters:  # a tokenizer of one token per letter, "^" its BOS and " " token 27
    ...     bos_token_id = 0
    ...     def encode(self, text, add_special_tokens=True):
    ...         return [0] * add_special_tokens + [27 if c == " " else ord(c) - 96 for c in text]
    ...     def decode(self, ids):
    ...         return "".join({0: "^", 27: " "}.get(i, chr(i + 96)) for i in ids)
    >>> cfg = DecoderConfig(family="llama", vocab_size=28, hidden_size=8, num_layers=2, num_heads=2,
    ...                     num_kv_heads=1, head_dim=4, mlp=MLPConfig(12))
    >>> found = test_prompt("ab", "c", CausalLM(cfg, rng=0), Letters(), top_k=2)  # doctest: +ELLIPSIS
    Tokenized prompt: ['^', 'a', 'b']
    Tokenized answer: [' ', 'c']
    Performance on answer token:
    Rank: ...
    Ranks of the answer tokens: [(' ', ...), ('c', ...)]
    >>> found.ranks.shape, found.top_ids.shape
    ((2, 1), (2, 2))
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    answers = [answer] if isinstance(answer, str) else list(answer)
    if not answers or not all(isinstance(a, str) for a in answers):
        raise TypeError(f"answer must be a str or a non-empty list of str, got {answer!r}")
    vocab = model.config.vocab_size
    top_k = check_positive_int(top_k, "top_k", maximum=vocab)
    several = len(answers) > 1
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    prompt_ids = _encode(tokenizer, prompt, prepend_bos)
    answer_ids = [_encode(tokenizer, a, False) for a in answers]
    if not prompt_ids or not all(answer_ids):
        raise ValueError(f"the prompt and every answer must be at least one token, got {len(prompt_ids)} prompt "
                         f"tokens and answers of {[len(ids) for ids in answer_ids]}")
    if several:  # only the next token is compared
        answer_ids = [ids[:1] for ids in answer_ids]
    tokens = np.array([prompt_ids + ids for ids in answer_ids], dtype=np.int64)  # (A, L + T)
    prompt_tokens = to_str_tokens(tokenizer, prompt_ids)
    answer_tokens = [to_str_tokens(tokenizer, ids) for ids in answer_ids]
    lines = []

    def say(text: str, always: bool = False) -> None:
        if print_details or always:
            lines.append(text)
            print(text)

    say(f"Tokenized prompt: {prompt_tokens}")
    say(f"Tokenized answers: {answer_tokens}" if several else f"Tokenized answer: {answer_tokens[0]}")
    logits = np.asarray(model(tokens), dtype=np.float64)  # (A, L + T, V)
    logits = logits[:, len(prompt_ids) - 1:-1]  # (A, T, V): the distribution before each answer token
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)  # (A, T, V)
    ids = tokens[:, len(prompt_ids):]  # (A, T)
    order = np.argsort(-probs, axis=-1, kind="stable")  # (A, T, V): best first, ties by id
    ranks = np.argmax(order == ids[..., None], axis=-1)  # (A, T)
    rows, cols = np.indices(ids.shape)
    answer_logits, answer_probs = logits[rows, cols, ids], probs[rows, cols, ids]  # (A, T)
    top = order[0, :, :top_k]  # (T, K): at the first answer's positions
    top_logits = np.take_along_axis(logits[0], top, axis=-1)  # (T, K)
    top_probs = np.take_along_axis(probs[0], top, axis=-1)  # (T, K)
    for t in range(ids.shape[1]):
        say(f"Performance on answer token{'s' if several else ''}:")
        for a in range(len(answers)):
            say(f"Rank: {ranks[a, t]: <8} Logit: {answer_logits[a, t]:5.2f} Prob: {answer_probs[a, t]:6.2%} "
                f"Token: |{answer_tokens[a][t]}|")
        for k in range(top_k):
            say(f"Top {k}th token. Logit: {top_logits[t, k]:5.2f} Prob: {top_probs[t, k]:6.2%} "
                f"Token: |{tokenizer.decode([int(top[t, k])])}|")
    per_position = [[(answer_tokens[a][t], int(ranks[a, t])) for a in range(len(answers))]
                    for t in range(ids.shape[1])]
    shown = per_position if several else [pairs[0] for pairs in per_position]
    say(f"Ranks of the answer tokens: {shown}", always=True)
    return PromptTest(prompt_tokens, answer_tokens, ids, ranks.T, answer_logits.T, answer_probs.T, top, top_logits,
                      top_probs, "\n".join(lines))


test_prompt.__test__ = False  # a library function, not a test, though its name (TransformerLens's) starts so
